"""Inspect: what a checkpoint holds, from metadata only.

`inspect_checkpoint` gathers, without reading any array data: the steps under
the root, the layout detected and the rewrites that apply, every item's
canonical leaves (shape, dtype, bytes), the LoRA adapters, the optimizer
state's structure, and the inject_hyperparams values (small scalars, the only
values read). Orbax's `metadata()` opens each array's small zarr header for
its dtype; that is the only per-array read.

The rest of the module shapes that report for people: `collapse` folds
identical numbered layers into one row, `to_json` gives the machine form.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import optax
from etils import epath

from orbax_tunix import errors, reader, rules
from orbax_tunix.detect import Detection, StepInfo
from orbax_tunix.hyperparams import hyperparameters
from orbax_tunix.tree_paths import Path, fmt, nest

_RULE_DESCRIPTIONS = {rule.name: rule.description for rule in rules.RULES}

def _optax_state_fields() -> dict[str, frozenset[str]]:
  """optax's own state NamedTuples, by name: the outline names states with them."""
  return {
      name: frozenset(obj._fields)
      for name, obj in vars(optax).items()
      if isinstance(obj, type) and issubclass(obj, tuple) and getattr(obj, '_fields', ())
      and name.endswith('State')
  }


_OPTAX_STATES = _optax_state_fields()


def optax_state_names(keys: frozenset[str]) -> tuple[str, ...]:
  """The optax state types whose fields fit a saved node's keys.

  nnx drops fields that hold no leaves, so a saved node's keys may be a subset
  of its type's fields: exact matches win, else the types with fewest extra
  fields.

  Args:
    keys: the child keys of one node of a saved optimizer state.

  Returns:
    Sorted type names (e.g. ('ScaleByAdamState', ...)); empty when none fit.
  """
  fits = {name: len(fields - keys) for name, fields in _OPTAX_STATES.items() if keys <= fields}
  if not keys or not fits:
    return ()
  best = min(fits.values())
  return tuple(sorted(name for name, extra in fits.items() if extra == best))


@dataclasses.dataclass(frozen=True)
class ItemReport:
  """One item of the step.

  Attributes:
    name: the item name.
    handler: the handler typestr recorded at save time.
    rewrites: (rule name, description) of each rewrite that applies.
    leaves: its canonical leaves.
    side_leaves: on-disk paths outside the canonical view.
  """

  name: str
  handler: str | None
  rewrites: tuple[tuple[str, str], ...]
  leaves: tuple[reader.LeafInfo, ...]
  side_leaves: tuple[Path, ...]

  @property
  def nbytes(self) -> int:
    return sum(leaf.nbytes for leaf in self.leaves)


@dataclasses.dataclass(frozen=True)
class LoraReport:
  """The LoRA adapters among the weights.

  Attributes:
    style: 'qwix' (`<weight>_lora_a/_b` siblings) or 'flax' (`lora_a`/`lora_b`
      in an nnx LoRA module).
    targets: the weights (qwix) or modules (flax) adapted, canonical.
    ranks: the distinct ranks.
    num_leaves: LoRA leaves.
    nbytes: their bytes.
    base_weights: whether the adapted base weights are saved too (a qwix LoRA
      run saves only the adapters).
  """

  style: str
  targets: tuple[str, ...]
  ranks: tuple[int, ...]
  num_leaves: int
  nbytes: int
  base_weights: bool


@dataclasses.dataclass(frozen=True)
class OutlineRow:
  """One line of the optimizer outline.

  Attributes:
    depth: nesting depth (0 for the item's top level).
    path: the node's canonical path in the optimizer item.
    leaf: whether the node is a leaf.
    text: what it is ('() int32', 'mirrors the weights: ...', a state name).
  """

  depth: int
  path: Path
  leaf: bool
  text: str


@dataclasses.dataclass(frozen=True)
class Report:
  """Everything `inspect` shows.

  Attributes:
    detection: what `detect()` found.
    steps: the steps under the root, committed or not.
    items: the step's PyTree items.
    skipped: items that are not PyTrees -> why.
    lora: the LoRA adapters, if any.
    optimizer_item: the item the optimizer outline describes, if any.
    optimizer: the optimizer outline.
    hyperparameters: inject_hyperparams shell -> {name: value}.
    notes: things a person should know.
    checkpoint: the step as opened (to read it further, e.g. to verify).
  """

  detection: Detection
  steps: tuple[StepInfo, ...]
  items: tuple[ItemReport, ...]
  skipped: Mapping[str, str]
  lora: LoraReport | None
  optimizer_item: str | None
  optimizer: tuple[OutlineRow, ...]
  hyperparameters: Mapping[str, Mapping[str, Any]]
  notes: tuple[str, ...]
  checkpoint: reader.CanonicalCheckpoint | None = None

  @property
  def nbytes(self) -> int:
    return sum(item.nbytes for item in self.items)

  @property
  def num_leaves(self) -> int:
    return sum(len(item.leaves) for item in self.items)


# --- helpers on paths -------------------------------------------------------


def natural_key(key: str) -> tuple[int, int, str]:
  """Sorts '2' before '10', and numbers before names."""
  return (0, int(key), '') if key.isdigit() else (1, 0, key)


def _path_key(path: Path) -> tuple[tuple[int, int, str], ...]:
  return tuple(natural_key(k) for k in path)


# --- LoRA -------------------------------------------------------------------


def lora_report(leaves: Sequence[reader.LeafInfo]) -> LoraReport | None:
  """Finds LoRA adapters among canonical weight leaves.

  Args:
    leaves: the model item's canonical leaves.

  Returns:
    A `LoraReport`, or None when there is no adapter.
  """
  by_path = {leaf.path: leaf for leaf in leaves}
  targets, ranks, lora_leaves = [], set(), []
  style = None
  for path, leaf in by_path.items():
    name = path[-1]
    if name.endswith('_lora_a'):
      target = path[:-1] + (name[: -len('_lora_a')],)
      b = by_path.get(path[:-1] + (target[-1] + '_lora_b',))
      style = style or 'qwix'
    elif name == 'lora_a':
      target = path[:-1]
      b = by_path.get(path[:-1] + ('lora_b',))
      style = style or 'flax'
    else:
      continue
    lora_leaves += [leaf] + ([b] if b is not None else [])
    targets.append(target)
    if leaf.shape:
      ranks.add(int(leaf.shape[-1]))
  if not targets:
    return None
  if style == 'qwix':
    base = all(t in by_path for t in targets)
  else:
    # flax: the wrapped layer sits beside the adapter, as `base_module/...`
    # under an nnx.LoRA, or as the parent's own kernel for an nnx.LoRALinear
    # (whose adapter is its `lora` submodule).
    def has_base(target: Path) -> bool:
      prefix = target[:-1] if target[-1] == 'lora' else target
      return any(
          p[: len(prefix)] == prefix and not any('lora' in k for k in p[len(prefix) :])
          for p in by_path
      )

    base = all(has_base(t) for t in targets)
  return LoraReport(
      style=style,
      targets=tuple(fmt(t) for t in sorted(targets, key=_path_key)),
      ranks=tuple(sorted(ranks)),
      num_leaves=len(lora_leaves),
      nbytes=sum(leaf.nbytes for leaf in lora_leaves),
      base_weights=base,
  )


# --- optimizer outline ------------------------------------------------------


def _mirrors(
    sub: Sequence[tuple[Path, reader.LeafInfo]], weights: Mapping[Path, tuple[int, ...] | None]
) -> bool:
  """Whether a subtree holds one leaf per weight, shaped like it."""
  if not weights or not sub:
    return False
  for rel, leaf in sub:
    if rel[:1] == ('params',) and rel not in weights:
      rel = rel[1:]  # MaxText keeps the `params` collection level in mu/nu.
    if rel not in weights or weights[rel] != leaf.shape:
      return False
  return True


def optimizer_outline(
    leaves: Sequence[tuple[Path, reader.LeafInfo]],
    weights: Mapping[Path, tuple[int, ...] | None],
    shells: Sequence[str] = (),
) -> tuple[OutlineRow, ...]:
  """Describes an optimizer state's structure, folding weight-shaped subtrees.

  Args:
    leaves: (canonical path, leaf) of the optimizer state.
    weights: weight path -> shape, to recognise `mu`, `nu`, `acc_grads`...
    shells: canonical locations of inject_hyperparams shells.

  Returns:
    Outline rows, depth first, in natural order.
  """
  rows: list[OutlineRow] = []
  shell_set = set(shells)

  def visit(node: Path, below: list[tuple[Path, reader.LeafInfo]], depth: int) -> None:
    groups: dict[str, list[tuple[Path, reader.LeafInfo]]] = {}
    for rel, leaf in below:
      groups.setdefault(rel[0], []).append((rel[1:], leaf))
    for key in sorted(groups, key=natural_key):
      path, sub = node + (key,), groups[key]
      if len(sub) == 1 and sub[0][0] == ():
        leaf = sub[0][1]
        rows.append(OutlineRow(depth, path, True, f'{leaf.shape} {leaf.dtype}'))
        continue
      if _mirrors(sub, weights):
        nbytes = sum(leaf.nbytes for _, leaf in sub)
        text = f'mirrors the weights ({len(sub)} of {len(weights)} leaves, {format_bytes(nbytes)})'
        rows.append(OutlineRow(depth, path, False, text))
        continue
      keys = frozenset(rel[0] for rel, _ in sub if rel)
      notes = []
      if fmt(path) in shell_set:
        notes.append('inject_hyperparams shell (hyperparameters listed below)')
      names = optax_state_names(keys)
      if names and not all(k.isdigit() for k in keys):
        notes.append('optax ' + ' / '.join(names))
      elif keys and all(k.isdigit() for k in keys):
        notes.append('optax chain: one entry per transform with state')
      rows.append(OutlineRow(depth, path, False, '; '.join(notes)))
      visit(path, sub, depth + 1)

  visit((), [(path, leaf) for path, leaf in leaves if path], 0)
  return tuple(rows)


# --- the report -------------------------------------------------------------


def _optimizer_leaves(ckpt: reader.CanonicalCheckpoint) -> tuple[str | None, list[tuple[Path, reader.LeafInfo]]]:
  if rules.OPTIMIZER_ITEM in ckpt.items:
    return rules.OPTIMIZER_ITEM, [(leaf.path, leaf) for leaf in ckpt.items[rules.OPTIMIZER_ITEM]]
  if reader.MAXTEXT_ITEM in ckpt.items:
    found = [(leaf.path, leaf) for leaf in ckpt.items[reader.MAXTEXT_ITEM] if leaf.path[:1] == ('opt_state',)]
    if found:
      return reader.MAXTEXT_ITEM, found
  return None, []


def _steps(detection: Detection) -> tuple[StepInfo, ...]:
  return tuple(reader.find_steps(detection.step_dir))


def inspect_checkpoint(path: epath.PathLike, step: int | None = None) -> Report:
  """Builds the inspect report of a checkpoint, from metadata only.

  Args:
    path: a root (latest committed step, or `step`), a step or an item.
    step: the step to describe.

  Returns:
    A `Report`.

  Raises:
    TunixCheckpointError subclasses: the path is not a readable checkpoint.
  """
  ckpt = reader.open_checkpoint(path, step)
  detection = ckpt.detection
  items = []
  for name in sorted(ckpt.items):
    layout = detection.layouts.get(name)
    names = layout.rule_names if layout is not None else ()
    items.append(
        ItemReport(
            name=name,
            handler=detection.item_handlers.get(name),
            rewrites=tuple((n, _RULE_DESCRIPTIONS.get(n, '')) for n in names),
            leaves=tuple(sorted(ckpt.items[name], key=lambda leaf: _path_key(leaf.path))),
            side_leaves=ckpt.side_leaves.get(name, ()),
        )
    )
  notes = list(detection.notes)
  try:
    weight_pairs = reader.weights(ckpt)
  except errors.UnsupportedLayoutError:
    weight_pairs = []
  lora = lora_report([leaf for leaf, _ in weight_pairs]) if weight_pairs else None
  hparams: dict[str, dict[str, Any]] = {}
  if detection.is_tunix and rules.OPTIMIZER_ITEM in ckpt.items:
    try:
      hparams = {k: dict(v) for k, v in hyperparameters(detection.step_dir).items()}
    except errors.TunixCheckpointError as e:
      notes.append(f'hyperparameters not read: {e}')
  opt_item, opt_leaves = _optimizer_leaves(ckpt)
  outline = optimizer_outline(
      opt_leaves, {path: leaf.shape for leaf, path in weight_pairs}, tuple(hparams)
  )
  return Report(
      detection=detection,
      steps=_steps(detection),
      items=tuple(items),
      skipped=dict(ckpt.skipped),
      lora=lora,
      optimizer_item=opt_item,
      optimizer=outline,
      hyperparameters=hparams,
      notes=tuple(notes),
      checkpoint=ckpt,
  )


# --- shaping for people -----------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Row:
  """One display row: a leaf, or identical leaves of numbered layers folded.

  Attributes:
    path: e.g. 'layers/[0-27]/attn/q_proj/w'.
    count: how many leaves it stands for.
    shape: each leaf's shape.
    dtype: each leaf's dtype.
    nbytes: bytes of all `count` leaves.
  """

  path: str
  count: int
  shape: tuple[int, ...] | None
  dtype: np.dtype | None
  nbytes: int


def _range_label(keys: Sequence[str]) -> str:
  """'[0-3,7]' for ['0', '1', '2', '3', '7']."""
  numbers = sorted(int(k) for k in keys)
  spans = [[numbers[0], numbers[0]]]
  for n in numbers[1:]:
    if n == spans[-1][1] + 1:
      spans[-1][1] = n
    else:
      spans.append([n, n])
  return '[' + ','.join(f'{a}' if a == b else f'{a}-{b}' for a, b in spans) + ']'


def _signature(node: Any) -> Any:
  if isinstance(node, reader.LeafInfo):
    return (node.shape, str(node.dtype), node.kind)
  return tuple(sorted((k, _signature(v)) for k, v in node.items()))


def _collapse(node: Any) -> list[tuple[Path, int, reader.LeafInfo]]:
  if isinstance(node, reader.LeafInfo):
    return [((), 1, node)]
  groups: dict[Any, list[str]] = {}
  for key in node:
    if key.isdigit():
      groups.setdefault(_signature(node[key]), []).append(key)
  out, done = [], set()
  for key in sorted(node, key=natural_key):
    if key in done:
      continue
    members = groups.get(_signature(node[key])) if key.isdigit() else None
    if members and len(members) > 1:
      done.update(members)
      label, factor = _range_label(members), len(members)
    else:
      label, factor = key, 1
    out += [((label,) + p, n * factor, leaf) for p, n, leaf in _collapse(node[key])]
  return out


def collapse(leaves: Sequence[reader.LeafInfo]) -> list[Row]:
  """Folds numbered siblings with identical subtrees (layers) into one row each.

  `layers/0/...` to `layers/27/...` become `layers/[0-27]/...` when every
  layer holds the same leaves with the same shapes and dtypes; layers that
  differ are grouped by kind (`layers/[0,2-5]`, `layers/[1]`). Optimizer
  chain positions (a lone `0`) stay as they are.

  Args:
    leaves: canonical leaves of one item.

  Returns:
    Display rows, in natural order.
  """
  if not leaves:
    return []
  tree = nest((leaf.path, leaf) for leaf in leaves)
  return [
      Row(fmt(path), count, leaf.shape, leaf.dtype, leaf.nbytes * count)
      for path, count, leaf in _collapse(tree)
  ]


def format_bytes(n: int) -> str:
  """'1.5 MiB': sizes for people (binary units)."""
  value = float(n)
  for unit in ('B', 'KiB', 'MiB', 'GiB', 'TiB'):
    if value < 1024 or unit == 'TiB':
      return f'{int(value)} {unit}' if unit == 'B' else f'{value:.1f} {unit}'
    value /= 1024
  return f'{n} B'


def _leaf_json(leaf: reader.LeafInfo) -> dict[str, Any]:
  return {
      'shape': None if leaf.shape is None else list(leaf.shape),
      'dtype': None if leaf.dtype is None else str(leaf.dtype),
      'bytes': leaf.nbytes,
  }


def to_json(report: Report) -> dict[str, Any]:
  """The report as one JSON-ready document.

  Each item's `leaves` maps every canonical path to its shape, dtype and
  bytes.
  """
  d = report.detection
  return {
      'path': str(d.path),
      'step_dir': str(d.step_dir),
      'step': d.step,
      'kind': d.kind,
      'writer': d.writer,
      'steps': [
          {'step': s.step, 'committed': s.committed, 'path': str(s.path)} for s in report.steps
      ],
      'items': {
          item.name: {
              'handler': item.handler,
              'rewrites': [{'rule': n, 'description': t} for n, t in item.rewrites],
              'num_leaves': len(item.leaves),
              'bytes': item.nbytes,
              'side_leaves': [fmt(p) for p in item.side_leaves],
              'leaves': {fmt(leaf.path): _leaf_json(leaf) for leaf in item.leaves},
          }
          for item in report.items
      },
      'skipped_items': dict(report.skipped),
      'num_leaves': report.num_leaves,
      'bytes': report.nbytes,
      'lora': None if report.lora is None else dataclasses.asdict(report.lora),
      'optimizer': {
          'item': report.optimizer_item,
          'outline': [
              {'path': fmt(r.path), 'depth': r.depth, 'leaf': r.leaf, 'description': r.text}
              for r in report.optimizer
          ],
      },
      'hyperparameters': {
          shell: {k: reader.json_scalar(v) for k, v in values.items()}
          for shell, values in report.hyperparameters.items()
      },
      'notes': list(report.notes),
  }

"""Inspect: what a checkpoint holds, from metadata only.

`inspect_checkpoint` gathers, without reading any array data: the steps under
the root, the kind of checkpoint and the rewrites that apply, every item's
canonical leaves (shape, dtype, bytes), the LoRA adapters, the optimizer
state's structure, and two kinds of small scalars, the only values read: the
inject_hyperparams values and the optimizer's own step counter. Shapes and
dtypes come from each array's small zarr header. The command line draws the
report (`orbax_tunix.cli.display`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
from etils import epath

from orbax_tunix import conventions, errors
from orbax_tunix.keypaths import Path, fmt, natural_key, natural_order
from orbax_tunix.mapping import huggingface, stacks, step_layers
from orbax_tunix.mapping import lora as lora_lib
from orbax_tunix.reading import reader
from orbax_tunix.reading.hyperparams import AS_NUMPY, by_shell, hyperparameter_leaves
from orbax_tunix.reading.planned_item import Reads
from orbax_tunix.store.step_store import StepEntry
from orbax_tunix.view import rules
from orbax_tunix.view.detection import Detection

_RULE_DESCRIPTIONS = {rule.name: rule.description for rule in rules.RULES}


@functools.cache
def _optax_states() -> dict[str, frozenset[str]]:
  """optax's own state NamedTuples, by name: the outline names states with them. Imported
  when first asked (by `inspect`): optax and the jax.scipy it imports cost every other
  command 0.1-0.15 s of start-up (BENCHMARKS §23)."""
  import optax  # noqa: PLC0415

  return {name: frozenset(obj._fields) for name, obj in vars(optax).items()
          if isinstance(obj, type) and issubclass(obj, tuple) and getattr(obj, '_fields', ())
          and name.endswith('State')}


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
  fits = {name: len(fields - keys) for name, fields in _optax_states().items() if keys <= fields}
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
      in an nnx LoRA module); 'qwix+flax' if both.
    targets: the adapted weights, canonical paths in the plain model.
    target_ranks: the rank of each, in the same order.
    ranks: the distinct ranks.
    num_leaves: LoRA leaves.
    nbytes: their bytes.
    base_weights: whether every adapted base weight is saved too (a qwix
      LoRA run saves only the adapters).
  """

  style: str
  targets: tuple[str, ...]
  target_ranks: tuple[int, ...]
  ranks: tuple[int, ...]
  num_leaves: int
  nbytes: int
  base_weights: bool


@dataclasses.dataclass(frozen=True)
class QuantizedReport:
  """Weights saved quantized (a QLoRA run's frozen base, `reading.quantized`).

  Attributes:
    schemes: how they are quantized (`Scheme.describe()`: qtype, per channel or tiles of
      N on an axis, calibration) -> the weights so quantized, canonical paths.
    stored_bytes: their parts' bytes as stored.
    dequantized_bytes: their bytes dequantized (in their scale's dtype, as read).
  """

  schemes: Mapping[str, tuple[str, ...]]
  stored_bytes: int
  dequantized_bytes: int


def quantized_report(leaves: Sequence[reader.LeafInfo]) -> QuantizedReport | None:
  """The weights among `leaves` saved quantized, or None when there are none."""
  found = sorted((leaf for leaf in leaves if leaf.quantized is not None),
                 key=lambda leaf: natural_order(leaf.path))
  if not found:
    return None
  schemes: dict[str, list[str]] = {}
  for leaf in found:
    schemes.setdefault(leaf.quantized.describe(), []).append(fmt(leaf.path))
  return QuantizedReport({k: tuple(v) for k, v in sorted(schemes.items())},
                         sum(leaf.quantized.stored_bytes for leaf in found),
                         sum(leaf.quantized.dequantized_bytes for leaf in found))


# A LoRA save of adapters alone cannot say whether the run quantized its base (QLoRA).
ADAPTERS_ONLY_QLORA_NOTE = (
    'adapters only: a save cannot tell whether the run trained them on a quantized base'
    ' (QLoRA: qwix\'s weight_qtype). If it did, merge with --base BASE --base-qtype Q'
    ' [--base-tile-size N] [--base-calibration minmax] as the run set them (Q: int8, int4,'
    ' nf4, float8_e4m3fn), so the base is re-quantized as the run did')


@dataclasses.dataclass(frozen=True)
class OutlineRow:
  """One node of the optimizer outline.

  Attributes:
    depth: nesting depth (0 for the item's top level).
    path: the node's canonical path in the optimizer item.
    leaf: the leaf, when the node is one.
    mirrored: (leaves, bytes) when the subtree holds one leaf per weight,
      shaped like it (optax's mu, nu, acc_grads...); its rows are folded.
    states: the optax state types whose fields are the node's keys (several
      types share fields: ScaleByAdamState, ScaleByBeliefState...).
    shell: the node is an inject_hyperparams shell.
    chain: the node's keys are chain positions (one per transform with state).
  """

  depth: int
  path: Path
  leaf: reader.LeafInfo | None = None
  mirrored: tuple[int, int] | None = None
  states: tuple[str, ...] = ()
  shell: bool = False
  chain: bool = False


@dataclasses.dataclass(frozen=True)
class LayerReport:
  """MaxText's decoder layers in a step.

  Attributes:
    form: `mapping.stacks.SCANNED` or `UNSCANNED_NAME` (`LayerForm.kind`).
    count: how many layers (None: the weights do not agree on one).
    axis: the layer axis of scanned weights (None: unscanned, or not told by
      the shapes nor recorded).
  """

  form: str
  count: int | None
  axis: int | None


@dataclasses.dataclass(frozen=True)
class Report:
  """Everything `inspect` shows.

  Attributes:
    detection: what `detect()` found.
    steps: the steps under the root, committed or not.
    items: the step's PyTree items.
    json_items: the step's JSON items (read whole by the tools).
    state_step: the step counter the optimizer state holds (it may differ
      from the step directory's number), when there is one.
    lora: the LoRA adapters, if any.
    optimizer_item: the item the optimizer outline describes, if any.
    optimizer: the optimizer outline.
    num_weights: the model's weight leaves (what `mirrored` rows count against).
    hyperparameters: inject_hyperparams shell -> {name: value}.
    layers: MaxText's decoder layers, when the weights are a MaxText model's.
    notes: things a person should know.
    checkpoint: the step as opened (to read it further, e.g. to verify).
    source: what kind of model the weights are, as export takes them
      (`huggingface.describe_weights`), when there are weights.
    quantized: the weights saved quantized (a QLoRA run's base), if any.
  """

  detection: Detection
  steps: tuple[StepEntry, ...]
  items: tuple[ItemReport, ...]
  json_items: tuple[str, ...]
  state_step: int | None
  lora: LoraReport | None
  optimizer_item: str | None
  optimizer: tuple[OutlineRow, ...]
  num_weights: int
  hyperparameters: Mapping[str, Mapping[str, Any]]
  notes: tuple[str, ...]
  checkpoint: reader.Source | None = None
  layers: LayerReport | None = None
  source: str | None = None
  quantized: QuantizedReport | None = None

  @property
  def nbytes(self) -> int:
    return sum(item.nbytes for item in self.items)

  @property
  def num_leaves(self) -> int:
    return sum(len(item.leaves) for item in self.items)


# --- LoRA -------------------------------------------------------------------


def lora_report(leaves: Sequence[reader.LeafInfo]) -> LoraReport | None:
  """Finds LoRA adapters among canonical weight leaves (see `lora.find_adapters`).

  Args:
    leaves: the model item's canonical leaves.

  Returns:
    A `LoraReport`, or None when there is no adapter.

  Raises:
    LoraError: adapters that cannot be paired.
  """
  by_path = {leaf.path: leaf for leaf in leaves}
  adapters = lora_lib.find_adapters({p: leaf.shape for p, leaf in by_path.items()})
  if not adapters:
    return None
  ordered = sorted(adapters.values(), key=lambda a: natural_order(a.weight))
  lora_leaves = [by_path[p] for a in ordered for p in (a.a, a.b)]
  return LoraReport(
      style='+'.join(sorted({a.style for a in ordered}, reverse=True)),
      targets=tuple(fmt(a.weight) for a in ordered),
      target_ranks=tuple(a.rank for a in ordered),
      ranks=tuple(sorted({a.rank for a in ordered})),
      num_leaves=len(lora_leaves),
      nbytes=sum(leaf.nbytes for leaf in lora_leaves),
      base_weights=all(a.saved_base in by_path for a in ordered),
  )


# --- optimizer outline ------------------------------------------------------


def _mirrors(
    sub: Sequence[tuple[Path, reader.LeafInfo]], weights: Mapping[Path, tuple[int, ...] | None]
) -> bool:
  """Whether a subtree holds one leaf per weight, shaped like it."""
  if not weights or not sub:
    return False
  for rel, leaf in sub:
    if rel[:1] == conventions.MAXTEXT_PARAMS[1:] and rel not in weights:
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
        rows.append(OutlineRow(depth, path, leaf=sub[0][1]))
        continue
      if _mirrors(sub, weights):
        rows.append(OutlineRow(depth, path, mirrored=(len(sub), sum(x.nbytes for _, x in sub))))
        continue
      keys = frozenset(rel[0] for rel, _ in sub if rel)
      chain = bool(keys) and all(k.isdigit() for k in keys)
      rows.append(OutlineRow(
          depth, path, states=() if chain else optax_state_names(keys),
          shell=fmt(path) in shell_set, chain=chain,
      ))
      visit(path, sub, depth + 1)

  visit((), [(path, leaf) for path, leaf in leaves if path], 0)
  return tuple(rows)


# --- the report -------------------------------------------------------------


def _optimizer_leaves(ckpt: reader.Source) -> tuple[str | None, list[tuple[Path, reader.LeafInfo]]]:
  """The optimizer state's item and leaves, where the step's kind keeps it (`source_kinds`)."""
  item, prefix = ckpt.detection.source_kind.optimizer
  if item is not None:
    found = [(leaf.path, leaf) for leaf in ckpt.items.get(item, ())
             if leaf.path[:len(prefix)] == prefix]
    return (item, found) if found else (None, [])
  for name, leaves in sorted(ckpt.items.items()):
    keys = {leaf.path[0] for leaf in leaves if leaf.path}
    if name != conventions.MAXTEXT_ITEM and conventions.role(name, keys) == conventions.OPTIMIZER_ITEM:
      return name, [(leaf.path, leaf) for leaf in leaves]
  return None, []


def _step_counter(ckpt: reader.Source, opt_item: str | None) -> Path | None:
  """The on-disk path of the optimizer's own step counter, if the state has one."""
  if opt_item is None:
    return None
  leaf = next((x for x in ckpt.items[opt_item] if x.path == conventions.OPTIMIZER_STEP), None)
  if leaf is None or leaf.shape != () or leaf.dtype is None or leaf.dtype.kind not in 'iu':
    return None
  return ckpt.detection.maps[opt_item].canonical_to_disk[leaf.path]


def _read_scalars(
    ckpt: reader.Source, opt_item: str | None
) -> tuple[dict[str, dict[str, Any]], int | None]:
  """(hyperparameters, the optimizer's step counter): one read per item holding them."""
  detection = ckpt.detection
  found = hyperparameter_leaves(detection) if detection.is_tunix else None
  counter = _step_counter(ckpt, opt_item)
  reads = Reads()
  for item, path in [*([(found[0], p) for p in found[1]] if found is not None else []),
                     *([(opt_item, counter)] if counter is not None else [])]:
    reads.want(detection, item, path, (0, AS_NUMPY))
  reads.read(on_disk=True)
  hparams = {} if found is None else by_shell(
      found[1], {p: reads.got(detection, found[0], p) for p in found[1]})
  step = None if counter is None else int(np.asarray(reads.got(detection, opt_item, counter)))
  return hparams, step


def inspect_checkpoint(
    path: epath.PathLike, step: int | None = None, items: Iterable[str] | None = None
) -> Report:
  """Builds the inspect report of a checkpoint, from metadata only.

  Args:
    path: a root (latest committed step, or `step`), a step or an item.
    step: the step to describe.
    items: the items to describe (default: every item the step records).

  Returns:
    A `Report`.

  Raises:
    TunixCheckpointError subclasses: the path is not a readable checkpoint.
  """
  ckpt = reader.open_source(path, step, items, whole=False)
  detection = ckpt.detection
  reports = [
      ItemReport(
          name=name,
          handler=detection.item_handlers.get(name),
          rewrites=tuple((n, _RULE_DESCRIPTIONS.get(n, ''))
                         for n in detection.maps[name].rule_names),
          leaves=tuple(sorted(ckpt.items[name], key=lambda leaf: natural_order(leaf.path))),
          side_leaves=ckpt.side_leaves.get(name, ()),
      )
      for name in sorted(ckpt.items)
  ]
  try:
    weight_pairs = reader.weights(ckpt)
  except (errors.UnsupportedLayoutError, errors.MissingItemError):
    weight_pairs = []  # No weights here (the notes say when they are absent).
  lora = lora_report([leaf for leaf, _ in weight_pairs]) if weight_pairs else None
  quantized = quantized_report([leaf for leaf, _ in weight_pairs])
  notes = [*detection.notes]
  if lora is not None and not lora.base_weights and lora.style != lora_lib.FLAX:
    notes.append(ADAPTERS_ONLY_QLORA_NOTE)
  opt_item, opt_leaves = _optimizer_leaves(ckpt)
  hparams, state_step = _read_scalars(ckpt, opt_item)
  weight_shapes = {path: leaf.shape for leaf, path in weight_pairs}
  outline = optimizer_outline(opt_leaves, weight_shapes, tuple(hparams))
  layers = step_layers.of(ckpt)  # As every plan of this step reads them.
  layer_form = None if layers.form is None else LayerReport(layers.form.kind, layers.count,
                                                            layers.axis)
  notes += [] if layers.problem is None else [layers.problem]
  return Report(
      detection=detection,
      steps=detection.steps,
      items=tuple(reports),
      json_items=ckpt.json_items,
      state_step=state_step,
      lora=lora,
      optimizer_item=opt_item,
      optimizer=outline,
      num_weights=len(weight_pairs),
      hyperparameters=hparams,
      notes=tuple(notes),
      checkpoint=ckpt,
      layers=layer_form,
      source=_source(weight_shapes, layer_form),
      quantized=quantized,
  )


def _source(shapes: Mapping[Path, tuple[int, ...] | None], layers: LayerReport | None
            ) -> str | None:
  """What kind of model the weights are (a MaxText or a Tunix model's), if any: the layer
  count along the axis the layer report found ('?' where it found none or no count)."""
  if not shapes:
    return None
  axis = stacks.DEFAULT_AXIS
  if layers is not None and layers.form == stacks.SCANNED:
    axis = layers.axis if layers.count is not None else None
  return huggingface.describe_weights({p: s for p, s in shapes.items() if s is not None}, axis)

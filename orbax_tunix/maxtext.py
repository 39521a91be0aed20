"""MaxText's view: a Tunix checkpoint restored as MaxText's train state.

MaxText keeps one item, `items`, holding a Linen `TrainState`:
`params/params/<weights>` (the Linen `params` collection), `opt_state` (the
optax chain's states in chain order, `None` where a state is empty), `step`
and, for NNX models, `nnx_aux` (RNGs and other non-weight variables). Tunix
writes `model_params` and `optimizer_state` in nnx's layout instead.

Nothing here knows an optimizer. A `RestorePlan` is worked out once from the
checkpoint's metadata (canonical paths and shapes, see `layout.py`) and the
abstract state's key paths: optax states are matched by their fields (`count`,
`mu` mirroring the weights, ...) in chain order, states Tunix never wrote are
filled, and every mismatch is reported before any array is read. Executing the
plan reads each needed array once, through `TunixPyTreeHandler`, straight into
the target's sharding and dtype.

  restore_train_state(path, abstract_state)    the function
  ItemsHandler                                 the same as an Orbax handler
  plan_restore(path, abstract_state)           the plan alone, to inspect
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from orbax_tunix import errors, rules
from orbax_tunix.detect import Detection, as_path, detect
from orbax_tunix.pytree_handler import TunixPyTreeHandler, TunixPyTreeRestore, as_pytree_restore
from orbax_tunix.tree_paths import Path, flat_dict, flatten, fmt, key_str, nest

PyTree = Any
Shape = tuple[int, ...]

logger = logging.getLogger('orbax_tunix')

# MaxText's TrainState keys, and the Linen collection its weights sit in.
PARAMS = 'params'
COLLECTION = 'params'
OPT_STATE = 'opt_state'
STEP = 'step'
NNX_AUX = 'nnx_aux'
# MaxText's `to_checkpoint_dict` keeps nnx's `model` level inside `nnx_aux`.
NNX_AUX_MODEL = 'model'
TOP_KEYS = (PARAMS, OPT_STATE, STEP, NNX_AUX)

# The optimizer's step counter in Tunix's optimizer item (canonical path).
_TUNIX_STEP: Path = ('step',)
# nnx.Rngs streams and the RNGs of Dropout & co. sit under a key 'rngs'.
_RNG_KEY = 'rngs'
# A state Tunix may not have written but whose value is known: a schedule's
# `count` (ScaleByScheduleState) is the number of steps taken.
_STEP_COUNTER_FIELDS = (('count', False),)
_LORA_SUFFIXES = ('_lora_a', '_lora_b')
_LORA_KEYS = frozenset({'lora_a', 'lora_b'})
# A layer index as a key of its own ('layers/0/...', nnx.List) or a name
# suffix ('layers_0/...', Linen's unscanned layers).
_INDEXED_NAME = re.compile(r'(.+)_(\d+)')


class LayerScanMismatchError(errors.TargetMismatchError):
  """One side stacks the layers into one array per weight (scanned), the other not."""


class LoraOnlyCheckpointError(errors.TargetMismatchError):
  """The checkpoint holds only LoRA adapters; the target needs full weights."""


# --- the plan --------------------------------------------------------------


@dataclasses.dataclass(frozen=True, order=True)
class Source:
  """One leaf of a Tunix item, by its canonical path."""

  item: str
  path: Path

  def __str__(self) -> str:
    return f'{self.item}:{fmt(self.path)}'


@dataclasses.dataclass(frozen=True)
class Fill:
  """A target leaf Tunix never wrote, computed instead of read.

  Attributes:
    source: the leaf whose value it takes (the optimizer's step), or None.
    value: the value when there is no source (the step directory's number).
    reason: why this is right, for the log.
  """

  source: Source | None
  value: int | None
  reason: str

  def describe(self) -> str:
    origin = f"the checkpoint's {self.source}" if self.source else f'{self.value}'
    return f'{origin} ({self.reason})'


@dataclasses.dataclass(frozen=True)
class RestorePlan:
  """Where every leaf of a MaxText target comes from; computed once, before any read.

  Attributes:
    step_dir: the Tunix step directory.
    reads: target leaf path -> the Tunix leaf it is read from.
    fills: target leaf path -> how it is filled (leaves Tunix never wrote).
    kept: target leaves returned as given (outside `params` when params_only).
    left_out: what the checkpoint holds that the target does not take.
    notes: what `detect()` noticed (e.g. unfinished steps skipped).
  """

  step_dir: epath.Path
  reads: Mapping[Path, Source]
  fills: Mapping[Path, Fill]
  kept: frozenset[Path]
  left_out: tuple[str, ...] = ()
  notes: tuple[str, ...] = ()

  def sources(self) -> dict[str, list[Path]]:
    """Tunix item -> the canonical paths read from it, each once, sorted."""
    needed = set(self.reads.values())
    needed.update(f.source for f in self.fills.values() if f.source is not None)
    out: dict[str, list[Path]] = {}
    for source in sorted(needed):
      out.setdefault(source.item, []).append(source.path)
    return out

  def describe(self) -> str:
    """A few lines for people: what is read, filled and left out."""
    lines = [f'{self.step_dir} -> MaxText train state']
    lines += [f'  note: {n}' for n in self.notes]
    for item, paths in self.sources().items():
      lines.append(f'  read {len(paths)} arrays from {item}')
    for target, fill in sorted(self.fills.items()):
      lines.append(f'  fill {fmt(target)} from {fill.describe()}')
    if self.kept:
      lines.append(f'  keep {len(self.kept)} target leaves as given (not restored)')
    lines += [f'  left out: {n}' for n in self.left_out]
    return '\n'.join(lines)


@dataclasses.dataclass(frozen=True)
class CheckpointView:
  """The canonical leaves of one Tunix step, from metadata only.

  Attributes:
    step_dir: the step directory.
    step: the number in the step directory's name, if any.
    model: canonical weight path -> global shape (None when not looked up).
    optimizer: canonical optimizer path -> global shape (None when not looked
      up), or None when the step has no optimizer item.
    side_paths: on-disk optimizer leaves outside the canonical view (the
      inject_hyperparams shell).
  """

  step_dir: epath.Path
  step: int | None
  model: Mapping[Path, Shape | None]
  optimizer: Mapping[Path, Shape | None] | None
  side_paths: tuple[Path, ...] = ()


@dataclasses.dataclass(frozen=True)
class OptState:
  """One optax state: the fields found under one node of `opt_state`.

  Attributes:
    node: its path below `opt_state` (chain positions, e.g. ('1', '0')).
    fields: (field name, mirrors the weights) pairs, sorted; e.g. adam's
      (('count', False), ('mu', True), ('nu', True)).
  """

  node: Path
  fields: tuple[tuple[str, bool], ...]

  def __str__(self) -> str:
    names = ', '.join(f'{f}[weights]' if mirrored else f for f, mirrored in self.fields)
    return f'{fmt((OPT_STATE,) + self.node)} {{{names}}}'


# --- reading the checkpoint's metadata --------------------------------------


def _shape(leaf: Any) -> Shape | None:
  shape = getattr(leaf, 'shape', None)
  return None if shape is None else tuple(shape)


def read_view(detection: Detection, *, shapes_of: Collection[str]) -> CheckpointView:
  """Collects the canonical leaves of a Tunix step.

  Args:
    detection: what `detect()` found (must be Tunix).
    shapes_of: items whose shapes to look up (Orbax opens each array's
      metadata for them); the others give paths only, from JSON.

  Returns:
    A `CheckpointView`.

  Raises:
    UnsupportedLayoutError: the step has no `model_params` item.
  """
  layouts = detection.layouts
  if rules.MODEL_ITEM not in layouts:
    raise errors.UnsupportedLayoutError(
        f'{detection.step_dir}: expected a Tunix {rules.MODEL_ITEM!r} item, found'
        f' items {list(detection.items)}. Only steps holding the weights can be'
        ' restored as a MaxText train state.'
    )

  def canonical(item: str) -> dict[Path, Shape | None]:
    if item not in shapes_of:
      return {p: None for p in layouts[item].canonical_to_disk}
    meta = TunixPyTreeHandler().metadata(detection.step_dir / item)
    return {p: _shape(m) for p, m in flat_dict(meta.tree).items()}

  has_optimizer = rules.OPTIMIZER_ITEM in layouts
  return CheckpointView(
      step_dir=detection.step_dir,
      step=detection.step,
      model=canonical(rules.MODEL_ITEM),
      optimizer=canonical(rules.OPTIMIZER_ITEM) if has_optimizer else None,
      side_paths=layouts[rules.OPTIMIZER_ITEM].side_paths if has_optimizer else (),
  )


# --- matching optimizer states ----------------------------------------------


def _order(path: Path) -> tuple[tuple[int, int, str], ...]:
  """Sort key putting chain positions in numeric order ('2' before '10')."""
  return tuple((0, int(k), '') if k.isdigit() else (1, 0, k) for k in path)


def split_opt_path(
    path: Path, weights: Collection[Path], collection: str | None = None
) -> tuple[Path, str, Path | None]:
  """Splits an `opt_state/...` leaf path into (state node, field, weight).

  A field mirrors the weights (optax's `mu`, `nu`, `trace`, ...) when the rest
  of the path below it is a weight path, optionally under `collection` (the
  Linen `params` level in MaxText's `mu/params/<w>`); the shortest such field
  wins. Any other leaf is a field of its own (e.g. `count`).

  Args:
    path: the full path, starting with 'opt_state'.
    weights: canonical weight paths (no collection level).
    collection: a level that may sit between the field and the weight.

  Returns:
    (node below `opt_state`, field name, canonical weight path or None).
  """
  rest = path[1:]
  for j in range(1, len(rest)):
    tail = rest[j:]
    if collection is not None and tail[0] == collection and tail[1:] in weights:
      return rest[: j - 1], rest[j - 1], tail[1:]
    if tail in weights:
      return rest[: j - 1], rest[j - 1], tail
  return rest[:-1], rest[-1], None


def opt_states(splits: Iterable[tuple[Path, str, Path | None]]) -> list[OptState]:
  """Groups split leaf paths into optax states, in chain order."""
  fields: dict[Path, dict[str, bool]] = {}
  for node, field, weight in splits:
    known = fields.setdefault(node, {})
    known[field] = known.get(field, False) or weight is not None
  return [
      OptState(node, tuple(sorted(fields[node].items())))
      for node in sorted(fields, key=_order)
  ]


def _worth(state: OptState) -> int:
  """How much a match is worth: a state holding weight-shaped data beats a counter."""
  return 1 + sum(mirrored for _, mirrored in state.fields)


def align_states(target: Sequence[OptState], source: Sequence[OptState]) -> dict[int, int]:
  """Matches target states to checkpoint states with the same fields, in order.

  An order-preserving alignment (a longest common subsequence, weighted by
  `_worth`), so empty states (missing on one side, `None` on the other), a
  clipping transform in front, or wrappers only one side has all fall out of
  the match, and where two matches exclude each other the one carrying
  `mu`/`nu`-like data wins over a lone counter (which can be filled).

  Returns:
    target index -> source index, for every matched state.
  """
  n, m = len(target), len(source)
  best = [[0] * (m + 1) for _ in range(n + 1)]
  for i in range(n - 1, -1, -1):
    for j in range(m - 1, -1, -1):
      best[i][j] = max(best[i + 1][j], best[i][j + 1])
      if target[i].fields == source[j].fields:
        best[i][j] = max(best[i][j], _worth(target[i]) + best[i + 1][j + 1])
  matched, i, j = {}, 0, 0
  while i < n and j < m:
    same = target[i].fields == source[j].fields
    if same and best[i][j] == _worth(target[i]) + best[i + 1][j + 1]:
      matched[i] = j
      i, j = i + 1, j + 1
    elif best[i + 1][j] >= best[i][j + 1]:
      i += 1
    else:
      j += 1
  return matched


# --- checking the weights ---------------------------------------------------


def _is_lora(path: Path) -> bool:
  return any(k.endswith(_LORA_SUFFIXES) or k in _LORA_KEYS for k in path)


def _unindexed(path: Path) -> tuple[Path, int] | None:
  """The path without its first layer index, and that index ('layers/0' or 'layers_0')."""
  for i, key in enumerate(path):
    if key.isdigit():
      return path[:i] + path[i + 1 :], int(key)
    m = _INDEXED_NAME.fullmatch(key)
    if m:
      return path[:i] + (m.group(1),) + path[i + 1 :], int(m.group(2))
  return None


def _layer_axis(stacked: Shape | None, per_layer: Shape | None, n: int) -> int | None:
  """The axis of `stacked` that holds `n` layers of shape `per_layer`, if any."""
  if stacked is None or per_layer is None:
    return None
  for axis, size in enumerate(stacked):
    if size == n and stacked[:axis] + stacked[axis + 1 :] == per_layer:
      return axis
  return None


@dataclasses.dataclass(frozen=True)
class _Stacking:
  """Evidence of scanned vs unscanned: one stacked leaf and its per-layer leaves."""

  stacked: str
  stacked_shape: Shape | None
  per_layer: tuple[str, ...]
  per_layer_shape: Shape | None
  axis: int | None

  def __str__(self) -> str:
    axis = f'layer axis {self.axis}' if self.axis is not None else 'no layer axis fits'
    return (
        f'{self.stacked} {self.stacked_shape} <-> {len(self.per_layer)} per-layer leaves'
        f' {self.per_layer[0]}, ... {self.per_layer_shape} ({axis})'
    )


def _stackings(
    per_layer: Mapping[Path, tuple[str, Shape | None]],
    stacked: Mapping[Path, tuple[str, Shape | None]],
) -> list[_Stacking]:
  """Pairs each stacked leaf with the per-layer leaves that would make it.

  Args:
    per_layer: path -> (name for messages, shape) on the per-layer side.
    stacked: path -> (name for messages, shape) on the other side.
  """
  groups: dict[Path, list[tuple[int, Path]]] = {}
  for path in per_layer:
    unindexed = _unindexed(path)
    if unindexed is not None:
      groups.setdefault(unindexed[0], []).append((unindexed[1], path))
  found = []
  for path, (name, shape) in sorted(stacked.items()):
    layers = sorted(groups.get(path, ()))
    if not layers:
      continue
    per_shape = per_layer[layers[0][1]][1]
    found.append(
        _Stacking(
            stacked=name,
            stacked_shape=shape,
            per_layer=tuple(per_layer[p][0] for _, p in layers),
            per_layer_shape=per_shape,
            axis=_layer_axis(shape, per_shape, len(layers)),
        )
    )
  return found


def _check_weights(
    view: CheckpointView,
    target: Mapping[Path, Path],
    target_shapes: Mapping[Path, Shape | None],
    aux: Collection[Path],
) -> list[str]:
  """Checks the target's weights against the checkpoint's.

  Args:
    view: the checkpoint.
    target: canonical weight path -> target leaf path.
    target_shapes: target leaf path -> shape.
    aux: canonical paths of non-weight variables (never required).

  Returns:
    Message sections for a generic mismatch (empty when all is well).

  Raises:
    LoraOnlyCheckpointError, LayerScanMismatchError: those two cases, which
      explain a whole set of missing leaves at once.
  """
  missing = [w for w in target if w not in view.model]
  extra = [w for w in view.model if w not in target and w not in aux] if target else []
  sections = []
  if missing or extra:
    disk_weights = [w for w in view.model if w not in aux]
    needed_full = [w for w in missing if not _is_lora(w)]
    if disk_weights and all(_is_lora(w) for w in disk_weights) and needed_full:
      raise LoraOnlyCheckpointError(
          f'{view.step_dir}: the checkpoint holds only LoRA adapter weights'
          f' ({len(disk_weights)} leaves), but the target needs full weights:'
          f' {len(needed_full)} target weights are not in it, e.g.\n'
          f'{errors.list_paths([fmt(target[w]) for w in needed_full])}\n'
          f'The checkpoint has:\n{errors.list_paths([fmt(w) for w in disk_weights])}\n'
          'A Tunix LoRA run saves only the adapters. Restore the base weights'
          ' from the checkpoint the run started from, or merge the adapters'
          ' into them and save full weights, then restore that.'
      )
    scanned_target = _stackings(
        {w: (fmt(w), view.model[w]) for w in extra},
        {w: (fmt(target[w]), target_shapes[target[w]]) for w in missing},
    )
    scanned_disk = _stackings(
        {w: (fmt(target[w]), target_shapes[target[w]]) for w in missing},
        {w: (fmt(w), view.model[w]) for w in extra},
    )
    if scanned_target or scanned_disk:
      raise LayerScanMismatchError(
          _scan_message(view.step_dir, scanned_target, scanned_disk, len(missing), len(extra))
      )
    if missing:
      sections.append(
          f'{len(missing)} target weights are not in the checkpoint:\n'
          + errors.list_paths([f'{fmt(target[w])} (checkpoint path {fmt(w)})' for w in missing])
      )
    if extra:
      sections.append(
          f'{len(extra)} weights in the checkpoint are not in the target:\n'
          + errors.list_paths([fmt(w) for w in extra])
      )
    sections.append(
        'Build the abstract state from the model the checkpoint was trained'
        ' with (same parameter names; target params/params/<w> is the'
        " checkpoint's <w>); `orbax_tunix.detect(path).layouts` lists the"
        " checkpoint's canonical paths."
    )
  return sections


def _scan_message(
    step_dir: epath.Path,
    scanned_target: Sequence[_Stacking],
    scanned_disk: Sequence[_Stacking],
    n_missing: int,
    n_extra: int,
) -> str:
  parts = [
      f'{step_dir}: scanned vs unscanned layers. Tunix records neither; this is'
      ' inferred from the paths and shapes.'
  ]
  if scanned_target:
    parts.append(
        f'The target is SCANNED (one array per weight holding every layer) and'
        f' the checkpoint UNSCANNED (one array per layer): {len(scanned_target)}'
        f' target weights (target <-> checkpoint):\n'
        + errors.list_paths([str(s) for s in scanned_target])
    )
  if scanned_disk:
    parts.append(
        f'The checkpoint is SCANNED (one array per weight holding every layer)'
        f' and the target UNSCANNED (one array per layer): {len(scanned_disk)}'
        f' checkpoint weights (checkpoint <-> target):\n'
        + errors.list_paths([str(s) for s in scanned_disk])
    )
  parts.append(
      f'In all, {n_missing} target weights are not in the checkpoint and'
      f' {n_extra} checkpoint weights not in the target. Build the abstract'
      ' state with the same layer layout as the checkpoint (MaxText:'
      f' scan_layers={"False" if scanned_target else "True"}), or convert the'
      ' checkpoint first.'
  )
  return '\n'.join(parts)


# --- planning ---------------------------------------------------------------


@dataclasses.dataclass
class _Draft:
  """A plan being worked out: what the planners below add, and what they find wrong."""

  view: CheckpointView
  target: Mapping[Path, Shape | None]
  reads: dict[Path, Source] = dataclasses.field(default_factory=dict)
  fills: dict[Path, Fill] = dataclasses.field(default_factory=dict)
  left_out: list[str] = dataclasses.field(default_factory=list)
  problems: list[str] = dataclasses.field(default_factory=list)
  shapes: list[str] = dataclasses.field(default_factory=list)

  def read(self, target: Path, item: str, path: Path) -> None:
    disk = self.view.model if item == rules.MODEL_ITEM else self.view.optimizer
    have, want = disk[path], self.target[target]
    if have is not None and want is not None and have != want:
      self.shapes.append(f'{fmt(target)}: target {want}, checkpoint {have} ({item}:{fmt(path)})')
    self.reads[target] = Source(item, path)

  @property
  def step_source(self) -> Source | None:
    if self.view.optimizer is not None and _TUNIX_STEP in self.view.optimizer:
      return Source(rules.OPTIMIZER_ITEM, _TUNIX_STEP)
    return None


def _plan_weights(draft: _Draft, aux: frozenset[Path]) -> dict[Path, Path]:
  """params/params/<w> <- model_params:<w>; returns canonical weight -> target path."""
  weights = {p[2:]: p for p in draft.target if p[0] == PARAMS}
  draft.problems += _check_weights(draft.view, weights, draft.target, aux)
  for w, target in weights.items():
    if w in draft.view.model:
      draft.read(target, rules.MODEL_ITEM, w)
  return weights


def _plan_aux(draft: _Draft, aux: frozenset[Path]) -> None:
  """nnx_aux[/model]/<path> <- model_params:<path>; other RNG state is left out."""
  targets = [p for p in draft.target if p[0] == NNX_AUX]
  nested = targets and all(len(p) > 2 and p[1] == NNX_AUX_MODEL for p in targets)
  depth = 2 if nested else 1
  missing = [p for p in targets if p[depth:] not in draft.view.model]
  if missing:
    draft.problems.append(
        f'{len(missing)} {NNX_AUX} leaves are not in the checkpoint'
        f"'s {rules.MODEL_ITEM}:\n{errors.list_paths([fmt(p) for p in missing])}"
    )
  for p in targets:
    if p[depth:] in draft.view.model:
      draft.read(p, rules.MODEL_ITEM, p[depth:])
  taken = {s.path for s in draft.reads.values() if s.item == rules.MODEL_ITEM}
  unused = sorted(w for w in aux if w not in taken)
  if unused:
    why = 'not in the target' if targets else 'the target has no nnx_aux'
    draft.left_out.append(
        f'{len(unused)} RNG/non-weight variables of {rules.MODEL_ITEM} ({why}),'
        f' e.g. {fmt(unused[0])}'
    )


def _plan_step(draft: _Draft) -> None:
  """step <- optimizer_state:step (uint32, cast to the target's dtype on read)."""
  if (STEP,) not in draft.target:
    return
  if draft.step_source is not None:
    draft.read((STEP,), rules.OPTIMIZER_ITEM, _TUNIX_STEP)
  elif draft.view.step is not None:
    draft.fills[(STEP,)] = Fill(
        None, draft.view.step, f'no {rules.OPTIMIZER_ITEM} item: the step directory number'
    )
  else:
    draft.problems.append(
        f'the target has {STEP}, but the checkpoint has no {rules.OPTIMIZER_ITEM}'
        ' item and its directory name carries no step number.'
    )


def _plan_optimizer(
    draft: _Draft,
    weights: Collection[Path],
    source_splits: Mapping[Path, tuple[Path, str, Path | None]],
) -> None:
  """opt_state/... <- optimizer_state:opt_state/..., state by state.

  Target and checkpoint states are matched by their fields in chain order
  (`align_states`); a matched state's leaves map field by field. A target
  state left unmatched is filled when it is a lone `count` (a schedule's
  state, which Tunix's optimizer may not have: it equals the step), and is an
  error otherwise.
  """
  view = draft.view
  targets = [p for p in draft.target if p[0] == OPT_STATE]
  if not targets:
    return
  if view.optimizer is None:
    draft.problems.append(
        f'the target has {len(targets)} {OPT_STATE} leaves, but the checkpoint'
        f' has no {rules.OPTIMIZER_ITEM} item (Tunix wrote only the weights). Use'
        ' params_only=True, or a target without opt_state.'
    )
    return
  known = set(weights) | set(view.model)
  splits = {p: split_opt_path(p, known, COLLECTION) for p in targets}
  target_states = opt_states(splits.values())
  source_states = opt_states(source_splits.values())
  matched = align_states(target_states, source_states)
  index = {s.node: i for i, s in enumerate(target_states)}
  fillable = draft.step_source is not None or view.step is not None
  unmatched: list[OptState] = []
  missing = []
  for p in sorted(targets, key=_order):
    node, field, weight = splits[p]
    i = index[node]
    if i in matched:
      source = (OPT_STATE,) + source_states[matched[i]].node + (field,) + (weight or ())
      if source in view.optimizer:
        draft.read(p, rules.OPTIMIZER_ITEM, source)
      else:
        missing.append(f'{fmt(p)} (checkpoint path {fmt(source)})')
    elif target_states[i].fields == _STEP_COUNTER_FIELDS and fillable:
      draft.fills[p] = Fill(
          draft.step_source,
          None if draft.step_source else view.step,
          "Tunix never wrote this state; a schedule's count is the step",
      )
    elif target_states[i] not in unmatched:
      unmatched.append(target_states[i])
  if unmatched:
    draft.problems.append(
        f"{len(unmatched)} states of the target's optimizer have no counterpart in"
        f' the checkpoint:\n{errors.list_paths([str(s) for s in unmatched])}\n'
        "The checkpoint's optimizer states (canonical):\n"
        + errors.list_paths([str(s) for s in source_states])
        + '\nBuild the abstract state with the optimizer the Tunix run used'
        ' (empty states, a clipping transform and inject_hyperparams may'
        ' differ), or restore with params_only=True.'
    )
  if missing:
    draft.problems.append(
        f'{len(missing)} {OPT_STATE} leaves are not in the checkpoint:\n'
        + errors.list_paths(missing)
    )
  used = set(matched.values())
  draft.left_out += [
      f"optimizer state {state} (the target's optimizer has no such state)"
      for j, state in enumerate(source_states)
      if j not in used
  ]
  if view.side_paths:
    draft.left_out.append(
        f'{len(view.side_paths)} leaves outside the canonical view (the'
        ' inject_hyperparams count and hyperparameters): MaxText takes its'
        ' hyperparameters from its config'
    )


def make_plan(
    view: CheckpointView,
    target_shapes: Mapping[Path, Shape | None],
    *,
    params_only: bool = False,
    notes: Sequence[str] = (),
) -> RestorePlan:
  """Works out where every target leaf comes from; a pure function of metadata.

  Args:
    view: the checkpoint's canonical leaves.
    target_shapes: the target's leaf paths (MaxText key paths) -> shapes as
      stored (key data for PRNG keys).
    params_only: plan the `params` subtree only; other leaves are kept.
    notes: carried into the plan.

  Returns:
    A `RestorePlan`.

  Raises:
    TargetMismatchError (or its subclasses `LoraOnlyCheckpointError`,
      `LayerScanMismatchError`): the target cannot be filled from the
      checkpoint; the message lists every problem.
  """
  wanted = {p: s for p, s in target_shapes.items() if not params_only or p[0] == PARAMS}
  where = f'{view.step_dir}: the MaxText target does not match the Tunix checkpoint.'
  unknown = [
      p for p in wanted
      if p[0] not in TOP_KEYS or (p[0] == PARAMS and (len(p) < 3 or p[1] != COLLECTION))
  ]
  if unknown:
    raise errors.TargetMismatchError(
        f'{where}\n{len(unknown)} target leaves are not where a MaxText train'
        f' state has them (params/{COLLECTION}/<weights>, {OPT_STATE}/...,'
        f' {STEP}, {NNX_AUX}/...):\n{errors.list_paths([fmt(p) for p in unknown])}\n'
        'Pass the train state MaxText builds (or a dict with the same key paths).'
    )
  if params_only and not wanted:
    raise errors.TargetMismatchError(
        f'{where}\nparams_only=True, but the target has no'
        f' {PARAMS}/{COLLECTION}/... leaves. Pass the abstract state with its params.'
    )
  draft = _Draft(view, wanted)
  # Which model leaves are weights: those the optimizer mirrors (its `wrt`),
  # never RNG state; with no optimizer item, everything but RNG state.
  source_splits = {
      p: split_opt_path(p, view.model) for p in (view.optimizer or {}) if p[0] == OPT_STATE
  }
  mirrored = {w for _, _, w in source_splits.values() if w is not None}
  aux = frozenset(w for w in view.model if _RNG_KEY in w or (mirrored and w not in mirrored))

  weights = _plan_weights(draft, aux)
  _plan_aux(draft, aux)
  _plan_step(draft)
  _plan_optimizer(draft, weights, source_splits)
  if params_only and view.optimizer is not None:
    draft.left_out.append(f'{rules.OPTIMIZER_ITEM} (params_only=True)')
  if draft.shapes:
    draft.problems.append(
        f'{len(draft.shapes)} leaves differ in shape:\n' + errors.list_paths(draft.shapes)
        + '\nThe target must have the shapes the run trained with (vocabulary,'
        ' widths, number of layers).'
    )
  if draft.problems:
    raise errors.TargetMismatchError('\n'.join([where, *draft.problems]))
  return RestorePlan(
      step_dir=view.step_dir,
      reads=draft.reads,
      fills=draft.fills,
      kept=frozenset(p for p in target_shapes if p not in wanted),
      left_out=tuple(draft.left_out),
      notes=tuple(notes),
  )


def _is_key(dtype: Any) -> bool:
  return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def _stored_form(shape: Shape, dtype: Any) -> jax.ShapeDtypeStruct:
  """The shape and dtype a leaf has on disk: PRNG keys are stored as their key data."""
  if not _is_key(dtype):
    return jax.ShapeDtypeStruct(shape, dtype)
  return jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(shape, dtype))


def _target_shapes(pairs: Sequence[tuple[Path, Any]]) -> dict[Path, Shape | None]:
  """Target leaf path -> the shape it has on disk (key data for typed PRNG keys)."""
  bad = [fmt(p) for p, leaf in pairs if not hasattr(leaf, 'dtype') or _shape(leaf) is None]
  if bad:
    raise errors.TargetMismatchError(
        f'The abstract state has {len(bad)} leaves that are not arrays (expected'
        ' jax.ShapeDtypeStruct or jax.Array):\n'
        f'{errors.list_paths(bad)}\nBuild it with jax.eval_shape.'
    )
  return {p: _stored_form(_shape(leaf), leaf.dtype).shape for p, leaf in pairs}


def plan_restore(
    path: epath.PathLike, abstract_state: PyTree, *, params_only: bool = False
) -> RestorePlan:
  """Plans restoring a Tunix checkpoint into a MaxText-shaped abstract state.

  Reads metadata only: both items' JSON, and the array metadata of the items
  the target needs (only the weights' when `params_only`).

  Args:
    path: a Tunix root (latest committed step), step or RL root.
    abstract_state: MaxText's train state, abstract (see `restore_train_state`).
    params_only: plan the `params` subtree only.

  Returns:
    A `RestorePlan`; `describe()` says what it will do.

  Raises:
    UnsupportedLayoutError: not a Tunix checkpoint.
    TargetMismatchError (and subclasses): see `make_plan`.
    NotACheckpointError, UncommittedStepError, CorruptMetadataError.
  """
  path = epath.Path(path)
  # Orbax reads only absolute paths; a relative one is the user's working dir.
  detection = detect(path if path.is_absolute() else path.resolve())
  if not detection.is_tunix:
    raise errors.UnsupportedLayoutError(
        f'{detection.step_dir}: expected a Tunix checkpoint, found a'
        f' {detection.kind} one (items {list(detection.items)}). Restore it with'
        f' plain Orbax; `{ItemsHandler.__name__}` does so by itself.'
    )
  pairs, _ = flatten(abstract_state)
  shapes = _target_shapes(pairs)
  needed = {rules.MODEL_ITEM}
  if not params_only and any(p[0] in (OPT_STATE, STEP) for p in shapes):
    needed.add(rules.OPTIMIZER_ITEM)
  view = read_view(detection, shapes_of=needed)
  return make_plan(view, shapes, params_only=params_only, notes=detection.notes)


# --- executing --------------------------------------------------------------


def _default_sharding(leaf: Any) -> jax.sharding.Sharding:
  sharding = getattr(leaf, 'sharding', None)
  if isinstance(sharding, jax.sharding.Sharding):
    return sharding
  return jax.sharding.SingleDeviceSharding(jax.local_devices()[0])


def _resolve(leaf: Any, arg: Any) -> tuple[jax.ShapeDtypeStruct, ocp.ArrayRestoreArgs]:
  """The target leaf as a sharded abstract array, and its restore args.

  Caller-given `ArrayRestoreArgs` are kept (their class too, e.g. MaxText's
  single-replica ones); what they leave open is taken from the abstract leaf,
  so every result has the target's dtype (MaxText passes shardings only).
  """
  shape = tuple(leaf.shape)
  if isinstance(arg, ocp.ArrayRestoreArgs):
    sharding = arg.sharding
    if not isinstance(sharding, jax.sharding.Sharding):
      sharding = None
    if sharding is None and arg.mesh is not None and arg.mesh_axes is not None:
      sharding = jax.sharding.NamedSharding(arg.mesh, arg.mesh_axes)
    changes: dict[str, Any] = {}
    if arg.dtype is None:
      changes['dtype'] = leaf.dtype
    if sharding is None:
      sharding = _default_sharding(leaf)
      if arg.sharding is None and arg.mesh is None:
        changes['sharding'] = sharding
    arg = dataclasses.replace(arg, **changes) if changes else arg
    return jax.ShapeDtypeStruct(shape, arg.dtype, sharding=sharding), arg
  dtype = getattr(arg, 'dtype', None) or leaf.dtype
  sharding = _default_sharding(leaf)
  args = ocp.ArrayRestoreArgs(sharding=sharding, dtype=dtype, global_shape=shape)
  return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding), args


def _restore_args_by_path(restore_args: PyTree | None) -> dict[Path, Any]:
  if restore_args is None:
    return {}
  pairs, _ = jax.tree_util.tree_flatten_with_path(
      restore_args, is_leaf=lambda x: isinstance(x, ocp.RestoreArgs)
  )
  return {tuple(key_str(k) for k in keys): arg for keys, arg in pairs}


def _constant(value: int, target: jax.ShapeDtypeStruct) -> jax.Array:
  host = np.full(target.shape, value, dtype=target.dtype)
  return jax.make_array_from_callback(target.shape, target.sharding, lambda idx: host[idx])


def _read_form(
    target: jax.ShapeDtypeStruct, arg: ocp.ArrayRestoreArgs
) -> tuple[jax.ShapeDtypeStruct, ocp.ArrayRestoreArgs]:
  """What to ask the item handler for: a typed PRNG key is read as its key data.

  The checkpoint records key data (e.g. uint32 (2,) for a threefry key of
  shape ()); Orbax wraps it back into a key after reading, see `_as_target`.
  """
  if not _is_key(target.dtype):
    return target, arg
  data = _stored_form(target.shape, target.dtype)
  sharding = target.sharding
  if isinstance(sharding, jax.sharding.NamedSharding):
    trailing = (None,) * (len(data.shape) - len(target.shape))
    sharding = jax.sharding.NamedSharding(
        sharding.mesh, jax.sharding.PartitionSpec(*sharding.spec, *trailing)
    )
  arg = dataclasses.replace(
      arg, dtype=data.dtype, global_shape=data.shape, shape=data.shape, sharding=sharding,
      mesh=None, mesh_axes=None,
  )
  return jax.ShapeDtypeStruct(data.shape, data.dtype, sharding=sharding), arg


def _as_target(value: jax.Array, target: jax.ShapeDtypeStruct) -> jax.Array:
  """Puts PRNG keys in the target's form (typed key or key data), as read otherwise."""
  want_key, is_key = _is_key(target.dtype), _is_key(value.dtype)
  if want_key == is_key:
    return value
  value = jax.random.wrap_key_data(value) if want_key else jax.random.key_data(value)
  return jax.device_put(value, target.sharding)


def _convert(array: jax.Array, target: jax.ShapeDtypeStruct) -> jax.Array:
  """A second target leaf from the same source: cast and reshard on device."""
  array = _as_target(array, target)
  if _is_key(target.dtype):
    return jax.device_put(array, target.sharding)
  return jax.jit(lambda x: x.astype(target.dtype), out_shardings=target.sharding)(array)


def _host_int(array: jax.Array) -> int:
  # A scalar is replicated: any local shard holds the value (multi-process too).
  return int(np.asarray(array.addressable_data(0)).item())


def execute_plan(
    plan: RestorePlan, abstract_state: PyTree, *, restore_args: PyTree | None = None
) -> PyTree:
  """Reads what a plan says, once per array, into the target's shardings and dtypes.

  Args:
    plan: from `plan_restore` for this `abstract_state`.
    abstract_state: the target (abstract arrays with shardings).
    restore_args: optional `ocp.RestoreArgs` tree in the target's structure.

  Returns:
    A tree of the target's structure; planned leaves are `jax.Array`s, kept
    leaves are returned as given.
  """
  pairs, treedef = flatten(abstract_state)
  given = _restore_args_by_path(restore_args)
  resolved = {
      p: _resolve(leaf, given.get(p))
      for p, leaf in pairs
      if p in plan.reads or p in plan.fills
  }
  # Each source is read once, with the args of the first target leaf it fills.
  primary: dict[Source, Path] = {}
  for target, source in sorted(plan.reads.items()):
    primary.setdefault(source, target)
  values: dict[Source, jax.Array] = {}
  for item, paths in plan.sources().items():
    abstract, args = [], []
    for path in paths:
      source = Source(item, path)
      if source in primary:
        sds, arg = _read_form(*resolved[primary[source]])
      else:  # Only a fill needs it (the step): a scalar on one device.
        sharding = _default_sharding(None)
        sds = jax.ShapeDtypeStruct((), np.uint32, sharding=sharding)
        arg = ocp.ArrayRestoreArgs(sharding=sharding)
      abstract.append((path, sds))
      args.append((path, arg))
    restored = TunixPyTreeHandler().restore(
        plan.step_dir / item,
        args=TunixPyTreeRestore(item=nest(abstract), restore_args=nest(args)),
    )
    by_path = flat_dict(restored)
    values.update((Source(item, p), by_path[p]) for p in paths)
  leaves = []
  for path, leaf in pairs:
    if path in plan.reads:
      source = plan.reads[path]
      value = values[source]
      target = resolved[path][0]
      if primary[source] == path:
        leaves.append(_as_target(value, target))
      else:
        leaves.append(_convert(value, target))
    elif path in plan.fills:
      fill = plan.fills[path]
      number = fill.value if fill.source is None else _host_int(values[fill.source])
      logger.info('%s: filled with %d from %s', fmt(path), number, fill.describe())
      leaves.append(_constant(number, resolved[path][0]))
    else:
      leaves.append(leaf)
  for note in plan.left_out:
    logger.info('%s: left out of the MaxText state: %s', plan.step_dir, note)
  return jax.tree_util.tree_unflatten(treedef, leaves)


def restore_train_state(
    path: epath.PathLike,
    abstract_state: PyTree,
    *,
    params_only: bool = False,
    restore_args: PyTree | None = None,
) -> PyTree:
  """Restores a Tunix checkpoint as MaxText's train state.

  Example::

    abstract = jax.eval_shape(init_train_state)   # with shardings attached
    state = orbax_tunix.maxtext.restore_train_state(tunix_root, abstract)

  Args:
    path: a Tunix root (the latest committed step), step or RL root.
    abstract_state: a pytree with MaxText's key paths (a flax `TrainState`
      from `jax.eval_shape`, or a dict): `params/params/<weights>`,
      `opt_state` (optax states in chain order, empty ones `None` or
      `EmptyState`), `step`, and optionally `nnx_aux/model/<variables>` (or
      `nnx_aux/<variables>`) for RNGs and other non-weight variables. Leaves
      are `jax.ShapeDtypeStruct`s or arrays; their sharding and dtype are
      those of the result (a single local device when they have none).
    params_only: restore the `params` subtree only and open only the weights;
      every other leaf is returned as given.
    restore_args: optional `ocp.ArrayRestoreArgs` in the target's structure
      (as MaxText passes them); unset dtypes and shardings come from the
      abstract leaves.

  Returns:
    A tree of the same structure whose restored leaves are `jax.Array`s. Each
    needed array is read once; nothing the target does not need is read.

  Raises:
    TargetMismatchError: the target does not fit the checkpoint (weights on
      one side only, shapes, optimizer states); raised before any array is
      read. `LayerScanMismatchError` and `LoraOnlyCheckpointError` are the
      scanned/unscanned and LoRA-only cases.
    UnsupportedLayoutError: not a Tunix checkpoint.
    NotACheckpointError, UncommittedStepError, CorruptMetadataError.
  """
  plan = plan_restore(path, abstract_state, params_only=params_only)
  logger.debug('%s', plan.describe())
  return execute_plan(plan, abstract_state, restore_args=restore_args)


# --- the Orbax handler --------------------------------------------------------


class ItemsHandler(ocp.PyTreeCheckpointHandler):
  """MaxText's `items` handler that also restores Tunix steps.

  Example (what MaxText's own restore does, with this handler)::

    ckptr = ocp.Checkpointer(orbax_tunix.maxtext.ItemsHandler())
    state = ckptr.restore(step_dir, args=ocp.args.PyTreeRestore(
        item=abstract_state, restore_args=restore_args, partial_restore=True))

  On a Tunix checkpoint (root, step or RL root) `item` is the MaxText
  abstract state and the restore is `restore_train_state`; `ItemsRestore`
  adds `params_only`. Anything else (e.g. MaxText's own `items`) is restored
  by the plain `PyTreeCheckpointHandler`, and saving writes an ordinary PyTree.
  """

  def restore(
      self,
      directory: epath.Path,
      item: PyTree | None = None,
      restore_args: PyTree | None = None,
      transforms: PyTree | None = None,
      transforms_default_to_original: bool = True,
      legacy_transform_fn: Any = None,
      args: ocp.args.CheckpointArgs | None = None,
  ) -> PyTree:
    """Restores a train state; see the class docstring.

    Raises:
      TargetMismatchError: no target given, or it does not fit the checkpoint.
      UnsupportedLayoutError: legacy `transforms` on a Tunix checkpoint.
    """
    directory = as_path(directory)
    args = as_pytree_restore(
        args, item, restore_args, transforms, transforms_default_to_original, legacy_transform_fn
    )
    if not detect(directory).is_tunix:
      return super().restore(directory, args=args)
    if args.transforms is not None or args.legacy_transform_fn is not None:
      raise errors.UnsupportedLayoutError(
          f'{directory}: legacy `transforms` are not supported on a Tunix'
          ' checkpoint; pass the MaxText abstract state as `item` (the mapping'
          ' is worked out from it).'
      )
    if args.item is None:
      raise errors.TargetMismatchError(
          f'{directory}: a Tunix checkpoint is restored into a MaxText train'
          ' state, and none was given. Pass the abstract state as `item`.'
      )
    return restore_train_state(
        directory,
        args.item,
        params_only=getattr(args, 'params_only', False),
        restore_args=args.restore_args,
    )


# Registering args of its own makes `ocp.Checkpointer` pass any args (plain
# `ocp.args.PyTreeRestore` too) straight to the handler.
@ocp.args.register_with_handler(ItemsHandler, for_save=True)
@dataclasses.dataclass
class ItemsSave(ocp.args.PyTreeSave):
  """Saves like `ocp.args.PyTreeSave` (an ordinary Orbax PyTree)."""


@ocp.args.register_with_handler(ItemsHandler, for_restore=True)
@dataclasses.dataclass
class ItemsRestore(ocp.args.PyTreeRestore):
  """`ocp.args.PyTreeRestore` with `params_only` (restore `params` alone)."""

  params_only: bool = False

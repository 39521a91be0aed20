"""Planning: where every leaf of a MaxText target comes from, worked out once.

`make_plan` is a pure function of the checkpoint's view and the target's key
paths and shapes; `plan_restore` gathers both from a path. Every mismatch is
reported here, before any array is read.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

from etils import epath

from orbax_tunix import conventions, errors
from orbax_tunix.keypaths import Path, flatten, fmt
from orbax_tunix.mapping import stacks
from orbax_tunix.mapping.outputs import Input, Output
from orbax_tunix.mapping.patterns import Mapped
from orbax_tunix.mapping.transforms import IDENTITY, Transform, constant
from orbax_tunix.maxtext import layers
from orbax_tunix.maxtext.optimizer import (
  OptState,
  align_states,
  chain_order,
  opt_states,
  split_opt_path,
)
from orbax_tunix.maxtext.train_state import COLLECTION, OPT_STATE, PARAMS, STEP
from orbax_tunix.maxtext.view import CheckpointView, Shape, read_view
from orbax_tunix.maxtext.weights import check_weights
from orbax_tunix.reading.read_requests import stored_shape
from orbax_tunix.store import step_store
from orbax_tunix.view.detection import Detection, detect, wanted_items

PyTree = Any

_TUNIX_STEP = conventions.OPTIMIZER_STEP
# A state Tunix may not have written but whose value is known: a schedule's
# `count` (ScaleByScheduleState) is the number of steps taken.
_STEP_COUNTER_FIELDS = (('count', False),)


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
class Derived:
  """A target leaf made from several Tunix leaves, or from one by a transform.

  Attributes:
    sources: the leaves it is made from, in order (e.g. the layers to stack).
    transform: how (see `transforms.py`); the result is cast to the target's dtype.
  """

  sources: tuple[Source, ...]
  transform: Transform
  shapes: tuple[Shape, ...] = ()

  def __str__(self) -> str:
    first = ', '.join(str(s) for s in self.sources[:2])
    more = f', ... ({len(self.sources)} in all)' if len(self.sources) > 2 else ''
    return f'{self.transform} of {first}{more}'


@dataclasses.dataclass(frozen=True)
class RestorePlan:
  """Where every leaf of a MaxText target comes from; computed once, before any read.

  Attributes:
    step_dir: the Tunix step directory.
    detection: the step as detected (its items read once; execution reads
      through them without planning again).
    reads: target leaf path -> the Tunix leaf it is read from.
    derived: target leaf path -> the Tunix leaves it is made from and how
      (a layer of a stacked weight, the layers stacked).
    fills: target leaf path -> how it is filled (leaves Tunix never wrote).
    kept: target leaves returned as given (outside `params` when params_only;
      RNG variables the checkpoint does not hold in the target's form).
    left_out: what the checkpoint holds that the target does not take.
    notes: what `detect()` noticed (e.g. unfinished steps skipped).
  """

  step_dir: epath.Path
  detection: Detection
  reads: Mapping[Path, Source]
  fills: Mapping[Path, Fill]
  kept: frozenset[Path]
  left_out: tuple[str, ...] = ()
  notes: tuple[str, ...] = ()
  derived: Mapping[Path, Derived] = dataclasses.field(default_factory=dict)

  def sources(self) -> dict[str, list[Path]]:
    """Tunix item -> the canonical paths read from it, each once, sorted."""
    needed = set(self.reads.values())
    needed.update(f.source for f in self.fills.values() if f.source is not None)
    needed.update(s for d in self.derived.values() for s in d.sources)
    out: dict[str, list[Path]] = {}
    for source in sorted(needed):
      out.setdefault(source.item, []).append(source.path)
    return out

  def planned(self, path: Path) -> bool:
    """The target leaf is restored (read, made or filled), not kept as given."""
    return path in self.reads or path in self.derived or path in self.fills

  def first_source(self, path: Path) -> Source | None:
    """The (first) leaf a target leaf is made from; None for a constant or a kept leaf."""
    if path in self.reads:
      return self.reads[path]
    if path in self.derived:
      return self.derived[path].sources[0]
    fill = self.fills.get(path)
    return None if fill is None else fill.source

  def outputs(
      self, input_of: Callable[[Source], Input], targets: Mapping[Path, Any]
  ) -> tuple[Output, ...]:
    """Every planned target leaf as an `Output`, the vocabulary both executors run
    (`mapping.device` for a restore, the writer for a convert): a read is the
    identity of its source, a derived leaf its transform of its sources, a fill
    the identity of the leaf it takes or a constant.

    Args:
      input_of: a source leaf as an `Input` of the executor's.
      targets: target path -> what it is made as (its `shape` and `dtype`).
    """
    out = []
    for path in sorted({*self.reads, *self.derived, *self.fills}):
      if path in self.reads:
        inputs, transform = (input_of(self.reads[path]),), IDENTITY
      elif path in self.derived:
        derived = self.derived[path]
        inputs, transform = tuple(input_of(s) for s in derived.sources), derived.transform
      else:
        fill = self.fills[path]
        inputs = () if fill.source is None else (input_of(fill.source),)
        transform = IDENTITY if inputs else constant(fill.value)
      target = targets[path]
      out.append(Output(path, inputs, transform, tuple(target.shape), target.dtype))
    return tuple(out)

  def describe(self) -> str:
    """A few lines for people: what is read, filled and left out."""
    lines = [f'{self.step_dir} -> MaxText train state']
    lines += [f'  note: {n}' for n in self.notes]
    for item, paths in self.sources().items():
      lines.append(f'  read {len(paths)} arrays from {item}')
    if self.derived:
      lines.append(f'  make {len(self.derived)} target leaves from others, e.g.'
                   f' {fmt(min(self.derived))} = {self.derived[min(self.derived)]}')
    for target, fill in sorted(self.fills.items()):
      lines.append(f'  fill {fmt(target)} from {fill.describe()}')
    if self.kept:
      lines.append(f'  keep {len(self.kept)} target leaves as given (not restored)')
    lines += [f'  left out: {n}' for n in self.left_out]
    return '\n'.join(lines)


# --- planning ---------------------------------------------------------------


@dataclasses.dataclass
class _Draft:
  """A plan being worked out: what the planners below add, and what they find wrong."""

  view: CheckpointView
  target: Mapping[Path, Shape | None]
  axis: int | None = None
  reads: dict[Path, Source] = dataclasses.field(default_factory=dict)
  derived: dict[Path, Derived] = dataclasses.field(default_factory=dict)
  fills: dict[Path, Fill] = dataclasses.field(default_factory=dict)
  kept: set[Path] = dataclasses.field(default_factory=set)
  left_out: list[str] = dataclasses.field(default_factory=list)
  problems: list[str] = dataclasses.field(default_factory=list)
  shapes: list[str] = dataclasses.field(default_factory=list)
  # Canonical weight -> how it is made from the checkpoint's (the other layer form).
  relaid: dict[Path, Mapped] = dataclasses.field(default_factory=dict)
  # Stored shapes of the weights `relaid` reads, for the mirrored optimizer leaves.
  relaid_shapes: dict[Path, Shape] = dataclasses.field(default_factory=dict)
  # Optimizer leaves read for derived ones -> the shape of the weight they mirror.
  mirrored_shapes: dict[Path, Shape] = dataclasses.field(default_factory=dict)

  def read(self, target: Path, item: str, path: Path) -> None:
    self.reads[target] = Source(item, path)

  def derive(self, target: Path, item: str, paths: Sequence[Path], mapped: Mapped) -> None:
    """`target` <- `mapped`'s transform of `paths` (the sources of `mapped`, or mirrors of them)."""
    shapes = tuple(self.relaid_shapes[w] for w in mapped.sources)
    self.derived[target] = Derived(tuple(Source(item, p) for p in paths), mapped.transform, shapes)

  def check_shapes(self) -> None:
    """Every read against the checkpoint's shapes, an item at a time, before any read."""
    for item in (conventions.MODEL_ITEM, conventions.OPTIMIZER_ITEM):
      wanted: dict[Path, Shape] = {}
      targets: dict[Path, list[Path]] = {}
      for target, source in self.reads.items():
        shape = self.target[target]
        if source.item == item and shape is not None:
          wanted[source.path] = shape
          targets.setdefault(source.path, []).append(target)
      if not wanted:
        continue
      for path, have in self.view.mismatched_shapes(item, wanted).items():
        for target in targets[path]:
          self.shapes.append(
              f'{fmt(target)}: target {self.target[target]}, checkpoint {have}'
              f' ({item}:{fmt(path)}, stored as {self.view.stored(item, path)})'
          )
    # Leaves made from optimizer leaves that mirror relaid weights: their weights' shapes.
    wanted = self.mirrored_shapes
    for path, have in self.view.mismatched_shapes(conventions.OPTIMIZER_ITEM, wanted).items():
      self.shapes.append(f'{conventions.OPTIMIZER_ITEM}:{fmt(path)}: expected {wanted[path]}'
                         f' (its weight\'s shape), checkpoint {have}')

  @property
  def step_source(self) -> Source | None:
    if self.view.optimizer is not None and _TUNIX_STEP in self.view.optimizer:
      return Source(conventions.OPTIMIZER_ITEM, _TUNIX_STEP)
    return None


def _plan_weights(draft: _Draft, aux: frozenset[Path]) -> dict[Path, Path]:
  """params/params/<w> <- model_params:<w>, or made from the other layer form of it.

  Returns:
    canonical weight -> target path.
  """
  view = draft.view
  weights = {p[2:]: p for p in draft.target if p[0] == PARAMS}
  missing = [w for w in weights if w not in view.model]
  others = [w for w in view.model if w not in weights and w not in aux]
  if missing and stacks.form_of(missing) and stacks.form_of(others):
    # The target asks for the other form of the layers (scanned vs unscanned).
    shapes = view.shapes(conventions.MODEL_ITEM, others)
    draft.relaid = layers.relayout(
        shapes, {w: draft.target[t] for w, t in weights.items()}, draft.axis,
        where=str(view.step_dir))
    used = {s for m in draft.relaid.values() for s in m.sources}
    draft.relaid_shapes = {s: shapes[s] for s in used}
    aux = aux | used
  plain = {w: t for w, t in weights.items() if w not in draft.relaid}
  draft.problems += check_weights(view, plain, draft.target, aux)
  for w, target in weights.items():
    if w in draft.relaid:
      mapped = draft.relaid[w]
      draft.derive(target, conventions.MODEL_ITEM, mapped.sources, mapped)
    elif w in view.model:
      draft.read(target, conventions.MODEL_ITEM, w)
  return weights


def _plan_aux(draft: _Draft, aux: frozenset[Path]) -> None:
  """nnx_aux[/model]/<path> <- model_params:<path>; other RNG state is left out."""
  targets = [p for p in draft.target if p[0] == conventions.MAXTEXT_NNX_AUX]
  nested = targets and all(len(p) > 2 and p[1] == conventions.MAXTEXT_NNX_AUX_MODEL for p in targets)
  depth = 2 if nested else 1
  present = {p: draft.target[p] for p in targets if p[depth:] in draft.view.model}
  # Kept as given, as MaxText keeps its own values for what a checkpoint lacks:
  # leaves the checkpoint does not hold, or holds in another form (e.g. other
  # RNG key data).
  other = draft.view.mismatched_shapes(
      conventions.MODEL_ITEM, {p[depth:]: s for p, s in present.items() if s is not None})
  kept = [p for p in targets if p not in present or p[depth:] in other]
  if kept:
    draft.kept.update(kept)
    draft.left_out.append(
        f'{len(kept)} {conventions.MAXTEXT_NNX_AUX} leaves of the target kept as given (the'
        f' checkpoint does not hold them, or holds them in another form), e.g. {fmt(kept[0])}'
    )
  for p in targets:
    if p not in draft.kept:
      draft.read(p, conventions.MODEL_ITEM, p[depth:])
  taken = {s.path for s in draft.reads.values() if s.item == conventions.MODEL_ITEM}
  unused = sorted(w for w in aux if w not in taken)
  if unused:
    why = 'not in the target' if targets else 'the target has no nnx_aux'
    draft.left_out.append(
        f'{len(unused)} RNG/non-weight variables of {conventions.MODEL_ITEM} ({why}),'
        f' e.g. {fmt(unused[0])}'
    )


def _plan_step(draft: _Draft) -> None:
  """step <- optimizer_state:step (uint32, cast to the target's dtype on read)."""
  if (STEP,) not in draft.target:
    return
  if draft.step_source is not None:
    draft.read((STEP,), conventions.OPTIMIZER_ITEM, _TUNIX_STEP)
  elif draft.view.step is not None:
    draft.fills[(STEP,)] = Fill(
        None, draft.view.step, f'no {conventions.OPTIMIZER_ITEM} item: the step directory number'
    )
  else:
    draft.problems.append(
        f'the target has {STEP}, but the checkpoint has no {conventions.OPTIMIZER_ITEM}'
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
        f' has no {conventions.OPTIMIZER_ITEM} item (Tunix wrote only the weights). Use'
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
  for p in sorted(targets, key=chain_order):
    node, field, weight = splits[p]
    i = index[node]
    if i in matched:
      node = (OPT_STATE,) + source_states[matched[i]].node + (field,)
      if weight in draft.relaid:  # Mirrors a weight made from the other layer form.
        mapped = draft.relaid[weight]
        sources = [node + w for w in mapped.sources]
        absent = [s for s in sources if s not in view.optimizer]
        if absent:
          missing.append(f'{fmt(p)} (checkpoint path {fmt(absent[0])})')
        else:
          draft.derive(p, conventions.OPTIMIZER_ITEM, sources, mapped)
          draft.mirrored_shapes.update(
              (s, draft.relaid_shapes[w]) for s, w in zip(sources, mapped.sources, strict=True))
        continue
      source = node + (weight or ())
      if source in view.optimizer:
        draft.read(p, conventions.OPTIMIZER_ITEM, source)
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
    param_scan_axis: int | None = None,
) -> RestorePlan:
  """Works out where every target leaf comes from; a pure function of metadata.

  Args:
    view: the checkpoint's canonical leaves.
    target_shapes: the target's leaf paths (MaxText key paths) -> shapes as
      stored (key data for PRNG keys).
    params_only: plan the `params` subtree only; other leaves are kept.
    notes: carried into the plan.
    param_scan_axis: the layer axis of scanned weights (MaxText's; used when
      the target and the checkpoint hold the layers in different forms).

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
      if p[0] not in conventions.MAXTEXT_KEYS or (p[0] == PARAMS and (len(p) < 3 or p[1] != COLLECTION))
  ]
  if unknown:
    raise errors.TargetMismatchError(
        f'{where}\n{len(unknown)} target leaves are not where a MaxText train'
        f' state has them (params/{COLLECTION}/<weights>, {OPT_STATE}/...,'
        f' {STEP}, {conventions.MAXTEXT_NNX_AUX}/...):\n'
        f'{errors.list_paths([fmt(p) for p in unknown])}\n'
        'Pass the train state MaxText builds (or a dict with the same key paths).'
    )
  if params_only and not wanted:
    raise errors.TargetMismatchError(
        f'{where}\nparams_only=True, but the target has no'
        f' {PARAMS}/{COLLECTION}/... leaves. Pass the abstract state with its params.'
    )
  draft = _Draft(view, wanted, param_scan_axis)
  # Which model leaves are weights: those the optimizer mirrors (its `wrt`),
  # never RNG state; with no optimizer item, everything but RNG state.
  source_splits = {
      p: split_opt_path(p, view.model) for p in (view.optimizer or {}) if p[0] == OPT_STATE
  }
  mirrored = {w for _, _, w in source_splits.values() if w is not None}
  aux = frozenset(
      w for w in view.model if conventions.is_rng_state(w) or (mirrored and w not in mirrored)
  )

  weights = _plan_weights(draft, aux)
  _plan_aux(draft, aux)
  _plan_step(draft)
  _plan_optimizer(draft, weights, source_splits)
  if params_only and view.optimizer is not None:
    draft.left_out.append(f'{conventions.OPTIMIZER_ITEM} (params_only=True)')
  if not draft.problems:
    draft.check_shapes()
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
      detection=view.detection,
      reads=draft.reads,
      fills=draft.fills,
      kept=frozenset(p for p in target_shapes if p not in wanted) | frozenset(draft.kept),
      left_out=tuple(draft.left_out),
      notes=tuple(notes),
      derived=draft.derived,
  )


def _target_shapes(pairs: Sequence[tuple[Path, Any]]) -> dict[Path, Shape | None]:
  """Target leaf path -> the shape it has on disk (key data for typed PRNG keys)."""
  shapes = {p: stored_shape(leaf) if hasattr(leaf, 'dtype') else None for p, leaf in pairs}
  bad = [fmt(p) for p, shape in shapes.items() if shape is None]
  if bad:
    raise errors.TargetMismatchError(
        f'The abstract state has {len(bad)} leaves that are not arrays (expected'
        ' jax.ShapeDtypeStruct or jax.Array):\n'
        f'{errors.list_paths(bad)}\nBuild it with jax.eval_shape.'
    )
  return shapes


def needed_items(params_only: bool) -> tuple[str, ...]:
  """The Tunix items a MaxText restore reads: the weights, and the optimizer unless params-only."""
  if params_only:
    return (conventions.MODEL_ITEM,)
  return (conventions.MODEL_ITEM, conventions.OPTIMIZER_ITEM)


def detect_for(path: epath.PathLike, params_only: bool) -> Detection:
  """Detects only the items a MaxText restore needs (a params-only one opens no optimizer)."""
  location = step_store.resolve(path)
  return detect(location, items=wanted_items(location, needed_items(params_only)))


def require_target(abstract_state: PyTree, where: object) -> None:
  """Refuses a target with no leaves (None, {}): nothing would say what to restore.

  Raises:
    TargetMismatchError: saying how to build MaxText's abstract state.
  """
  if not flatten(abstract_state)[0]:
    raise errors.TargetMismatchError(
        f'{where}: `abstract_state` {abstract_state!r}: expected MaxText\'s abstract train'
        ' state (its leaves say what is restored, in which shape, dtype and sharding),'
        ' found no leaves. Build it as MaxText does: `train_state_nnx.to_checkpoint_dict`'
        ' of its abstract NNX state, or `jax.eval_shape` of a Linen TrainState\'s'
        ' init, shardings attached (README: "In your own code").'
    )


def plan_restore(
    path: epath.PathLike | Detection,
    abstract_state: PyTree,
    *,
    params_only: bool = False,
    param_scan_axis: int | None = None,
) -> RestorePlan:
  """Plans restoring a Tunix checkpoint into a MaxText-shaped abstract state.

  Reads metadata only: the items' JSON (only the weights' when
  `params_only`), and what checks the shapes of the arrays the target needs.

  Args:
    path: a Tunix root (latest committed step), step or RL root, or its
      `detect()` result.
    abstract_state: MaxText's train state, abstract (see `restore_train_state`).
    params_only: plan the `params` subtree only.
    param_scan_axis: the layer axis of scanned weights (see `make_plan`).

  Returns:
    A `RestorePlan`; `describe()` says what it will do.

  Raises:
    UnsupportedLayoutError: not a Tunix checkpoint.
    TargetMismatchError (and subclasses): an `abstract_state` with no leaves
      (None, {}); see `make_plan`.
    MissingItemError: an item the restore needs is recorded but not on disk.
    NotACheckpointError, UncommittedStepError, CorruptMetadataError.
  """
  require_target(abstract_state, path.step_dir if isinstance(path, Detection) else path)
  detection = path if isinstance(path, Detection) else detect_for(path, params_only)
  detection.require(needed_items(params_only))
  if not detection.is_tunix:
    raise errors.UnsupportedLayoutError(
        f'{detection.step_dir}: expected a Tunix checkpoint, found a'
        f' {detection.kind} one (items {list(detection.items)}). Restore it with'
        ' plain Orbax; `ItemsHandler` does so by itself.'
    )
  pairs, _ = flatten(abstract_state)
  shapes = _target_shapes(pairs)
  view = read_view(detection)
  return make_plan(view, shapes, params_only=params_only, notes=detection.notes,
                   param_scan_axis=param_scan_axis)

"""Planning: where every leaf of a MaxText target comes from, worked out once.

The target's leaves are made by `train_state`'s layout rules over the Tunix step's
canonical leaves, applied by `patterns.map_paths`; what Tunix never wrote is filled.
`make_plan` is a pure function of metadata; `plan_restore` gathers it from a path.
Every mismatch is reported here, before any array is read.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from etils import epath

from orbax_tunix import conventions, errors
from orbax_tunix.keypaths import Path, flatten, fmt, natural_order
from orbax_tunix.mapping import patterns, stacks
from orbax_tunix.mapping.outputs import Input, Output
from orbax_tunix.mapping.patterns import LayoutRule, Mapped
from orbax_tunix.mapping.transforms import IDENTITY, constant
from orbax_tunix.maxtext import layers, train_state
from orbax_tunix.maxtext.optimizer import align_states, opt_states, split_opt_path
from orbax_tunix.maxtext.train_state import COLLECTION, OPT_STATE, PARAMS, STEP
from orbax_tunix.maxtext.view import CheckpointView, Shape, read_view
from orbax_tunix.maxtext.weights import check_weights
from orbax_tunix.reading.read_requests import stored_shape
from orbax_tunix.store import step_store
from orbax_tunix.view.detection import Detection, detect, wanted_items

PyTree = Any

MODEL, OPTIMIZER = conventions.MODEL_ITEM, conventions.OPTIMIZER_ITEM
_TUNIX_STEP = (OPTIMIZER, *conventions.OPTIMIZER_STEP)
# A state Tunix may not have written but whose value is known: a schedule's
# `count` (ScaleByScheduleState) is the number of steps taken.
_STEP_COUNTER_FIELDS = (('count', False),)


def source_name(source: Path) -> str:
  """A source leaf, `(item, *canonical path)`, for people: 'item:path'."""
  return f'{source[0]}:{fmt(source[1:])}'


# --- the plan --------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RestorePlan:
  """Where every leaf of a MaxText target comes from; computed once, before any read.

  Attributes:
    step_dir: the Tunix step directory.
    detection: the step as detected (its items read once; execution reads
      through them without planning again).
    leaves: each restored target leaf -> its sources (`(item, *canonical
      path)`, in order) and the transform making it (`patterns.Mapped`): the
      identity of one leaf, a layer of a stacked weight, the layers stacked, or
      a constant.
    shapes: each source -> its stored shape (checked against the store, or read).
    fills: target leaves Tunix never wrote -> where their value comes from, and why.
    kept: target leaves returned as given (outside `params` when params_only;
      RNG variables the checkpoint does not hold in the target's form).
    left_out: what the checkpoint holds that the target does not take.
    notes: what `detect()` noticed (e.g. unfinished steps skipped).
  """

  step_dir: epath.Path
  detection: Detection
  leaves: Mapping[Path, Mapped]
  shapes: Mapping[Path, Shape]
  fills: Mapping[Path, str]
  kept: frozenset[Path]
  left_out: tuple[str, ...] = ()
  notes: tuple[str, ...] = ()

  def sources(self) -> dict[str, list[Path]]:
    """Tunix item -> the canonical paths read from it, each once, sorted."""
    out: dict[str, list[Path]] = {}
    for source in sorted({s for m in self.leaves.values() for s in m.sources}):
      out.setdefault(source[0], []).append(source[1:])
    return out

  def outputs(
      self, input_of: Callable[[Path], Input], targets: Mapping[Path, Any]
  ) -> tuple[Output, ...]:
    """Every restored target leaf as an `Output`, the vocabulary the executor runs
    (into device targets for a restore, into an item for a convert).

    Args:
      input_of: a source leaf, `(item, *canonical path)`, as an `Input` of the executor's.
      targets: target path -> what it is made as (its `shape` and `dtype`).
    """
    return tuple(
        Output(path, tuple(input_of(s) for s in m.sources), m.transform,
               tuple(targets[path].shape), targets[path].dtype)
        for path, m in sorted(self.leaves.items()))

  def describe(self) -> str:
    """A few lines for people: what is read, filled and left out."""
    lines = [f'{self.step_dir} -> MaxText train state']
    lines += [f'  note: {n}' for n in self.notes]
    for item, paths in self.sources().items():
      lines.append(f'  read {len(paths)} arrays from {item}')
    made = sorted(p for p, m in self.leaves.items()
                  if not m.transform.is_identity and p not in self.fills)
    if made:
      m = self.leaves[made[0]]
      first = ', '.join(source_name(s) for s in m.sources[:2])
      more = f', ... ({len(m.sources)} in all)' if len(m.sources) > 2 else ''
      lines.append(f'  make {len(made)} target leaves from others, e.g.'
                   f' {fmt(made[0])} = {m.transform} of {first}{more}')
    for target, fill in sorted(self.fills.items()):
      lines.append(f'  fill {fmt(target)} from {fill}')
    if self.kept:
      lines.append(f'  keep {len(self.kept)} target leaves as given (not restored)')
    lines += [f'  left out: {n}' for n in self.left_out]
    return '\n'.join(lines)


# --- planning ---------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Sides:
  """What every part of a plan looks at: the checkpoint, the target, and how the
  decoder's layers go from one to the other.

  Attributes:
    view: the checkpoint.
    target: target leaf path -> shape as stored (None: not an array).
    layers: the layer rules (`layers.relayout`): the stored form to the target's.
    relaid: target weight -> how it is made from the stored layers (the other form).
    stored: the stored shapes of the checkpoint's weights the target does not name as
      they are (the layers in the other form; read only when the forms differ).
    step: the checkpoint's optimizer step, `(item, *path)`, or None.
  """

  view: CheckpointView
  target: Mapping[Path, Shape | None]
  layers: tuple[LayoutRule, ...]
  relaid: Mapping[Path, Mapped]
  stored: Mapping[Path, Shape]
  step: Path | None


def _apply(sides: _Sides, shapes: Mapping[Path, Shape | None], rules, problems) -> dict:
  """`map_paths` of some source leaves, `(item, *path)`; what does not fit, a problem."""
  try:
    return patterns.map_paths(shapes, rules, where=str(sides.view.step_dir)).outputs
  except errors.UnsupportedLayoutError as e:
    problems.append(str(e))
    return {}


def _plan_weights(sides: _Sides, aux: frozenset[Path], leaves, problems) -> None:
  """params/params/<w> <- model_params:<w> (`train_state.weight_rules`), the layers in
  the target's form."""
  view = sides.view
  weights = {p[2:]: p for p in sides.target if p[0] == PARAMS}
  plain = {w: t for w, t in weights.items() if w not in sides.relaid}
  used = {s for m in sides.relaid.values() for s in m.sources}
  problems += check_weights(view, plain, sides.target, aux | used)
  made = _apply(sides, {(MODEL, *w): sides.stored.get(w) for w in view.model if w not in aux},
                train_state.weight_rules(sides.layers), problems)
  leaves.update((t, made[t]) for t in weights.values() if t in made)


def _plan_aux(sides: _Sides, aux: frozenset[Path], leaves, kept, left_out) -> None:
  """nnx_aux[/model]/<path> <- model_params:<path>; other RNG state is left out."""
  targets = [p for p in sides.target if p[0] == conventions.MAXTEXT_NNX_AUX]
  nested = targets and all(len(p) > 2 and p[1] == conventions.MAXTEXT_NNX_AUX_MODEL for p in targets)
  depth = 2 if nested else 1
  present = {p: sides.target[p] for p in targets if p[depth:] in sides.view.model}
  # Kept as given, as MaxText keeps its own values for what a checkpoint lacks:
  # leaves the checkpoint does not hold, or holds in another form (e.g. other
  # RNG key data).
  other = sides.view.mismatched_shapes(
      MODEL, {p[depth:]: s for p, s in present.items() if s is not None})
  kept.update(p for p in targets if p not in present or p[depth:] in other)
  if kept:
    left_out.append(
        f'{len(kept)} {conventions.MAXTEXT_NNX_AUX} leaves of the target kept as given (the'
        f' checkpoint does not hold them, or holds them in another form), e.g.'
        f' {fmt(sorted(kept, key=targets.index)[0])}'
    )
  read = [p for p in targets if p not in kept]
  if read:
    made = patterns.map_paths({(MODEL, *p[depth:]): None for p in read},
                              train_state.aux_rules(read[0][:depth])).outputs
    leaves.update((p, made[p]) for p in read)
  taken = {m.sources[0][1:] for m in leaves.values() if m.sources and m.sources[0][0] == MODEL}
  unused = sorted(w for w in aux if w not in taken)
  if unused:
    why = 'not in the target' if targets else 'the target has no nnx_aux'
    left_out.append(
        f'{len(unused)} RNG/non-weight variables of {MODEL} ({why}),'
        f' e.g. {fmt(unused[0])}'
    )


def _step_fill(sides: _Sides, reason: str) -> tuple[Mapped, str]:
  """A leaf Tunix never wrote whose value is the step: the optimizer's, else the
  step directory's number."""
  if sides.step is not None:
    return (Mapped((sides.step,), IDENTITY, ()),
            f"the checkpoint's {source_name(sides.step)} ({reason})")
  return Mapped((), constant(sides.view.step), ()), f'{sides.view.step} ({reason})'


def _plan_optimizer(
    sides: _Sides,
    source_splits: Mapping[Path, tuple[Path, str, Path | None]],
    leaves, fills, problems, left_out,
) -> dict[Path, Shape]:
  """opt_state/... <- optimizer_state:opt_state/... and step <- optimizer_state:step.

  Target and checkpoint states are matched by their fields in chain order
  (`align_states`); a matched state's fields map by `train_state.state_rules`.
  A target state left unmatched is filled when it is a lone `count` (a
  schedule's state, which Tunix's optimizer may not have: it equals the step),
  and is an error otherwise.

  Returns:
    the optimizer leaves mirroring re-laid weights -> their weights' stored shapes.
  """
  view = sides.view
  targets = [p for p in sides.target if p[0] == OPT_STATE]
  if (STEP,) in sides.target:
    if sides.step is not None:
      leaves[(STEP,)] = Mapped((sides.step,), IDENTITY, ())
    elif view.step is not None:
      leaves[(STEP,)], fills[(STEP,)] = _step_fill(
          sides, f'no {OPTIMIZER} item: the step directory number')
    else:
      problems.append(
          f'the target has {STEP}, but the checkpoint has no {OPTIMIZER}'
          ' item and its directory name carries no step number.'
      )
  if not targets:
    return {}
  if view.optimizer is None:
    problems.append(
        f'the target has {len(targets)} {OPT_STATE} leaves, but the checkpoint'
        f' has no {OPTIMIZER} item (Tunix wrote only the weights). Use'
        ' params_only=True, or a target without opt_state.'
    )
    return {}
  known = {p[2:] for p in sides.target if p[0] == PARAMS} | view.model
  splits = {p: split_opt_path(p, known, COLLECTION) for p in targets}
  target_states = opt_states(splits.values())
  source_states = opt_states(source_splits.values())
  matched = align_states(target_states, source_states)
  index = {s.node: i for i, s in enumerate(target_states)}
  fillable = sides.step is not None or view.step is not None
  # Each matched field: its node in the checkpoint -> its node in the target; and
  # the checkpoint leaf each target leaf takes (for the messages).
  fields: dict[Path, Path] = {}
  expected: dict[Path, list[Path]] = {}
  unmatched, missing = [], []
  for p in sorted(targets, key=natural_order):
    node, field, weight = splits[p]
    i = index[node]
    if i in matched:
      source = (OPT_STATE, *source_states[matched[i]].node, field)
      fields.setdefault(source, p[:len(p) - len(weight or ())])
      mirrored = sides.relaid[weight].sources if weight in sides.relaid else (weight or (),)
      expected[p] = [source + w for w in mirrored]
    elif target_states[i].fields == _STEP_COUNTER_FIELDS and fillable:
      leaves[p], fills[p] = _step_fill(
          sides, "Tunix never wrote this state; a schedule's count is the step")
    elif target_states[i] not in unmatched:
      unmatched.append(target_states[i])
  if unmatched:
    problems.append(
        f"{len(unmatched)} states of the target's optimizer have no counterpart in"
        f' the checkpoint:\n{errors.list_paths([str(s) for s in unmatched])}\n'
        "The checkpoint's optimizer states (canonical):\n"
        + errors.list_paths([str(s) for s in source_states])
        + '\nBuild the abstract state with the optimizer the Tunix run used'
        ' (empty states, a clipping transform and inject_hyperparams may'
        ' differ), or restore with params_only=True.'
    )
  for p, sources in expected.items():
    absent = [s for s in sources if s not in view.optimizer]
    if absent:
      missing.append(f'{fmt(p)} (checkpoint path {fmt(absent[0])})')
  if missing:
    problems.append(
        f'{len(missing)} {OPT_STATE} leaves are not in the checkpoint:\n'
        + errors.list_paths(missing)
    )
  mirrors = {}
  if not missing:
    # A leaf mirroring a re-laid weight is laid out as that weight is: its shape.
    shapes = {(OPTIMIZER, *s): sides.stored.get(w) for s, (_, _, w) in source_splits.items()}
    made = _apply(sides, shapes, train_state.state_rules(fields, sides.layers), problems)
    leaves.update((p, made[p]) for p in expected if p in made)
    mirrors = {s: shapes[s] for p in expected if p in made and not made[p].transform.is_identity
               for s in made[p].sources}
  left_out += [
      f"optimizer state {state} (the target's optimizer has no such state)"
      for j, state in enumerate(source_states)
      if j not in matched.values()
  ]
  if view.side_paths:
    left_out.append(
        f'{len(view.side_paths)} leaves outside the canonical view (the'
        ' inject_hyperparams count and hyperparameters): MaxText takes its'
        ' hyperparameters from its config'
    )
  return mirrors


def _check_shapes(
    sides: _Sides, leaves: Mapping[Path, Mapped], fills, mirrors: Mapping[Path, Shape]
) -> tuple[dict[Path, Shape], list[str]]:
  """Every source whose shape the plan assumes, against the store, an item at a time,
  before any read: a leaf read as it is has its target's shape; an optimizer leaf
  mirroring a re-laid weight (`mirrors`), its weight's.

  Returns:
    (each source -> its stored shape, the mismatches for people).
  """
  view, mismatches = sides.view, []
  shapes = {(MODEL, *w): s for w, s in sides.stored.items()} | dict(mirrors)
  for item in (MODEL, OPTIMIZER):
    reads: dict[Path, list[Path]] = {}
    for target, m in leaves.items():
      if (m.transform.is_identity and target not in fills and m.sources[0][0] == item
          and sides.target[target] is not None):
        reads.setdefault(m.sources[0][1:], []).append(target)
        shapes[m.sources[0]] = sides.target[target]
    wanted = {path: sides.target[targets[0]] for path, targets in reads.items()}
    for path, have in view.mismatched_shapes(item, wanted).items():
      for target in reads[path]:
        mismatches.append(
            f'{fmt(target)}: target {sides.target[target]}, checkpoint {have}'
            f' ({item}:{fmt(path)}, stored as {view.stored(item, path)})'
        )
  wanted = {s[1:]: shape for s, shape in mirrors.items()}
  for path, have in view.mismatched_shapes(OPTIMIZER, wanted).items():
    mismatches.append(f'{OPTIMIZER}:{fmt(path)}: expected {wanted[path]}'
                      f' (its weight\'s shape), checkpoint {have}')
  return shapes, mismatches


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
  # Which model leaves are weights: those the optimizer mirrors (its `wrt`),
  # never RNG state; with no optimizer item, everything but RNG state.
  source_splits = {
      p: split_opt_path(p, view.model) for p in (view.optimizer or {}) if p[0] == OPT_STATE
  }
  mirrored = {w for _, _, w in source_splits.values() if w is not None}
  aux = frozenset(
      w for w in view.model if conventions.is_rng_state(w) or (mirrored and w not in mirrored)
  )
  sides = _sides(view, wanted, aux, param_scan_axis)
  leaves: dict[Path, Mapped] = {}
  fills: dict[Path, str] = {}
  kept: set[Path] = set()
  problems: list[str] = []
  left_out: list[str] = []
  _plan_weights(sides, aux, leaves, problems)
  _plan_aux(sides, aux, leaves, kept, left_out)
  mirrors = _plan_optimizer(sides, source_splits, leaves, fills, problems, left_out)
  if params_only and view.optimizer is not None:
    left_out.append(f'{OPTIMIZER} (params_only=True)')
  # Never a target leaf handed back unread as if restored.
  unmade = [fmt(p) for p in wanted if p not in leaves and p not in kept]
  if unmade and not problems:
    problems.append(
        f'{len(unmade)} target leaves are not made by the MaxText rules from any leaf of'
        f' the checkpoint:\n{errors.list_paths(unmade)}\nBuild the abstract state from the'
        ' model and the optimizer the run trained with.'
    )
  shapes, mismatches = _check_shapes(sides, leaves, fills, mirrors) if not problems else ({}, [])
  if mismatches:
    problems.append(
        f'{len(mismatches)} leaves differ in shape:\n' + errors.list_paths(mismatches)
        + '\nThe target must have the shapes the run trained with (vocabulary,'
        ' widths, number of layers).'
    )
  if problems:
    raise errors.TargetMismatchError('\n'.join([where, *problems]))
  return RestorePlan(
      step_dir=view.step_dir,
      detection=view.detection,
      leaves=leaves,
      shapes=shapes,
      fills=fills,
      kept=frozenset(p for p in target_shapes if p not in wanted) | frozenset(kept),
      left_out=tuple(left_out),
      notes=tuple(notes),
  )


def _sides(view: CheckpointView, target: Mapping[Path, Shape | None], aux: frozenset[Path],
           axis: int | None) -> _Sides:
  """The two sides, and the layer rules between them: when the target asks for the
  decoder's layers in the other form (scanned vs unscanned), `layers.relayout`'s."""
  weights = {p[2:]: s for p, s in target.items() if p[0] == PARAMS}
  missing = [w for w in weights if w not in view.model]
  others = [w for w in view.model if w not in weights and w not in aux]
  step = _TUNIX_STEP if view.optimizer is not None and _TUNIX_STEP[1:] in view.optimizer else None
  if not (missing and stacks.form_of(missing) and stacks.form_of(others)):
    return _Sides(view, target, (stacks.AS_STORED,), {}, {}, step)
  stored = view.shapes(MODEL, others)
  rules, relaid = layers.relayout(stored, weights, axis, where=str(view.step_dir))
  return _Sides(view, target, rules, relaid, stored, step)


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
  return (MODEL,) if params_only else (MODEL, OPTIMIZER)


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
  shapes = _target_shapes(flatten(abstract_state)[0])  # Before the view: its errors first.
  model = detection.maps.get(conventions.MODEL_ITEM)
  composed = {} if model is None else model.composed
  quantized = [f'{len(composed)} weights saved quantized (a QLoRA run\'s frozen base, e.g.'
               f' {fmt(min(composed))}) are read dequantized: MaxText\'s model takes float'
               ' kernels'] if composed else []
  return make_plan(read_view(detection), shapes, params_only=params_only,
                   notes=(*detection.notes, *quantized), param_scan_axis=param_scan_axis)

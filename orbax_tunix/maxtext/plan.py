"""Planning: the leaves of a MaxText train state, made from a Tunix step's canonical leaves.

`state_leaves` applies MaxText's rules (`train_state`) to a step, from metadata alone: the weights
(their layers in the state's form), the optimizer's states matched to the chain the state
holds (`optimizer.align_states`: nothing knows an optimizer by name), the step; a state
Tunix never wrote whose value is known (a schedule's `count`: the step) is filled. A restore
(`plan_restore`) makes the abstract state a caller gives and checks it against what is
made; a convert (`layouts/maxtext.py`) makes MaxText's own adamw state. Every mismatch is
reported before any array is read.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from etils import epath

from orbax_tunix import conventions, errors
from orbax_tunix.keypaths import Path, flatten, fmt
from orbax_tunix.mapping import device, step_layers
from orbax_tunix.mapping.optax_states import Chain, align_states, opt_states, split_opt_path
from orbax_tunix.mapping.outputs import Input, Output
from orbax_tunix.mapping.patterns import Mapped
from orbax_tunix.mapping.transforms import IDENTITY, Shape, constant
from orbax_tunix.maxtext.train_state import (
  COLLECTION,
  MODEL,
  OPT_STATE,
  OPTIMIZER,
  PARAMS,
  STEP,
  under,
)
from orbax_tunix.maxtext.weights import check_weights
from orbax_tunix.reading import reader
from orbax_tunix.reading.read_requests import stored_shape
from orbax_tunix.view.detection import Detection, detect

PyTree = Any
# A state Tunix may not have written but whose value is known: a schedule's
# `count` (ScaleByScheduleState) is the number of steps taken.
_STEP_COUNTER_FIELDS = (('count', False),)


@dataclasses.dataclass(frozen=True)
class StateLeaves:
  """MaxText leaves made from a Tunix step, and what a person should know of them.

  Attributes:
    leaves: MaxText leaf path -> its sources (`(item, *canonical path)`, in order)
      and the transform making it (`patterns.Mapped`; shape None: as stored).
    fills: leaves Tunix never wrote -> where their value comes from, and why.
    left_out: what the checkpoint holds that the state does not take.
    problems: why some leaves cannot be made (none when all is well).
  """

  leaves: Mapping[Path, Mapped] = dataclasses.field(default_factory=dict)
  fills: Mapping[Path, str] = dataclasses.field(default_factory=dict)
  left_out: tuple[str, ...] = ()
  problems: tuple[str, ...] = ()

  def __add__(self, other: StateLeaves) -> StateLeaves:
    return StateLeaves({**self.leaves, **other.leaves}, {**self.fills, **other.fills},
                self.left_out + other.left_out, self.problems + other.problems)


def state_leaves(source: reader.Source, relaid: Mapping[Path, Mapped], chain: Chain, *,
         step: bool = True, every_weight: bool = False) -> StateLeaves:
  """The leaves of a MaxText state a Tunix step makes: `params/params/<w>` for each weight
  of `relaid`, `chain`'s states from the checkpoint's states they match, and `step`.

  Args:
    source: the checkpoint (opened).
    relaid: the state's weights (no `params` level) -> the stored weights making each
      (the layers in the state's form: `mapping.stacks`).
    chain: the state's optimizer (empty: none).
    step: make `step` too.
    every_weight: each mirroring field (adam's `mu`) holds every weight of `relaid`, as
      MaxText's own state does; else those the checkpoint's field holds.
  """
  weights = StateLeaves(under(relaid, (MODEL,), conventions.MAXTEXT_PARAMS))
  steps = _step(source) if step else StateLeaves()
  return weights + steps + (_optimizer(source, chain, relaid, every_weight) if chain.states
                            else StateLeaves())


def _fill(source: reader.Source, reason: str) -> tuple[Mapped, str]:
  """A leaf whose value is the step: the optimizer's, else the step directory's number."""
  if source.step_leaf is not None:
    return (Mapped((source.step_leaf,), IDENTITY, ()),
            f"the checkpoint's {OPTIMIZER}:{fmt(source.step_leaf[1:])} ({reason})")
  return Mapped((), constant(source.step), ()), f'{source.step} ({reason})'


def _step(source: reader.Source) -> StateLeaves:
  """step <- optimizer_state:step (else the step directory's number)."""
  if source.step_leaf is not None:
    return StateLeaves({(STEP,): Mapped((source.step_leaf,), IDENTITY, ())})
  if source.step is not None:
    leaf, fill = _fill(source, f'no {OPTIMIZER} item: the step directory number')
    return StateLeaves({(STEP,): leaf}, {(STEP,): fill})
  return StateLeaves(problems=(f'the target has {STEP}, but the checkpoint has no {OPTIMIZER} item'
                        ' and its directory name carries no step number.',))


def _optimizer(source: reader.Source, chain: Chain, relaid: Mapping[Path, Mapped],
               every_weight: bool) -> StateLeaves:
  """opt_state/... <- optimizer_state:opt_state/...: the chain's states matched to the
  checkpoint's by their fields in chain order (`align_states`); a field mirroring the
  weights laid out as they are. A state left unmatched is filled when it is a lone `count`
  (a schedule's state, which Tunix's optimizer may not have: it equals the step), and is
  a problem otherwise."""
  model = source.paths(MODEL)
  splits = [split_opt_path(p, model) for p in source.paths(OPTIMIZER) if p[0] == OPT_STATE]
  states = opt_states(splits)
  matched = align_states(chain.states, states)
  mirrors: dict[tuple[Path, str], set[Path]] = {}
  for node, field, weight in splits:
    mirrors.setdefault((node, field), set()).update(() if weight is None else (weight,))
  leaves, fills, unmatched, problems = {}, {}, [], []
  for i, state in enumerate(chain.states):
    if i not in matched:
      if state.fields == _STEP_COUNTER_FIELDS and (source.step_leaf or source.step) is not None:
        dest = chain.nodes[(state.node, 'count')]
        leaves[dest], fills[dest] = _fill(
            source, "Tunix never wrote this state; a schedule's count is the step")
      else:
        unmatched.append(str(state))
      continue
    node = states[matched[i]].node
    for field, mirrored in state.fields:
      field_of, dest = (OPTIMIZER, OPT_STATE, *node, field), chain.nodes[(state.node, field)]
      held = {w: m for w, m in relaid.items() if set(m.sources) <= mirrors[(node, field)]}
      if every_weight and mirrored and len(held) < len(relaid):
        lacking = sorted(fmt(w) for w in relaid if w not in held)
        problems.append(f'{len(lacking)} weights have no {field} in the checkpoint\'s'
                        f' {fmt((OPT_STATE, *node))}:\n{errors.list_paths(lacking)}')
      leaves.update(under(held, field_of, dest) if mirrored
                    else {dest: Mapped((field_of,), IDENTITY, None)})
  if unmatched:
    problems.append(
        f"{len(unmatched)} states of the target's optimizer have no counterpart in the"
        f' checkpoint:\n{errors.list_paths(unmatched)}\nThe checkpoint\'s optimizer states'
        f' (canonical):\n{errors.list_paths([str(s) for s in states])}\nBuild the abstract'
        ' state with the optimizer the Tunix run used (empty states, a clipping transform'
        ' and inject_hyperparams may differ), or restore with params_only=True.')
  left_out = [f"optimizer state {state} (the target's optimizer has no such state)"
              for j, state in enumerate(states) if j not in matched.values()]
  side = source.detection.maps[OPTIMIZER].side_paths
  if side:
    left_out.append(
        f'{len(side)} leaves outside the canonical view (the inject_hyperparams'
        ' count and hyperparameters): MaxText takes its hyperparameters from its config')
  return StateLeaves(leaves, fills, tuple(left_out), tuple(problems))


# --- a restore: the caller's abstract state -------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RestorePlan:
  """What a restore reads and makes, worked out before any read.

  Attributes:
    step_dir: the Tunix step directory.
    outputs: each restored target leaf, as the device executor makes it
      (`outputs.Output`: its sources, read once, and the transform making it).
    fills: target leaves Tunix never wrote -> where their value comes from, and why.
    kept: target leaves returned as given (outside `params` when params_only;
      RNG variables the checkpoint does not hold in the target's form).
    left_out: what the checkpoint holds that the target does not take.
    notes: what `detect()` noticed (e.g. unfinished steps skipped).
  """

  step_dir: epath.Path
  outputs: tuple[Output, ...]
  fills: Mapping[Path, str]
  kept: frozenset[Path]
  left_out: tuple[str, ...] = ()
  notes: tuple[str, ...] = ()

  def sources(self) -> dict[str, list[Path]]:
    """Tunix item -> the canonical paths read from it, each once, sorted."""
    out: dict[str, list[Path]] = {}
    for item, path in sorted({(i.leaf.item, i.leaf.path) for o in self.outputs
                              for i in o.inputs}):
      out.setdefault(item, []).append(path)
    return out

  def describe(self) -> str:
    """A few lines for people: what is read, made, filled and left out."""
    lines = [f'{self.step_dir} -> MaxText train state']
    lines += [f'  note: {n}' for n in self.notes]
    for item, paths in self.sources().items():
      lines.append(f'  read {len(paths)} arrays from {item}')
    made_ = [o for o in self.outputs if not o.transform.is_identity and o.path not in self.fills]
    if made_:
      first = ', '.join(f'{i.leaf.item}:{fmt(i.leaf.path)}' for i in made_[0].inputs[:2])
      more = f', ... ({len(made_[0].inputs)} in all)' if len(made_[0].inputs) > 2 else ''
      lines.append(f'  make {len(made_)} target leaves from others, e.g.'
                   f' {fmt(made_[0].path)} = {made_[0].transform} of {first}{more}')
    lines += [f'  fill {fmt(target)} from {fill}' for target, fill in sorted(self.fills.items())]
    if self.kept:
      lines.append(f'  keep {len(self.kept)} target leaves as given (not restored)')
    lines += [f'  left out: {n}' for n in self.left_out]
    return '\n'.join(lines)


def make_plan(source: reader.Source, target: Mapping[Path, Any], *, params_only: bool = False,
              notes: Sequence[str] = (), param_scan_axis: int | None = None) -> RestorePlan:
  """Works out where every target leaf comes from; a pure function of metadata.

  Args:
    source: the checkpoint, opened.
    target: the target's leaf paths (MaxText key paths) -> abstract leaves (shape, dtype).
    params_only: plan the `params` subtree only; other leaves are kept.
    notes: carried into the plan.
    param_scan_axis: the layer axis of scanned weights (MaxText's; used when the target
      and the checkpoint hold the layers in different forms).

  Raises:
    TargetMismatchError (or its subclasses `LoraOnlyCheckpointError`,
      `LayerScanMismatchError`): the target cannot be filled from the checkpoint; the
      message lists every problem.
  """
  wanted = {p: stored_shape(leaf) for p, leaf in target.items()
            if not params_only or p[0] == PARAMS}
  where = f'{source.step_dir}: the MaxText target does not match the Tunix checkpoint.'
  _check_paths(wanted, params_only, where)
  # Which model leaves are weights: those the optimizer mirrors (its `wrt`), never RNG
  # state; with no optimizer item, everything but RNG state.
  model, optimizer = source.paths(MODEL), source.paths(OPTIMIZER)
  mirrored = {w for p in optimizer or () if p[0] == OPT_STATE
              if (w := split_opt_path(p, model)[2]) is not None}
  aux = frozenset(w for w in model
                  if conventions.is_rng_state(w) or (mirrored and w not in mirrored))
  weights = {p[2:]: p for p in wanted if p[0] == PARAMS}
  relaid, stored = step_layers.relayout(source, {w: wanted[p] for w, p in weights.items()}, aux,
                                   param_scan_axis)
  problems = check_weights(source, weights, relaid, aux)
  targets = [p for p in wanted if p[0] == OPT_STATE]
  if targets and optimizer is None:
    problems.append(
        f'the target has {len(targets)} {OPT_STATE} leaves, but the checkpoint has no'
        f' {OPTIMIZER} item (Tunix wrote only the weights). Use params_only=True, or a'
        ' target without opt_state.')
  known = set(weights) | model
  chain = Chain.of(targets, known, COLLECTION) if optimizer is not None else Chain()
  state = state_leaves(source, {w: m for w, m in relaid.items() if w in weights}, chain,
               step=(STEP,) in wanted)
  aux_leaves, kept, aux_notes = _aux(source, wanted, aux, state.leaves)
  state += StateLeaves(aux_leaves, left_out=aux_notes)
  left_out = list(state.left_out) + ([f'{OPTIMIZER} (params_only=True)']
                                     if params_only and optimizer is not None else [])
  problems += state.problems
  # Never a target leaf handed back unread as if restored.
  unmade = [fmt(p) for p in wanted if p not in state.leaves and p not in kept]
  if unmade and not problems:
    problems.append(
        f'{len(unmade)} target leaves are not made by the MaxText rules from any leaf of'
        f' the checkpoint:\n{errors.list_paths(unmade)}\nBuild the abstract state from the'
        ' model and the optimizer the run trained with.')
  if not problems:
    _check_shapes(source, wanted, state, stored, problems)
  if problems:
    raise errors.TargetMismatchError('\n'.join([where, *problems]))
  outputs = tuple(
      Output(p, tuple(Input(source, source.by_path[s]) for s in m.sources), m.transform, tuple(target[p].shape),
             target[p].dtype) for p, m in sorted(state.leaves.items()) if p in wanted)
  return RestorePlan(source.step_dir, outputs, {p: f for p, f in state.fills.items() if p in wanted},
                     frozenset(p for p in target if p not in wanted) | kept, tuple(left_out),
                     tuple(notes))


def _check_paths(wanted: Mapping[Path, Shape], params_only: bool, where: str) -> None:
  """Refuses target leaves that are not where a MaxText train state has them."""
  unknown = [p for p in wanted if p[0] not in conventions.MAXTEXT_KEYS
             or (p[0] == PARAMS and (len(p) < 3 or p[1] != COLLECTION))]
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


def _aux(source: reader.Source, target: Mapping[Path, Shape], aux: frozenset[Path],
         leaves: Mapping[Path, Mapped]) -> tuple[dict[Path, Mapped], frozenset[Path], tuple]:
  """nnx_aux[/model]/<path> <- model_params:<path>; other RNG state is left out.

  Returns:
    (the leaves read, those kept as given, notes of what is left out).
  """
  targets = [p for p in target if p[0] == conventions.MAXTEXT_NNX_AUX]
  depth = 2 if targets and all(
      len(p) > 2 and p[1] == conventions.MAXTEXT_NNX_AUX_MODEL for p in targets) else 1
  present = {p: target[p] for p in targets if p[depth:] in source.paths(MODEL)}
  # Kept as given, as MaxText keeps its own values for what a checkpoint lacks: leaves the
  # checkpoint does not hold, or holds in another form (e.g. other RNG key data).
  other = source.mismatched_shapes(MODEL, {p[depth:]: s for p, s in present.items()})
  kept = frozenset(p for p in targets if p not in present or p[depth:] in other)
  notes = [] if not kept else [
      f'{len(kept)} {conventions.MAXTEXT_NNX_AUX} leaves of the target kept as given (the'
      ' checkpoint does not hold them, or holds them in another form), e.g.'
      f' {fmt(sorted(kept, key=targets.index)[0])}']
  read = {p: Mapped(((MODEL, *p[depth:]),), IDENTITY, None) for p in targets if p not in kept}
  taken = {m.sources[0][1:] for m in [*leaves.values(), *read.values()]
           if m.sources and m.sources[0][0] == MODEL}
  unused = sorted(w for w in aux if w not in taken)
  if unused:
    why = 'not in the target' if targets else 'the target has no nnx_aux'
    notes.append(f'{len(unused)} RNG/non-weight variables of {MODEL} ({why}),'
                 f' e.g. {fmt(unused[0])}')
  return read, kept, tuple(notes)


def _check_shapes(source: reader.Source, target: Mapping[Path, Shape], state: StateLeaves,
                  stored: Mapping[Path, Shape], problems: list[str]) -> None:
  """Every source's shape the plan assumes, against the store, an item at a time, before
  any read: a leaf read as it is has its target's shape; a re-laid weight's were read
  (`stored`); an optimizer leaf mirroring one, its weight's. The mismatches are appended
  to `problems`."""
  mirrors = {s: stored[w] for m in state.leaves.values() if not m.transform.is_identity
             for s in m.sources if s[0] == OPTIMIZER
             # Its weight: the longest end of its path that is one.
             if (w := next((s[k:] for k in range(1, len(s)) if s[k:] in stored), None))}
  mismatches = []
  for item in (MODEL, OPTIMIZER):
    reads: dict[Path, list[Path]] = {}
    for p, m in state.leaves.items():
      if (p in target and m.transform.is_identity and p not in state.fills
          and m.sources[0][0] == item and target[p] is not None):
        reads.setdefault(m.sources[0][1:], []).append(p)
    found = source.mismatched_shapes(item, {path: target[ps[0]] for path, ps in reads.items()})
    mismatches += [f'{fmt(p)}: target {target[p]}, checkpoint {have} ({item}:{fmt(path)},'
                   f' stored as {source.stored(item, path)})'
                   for path, have in found.items() for p in reads[path]]
  found = source.mismatched_shapes(OPTIMIZER, {s[1:]: shape for s, shape in mirrors.items()})
  mismatches += [f'{OPTIMIZER}:{fmt(path)}: expected {mirrors[(OPTIMIZER, *path)]} (its'
                 f' weight\'s shape), checkpoint {have}' for path, have in found.items()]
  if mismatches:
    problems.append(f'{len(mismatches)} leaves differ in shape:\n'
                    + errors.list_paths(mismatches) + '\nThe target must have the shapes'
                    ' the run trained with (vocabulary, widths, number of layers).')


# What a MaxText restore takes: a path, its `detect()` result, or the step opened already.
StepLike = epath.PathLike | Detection | reader.Source


def needed_items(params_only: bool) -> tuple[str, ...]:
  """The Tunix items a MaxText restore reads: the weights, and the optimizer unless params-only."""
  return (MODEL,) if params_only else (MODEL, OPTIMIZER)


def detect_for(path: epath.PathLike, params_only: bool) -> Detection:
  """Detects only the items a MaxText restore needs (a params-only one opens no optimizer)."""
  return detect(path, roles=needed_items(params_only))


def step_dir(path: StepLike) -> object:
  """Where a restore's step is, for messages."""
  return path.step_dir if isinstance(path, (Detection, reader.Source)) else path


def _detection(path: StepLike, params_only: bool) -> Detection:
  """The detection of the step a restore reads (made here for a path), with the items it
  needs on disk, and in the view of a step opened already.

  Raises:
    MissingItemError: a needed item is recorded but not on disk, or was left out when the
      step given was opened.
  """
  needed = needed_items(params_only)
  if isinstance(path, reader.Source):
    found = path.detection
    left_out = [n for n in needed if n not in found.maps and n in found.source.items]
    if left_out:
      raise errors.MissingItemError(
          f'{found.step_dir}: the step was opened without {left_out}, which this restore'
          f' reads. Open it with them (`reader.open_source(path, items={list(needed)})`), or'
          ' pass its path.')
  else:
    found = path if isinstance(path, Detection) else detect_for(path, params_only)
  found.require(needed)
  return found


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
        ' init, shardings attached (docs/maxtext.md: "In your own code").'
    )


def plan_restore(
    path: StepLike,
    abstract_state: PyTree,
    *,
    params_only: bool = False,
    param_scan_axis: int | None = None,
) -> RestorePlan:
  """Plans restoring a Tunix checkpoint into a MaxText-shaped abstract state.

  Reads metadata only: the items' JSON (only the weights' when
  `params_only`), and what checks the shapes of the arrays the target needs.

  Args:
    path: a Tunix root (latest committed step), step or RL root, its `detect()`
      result, or the step opened already (`reader.Source`: opened once for every tool).
    abstract_state: MaxText's train state, abstract (see `restore_train_state`).
    params_only: plan the `params` subtree only.
    param_scan_axis: the layer axis of scanned weights (see `make_plan`).

  Returns:
    A `RestorePlan`; `describe()` says what it will do.

  Raises:
    UnsupportedLayoutError: not a Tunix checkpoint.
    TargetMismatchError (and subclasses): an `abstract_state` with no leaves
      (None, {}); see `make_plan`.
    MissingItemError: an item the restore needs is recorded but not on disk, or was left
      out of the `reader.Source` given.
    NotACheckpointError, UncommittedStepError, CorruptMetadataError.
  """
  require_target(abstract_state, step_dir(path))
  detection = _detection(path, params_only)
  if not detection.is_tunix:
    raise errors.UnsupportedLayoutError(
        f'{detection.step_dir}: expected a Tunix checkpoint, found a'
        f' {detection.kind} one (items {list(detection.items)}). Restore it with'
        ' plain Orbax; `ItemsHandler` does so by itself.'
    )
  target = dict(flatten(abstract_state)[0])
  # Before the step is opened: its errors first.
  device.require_arrays(target, 'The abstract state', 'Build it with jax.eval_shape.')
  model = detection.maps.get(conventions.MODEL_ITEM)
  composed = {} if model is None else model.composed
  quantized = [f'{len(composed)} weights saved quantized (a QLoRA run\'s frozen base, e.g.'
               f' {fmt(min(composed))}) are read dequantized: MaxText\'s model takes float'
               ' kernels'] if composed else []
  source = path if isinstance(path, reader.Source) else reader.open_checkpoint(detection)
  return make_plan(source, target, params_only=params_only,
                   notes=(*detection.notes, *quantized), param_scan_axis=param_scan_axis)

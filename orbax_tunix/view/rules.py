"""The rewrite rules: each wrapper level Tunix adds, as a small value.

A `Rule` is data: a `find` that says where in a tree of key paths the wrapper
sits (its anchors), and two pure functions on one path, `to_canonical`
(on-disk -> canonical) and `to_disk` (its exact inverse). Rules compose in the
order of `RULES`; supporting a new wrapper format means appending one rule.

All functions here work on key paths (tuples of strings), never on arrays:
rewriting a restore target costs nothing on the array path.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Iterable, Mapping

from orbax_tunix.conventions import (
  ADAPTER_KEY,
  MODEL_ITEM,
  NNX_VALUE,
  QARRAY_KEY,
  QARRAY_PARTS,
  QVALUE,
)
from orbax_tunix.keypaths import Path


class Anchors(frozenset):
  """The nodes (paths) where a wrapper sits, with their depths precomputed.

  The path functions check a path's prefixes only at these depths: a rule
  runs on every leaf of a 50k-leaf item, so a check at every depth would
  dominate planning.
  """

  depths: tuple[int, ...]

  def __new__(cls, nodes: Iterable[Path] = ()) -> Anchors:
    self = super().__new__(cls, nodes)
    self.depths = tuple(sorted({len(n) for n in self}))
    return self

# The paths of every item of one step, as seen by the rule being planned.
StepPaths = Mapping[str, frozenset[Path]]

# optax.inject_hyperparams' InjectHyperparamsState / InjectStatefulHyperparamsState
# fields; nnx drops `hyperparams_states` when it holds no leaves.
_SHELL_FIELDS = frozenset({'count', 'hyperparams', 'hyperparams_states', 'inner_state'})
_SHELL_REQUIRED = frozenset({'hyperparams', 'inner_state'})


@dataclasses.dataclass(frozen=True)
class Rule:
  """One wrapper level, as data.

  Attributes:
    name: short identifier, shown by `detect()` and the CLI.
    description: one line for people.
    find: `find(item, step) -> anchors`: where the wrapper sits in item
      `item` of a step (empty when it does not apply).
    to_canonical: `(path, anchors) -> path or None`; None marks a leaf that
      leaves the canonical view (e.g. the inject shell's hyperparameters).
    to_disk: `(path, anchors) -> path`, the inverse of `to_canonical` on every
      path it does not send to None.
    identifies: finding this wrapper alone says the item was written by Tunix
      (an item where no identifying rule applies is read as it is, whatever
      the other rules find: a plain optax state is not rewritten).
    part_of: for a rule that makes one canonical leaf of several stored ones
      (a quantized weight): `(path, anchors) -> (leaf's path, part name)` for
      each such stored path, else None; `to_canonical` sends the leaf's first
      part to the leaf's path and the other parts to None.
  """

  name: str
  description: str
  find: Callable[[str, StepPaths], Anchors]
  to_canonical: Callable[[Path, Anchors], Path | None]
  to_disk: Callable[[Path, Anchors], Path]
  identifies: bool = False
  part_of: Callable[[Path, Anchors], tuple[Path, str] | None] | None = None


@dataclasses.dataclass(frozen=True)
class Rewrite:
  """A rule planned on one item: the rule and the anchors where it applies."""

  rule: Rule
  anchors: Anchors

  def to_canonical(self, path: Path) -> Path | None:
    return self.rule.to_canonical(path, self.anchors)

  def to_disk(self, path: Path) -> Path:
    return self.rule.to_disk(path, self.anchors)

  def part_of(self, path: Path) -> tuple[Path, str] | None:
    return None if self.rule.part_of is None else self.rule.part_of(path, self.anchors)


# --- the nnx `value` level -------------------------------------------------


def _sown(path: Path) -> bool:
  """An entry of a tuple an nnx Variable holds (`<var>/value/<n>`): what `Module.sow` keeps
  (an `nnx.Intermediate`, e.g. MaxText's MoE `moe_has_overflow` flags after a forward pass,
  which a Tunix run of the model saves with its weights); no weight's value is a tuple."""
  return len(path) >= 3 and path[-2] == NNX_VALUE and path[-1].isdigit()


def _find_value(item: str, step: StepPaths) -> Anchors:
  paths = step[item]
  if paths and any(p[-1] == NNX_VALUE for p in paths) and all(
      (len(p) >= 2 and p[-1] == NNX_VALUE) or _sown(p) for p in paths):
    return Anchors({()})
  return Anchors()


NNX_VALUE_LEVEL = Rule(
    name='nnx_value',
    description=("every leaf is an nnx Variable saved under its 'value' attribute (a sown"
                 " intermediate's tuple, 'value/<n>', leaves the view: no weight)"),
    find=_find_value,
    to_canonical=lambda path, _: None if _sown(path) else path[:-1],
    to_disk=lambda path, _: path + (NNX_VALUE,),
    identifies=True,
)


# --- wrapper levels: one key inserted below some nodes ---------------------


def _drop_level(key: str, keep_siblings: bool) -> Callable[[Path, Anchors], Path | None]:
  """Path function that removes `key` right below each anchor.

  Siblings of `key` under an anchor are kept when `keep_siblings`, else the
  leaf leaves the canonical view (None).
  """

  def to_canonical(path: Path, anchors: Anchors) -> Path | None:
    dropped = []
    for depth in anchors.depths:
      if depth >= len(path):
        break
      if path[:depth] in anchors:
        if path[depth] == key:
          dropped.append(depth)
        elif not keep_siblings:
          return None
    for depth in reversed(dropped):
      path = path[:depth] + path[depth + 1:]
    return path

  return to_canonical


def _insert_level(key: str) -> Callable[[Path, Anchors], Path]:
  """Path function that puts `key` back right below each anchor."""

  def to_disk(path: Path, anchors: Anchors) -> Path:
    depths = anchors.depths
    out: list[str] = []
    for k in path:
      # `while`: wrappers may nest.
      while len(out) in depths and tuple(out) in anchors:
        out.append(key)
      out.append(k)
    return tuple(out)

  return to_disk


def _children_of(paths: Iterable[Path], nodes: Collection[Path]) -> dict[Path, set[str]]:
  """Maps each of `nodes` (inner nodes of `paths`) to its child keys."""
  kids: dict[Path, set[str]] = {node: set() for node in nodes}
  if not kids:
    return kids
  depths = sorted({len(n) for n in nodes})
  for path in paths:
    for depth in depths:
      if depth >= len(path):
        break
      found = kids.get(path[:depth])
      if found is not None:
        found.add(path[depth])
  return kids


def _parents_of(paths: Iterable[Path], key: str) -> set[Path]:
  """Every node that has `key` as a child key."""
  nodes: set[Path] = set()
  for path in paths:
    if key in path:  # Most paths hold no wrapper key: skip them at C speed.
      nodes.update(path[:at] for at, k in enumerate(path) if k == key)
  return nodes


def _find_shells(item: str, step: StepPaths) -> Anchors:
  """Nodes holding an `inject_hyperparams` state, at any depth."""
  paths = step[item]
  kids = _children_of(paths, _parents_of(paths, 'inner_state'))
  return Anchors(node for node, keys in kids.items() if _SHELL_REQUIRED <= keys <= _SHELL_FIELDS)


INJECT_SHELL = Rule(
    name='inject_hyperparams',
    description=(
        'optax.inject_hyperparams shell (count, hyperparams, inner_state)'
        ' around the optimizer state'
    ),
    find=_find_shells,
    to_canonical=_drop_level('inner_state', keep_siblings=False),
    to_disk=_insert_level('inner_state'),
)


def _has_adapter(model_paths: frozenset[Path]) -> bool:
  return bool(model_paths) and all(p[0] == ADAPTER_KEY and len(p) > 1 for p in model_paths)


def _find_adapter(item: str, step: StepPaths) -> Anchors:
  """The adapter `base` level: only where it wraps the whole weight tree.

  In the model item that is a root whose sole key is `base`. In other items
  (the optimizer state) it is a node whose sole key is `base` and whose
  subtree mirrors the weights (every path below `base` is a weight path);
  when the step has no model item to compare with, a sole `base` key
  suffices. A model's own module called `base` beside other modules is never
  an adapter level.
  """
  paths = step[item]
  if item == MODEL_ITEM:
    return Anchors({()}) if _has_adapter(paths) else Anchors()
  model = step.get(MODEL_ITEM)
  if model is not None and not _has_adapter(model):
    return Anchors()
  if not any(ADAPTER_KEY in p for p in paths):
    return Anchors()
  weights = None if model is None else frozenset(p[1:] for p in model)
  kids = _children_of(paths, {n for n in _parents_of(paths, ADAPTER_KEY) if n})
  anchors = set()
  for node, keys in kids.items():
    if keys != {ADAPTER_KEY}:
      continue
    depth = len(node) + 1
    below = [p[depth:] for p in paths if p[: depth] == node + (ADAPTER_KEY,)]
    if weights is None or all(p in weights for p in below):
      anchors.add(node)
  return Anchors(anchors)


ADAPTER_BASE = Rule(
    name='adapter_base',
    description="adapter level 'base' over the whole weight tree (and in mu/nu)",
    find=_find_adapter,
    to_canonical=_drop_level(ADAPTER_KEY, keep_siblings=True),
    to_disk=_insert_level(ADAPTER_KEY),
)

# --- a quantized weight: one canonical leaf of several stored ones -----------


def _find_qarrays(item: str, step: StepPaths) -> Anchors:
  """Weights saved as qwix `QArray`s (a QLoRA run's frozen base): a node whose one
  child `array` holds the leaves `qvalue` and `scale` (and `zero_point`), nothing else."""
  paths = step[item]
  nodes = {p[:-2] for p in paths if len(p) > 2 and p[-1] == QVALUE and p[-2] == QARRAY_KEY}
  if not nodes:
    return Anchors()
  arrays = {n + (QARRAY_KEY,) for n in nodes}
  kids = _children_of(paths, nodes | arrays)
  leaves = {p for p in paths if p[:-1] in arrays}
  return Anchors(
      n for n in nodes
      if kids[n] == {QARRAY_KEY} and set(QARRAY_PARTS[:2]) <= kids[n + (QARRAY_KEY,)]
      <= set(QARRAY_PARTS) and all(n + (QARRAY_KEY, k) in leaves for k in kids[n + (QARRAY_KEY,)])
  )


def _qarray_part(path: Path, anchors: Anchors) -> tuple[Path, str] | None:
  node = path[:-2]
  if len(path) > 2 and path[-2] == QARRAY_KEY and len(node) in anchors.depths and node in anchors:
    return node, path[-1]
  return None


def _qarray_to_canonical(path: Path, anchors: Anchors) -> Path | None:
  part = _qarray_part(path, anchors)
  if part is None:
    return path
  return part[0] if part[1] == QVALUE else None


QUANTIZED = Rule(
    name='qwix_quantized',
    description=(
        "a weight qwix saved quantized (array/qvalue, scale[, zero_point]): read"
        ' dequantized, as one weight'
    ),
    find=_find_qarrays,
    to_canonical=_qarray_to_canonical,
    to_disk=lambda path, anchors: (
        path + (QARRAY_KEY, QVALUE) if len(path) in anchors.depths and path in anchors else path),
    part_of=_qarray_part,
)

# Order matters: each rule is planned on the paths the previous ones produced.
RULES: tuple[Rule, ...] = (NNX_VALUE_LEVEL, INJECT_SHELL, ADAPTER_BASE, QUANTIZED)

"""Matching optax states: one tree's `opt_state` against another's (a MaxText target's
against a Tunix step's: `maxtext/plan.py`).

Leaf paths are split into (state node, field, mirrored weight), grouped into
`OptState`s in chain order, and aligned by their fields; nothing here knows an
optimizer by name, nor a trainer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Iterable, Mapping, Sequence

from orbax_tunix.conventions import MAXTEXT_OPT_STATE as OPT_STATE
from orbax_tunix.keypaths import Path, fmt, natural_order


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
      for node in sorted(fields, key=natural_order)  # '2' before '10'
  ]


@dataclasses.dataclass(frozen=True)
class Chain:
  """An optimizer as a MaxText state holds it: its states and where their fields go.

  Attributes:
    states: its states, in chain order (empty states left out).
    nodes: (state node, field) -> the field's path in the state (a mirroring field's
      with the level, e.g. MaxText's `params`, its weights are under).
  """

  states: tuple[OptState, ...] = ()
  nodes: Mapping[tuple[Path, str], Path] = dataclasses.field(default_factory=dict)

  @classmethod
  def of(cls, paths: Iterable[Path], weights: Collection[Path], collection: str | None = None
         ) -> Chain:
    """The chain of some `opt_state/...` leaves (`split_opt_path`'s arguments); where one
    field is under two paths, the first in chain order is where it goes."""
    paths = sorted(paths, key=natural_order)
    splits = [split_opt_path(p, weights, collection) for p in paths]
    nodes: dict[tuple[Path, str], Path] = {}
    for p, (node, field, weight) in zip(paths, splits, strict=True):
      nodes.setdefault((node, field), p[:len(p) - len(weight or ())])
    return cls(tuple(opt_states(splits)), nodes)


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

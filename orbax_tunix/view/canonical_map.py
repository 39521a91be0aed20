"""The canonical view: the rules applied to one step's leaf paths, once.

A `CanonicalMap` maps every on-disk leaf path of one item to its canonical
path (or marks it as a side leaf outside the canonical view) and back.
Restoring executes it: the caller's canonical target is rewritten path by path
into the on-disk target, and the result back, with no array touched.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

from orbax_tunix import errors
from orbax_tunix.keypaths import Path, flatten, fmt, nest
from orbax_tunix.view import rules as rules_lib


@dataclasses.dataclass(frozen=True)
class CanonicalMap:
  """How one item's on-disk tree maps to its canonical tree.

  Attributes:
    item: item name (e.g. 'model_params').
    rewrites: the planned rules, in application order (disk -> canonical).
    disk_to_canonical: every on-disk leaf path -> canonical path, or None for
      side leaves that the canonical view leaves out (e.g. hyperparameters)
      and for the parts of a composed leaf but its first.
    composed: canonical leaves made of several stored ones (a quantized
      weight, `rules.QUANTIZED`): path -> {part name: on-disk path}.
    parts: each part of a composed leaf under the path it has without the
      composing rule (`<w>/array/qvalue`) -> its on-disk path: a target
      that keeps that structure reads the parts as stored.
  """

  item: str
  rewrites: tuple[rules_lib.Rewrite, ...]
  disk_to_canonical: Mapping[Path, Path | None]
  composed: Mapping[Path, Mapping[str, Path]] = dataclasses.field(default_factory=dict)
  parts: Mapping[Path, Path] = dataclasses.field(default_factory=dict)

  @property
  def rule_names(self) -> tuple[str, ...]:
    return tuple(r.rule.name for r in self.rewrites)

  @functools.cached_property
  def canonical_to_disk(self) -> dict[Path, Path]:
    return {c: d for d, c in self.disk_to_canonical.items() if c is not None}

  @property
  def side_paths(self) -> tuple[Path, ...]:
    """On-disk leaves outside the canonical view (the parts of composed leaves aside)."""
    parts = {d for d in self.parts.values()}
    return tuple(d for d, c in self.disk_to_canonical.items() if c is None and d not in parts)

  def disk_path(self, path: Path) -> Path | None:
    """The on-disk leaf a canonical path (or a composed leaf's part) reads; None: none."""
    found = self.canonical_to_disk.get(path)
    return self.parts.get(path) if found is None else found

  def to_canonical_path(self, path: Path) -> Path | None:
    """Runs the rules forwards on one on-disk path."""
    return self.path_before(None, path)

  def path_before(self, rule: rules_lib.Rule | None, path: Path) -> Path | None:
    """An on-disk path as `rule` saw it: only the rules planned before it applied (None:
    every rule)."""
    for rewrite in self.rewrites:
      if rewrite.rule is rule:
        break
      path = rewrite.to_canonical(path)
      if path is None:
        return None
    return path

  def to_disk_path(self, path: Path) -> Path:
    """Runs the rules backwards on one canonical path."""
    for rewrite in reversed(self.rewrites):
      path = rewrite.to_disk(path)
    return path


def plan_step(item_paths: Mapping[str, frozenset[Path]]) -> dict[str, CanonicalMap]:
  """Plans every rule (`rules.RULES`, in order) on every item of one step.

  Args:
    item_paths: item name -> the set of on-disk leaf paths of that item.

  Returns:
    item name -> its `CanonicalMap`. An item where no identifying rule (see
    `rules.Rule.identifies`) applies keeps its paths as they are.

  Raises:
    UnsupportedLayoutError: two on-disk leaves would share a canonical path.
  """
  disk = {item: list(paths) for item, paths in item_paths.items()}
  # Each item's paths as the rules planned so far see them (None: left out).
  current: dict[str, list[Path | None]] = {item: list(paths) for item, paths in disk.items()}
  stage = {item: frozenset(paths) for item, paths in item_paths.items()}
  planned: dict[str, list[rules_lib.Rewrite]] = {item: [] for item in item_paths}
  composed: dict[str, dict[Path, dict[str, Path]]] = {item: {} for item in item_paths}
  parts: dict[str, dict[Path, Path]] = {item: {} for item in item_paths}
  for rule in rules_lib.RULES:
    changed = []
    for item in current:
      anchors = rule.find(item, stage)
      if not anchors:
        continue
      rewrite = rules_lib.Rewrite(rule, anchors)
      planned[item].append(rewrite)
      # Composed leaves found earlier are rewritten as leaves are.
      composed[item] = {rewrite.to_canonical(c): p for c, p in composed[item].items()}
      if rule.part_of is not None:
        for d, c in zip(disk[item], current[item], strict=True):
          if c is not None and (part := rewrite.part_of(c)) is not None:
            composed[item].setdefault(part[0], {})[part[1]] = d
            parts[item][c] = d
      current[item] = [None if c is None else rewrite.to_canonical(c) for c in current[item]]
      changed.append(item)
    for item in changed:  # The next rule sees the rewritten paths.
      stage[item] = frozenset(c for c in current[item] if c is not None)
  maps = {}
  for item, paths in current.items():
    if not any(r.rule.identifies for r in planned[item]):
      maps[item] = identity(item, item_paths[item])
      continue
    mapping = dict(zip(disk[item], paths, strict=True))
    _check_bijective(item, mapping)
    maps[item] = CanonicalMap(item, tuple(planned[item]), mapping, composed[item], parts[item])
  return maps


def identity(item: str, paths: frozenset[Path]) -> CanonicalMap:
  """The map of an item read as it is (not Tunix's)."""
  return CanonicalMap(item, (), {p: p for p in paths})


def _check_bijective(item: str, mapping: Mapping[Path, Path | None]) -> None:
  canonical_paths = [c for c in mapping.values() if c is not None]
  if len(set(canonical_paths)) == len(canonical_paths):
    return  # The rules are one-to-one by construction; this guards their bugs.
  seen: dict[Path, Path] = {}
  clashes = []
  for disk, canon in mapping.items():
    if canon is not None and canon in seen:
      clashes.append(f'{fmt(seen[canon])} and {fmt(disk)} -> {fmt(canon)}')
    seen[canon] = disk
  raise errors.UnsupportedLayoutError(
      f'Item {item!r}: the rewrite rules map several on-disk leaves to one'
      f' canonical path:\n{errors.list_paths(clashes)}\nThis checkpoint cannot be'
      ' read canonically; restore it with plain Orbax (no orbax_tunix handler).'
  )


def to_canonical_tree(tree: Any, layout: CanonicalMap) -> dict[str, Any]:
  """Rewrites an on-disk tree (nested dicts, as Orbax restores it) to canonical.

  Side leaves (see `CanonicalMap.side_paths`) are left out. Leaves are moved,
  never copied.
  """
  pairs, _ = flatten(tree)
  known = layout.disk_to_canonical
  out = []
  for path, leaf in pairs:
    canon = known[path] if path in known else layout.to_canonical_path(path)
    if canon is not None:
      out.append((canon, leaf))
  return nest(out)


def to_disk_tree(tree: Any, layout: CanonicalMap) -> dict[str, Any]:
  """Rewrites a canonical tree to the on-disk structure: the exact inverse."""
  pairs, _ = flatten(tree)
  return nest((layout.to_disk_path(path), leaf) for path, leaf in pairs)

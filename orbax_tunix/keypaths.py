"""Key paths as tuples of strings, the one currency of the rewrite rules.

Orbax records every leaf of a saved tree under a tuple of string keys (dict
keys and sequence indices alike are written as strings). The rules and layouts
work on those tuples only; these helpers convert a caller's pytree to and from
them without touching the leaves.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Iterable, Mapping
from typing import Any

import jax

Path = tuple[str, ...]


def key_str(key: Any) -> str:
  """The string Orbax writes for one jax key-path entry."""
  kind = type(key)  # Exact types first: this runs for every key of every leaf.
  if kind is jax.tree_util.DictKey:
    return str(key.key)
  if kind is jax.tree_util.SequenceKey:
    return str(key.idx)
  if isinstance(key, jax.tree_util.DictKey):
    return str(key.key)
  if isinstance(key, jax.tree_util.SequenceKey):
    return str(key.idx)
  if isinstance(key, jax.tree_util.GetAttrKey):
    return key.name
  if isinstance(key, jax.tree_util.FlattenedIndexKey):
    return str(key.key)
  return str(key)


def flatten(tree: Any) -> tuple[list[tuple[Path, Any]], Any]:
  """Flattens a pytree into (string path, leaf) pairs and its treedef.

  `None` leaves are structure, as in jax: they are not returned.
  """
  pairs, treedef = jax.tree_util.tree_flatten_with_path(tree)
  return [(tuple([key_str(k) for k in kp]), leaf) for kp, leaf in pairs], treedef


def nest(
    items: Iterable[tuple[Path, Any]], sequences: Collection[Path] = ()
) -> dict[str, Any]:
  """Builds nested dicts from (path, value) pairs.

  Args:
    items: (path, value) pairs.
    sequences: nodes to build as lists instead (their keys are '0', '1', ...,
      every position present), as Orbax records sequence keys.

  Raises:
    ValueError: when one path is a prefix of another (a leaf and a subtree
      at the same place), which no Orbax tree can hold.
  """
  root: dict[str, Any] = {}
  for path, value in items:
    node = root
    for key in path[:-1]:
      child = node.setdefault(key, {})
      if not isinstance(child, dict):
        raise ValueError(f'{fmt(path)}: a leaf already sits at a prefix of it.')
      node = child
    if path[-1] in node and isinstance(node[path[-1]], dict):
      raise ValueError(f'{fmt(path)}: a subtree already sits at this path.')
    node[path[-1]] = value
  return as_lists(root, sequences) if sequences else root


def as_lists(tree: dict[str, Any], sequences: Collection[Path]) -> Any:
  """Nested dicts with the nodes at `sequences` turned into lists (keys '0', '1', ...)."""
  return _as_lists(tree, (), frozenset(sequences))


def _as_lists(node: Any, path: Path, sequences: frozenset[Path]) -> Any:
  if not isinstance(node, dict):
    return node
  children = {k: _as_lists(v, path + (k,), sequences) for k, v in node.items()}
  if path in sequences:
    return [children[k] for k in sorted(children, key=int)]
  return children


def flat_dict(tree: Mapping[str, Any] | Any) -> dict[Path, Any]:
  """The leaves of a tree of nested dicts/lists as {path: leaf}."""
  return dict(flatten(tree)[0])


def natural_key(key: str) -> tuple[int, int, str]:
  """Sorts '2' before '10', and numbers (chain positions, layers) before names."""
  return (0, int(key), '') if key.isascii() and key.isdigit() else (1, 0, key)


def natural_order(path: Path) -> tuple[tuple[int, int, str], ...]:
  """A sort key for paths, each key in `natural_key` order."""
  return tuple(natural_key(k) for k in path)


def _fmt_key(key: str) -> str:
  # A key that could be read as more than one (a '/' inside, empty, or
  # starting with a quote) is written as a JSON string, so that the text
  # names exactly one path.
  if not key or '/' in key or key.startswith('"'):
    return json.dumps(key)
  return key


def fmt(path: Path) -> str:
  """A path as people write it: 'opt_state/0/mu/layers/0/w'.

  One text per path: keys joined with '/', a key that holds a '/' (or is
  empty) written as a JSON string, e.g. `"a/b"/c`.
  """
  return '/'.join(_fmt_key(k) for k in path) if path else '<root>'


"""Trees as the fixture scripts record them in MANIFEST.json (both scripts use these).

Kept apart from orbax_tunix on purpose: the fixtures' descriptions must not come
from the code they test.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np


def key_str(k: Any) -> str:
  """A jax key path entry as the string Orbax writes for it."""
  if isinstance(k, jax.tree_util.DictKey):
    return str(k.key)
  if isinstance(k, jax.tree_util.GetAttrKey):
    return k.name
  if isinstance(k, jax.tree_util.SequenceKey):
    return str(k.idx)
  if isinstance(k, jax.tree_util.FlattenedIndexKey):
    return str(k.key)
  raise TypeError(f"unexpected key {k!r}")


def flat(tree: Any) -> dict[str, Any]:
  """Leaves by their on-disk key path ("a/b/c")."""
  return {"/".join(key_str(k) for k in path): leaf
          for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def describe_tree(tree: Any) -> list[dict[str, Any]]:
  """On-disk key paths, shapes and dtypes of a tree handed to Orbax, sorted by path.

  Orbax writes typed PRNG keys as their raw key data (uint32, with a trailing
  dimension of 2 for threefry); ``prng_impl`` records the impl for those.
  """
  out = []
  for path, leaf in sorted(flat(tree).items()):
    entry: dict[str, Any] = {"path": path}
    if isinstance(leaf, jax.Array) and jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
      data = jax.random.key_data(leaf)
      entry.update(shape=list(data.shape), dtype=str(data.dtype),
                   prng_impl=str(jax.random.key_impl(leaf)))
    else:
      a = leaf if hasattr(leaf, "dtype") else np.asarray(leaf)
      entry.update(shape=list(a.shape), dtype=str(a.dtype))
    out.append(entry)
  return out

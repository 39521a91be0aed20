"""What to ask Orbax for, per leaf: a target and its restore args, in one place.

Every read in this package is a set of requests, canonical path ->
(target leaf, `ocp.RestoreArgs`), executed by `planned_item.PlannedItem.read`.
These helpers make them: into a sharding and dtype, to the host as numpy, or
from what a caller's target leaf says.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from orbax_tunix.keypaths import Path, key_str

PyTree = Any
# (target leaf, restore args) for one leaf to read.
ReadRequest = tuple[Any, ocp.RestoreArgs]


def is_key(dtype: Any) -> bool:
  """A typed PRNG key dtype (numpy dtypes never are: the cheap test first)."""
  return (
      dtype is not None and not isinstance(dtype, np.dtype)
      and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)
  )


def stored_shape(leaf: Any) -> tuple[int, ...] | None:
  """The shape a leaf has on disk; typed PRNG keys are stored as their key data."""
  shape = getattr(leaf, 'shape', None)
  if shape is None:
    return None
  if is_key(getattr(leaf, 'dtype', None)):
    return tuple(shape) + tuple(jax.eval_shape(jax.random.key_data, leaf).shape[len(shape):])
  return tuple(shape)


def sharding_of(leaf: Any) -> jax.sharding.Sharding:
  """A leaf's sharding; the first local device when it has none."""
  sharding = getattr(leaf, 'sharding', None)
  if isinstance(sharding, jax.sharding.Sharding):
    return sharding
  return jax.sharding.SingleDeviceSharding(jax.local_devices()[0])


def into(shape: tuple[int, ...], dtype: Any, sharding: jax.sharding.Sharding | None) -> ReadRequest:
  """A request for an array in `sharding` and `dtype`; to the host (numpy) when None."""
  if sharding is None:
    return 0, ocp.RestoreArgs(restore_type=np.ndarray, dtype=dtype)
  shape = tuple(shape)
  return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding), _array_args(shape, dtype, sharding)


def _array_args(shape: tuple[int, ...], dtype: Any, sharding: Any) -> ocp.ArrayRestoreArgs:
  return ocp.ArrayRestoreArgs(
      restore_type=jax.Array, sharding=sharding, global_shape=shape, dtype=dtype
  )


def restore_arg_for(leaf: Any) -> ocp.RestoreArgs:
  """Restore args for a target leaf given without any: read into its sharding and dtype.

  Arrays and `jax.ShapeDtypeStruct`s with a sharding get `ArrayRestoreArgs`
  from it; anything else (placeholders, values without a sharding) gets
  Orbax's default `RestoreArgs()`.
  """
  sharding = getattr(leaf, 'sharding', None)
  if not isinstance(sharding, jax.sharding.Sharding):
    return ocp.RestoreArgs()
  if is_key(leaf.dtype):
    return ocp.checkpoint_utils.construct_restore_args(leaf)  # Its own key rules.
  # What construct_restore_args makes, without its per-call tree walk.
  return _array_args(tuple(leaf.shape), leaf.dtype, sharding)


def args_by_path(restore_args: PyTree | None) -> dict[Path, ocp.RestoreArgs]:
  """A restore-args tree as {path: RestoreArgs}."""
  if restore_args is None:
    return {}
  pairs, _ = jax.tree_util.tree_flatten_with_path(
      restore_args, is_leaf=lambda x: isinstance(x, ocp.RestoreArgs)
  )
  return {tuple(key_str(k) for k in kp): arg for kp, arg in pairs}

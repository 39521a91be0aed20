"""Executing a plan: each needed array read once, into the target's shardings and dtypes.

`execute_plan` reads through `planned_item.PlannedItem`, an item at a time, and fills
what Tunix never wrote; `restore_train_state` is planning and executing in one.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from orbax_tunix import conventions, errors
from orbax_tunix.keypaths import Path, flatten, fmt
from orbax_tunix.mapping import lora, merge, transforms
from orbax_tunix.maxtext.plan import RestorePlan, Source, plan_restore, require_target
from orbax_tunix.maxtext.view import Shape
from orbax_tunix.reading import reader
from orbax_tunix.reading.planned_item import PlannedItem, Reads
from orbax_tunix.reading.read_requests import args_by_path, into, is_key, sharding_of
from orbax_tunix.view.detection import Detection

PyTree = Any

logger = logging.getLogger('orbax_tunix')


def _stored_form(shape: Shape, dtype: Any) -> jax.ShapeDtypeStruct:
  """The shape and dtype a leaf has on disk: PRNG keys are stored as their key data."""
  if not is_key(dtype):
    return jax.ShapeDtypeStruct(shape, dtype)
  return jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(shape, dtype))


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
      sharding = sharding_of(leaf)
      if arg.sharding is None and arg.mesh is None:
        changes['sharding'] = sharding
    arg = dataclasses.replace(arg, **changes) if changes else arg
    return jax.ShapeDtypeStruct(shape, arg.dtype, sharding=sharding), arg
  dtype = getattr(arg, 'dtype', None) or leaf.dtype
  sharding = sharding_of(leaf)
  args = ocp.ArrayRestoreArgs(sharding=sharding, dtype=dtype, global_shape=shape)
  return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding), args


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
  if not is_key(target.dtype):
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
  want_key, have_key = is_key(target.dtype), is_key(value.dtype)
  if want_key == have_key:
    return value
  value = jax.random.wrap_key_data(value) if want_key else jax.random.key_data(value)
  return jax.device_put(value, target.sharding)


def _convert(array: jax.Array, target: jax.ShapeDtypeStruct) -> jax.Array:
  """A second target leaf from the same source: cast and reshard on device."""
  array = _as_target(array, target)
  if is_key(target.dtype):
    return jax.device_put(array, target.sharding)
  return jax.jit(lambda x: x.astype(target.dtype), out_shardings=target.sharding)(array)


def _host_int(array: jax.Array) -> int:
  # A scalar is replicated: any local shard holds the value (multi-process too).
  return int(np.asarray(array.addressable_data(0)).item())


def _make_derived(
    plan: RestorePlan, resolved: Mapping[Path, tuple[jax.ShapeDtypeStruct, Any]]
) -> dict[Path, jax.Array]:
  """The derived target leaves, a group of leaves sharing their sources at a time.

  Each group's sources are read (one restore) in the partition that lines up
  with the target's, transformed on the devices into the target's sharding
  and dtype, and released before the next group: at most the target plus one
  group's sources are held (e.g. one stacked weight and its layers).
  """
  groups: dict[tuple[Source, ...], list[Path]] = {}
  for target in sorted(plan.derived):
    groups.setdefault(plan.derived[target].sources, []).append(target)
  out: dict[Path, jax.Array] = {}
  for sources, targets in groups.items():
    derived = plan.derived[targets[0]]
    first = resolved[targets[0]][0]
    sharding = transforms.source_sharding(derived.transform, first.sharding, len(first.shape))
    item = sources[0].item
    requests = {s.path: into(shape, first.dtype, sharding)
                for s, shape in zip(sources, derived.shapes, strict=True)}
    planned = PlannedItem.of(plan.detection, item)
    read = planned.read(requests)
    inputs = [read[s.path] for s in sources]
    leaves = [resolved[t][0] for t in targets]
    make = transforms.on_devices([plan.derived[t].transform for t in targets],
                                 [leaf.sharding for leaf in leaves], [leaf.dtype for leaf in leaves])
    out.update(zip(targets, jax.block_until_ready(make(*inputs)), strict=True))
    del inputs, read  # Released before the next group is read.
  return out


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
  given = args_by_path(restore_args)
  resolved = {
      p: _resolve(leaf, given.get(p))
      for p, leaf in pairs
      if p in plan.reads or p in plan.fills or p in plan.derived
  }
  # Each source is read once, with the args of the first target leaf it fills.
  primary: dict[Source, Path] = {}
  for target, source in sorted(plan.reads.items()):
    primary.setdefault(source, target)
  direct = sorted({*plan.reads.values(), *(f.source for f in plan.fills.values() if f.source)})
  # One read per item; the plan checked every path and shape (no metadata read again).
  reads = Reads()
  for source in direct:
    if source in primary:
      request = _read_form(*resolved[primary[source]])
    else:  # Only a fill needs it (the step): a scalar on one device.
      sharding = sharding_of(None)
      request = (jax.ShapeDtypeStruct((), np.uint32, sharding=sharding),
                 ocp.ArrayRestoreArgs(sharding=sharding))
    reads.want(plan.detection, source.item, source.path, request)
  reads.read()
  values = {source: reads.pop(plan.detection, source.item, source.path) for source in direct}
  made = _make_derived(plan, resolved)
  leaves = []
  for path, leaf in pairs:
    if path in made:
      leaves.append(made.pop(path))
    elif path in plan.reads:
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
    path: epath.PathLike | Detection,
    abstract_state: PyTree,
    *,
    params_only: bool = False,
    restore_args: PyTree | None = None,
    merge_lora: bool = False,
    lora_alpha: float | None = None,
    lora_scale: float | None = None,
    lora_base: epath.PathLike | None = None,
    param_scan_axis: int | None = None,
) -> PyTree:
  """Restores a Tunix checkpoint as MaxText's train state.

  Example::

    abstract = jax.eval_shape(init_train_state)   # with shardings attached
    state = orbax_tunix.maxtext.restore_train_state(tunix_root, abstract)

  Args:
    path: a Tunix root (the latest committed step), step or RL root, or its
      `detect()` result.
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
    merge_lora: restore a LoRA run's weights with its adapters merged
      (`orbax_tunix.restore_merged_lora`); needs `params_only=True`.
    lora_alpha, lora_scale, lora_base: the merge's `alpha`, `scale` and
      `base` (the base weights' checkpoint, for an adapters-only save).
    param_scan_axis: MaxText's layer axis of scanned weights, of the side
      that is scanned. A checkpoint holding the decoder's layers in the other
      form than the target (`decoder/layers/<w>` stacked vs
      `decoder/layers_<i>/<w>`) is re-laid to the target's: each layer a
      slice along this axis, or the layers stacked along it (`mu`/`nu`
      alike). None: the checkpoint's own axis (the one along which every
      stacked weight holds the layer count), or for a scanned target the
      one its shapes give (1, MaxText's default, when several do).

  Returns:
    A tree of the same structure whose restored leaves are `jax.Array`s. Each
    needed array is read once; nothing the target does not need is read.

  Raises:
    TargetMismatchError: the target does not fit the checkpoint (weights on
      one side only, shapes, optimizer states), or has no leaves (None, {});
      raised before any array is read. `LayerScanMismatchError` (scanned vs unscanned with layer counts
      or an axis that do not fit) and `LoraOnlyCheckpointError` are two cases.
    UnsupportedLayoutError: not a Tunix checkpoint.
    LoraError: a merge without `params_only`, `lora_alpha` or `lora_scale`
      without a merge, or one that is not a finite number (before any read).
    NotACheckpointError, UncommittedStepError, CorruptMetadataError.
  """
  merging = merge_lora or lora_base is not None
  lora.check_merge_options(merging, lora_alpha, lora_scale)
  require_target(abstract_state, path.step_dir if isinstance(path, Detection) else path)
  if merging:
    return _restore_merged(path, abstract_state, params_only, restore_args,
                           lora_alpha, lora_scale, lora_base)
  plan = plan_restore(path, abstract_state, params_only=params_only,
                      param_scan_axis=param_scan_axis)
  logger.debug('%s', plan.describe())
  return execute_plan(plan, abstract_state, restore_args=restore_args)


def _restore_merged(path, abstract_state, params_only, restore_args, alpha, scale, base):
  """`params/params/<weights>` merged from a LoRA run; the rest as given."""
  where = path.step_dir if isinstance(path, Detection) else path
  if not params_only:
    raise errors.LoraError(
        f'{where}: `merge_lora=True` needs `params_only=True`. A LoRA run\'s optimizer'
        ' state belongs to its adapters, which the merged model no longer has, so a'
        ' full train state cannot be restored from it; restore the parameters and'
        ' start the optimizer afresh.'
    )
  source = reader.open_checkpoint(path) if isinstance(path, Detection) else path
  plan = merge.plan_merge(source, alpha=alpha, scale=scale, base=base)
  logger.debug('%s', plan.describe())
  pairs, treedef = flatten(abstract_state)
  args = args_by_path(restore_args)
  n = len(conventions.MAXTEXT_PARAMS)
  targets = {
      p[n:]: _resolve(leaf, args.get(p))[0]
      for p, leaf in pairs
      if p[:n] == conventions.MAXTEXT_PARAMS
  }
  values = merge.read_merged(plan, targets)
  leaves = [values[p[n:]] if p[:n] == conventions.MAXTEXT_PARAMS else leaf for p, leaf in pairs]
  return jax.tree_util.tree_unflatten(treedef, leaves)

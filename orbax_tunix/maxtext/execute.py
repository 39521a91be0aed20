"""Executing a plan: each needed array read once, into the target's shardings and dtypes;
`restore_train_state` is planning and executing in one.
"""

from __future__ import annotations

import logging
from typing import Any, Unpack

import jax
import numpy as np

from orbax_tunix import conventions, errors
from orbax_tunix.keypaths import flatten, fmt
from orbax_tunix.mapping import device, merge, merge_options, warmup
from orbax_tunix.maxtext.plan import RestorePlan, StepLike, plan_restore, require_target, step_dir
from orbax_tunix.reading import reader
from orbax_tunix.reading.read_requests import args_by_path
from orbax_tunix.view.detection import Detection

PyTree = Any

logger = logging.getLogger('orbax_tunix')


def execute_plan(
    plan: RestorePlan, abstract_state: PyTree, *, restore_args: PyTree | None = None
) -> PyTree:
  """Reads what a plan says, once per array, into the target's shardings and dtypes.

  The plan's outputs run on the device executor (`mapping.device`), as a LoRA merge's do.

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
  planned = {o.path for o in plan.outputs}
  targets = {p: device.Target.of(leaf, given.get(p)) for p, leaf in pairs if p in planned}
  values = device.execute(plan.outputs, targets)
  for path, fill in sorted(plan.fills.items() if logger.isEnabledFor(logging.INFO) else ()):
    # A count is replicated: any local shard holds it (multi-process too).
    number = np.asarray(values[path].addressable_data(0)).item()
    logger.info('%s: filled with %d from %s', fmt(path), number, fill)
  for note in plan.left_out:
    logger.info('%s: left out of the MaxText state: %s', plan.step_dir, note)
  return jax.tree_util.tree_unflatten(treedef, [values.get(p, leaf) for p, leaf in pairs])


def restore_train_state(
    path: StepLike,
    abstract_state: PyTree,
    *,
    params_only: bool = False,
    restore_args: PyTree | None = None,
    param_scan_axis: int | None = None,
    **merge: Unpack[merge_options.MergeKeywords],
) -> PyTree:
  """Restores a Tunix checkpoint as MaxText's train state.

  Example::

    abstract = jax.eval_shape(init_train_state)   # with shardings attached
    state = orbax_tunix.maxtext.restore_train_state(tunix_root, abstract)

  Args:
    path: a Tunix root (the latest committed step), step or RL root, its `detect()`
      result, or the step opened already (`reader.Source`, as the other tools take it).
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
    param_scan_axis: MaxText's layer axis of scanned weights, of the side
      that is scanned. A checkpoint holding the decoder's layers in the other
      form than the target (`decoder/layers/<w>` stacked vs
      `decoder/layers_<i>/<w>`) is re-laid to the target's: each layer a
      slice along this axis, or the layers stacked along it (`mu`/`nu`
      alike). None: the checkpoint's own axis (the one along which every
      stacked weight holds the layer count), or for a scanned target the
      one its shapes give (1, MaxText's default, when several do).
    **merge: the LoRA merge's options (`merge_options.MergeKeywords`): `merge_lora`
      restores a LoRA run's weights with its adapters merged
      (`orbax_tunix.restore_merged_lora`, which takes the others); needs
      `params_only=True`; `base` (the base weights' checkpoint, for an adapters-only save)
      implies it. A QLoRA full save merges onto its own quantized base, dequantized:
      MaxText's model takes float kernels. `lora_base` is the deprecated name of `base`.

  Returns:
    A tree of the same structure whose restored leaves are `jax.Array`s. Each
    needed array is read once; nothing the target does not need is read.

  Raises:
    TargetMismatchError: the target does not fit the checkpoint (weights on
      one side only, shapes, optimizer states), or has no leaves (None, {});
      raised before any array is read. `LayerScanMismatchError` (scanned vs unscanned with
      layer counts or an axis that do not fit) and `LoraOnlyCheckpointError` are two cases.
    UnsupportedLayoutError: not a Tunix checkpoint.
    TypeError: a keyword it does not take.
    LoraError: a merge without `params_only`, a merge's option without a merge, or a
      scaling that is not a finite number (before any read).
    NotACheckpointError, UncommittedStepError, CorruptMetadataError.
  """
  warmup.start(abstract_state)  # Started while the restore is planned.
  given = merge_options.renamed('restore_train_state', dict(merge),
                                {'lora_base': merge_options.BASE})
  merge_options.check_keywords('restore_train_state', given, merge_options.OPTIONS.names())
  merging = merge_options.MergeOptions.given(given, merging=bool(
      given.get(merge_options.MERGE_LORA.name)) or given.get(merge_options.BASE.name) is not None)
  if merging is not None:
    return _restore_merged(path, abstract_state, params_only, restore_args, merging)
  plan = plan_restore(path, abstract_state, params_only=params_only,
                      param_scan_axis=param_scan_axis)
  logger.debug('%s', plan.describe())
  return execute_plan(plan, abstract_state, restore_args=restore_args)


def _restore_merged(path, abstract_state, params_only, restore_args,
                    options: merge_options.MergeOptions):
  """`params/params/<weights>` merged from a LoRA run; the rest as given."""
  where = step_dir(path)
  require_target(abstract_state, where)  # (plan_restore checks it where nothing is merged)
  if not params_only:
    raise errors.LoraError(
        f'{where}: {merge_options.MERGE_LORA.named(True)} needs `params_only=True`. A LoRA run\'s optimizer'
        ' state belongs to its adapters, which the merged model no longer has, so a'
        ' full train state cannot be restored from it; restore the parameters and'
        ' start the optimizer afresh.'
    )
  plan = merge.plan_merge(reader.open_checkpoint(path) if isinstance(path, Detection) else path,
                          options)
  logger.debug('%s', plan.describe())
  pairs, treedef = flatten(abstract_state)
  args = args_by_path(restore_args)
  n = len(conventions.MAXTEXT_PARAMS)
  targets = {p[n:]: device.Target.of(leaf, args.get(p))
             for p, leaf in pairs if p[:n] == conventions.MAXTEXT_PARAMS}
  values = merge.read_merged(plan, targets)
  leaves = [values[p[n:]] if p[:n] == conventions.MAXTEXT_PARAMS else leaf for p, leaf in pairs]
  return jax.tree_util.tree_unflatten(treedef, leaves)

"""`ItemsHandler`: MaxText's `items` handler, which also restores Tunix steps.

Its save and restore args live beside it, registered with
`ocp.args.register_with_handler`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import orbax.checkpoint as ocp
from etils import epath

from orbax_tunix import errors
from orbax_tunix.maxtext.execute import restore_train_state
from orbax_tunix.maxtext.plan import detect_for
from orbax_tunix.store import fileio

PyTree = Any


class ItemsHandler(ocp.PyTreeCheckpointHandler):
  """MaxText's `items` handler that also restores Tunix steps.

  Example (what MaxText's own restore does, with this handler)::

    ckptr = ocp.Checkpointer(orbax_tunix.maxtext.ItemsHandler())
    state = ckptr.restore(step_dir, args=ocp.args.PyTreeRestore(
        item=abstract_state, restore_args=restore_args, partial_restore=True))

  On a Tunix checkpoint (root, step or RL root) `item` is the MaxText
  abstract state and the restore is `restore_train_state`; `ItemsRestore`
  adds `params_only`. Anything else (e.g. MaxText's own `items`) is restored
  by the plain `PyTreeCheckpointHandler`, and saving writes an ordinary PyTree.
  """

  @classmethod
  def typestr(cls) -> str:
    """What Orbax records in a step's metadata for this handler, and finds it by.

    Its public name, `orbax_tunix.maxtext.ItemsHandler`, not the module that
    defines it: checkpoints record the name, so it must not move with the code.
    Subclasses keep Orbax's default (their own module and name).
    """
    if cls is ItemsHandler:
      return f'orbax_tunix.maxtext.{cls.__qualname__}'
    return super().typestr()

  def restore(
      self,
      directory: epath.Path,
      item: PyTree | None = None,
      restore_args: PyTree | None = None,
      transforms: PyTree | None = None,
      transforms_default_to_original: bool = True,
      legacy_transform_fn: Any = None,
      args: ocp.args.CheckpointArgs | None = None,
  ) -> PyTree:
    """Restores a train state; see the class docstring.

    Raises:
      TargetMismatchError: no target given, or it does not fit the checkpoint.
      UnsupportedLayoutError: legacy `transforms` on a Tunix checkpoint.
    """
    if args is None:
      args = ocp.args.PyTreeRestore(
          item, restore_args, transforms, transforms_default_to_original, legacy_transform_fn
      )
    directory = fileio.as_path(directory)
    params_only = getattr(args, 'params_only', False)
    found = detect_for(directory, params_only)
    if not found.is_tunix:
      return super().restore(directory, args=args)
    # MaxText passes `transforms={}` to mean "partial restore"; it requests
    # nothing, so it is no transform.
    if getattr(args, 'transforms', None) or getattr(args, 'legacy_transform_fn', None):
      raise errors.UnsupportedLayoutError(
          f'{directory}: legacy `transforms` are not supported on a Tunix'
          ' checkpoint; pass the MaxText abstract state as `item` (the mapping'
          ' is worked out from it).'
      )
    return restore_train_state(
        found,
        args.item,
        params_only=params_only,
        restore_args=getattr(args, 'restore_args', None),
    )


# Registering args of its own makes `ocp.Checkpointer` pass any args (plain
# `ocp.args.PyTreeRestore` too) straight to the handler.
@ocp.args.register_with_handler(ItemsHandler, for_save=True)
@dataclasses.dataclass
class ItemsSave(ocp.args.PyTreeSave):
  """Saves like `ocp.args.PyTreeSave` (an ordinary Orbax PyTree)."""


@ocp.args.register_with_handler(ItemsHandler, for_restore=True)
@dataclasses.dataclass
class ItemsRestore(ocp.args.PyTreeRestore):
  """`ocp.args.PyTreeRestore` with `params_only` (restore `params` alone)."""

  params_only: bool = False

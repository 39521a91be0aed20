"""`TunixPyTreeHandler`: an Orbax PyTree handler that reads Tunix items canonically.

A thin adapter over `planned_item.PlannedItem` (see the class), reading through
this handler's Orbax reads or its `reader`'s. A Tunix item restored into a target
already in its on-disk shape (`PlannedItem.as_stored`) goes to Orbax as asked.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import orbax.checkpoint as ocp
from etils import epath

from orbax_tunix import errors
from orbax_tunix.mapping import device, warmup
from orbax_tunix.reading import planned_item
from orbax_tunix.store import _orbax, fileio

PyTree = Any

class _AsOrbax:
  """A `TunixPyTreeHandler` with Orbax's own `restore` and `metadata` (no canonical view).

  What Orbax's `StandardCheckpointHandler` reads through for an item restored
  as Orbax would (not Tunix's, or a target already in the on-disk shape): it
  calls back only these two methods, which then answer as Orbax's own.
  """

  def __init__(self, handler: ocp.PyTreeCheckpointHandler):
    self._orbax = super(TunixPyTreeHandler, handler)

  def restore(self, directory: epath.Path, args: ocp.args.CheckpointArgs | None = None) -> PyTree:
    return self._orbax.restore(directory, args=args)

  def metadata(self, directory: epath.Path) -> Any:
    return self._orbax.metadata(directory)


def _existing(directory: epath.PathLike) -> epath.Path:
  """`directory` as an absolute `epath.Path`, which must be a directory.

  Raises:
    NotACheckpointError: it does not exist or is a file (also a
      `FileNotFoundError`).
  """
  directory = fileio.as_path(directory)
  if not directory.is_dir():
    raise errors.NotACheckpointError(
        f'{directory}: expected an item directory of an Orbax checkpoint, found'
        f' {fileio.found_at(directory)}. Pass an item, e.g. <step>/model_params.'
    )
  return directory


class TunixPyTreeHandler(ocp.PyTreeCheckpointHandler):
  """A `PyTreeCheckpointHandler` that shows Tunix items in canonical form.

  Example::

    ckptr = ocp.Checkpointer(orbax_tunix.TunixPyTreeHandler())
    params = ckptr.restore(step_dir / 'model_params',
                           args=ocp.args.PyTreeRestore(item=abstract_params))

  On a Tunix item, `item` is a canonical target (arrays or
  `jax.ShapeDtypeStruct`s, with shardings): only the arrays it names are read,
  each straight into its sharding and dtype (from `restore_args` when given,
  else from the target leaf). `ocp.args.StandardRestore` has Orbax's
  `StandardCheckpointHandler` semantics on the canonical tree. Any other item
  is restored by the plain `PyTreeCheckpointHandler` (or `reader`) exactly as
  asked.

  Args:
    reader: an Orbax `PyTreeCheckpointHandler` or `StandardCheckpointHandler`
      to read with (its options apply); by default this handler reads itself.
    **kwargs: as for `ocp.PyTreeCheckpointHandler`.
  """

  def __init__(
      self,
      *,
      reader: ocp.PyTreeCheckpointHandler | ocp.StandardCheckpointHandler | None = None,
      **kwargs: Any,
  ):
    super().__init__(**kwargs)
    self._reader = reader

  @functools.cached_property
  def _standard(self) -> ocp.StandardCheckpointHandler:
    """Orbax's StandardCheckpointHandler over this one, for `StandardRestore` of a
    Tunix item in canonical form (it calls back `metadata` and `restore`)."""
    return _orbax.standard_handler_over(self)

  @functools.cached_property
  def _orbax_standard(self) -> ocp.StandardCheckpointHandler:
    """Orbax's StandardCheckpointHandler over Orbax's own reads of this one."""
    return _orbax.standard_handler_over(_AsOrbax(self))

  @functools.cached_property
  def _reads(self) -> planned_item.OrbaxReads:
    """Orbax's reads: the reader's PyTree handler, or Orbax's methods on this one."""
    if isinstance(self._reader, ocp.StandardCheckpointHandler):
      return planned_item.through(_orbax.pytree_handler_of(self._reader))
    if self._reader is not None:
      return planned_item.through(self._reader)
    base = super()
    return planned_item.OrbaxReads(
        self, lambda d, args: base.restore(d, args=args), base.metadata
    )

  def _orbax_restore(self, directory: epath.Path, args: ocp.args.CheckpointArgs) -> PyTree:
    """Orbax's own restore of an item that is not Tunix's, by the reader when there is one."""
    if self._reader is not None:
      return self._reader.restore(directory, args=args)
    if isinstance(args, ocp.args.StandardRestore):
      return self._orbax_standard.restore(directory, args=args)
    return super().restore(directory, args=args)

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
    """Restores an item; see the class docstring.

    Raises:
      NotACheckpointError: `directory` does not exist (also a
        `FileNotFoundError`, as Orbax raises).
      TargetMismatchError: the target names leaves absent on disk or with
        another shape (checked before any array is read).
      UnsupportedLayoutError: legacy `transforms` on a Tunix item.
      CorruptMetadataError: stored data the target needs is missing or damaged.
    """
    directory = _existing(directory)
    # Started while the item is planned; its programs (e.g. a QLoRA dequantization) compile after.
    warmup.start((item, restore_args, getattr(args, 'item', None),
                  getattr(args, 'restore_args', None)))
    planned = planned_item.find(directory)
    if args is None:
      nothing = item is None and restore_args is None and transforms is None
      standard = isinstance(self._reader, ocp.StandardCheckpointHandler) or (
          planned is not None and planned.meta.saved_by == ocp.StandardCheckpointHandler.typestr())
      if nothing and legacy_transform_fn is None and standard:
        # Asked for nothing: restored as the handler that saved it (or the
        # Standard reader given) restores: shardings from its metadata,
        # Orbax's topology check.
        args = ocp.args.StandardRestore()
      else:
        args = ocp.args.PyTreeRestore(
            item, restore_args, transforms, transforms_default_to_original, legacy_transform_fn
        )
    target = getattr(args, 'item', None)
    if planned is None and target is None:
      # Orbax raises FileNotFoundError here too; ours is one, and says more.
      raise errors.NotACheckpointError(
          f'{directory}: expected an item directory of an Orbax checkpoint'
          f' (holding {_orbax.PYTREE_METADATA}), found a directory without it.'
          ' Pass an item, e.g. <step>/model_params or <step>/optimizer_state.'
      )
    untargeted = target is None and getattr(args, 'restore_args', None) is None
    try:
      if planned is None or not planned.is_tunix or planned.as_stored(target):
        return self._orbax_restore(directory, args)
      with planned_item.using([planned]):
        if isinstance(args, ocp.args.StandardRestore):
          # Orbax's own StandardRestore logic, which calls back `metadata` and
          # `restore` (with PyTreeRestore) on this handler: planned once for both.
          return self._standard.restore(directory, args=args)
        return planned.restore(args, self._reads, device.plan_read)
    except ValueError as e:
      if untargeted and _orbax.is_topology_mismatch(e):
        # Orbax's PyTree path says only that a sharding is missing; its
        # StandardCheckpointHandler says why, and what to do.
        raise ValueError(f'{_orbax.TOPOLOGY_MISMATCH} ({directory})') from e
      raise

  def metadata(self, directory: epath.Path) -> _orbax.TreeMetadata:
    """Returns the item's metadata tree, canonical for a Tunix item.

    Raises:
      NotACheckpointError: `directory` does not exist.
      CorruptMetadataError: a Tunix item's array stores are unreadable.
    """
    directory = _existing(directory)
    planned = planned_item.find(directory)
    if planned is None or not planned.is_tunix:
      if self._reader is not None:
        return self._reader.metadata(directory)
      return super().metadata(directory)
    return planned.metadata(self._reads)


# Registering args of its own keeps `ocp.Checkpointer` from wrapping the handler
# in its legacy adapter, and gives composites default args for no-arg restores.
@ocp.args.register_with_handler(TunixPyTreeHandler, for_save=True)
@dataclasses.dataclass
class TunixPyTreeSave(ocp.args.PyTreeSave):
  """Saves like `ocp.args.PyTreeSave` (an ordinary Orbax PyTree)."""


@ocp.args.register_with_handler(TunixPyTreeHandler, for_restore=True)
@dataclasses.dataclass
class TunixPyTreeRestore(ocp.args.PyTreeRestore):
  """Restores like `ocp.args.PyTreeRestore`, with the canonical target."""


class V1ItemHandler(TunixPyTreeHandler):
  """`TunixPyTreeHandler` under the typestr Orbax's v1 API records for PyTrees.

  Orbax's v0 composite handler picks the handler of an item restored with no
  arguments by the typestr recorded at save time, and has none for v1's
  `PyTreeHandler`: a v1-written step does not restore through the v0 API.
  Registering this class gives that typestr a handler; it reads any PyTree
  item (Tunix or not) as `TunixPyTreeHandler` does, and saves nothing new.
  """

  @classmethod
  def typestr(cls) -> str:
    return _orbax.V1_PYTREE_TYPESTR


@ocp.args.register_with_handler(V1ItemHandler, for_save=True)
@dataclasses.dataclass
class V1ItemSave(ocp.args.PyTreeSave):
  """Registered for `V1ItemHandler` only because Orbax pairs save and restore args."""


@ocp.args.register_with_handler(V1ItemHandler, for_restore=True)
@dataclasses.dataclass
class V1ItemRestore(ocp.args.PyTreeRestore):
  """The default args of a v1-written item restored through the v0 API."""

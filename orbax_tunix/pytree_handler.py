"""`TunixPyTreeHandler`: an Orbax PyTree handler that reads Tunix items canonically.

The restore target is rewritten, path by path, into the on-disk structure and
read with Orbax's own restore (every leaf the target leaves out named as
`ocp.PLACEHOLDER`), so every array is read once, straight into the target's
sharding and dtype, and arrays the target does not name are never opened.
Items that are not Tunix's go to the plain `PyTreeCheckpointHandler` exactly
as asked. `read` is the one read path everything in this package uses.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, MutableMapping, Sequence
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from orbax_tunix import _orbax, canonical, errors, storage
from orbax_tunix.detection import Planned, plan_item
from orbax_tunix.keypaths import Path, as_lists, flat_dict, flatten, fmt, key_str, nest

PyTree = Any
# (target leaf, restore args) for one leaf to read.
Request = tuple[Any, ocp.RestoreArgs]


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


def validate_target(
    meta: storage.Item,
    canonical_paths: Sequence[Path],
    disk: Sequence[Path | None],
    leaves: Sequence[Any],
) -> None:
  """Checks a canonical target against the checkpoint before anything is read.

  Args:
    meta: the item, as `storage` read it.
    canonical_paths: the target's leaf paths, canonical.
    disk: the on-disk path of each, in the same order (None: not on disk).
    leaves: the target's leaves, in the same order.

  Raises:
    TargetMismatchError: leaves absent on disk, or with another shape; the
      message lists them all (up to a screenful) with counts.
    CorruptMetadataError: arrays the target names have no data in the store.
  """
  directory = meta.directory
  missing = [fmt(c) for c, d in zip(canonical_paths, disk, strict=True) if d is None]
  shapes_of = (
      (d, stored_shape(leaf)) for d, leaf in zip(disk, leaves, strict=True) if d is not None
  )
  expected = {d: shape for d, shape in shapes_of if shape is not None}
  have = meta.mismatched_shapes(expected)
  shapes = [
      f'{fmt(c)}: target {expected[d]}, on disk {have[d]}'
      for c, d in zip(canonical_paths, disk, strict=True) if d in have
  ]
  if missing or shapes:
    parts = [f'{directory}: the restore target does not match the checkpoint.']
    if missing:
      parts.append(
          f'{len(missing)} target leaves are not in the checkpoint (canonical'
          f' paths):\n{errors.list_paths(missing)}'
      )
    if shapes:
      parts.append(f'{len(shapes)} leaves differ in shape:\n{errors.list_paths(shapes)}')
    parts.append(
        'Remove these leaves from the target, or fix their shapes; '
        '`TunixPyTreeHandler().metadata(path)` shows the canonical tree.'
    )
    raise errors.TargetMismatchError('\n'.join(parts))


def _existing(directory: epath.PathLike) -> epath.Path:
  """`directory` as an absolute `epath.Path`, which must be a directory.

  Raises:
    NotACheckpointError: it does not exist or is a file (also a
      `FileNotFoundError`).
  """
  directory = storage.as_path(directory)
  if not directory.is_dir():
    raise errors.NotACheckpointError(
        f'{directory}: expected an item directory of an Orbax checkpoint, found'
        f' {storage.found_at(directory)}. Pass an item, e.g. <step>/model_params.'
    )
  return directory


def canonical_metadata(
    meta: _orbax.TreeMetadata, cmap: canonical.CanonicalMap
) -> _orbax.TreeMetadata:
  """An on-disk item's metadata tree in canonical form (no store is read)."""
  return _orbax.tree_metadata_like(meta, canonical.to_canonical_tree(meta.tree, cmap))


def _default_restore_arg(leaf: Any) -> ocp.RestoreArgs:
  """Restore args for a target leaf given without any: read into its sharding and dtype.

  Arrays and `jax.ShapeDtypeStruct`s with a sharding get `ArrayRestoreArgs`
  from it (Orbax's `construct_restore_args`); anything else (placeholders,
  values without a sharding) gets Orbax's default `RestoreArgs()`.
  """
  sharding = getattr(leaf, 'sharding', None)
  if not isinstance(sharding, jax.sharding.Sharding):
    return ocp.RestoreArgs()
  if is_key(leaf.dtype):
    return ocp.checkpoint_utils.construct_restore_args(leaf)  # Its own key rules.
  # What construct_restore_args makes, without its per-call tree walk.
  return ocp.ArrayRestoreArgs(
      restore_type=jax.Array, sharding=sharding, global_shape=tuple(leaf.shape), dtype=leaf.dtype
  )


def args_by_path(restore_args: PyTree | None) -> dict[Path, ocp.RestoreArgs]:
  """A restore-args tree as {path: RestoreArgs}."""
  if restore_args is None:
    return {}
  pairs, _ = jax.tree_util.tree_flatten_with_path(
      restore_args, is_leaf=lambda x: isinstance(x, ocp.RestoreArgs)
  )
  return {tuple(key_str(k) for k in kp): arg for kp, arg in pairs}


def _skeleton(
    item: storage.Item, requests: Mapping[Path, Request]
) -> tuple[PyTree, PyTree]:
  """The item's whole on-disk tree as a target: requested leaves, the rest placeholders.

  Orbax's own restore then reads exactly the requested leaves, whatever the
  tree's containers (lists where `_METADATA` records sequence keys, `None`
  where it records an empty node).
  """
  target: dict[str, Any] = {}
  args: dict[str, Any] = {}
  for leaf in item.leaves:
    if leaf.path in requests:
      value, arg = requests[leaf.path]
    elif leaf.is_empty:
      value, arg = None, ocp.RestoreArgs()
    else:
      value, arg = ocp.PLACEHOLDER, ocp.RestoreArgs()
    # Both trees in one walk (a hot loop: every leaf of the item).
    t, a = target, args
    for key in leaf.path[:-1]:
      t, a = t.setdefault(key, {}), a.setdefault(key, {})
      if not isinstance(t, dict):
        raise ValueError(f'{fmt(leaf.path)}: a leaf already sits at a prefix of it.')
    if isinstance(t.get(leaf.path[-1]), dict):
      raise ValueError(f'{fmt(leaf.path)}: a subtree already sits at this path.')
    t[leaf.path[-1]] = value
    a[leaf.path[-1]] = arg
  if not item.has_sequences:
    return target, args
  return as_lists(target, item.sequence_nodes), as_lists(args, item.sequence_nodes)


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
    plans: items already read and planned by the caller, by item directory
      (from `detect`), so that they are not read again.
    **kwargs: as for `ocp.PyTreeCheckpointHandler`.
  """

  def __init__(
      self,
      *,
      reader: ocp.PyTreeCheckpointHandler | ocp.StandardCheckpointHandler | None = None,
      plans: MutableMapping[epath.Path, Planned] | None = None,
      **kwargs: Any,
  ):
    super().__init__(**kwargs)
    self._reader = reader
    # Orbax's StandardRestore logic calls back into `metadata` and `restore`:
    # the plan made for the first call serves the others.
    self._planned = {} if plans is None else plans

  @functools.cached_property
  def _standard(self) -> ocp.StandardCheckpointHandler:
    """Orbax's StandardCheckpointHandler over this one, for `StandardRestore`."""
    return _orbax.standard_handler_over(self)

  def _orbax_restore(self, directory: epath.Path, args: ocp.args.CheckpointArgs) -> PyTree:
    """Orbax's own restore, by the reader when there is one."""
    if self._reader is not None:
      return self._reader.restore(directory, args=args)
    if isinstance(args, ocp.args.StandardRestore):
      return self._standard.restore(directory, args=args)
    return super().restore(directory, args=args)

  def _orbax_metadata(self, directory: epath.Path) -> _orbax.TreeMetadata:
    if self._reader is not None:
      return self._reader.metadata(directory)
    return super().metadata(directory)

  def _plan(self, directory: epath.Path) -> Planned | None:
    if directory in self._planned:
      return self._planned[directory]
    return plan_item(directory)

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
    if args is None:
      args = ocp.args.PyTreeRestore(
          item, restore_args, transforms, transforms_default_to_original, legacy_transform_fn
      )
    directory = _existing(directory)
    planned = self._plan(directory)
    if planned is None and getattr(args, 'item', None) is None:
      # Orbax raises FileNotFoundError here too; ours is one, and says more.
      raise errors.NotACheckpointError(
          f'{directory}: expected an item directory of an Orbax checkpoint'
          f' (holding {storage.PYTREE_METADATA}), found a directory without it.'
          ' Pass an item, e.g. <step>/model_params or <step>/optimizer_state.'
      )
    if planned is None or not planned[1].rewrites:
      return self._orbax_restore(directory, args)
    if isinstance(args, ocp.args.StandardRestore):
      # Orbax's own StandardRestore logic, which calls back `metadata` and
      # `restore` (with PyTreeRestore) on this handler: plan once for both.
      self._planned[directory] = planned
      try:
        return self._standard.restore(directory, args=args)
      finally:
        self._planned.pop(directory, None)
    if args.transforms or args.legacy_transform_fn is not None:
      raise errors.UnsupportedLayoutError(
          f'{directory}: legacy `transforms` are not supported on a Tunix item;'
          ' pass the canonical target as `item` instead (the rewrites apply'
          ' to it).'
      )
    meta, cmap = planned
    if meta.legacy:
      return self._restore_legacy(directory, cmap, args)
    return self._restore_canonical(meta, cmap, args)

  def _restore_legacy(
      self, directory: epath.Path, cmap: canonical.CanonicalMap, args: ocp.args.PyTreeRestore
  ) -> PyTree:
    """An item older than `_METADATA`: read whole, as Orbax does, then rewritten."""
    if args.item is not None:
      raise errors.UnsupportedLayoutError(
          f'{directory}: this item predates Orbax\'s _METADATA file, so a'
          ' partial restore into a target is not possible. Restore it without'
          ' a target (every array, canonical), or re-save it with a current'
          ' Orbax.'
      )
    return canonical.to_canonical_tree(
        self._orbax_read(directory, ocp.args.PyTreeRestore()), cmap
    )

  def _restore_canonical(
      self, meta: storage.Item, cmap: canonical.CanonicalMap, args: ocp.args.PyTreeRestore
  ) -> PyTree:
    """Checks the canonical target against the checkpoint, then reads only it."""
    given = args_by_path(args.restore_args)
    if args.item is None:
      # Every canonical leaf, restored as saved (as Orbax does without a target).
      requests = {c: (0, given.get(c, ocp.RestoreArgs())) for c in sorted(cmap.canonical_to_disk)}
      return nest(self.read(meta, cmap, requests).items())
    with storage.no_gc():  # Planning builds an object or two per leaf.
      pairs, treedef = flatten(args.item)
      to_disk = cmap.canonical_to_disk
      wanted = [(c, leaf) for c, leaf in pairs if leaf is not ocp.PLACEHOLDER]
      disk = [to_disk.get(c) for c, _ in wanted]
      validate_target(meta, [c for c, _ in wanted], disk, [leaf for _, leaf in wanted])
      requests = {c: (leaf, given.get(c) or _default_restore_arg(leaf)) for c, leaf in wanted}
    values = self.read(meta, cmap, requests)
    return jax.tree_util.tree_unflatten(treedef, [values.get(c, leaf) for c, leaf in pairs])

  def read(
      self,
      meta: storage.Item,
      cmap: canonical.CanonicalMap | None,
      requests: Mapping[Path, Request],
  ) -> dict[Path, Any]:
    """Reads some leaves of an item, by canonical path: the one read path.

    Args:
      meta: the item, as `storage` read it.
      cmap: its canonical map (None: paths are on-disk paths).
      requests: canonical path -> (target leaf, restore args) for each leaf to
        read; the paths must be in the checkpoint (checked by the caller).

    Returns:
      canonical path -> value read.

    Raises:
      CorruptMetadataError: stored data is missing or damaged.
    """
    if not requests:
      return {}
    to_disk = cmap.canonical_to_disk if cmap is not None else {p: p for p in requests}
    with storage.no_gc():
      by_disk = {to_disk[c]: request for c, request in requests.items()}
      if meta.has_sequences or 2 * len(by_disk) > len(meta.leaves):
        # Most of the tree, or lists in it: the whole tree, placeholders for the
        # rest (Orbax's plain path; it cannot prune a list).
        target, restore_args = _skeleton(meta, by_disk)
        args = ocp.args.PyTreeRestore(target, restore_args)
      else:
        # A few leaves of a tree of dicts: Orbax trims its metadata to them.
        args = ocp.args.PyTreeRestore(
            nest((d, t) for d, (t, _) in by_disk.items()),
            nest((d, a) for d, (_, a) in by_disk.items()),
            partial_restore=True,
        )
    restored = flat_dict(self._orbax_read(meta.directory, args))
    return {c: restored[to_disk[c]] for c in requests}

  def _orbax_read(self, directory: epath.Path, args: ocp.args.PyTreeRestore) -> PyTree:
    """Orbax's read of an on-disk target; damaged data is put in our terms.

    Failures that are about the request (e.g. a sharding that does not divide
    an array) reach the caller as Orbax raised them.
    """
    pytree = (
        _orbax.pytree_handler_of(self._reader)
        if isinstance(self._reader, ocp.StandardCheckpointHandler)
        else self._reader
    )
    try:
      if pytree is not None:
        return pytree.restore(directory, args=args)
      return super().restore(directory, args=args)
    except Exception as e:  # pylint: disable=broad-except
      cause = _orbax.storage_failure(e)
      if cause is None:
        raise
      raise errors.CorruptMetadataError(
          f'{directory}: reading the arrays failed: stored data is missing or'
          f' damaged ({_orbax.failure_text(cause)}). Expected readable array data'
          ' for every leaf asked for; use another step (`step`), or re-save this one.'
      ) from e

  def metadata(self, directory: epath.Path) -> _orbax.TreeMetadata:
    """Returns the item's metadata tree, canonical for a Tunix item.

    Raises:
      NotACheckpointError: `directory` does not exist.
      CorruptMetadataError: a Tunix item's array stores are unreadable.
    """
    directory = _existing(directory)
    planned = self._plan(directory)
    if planned is None or not planned[1].rewrites:
      return self._orbax_metadata(directory)
    try:
      meta = self._orbax_metadata(directory)
    except Exception as e:  # pylint: disable=broad-except
      cause = _orbax.storage_failure(e)
      if cause is None:
        raise
      raise errors.CorruptMetadataError(
          f'{directory}: reading the arrays\' metadata failed: stored data is'
          f' missing or damaged ({_orbax.failure_text(cause)}). Expected a readable'
          ' store for every leaf in _METADATA; use another step (`step`).'
      ) from e
    return canonical_metadata(meta, planned[1])


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

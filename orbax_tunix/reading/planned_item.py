"""One item of a step, planned: the canonical read every entry point goes through.

A `PlannedItem` is an item as `store.item_store` read it (its leaves, its `_METADATA`
as parsed) and its `CanonicalMap`. Reading is rewriting a request, path by
path, into the on-disk structure and executing it with Orbax's own restore
(every leaf the request leaves out named as `ocp.PLACEHOLDER`, or a partial
restore of a few), handing Orbax the metadata already parsed: every array is
read once, straight into its target's sharding and dtype, and arrays nobody
asked for are never opened. The handlers (`pytree_handler`,
`composite_handler`, the v1 handler in `handlers.plugins`) are thin adapters over it;
the tools read through it too.

Plans a caller already made (a composite for the items of the step it
restores) are put in effect for its context with `using`, where `find`
finds them; nothing is shared between threads or calls.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import types
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath

from orbax_tunix import errors
from orbax_tunix.keypaths import Path, as_lists, flat_dict, flatten, fmt, nest
from orbax_tunix.reading import quantized, read_requests
from orbax_tunix.store import _orbax, fileio, item_store, storage_errors
from orbax_tunix.view import canonical_map
from orbax_tunix.view.detection import plan_item

PyTree = Any


@dataclasses.dataclass(frozen=True)
class OrbaxReads:
  """How Orbax reads an item: one PyTree handler's restore and metadata, with its options.

  Attributes:
    handler: the `ocp.PyTreeCheckpointHandler` whose reads of `_METADATA`
      are served from the parse already made.
    restore: `(directory, PyTreeRestore args) -> tree`, Orbax's restore.
    metadata: `directory -> TreeMetadata`, Orbax's metadata.
  """

  handler: ocp.PyTreeCheckpointHandler
  restore: Callable[[epath.Path, ocp.args.PyTreeRestore], PyTree]
  metadata: Callable[[epath.Path], Any]


def through(handler: ocp.PyTreeCheckpointHandler | None = None) -> OrbaxReads:
  """Orbax's reads by `handler`'s own public methods (a new plain handler by default)."""
  handler = ocp.PyTreeCheckpointHandler() if handler is None else handler
  return OrbaxReads(
      handler, lambda d, args: handler.restore(d, args=args), handler.metadata
  )


def validate_target(
    meta: item_store.Item,
    canonical_paths: Sequence[Path],
    disk: Sequence[Path | None],
    leaves: Sequence[Any],
) -> None:
  """Checks a canonical target against the checkpoint before anything is read.

  Args:
    meta: the item, as `store.item_store` read it.
    canonical_paths: the target's leaf paths, canonical.
    disk: the on-disk path of each, in the same order (None: not on disk).
    leaves: the target's leaves, in the same order.

  Raises:
    TargetMismatchError: leaves absent on disk, or with another shape; the
      message lists them all (up to a screenful) with counts, each under its
      canonical path and, where it differs, its path on disk.
    CorruptMetadataError: arrays the target names have no data in the store.
  """
  missing = [fmt(c) for c, d in zip(canonical_paths, disk, strict=True) if d is None]
  expected = {d: shape for d, leaf in zip(disk, leaves, strict=True)
              if d is not None and (shape := read_requests.stored_shape(leaf)) is not None}
  have = meta.mismatched_shapes(expected)
  shapes = [
      f'{fmt(c)}: target {expected[d]}, on disk {have[d]}{"" if c == d else f" (at {fmt(d)})"}'
      for c, d in zip(canonical_paths, disk, strict=True) if d in have
  ]
  if missing or shapes:
    parts = [f'{meta.directory}: the restore target does not match the checkpoint.']
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


def _skeleton(
    item: item_store.Item, wanted: Mapping[Path, read_requests.ReadRequest]
) -> tuple[PyTree, PyTree]:
  """The item's whole on-disk tree as a target: requested leaves, the rest placeholders.

  Orbax's own restore then reads exactly the requested leaves, whatever the
  tree's containers (lists where `_METADATA` records sequence keys, `None`
  where it records an empty node).
  """
  target: dict[str, Any] = {}
  args: dict[str, Any] = {}
  for leaf in item.leaves:
    if leaf.path in wanted:
      value, arg = wanted[leaf.path]
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


def canonical_metadata(meta: Any, cmap: canonical_map.CanonicalMap, where: str = '') -> Any:
  """An on-disk item's metadata tree in canonical form (no store is read): a leaf made of
  several stored ones described as what a read gives (`quantized.as_read`).

  Raises:
    CorruptMetadataError: a quantized weight's parts are not one weight's
      (`quantized.scheme`); `where` (the item) names it.
  """
  tree = canonical_map.to_canonical_tree(meta.tree, cmap)
  return _orbax.tree_metadata_like(meta, quantized.as_read(tree, meta.tree, cmap, where))


@dataclasses.dataclass(frozen=True)
class PlannedItem:
  """One item read from metadata once, and its canonical map.

  Attributes:
    meta: the item, as `store.item_store` read it.
    cmap: its `CanonicalMap` (the identity for an item that is not Tunix's).
  """

  meta: item_store.Item
  cmap: canonical_map.CanonicalMap

  @classmethod
  def of(cls, detection: Any, item: str) -> PlannedItem:
    """The plan of `item` of a step detection already made (`detection.Detection`)."""
    return cls(detection.item_meta(item), detection.maps[item])

  @property
  def directory(self) -> epath.Path:
    return self.meta.directory

  @property
  def is_tunix(self) -> bool:
    """Whether rewrites apply (else the item is read as it is)."""
    return bool(self.cmap.rewrites)

  def as_stored(self, target: PyTree) -> bool:
    """Whether a restore target already has the on-disk shape: then it is Orbax's.

    A target whose every leaf (but `ocp.PLACEHOLDER`s) is at an on-disk path,
    some not canonical (e.g. flax's `nnx.state` of an abstract model, with its
    `value` levels, as flax's checkpointing guide restores): rewriting it
    would break what plain Orbax restores. Such a target, and every reader of
    it, is handed to Orbax unchanged.
    """
    if target is None or not self.is_tunix:
      return False
    paths = [p for p, leaf in flatten(target)[0] if leaf is not ocp.PLACEHOLDER]
    stored = self.meta.paths
    canonical = self.cmap.canonical_to_disk
    return (bool(paths) and all(p in stored for p in paths)
            and any(p not in canonical for p in paths))

  def read(
      self,
      wanted: Mapping[Path, read_requests.ReadRequest],
      via: OrbaxReads | None = None,
      *,
      on_disk: bool = False,
  ) -> dict[Path, Any]:
    """Reads some leaves with one Orbax restore: the one read path.

    Args:
      wanted: canonical path -> (target leaf, restore args) for each leaf to
        read; the paths must be in the checkpoint (checked by the caller).
      via: how Orbax reads (a plain `PyTreeCheckpointHandler` by default).
      on_disk: the paths of `wanted` are on-disk paths (side leaves, e.g.
        the inject_hyperparams scalars), not canonical ones.

    Returns:
      path -> value read, keyed as `wanted`.

    Raises:
      CorruptMetadataError: stored data is missing or damaged.
    """
    if not wanted:
      return {}
    meta, cmap = self.meta, self.cmap
    disk_path = (lambda p: p) if on_disk else cmap.disk_path
    with fileio.no_gc():
      by_disk = {disk_path(c): request for c, request in wanted.items()}
      if meta.has_sequences or 2 * len(by_disk) > len(meta.leaves):
        # Most of the tree, or lists in it: the whole tree, placeholders for the
        # rest (Orbax's plain path; it cannot prune a list).
        args = ocp.args.PyTreeRestore(*_skeleton(meta, by_disk))
        served = meta.tree_json_of()
      else:
        # A few leaves of a tree of dicts: Orbax is handed their metadata alone.
        args = ocp.args.PyTreeRestore(
            nest((d, t) for d, (t, _) in by_disk.items()),
            nest((d, a) for d, (_, a) in by_disk.items()),
            partial_restore=True,
        )
        served = meta.tree_json_of(by_disk)
    restored = flat_dict(self._orbax_read(via or through(), args, served))
    return {c: restored[disk_path(c)] for c in wanted}

  def read_parts(
      self, parts: Sequence[tuple[Path, tuple[Any, ...], Any]]
  ) -> list[Any]:
    """Reads parts of arrays (one layer of a stacked weight) to the host.

    Orbax restores an array whole (or a device's shards of it); a part is read
    from the same store with the same TensorStore spec Orbax's read opens
    (`_orbax.read_parts`), only the chunks under it.

    Args:
      parts: (canonical path, index into the array, dtype to cast to or None).

    Returns:
      One numpy array per part, in order.

    Raises:
      CorruptMetadataError: stored data is missing or damaged.
    """
    if not parts:
      return []
    reads = [(self.cmap.disk_path(path), index, dtype) for path, index, dtype in parts]
    with self._damaged('parts of arrays'):
      return list(_orbax.read_parts(self.directory, reads, use_ocdbt=self.meta.use_ocdbt,
                                    use_zarr3=self.meta.use_zarr3))

  def restore(self, args: ocp.args.PyTreeRestore, via: OrbaxReads | None = None,
              plan: PlanRead | None = None) -> PyTree:
    """A canonical `PyTreeRestore`: a canonical target (any subset), or none (every leaf).

    Target leaves without `restore_args` are read into their own sharding and
    dtype; `ocp.PLACEHOLDER` leaves are returned unread. `plan` plans the read of the
    requests (`PlannedItem.read` by default; the handlers' also makes the leaves made of
    several stored ones: `mapping.device.plan_read`), its own checks made first.

    Raises:
      TargetMismatchError: the target names leaves absent on disk or with
        another shape (before any array is read).
      UnsupportedLayoutError: legacy `transforms`; or a target on an item
        older than `_METADATA`.
      CorruptMetadataError: stored data the target needs is missing or damaged.
    """
    via = via or through()
    plan = plan or _plain_read
    if args.transforms or args.legacy_transform_fn is not None:
      raise errors.UnsupportedLayoutError(
          f'{self.directory}: legacy `transforms` are not supported on a Tunix item;'
          ' pass the canonical target as `item` instead (the rewrites apply'
          ' to it).'
      )
    if self.meta.legacy:
      return self._restore_legacy(args, via)
    given = read_requests.args_by_path(args.restore_args)
    if args.item is None:
      # Every canonical leaf, restored as saved (as Orbax does without a target).
      wanted = {c: (0, given.get(c, ocp.RestoreArgs())) for c in sorted(self.cmap.canonical_to_disk)}
      return nest(plan(self, wanted, via)().items())
    with fileio.no_gc():  # Planning builds an object or two per leaf.
      pairs, treedef = flatten(args.item)
      chosen = [(c, leaf) for c, leaf in pairs if leaf is not ocp.PLACEHOLDER]
      disk = [self.cmap.disk_path(c) for c, _ in chosen]
      wanted = {c: (leaf, given.get(c) or read_requests.restore_arg_for(leaf)) for c, leaf in chosen}
      # The plan's checks first (a quantized weight's parts: its leaf is read at one of them).
      read = plan(self, wanted, via)
      validate_target(self.meta, [c for c, _ in chosen], disk, [leaf for _, leaf in chosen])
    values = read()
    return jax.tree_util.tree_unflatten(treedef, [values.get(c, leaf) for c, leaf in pairs])

  def _restore_legacy(self, args: ocp.args.PyTreeRestore, via: OrbaxReads) -> PyTree:
    """An item older than `_METADATA`: read whole, as Orbax does, then rewritten."""
    if args.item is not None:
      raise errors.UnsupportedLayoutError(
          f'{self.directory}: this item predates Orbax\'s _METADATA file, so a'
          ' partial restore into a target is not possible. Restore it without'
          ' a target (every array, canonical), or re-save it with a current'
          ' Orbax.'
      )
    whole = self._orbax_read(via, ocp.args.PyTreeRestore(), None)
    return canonical_map.to_canonical_tree(whole, self.cmap)

  def metadata(self, via: OrbaxReads | None = None) -> Any:
    """The item's metadata tree as Orbax gives it, in canonical form.

    Raises:
      CorruptMetadataError: the array stores are unreadable.
    """
    via = via or through()
    with self._damaged(
        "the arrays' metadata", 'a readable store for every leaf in _METADATA; use another'
        ' step (`step`)'
    ), self._serving(via, self.meta.tree_json_of()), _orbax.tidy_failures():
      meta = via.metadata(self.directory)
    return canonical_metadata(meta, self.cmap, str(self.directory)) if self.is_tunix else meta

  def _serving(self, via: OrbaxReads, served: Mapping[str, Any] | None) -> Any:
    """Orbax's read of this item's `_METADATA` answered from `served` (parsed once)."""
    _orbax.serve_tree_reads(via.handler)
    return _orbax.serving({self.directory / _orbax.PYTREE_METADATA: served})

  def _orbax_read(
      self, via: OrbaxReads, args: ocp.args.PyTreeRestore, served: Mapping[str, Any] | None
  ) -> PyTree:
    """Orbax's read of an on-disk target; damaged data is put in our terms.

    Failures that are about the request (e.g. a sharding that does not divide
    an array) reach the caller as Orbax raised them.
    """
    # The cyclic GC paused too: Orbax's read allocates a few objects per array
    # and chunk, and each collection then walks every object alive (the
    # restored arrays, the parsed metadata): 18 % of a 1k-leaf restore's
    # time, 28 % at 10k leaves (benchmarks/restore_cost.py).
    # Reference counting still frees what the read drops.
    with (self._damaged('the arrays'), self._serving(via, served), _orbax.tidy_failures(),
          fileio.no_gc()):
      return via.restore(self.directory, args)

  @contextlib.contextmanager
  def _damaged(
      self, what: str, expected: str = 'readable array data for every leaf asked for; use'
      ' another step (`step`), or re-save this one',
  ) -> Iterator[None]:
    """Storage failures inside (missing or damaged data) raised in our terms.

    Raises:
      CorruptMetadataError: naming this item's directory, `what` was being
        read and `expected`; other failures (e.g. a sharding that does not
        divide an array) propagate as Orbax raised them.
    """
    try:
      yield
    except Exception as e:  # pylint: disable=broad-except
      cause = storage_errors.storage_failure(e)
      if cause is None:
        raise
      raise errors.CorruptMetadataError(
          f'{self.directory}: reading {what} failed: stored data is missing or damaged'
          f' ({storage_errors.failure_text(cause)}). Expected {expected}.'
      ) from e


# How `PlannedItem.restore` reads its requests: (item, canonical path -> request, Orbax's
# reads) -> what reads them, its checks made (raising before anything is read).
PlanRead = Callable[['PlannedItem', Mapping[Path, read_requests.ReadRequest], OrbaxReads],
                    Callable[[], dict[Path, Any]]]


def _plain_read(planned: PlannedItem, wanted: Mapping[Path, read_requests.ReadRequest],
                via: OrbaxReads) -> Callable[[], dict[Path, Any]]:
  return lambda: planned.read(wanted, via)


# --- the one multi-item read --------------------------------------------------------


class Reads:
  """Leaves of several steps' items, read with one restore per item: the one read API.

  Use: `want(...)` every leaf (from any step and item, in any order) and
  `want_part(...)` every part of one, then `read()`, then `got(...)` each
  value (`part(...)` each part).

  Example::

    reads = Reads()
    reads.want(det, 'model_params', ('w',), into(shape, dtype, sharding))
    reads.read()
    w = reads.got(det, 'model_params', ('w',))
  """

  def __init__(self):
    # (id of the step's detection, item) -> (detection, {path: request}, {key: part});
    # the detection's id: it is not hashable, and one detection is one step.
    self._wanted: dict[tuple[int, str], tuple[Any, dict[Path, Any], dict[Any, tuple]]] = {}
    self._got: dict[Any, Any] = {}

  def _of(self, detection: Any, item: str) -> tuple[Any, dict[Path, Any], dict[Any, tuple]]:
    return self._wanted.setdefault((id(detection), item), (detection, {}, {}))

  def want(self, detection: Any, item: str, path: Path, request: Any) -> None:
    """Asks for one leaf (`PlannedItem.read`'s request); a leaf asked twice is read once,
    with the first request."""
    self._of(detection, item)[1].setdefault(path, request)

  def want_part(self, key: Any, detection: Any, item: str, path: Path, index: tuple[Any, ...],
                dtype: Any = None) -> None:
    """Asks for a part of one leaf, to the host (`PlannedItem.read_parts`), got as `part(key)`."""
    self._of(detection, item)[2].setdefault(key, (path, index, dtype))

  def read(self, *, on_disk: bool = False) -> None:
    """Reads everything wanted, one restore per item (`PlannedItem.read`).

    Raises:
      CorruptMetadataError: stored data is missing or damaged.
    """
    for (key, item), (detection, wanted, parts) in self._wanted.items():
      planned = PlannedItem.of(detection, item)
      if wanted:
        got = planned.read(wanted, on_disk=on_disk)
        self._got.update(((key, item, path), value) for path, value in got.items())
      self._got.update(zip(((_PART, k) for k in parts), planned.read_parts(list(parts.values())),
                           strict=True))
    self._wanted.clear()

  def got(self, detection: Any, item: str, path: Path) -> Any:
    return self._got[(id(detection), item, path)]

  def part(self, key: Any) -> Any:
    return self._got[(_PART, key)]


_PART = object()  # Keys parts apart from leaves in `Reads`.


# --- plans in effect for a restore --------------------------------------------------

# Item directory -> its plan, for the restores under way in this context. Orbax
# calls each item's handler with a directory alone; the step's handler has
# already planned every item from one read of the step's metadata (and an
# item's StandardRestore calls back `metadata` and `restore`): the item's
# handler finds that plan here rather than reading the metadata again.
_IN_EFFECT: contextvars.ContextVar[Mapping[str, PlannedItem]] = contextvars.ContextVar(
    'orbax_tunix_plans_in_effect', default=types.MappingProxyType({})
)


@contextlib.contextmanager
def using(plans: Iterable[PlannedItem]) -> Iterator[None]:
  """Puts plans already made in effect for this context (`find` returns them)."""
  token = _IN_EFFECT.set({**_IN_EFFECT.get(), **{str(p.directory): p for p in plans}})
  try:
    yield
  finally:
    _IN_EFFECT.reset(token)


def find(directory: epath.PathLike) -> PlannedItem | None:
  """The plan of an item directory: the one in effect, else made now from its metadata.

  Returns:
    None when the directory holds no PyTree.

  Raises:
    CorruptMetadataError, UnsupportedLayoutError.
  """
  directory = fileio.as_path(directory)
  found = _IN_EFFECT.get().get(str(directory))
  if found is not None:
    return found
  planned = plan_item(directory)
  return None if planned is None else PlannedItem(*planned)

"""Every use of Orbax's (and JAX's) private API, in one place.

Orbax's public surface does not cover everything a plugin handler needs, nor JAX's what a
multi-process job checks before its backends start. Each function here leans on one private
detail of orbax-checkpoint 0.12.x (or JAX 0.10's multi-controller runtime), and
`tests/test_orbax_assumptions.py` pins each one, so that an Orbax upgrade that
moves it fails there, loudly, and nowhere else. What merely sits near Orbax
without being its API lives beside this module: `storage_errors` (telling a
storage failure from the caller's error), `zarr_format` (the arrays' headers
and chunk keys), `loops` (draining an event loop).
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import threading
import types
from collections.abc import Collection, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts
from etils import epath
from orbax.checkpoint._src import asyncio_utils as _asyncio_utils
from orbax.checkpoint._src.metadata import step_metadata_serialization as _step_serialization
from orbax.checkpoint._src.metadata import tree as _tree_metadata
from orbax.checkpoint._src.metadata.tree import InternalTreeMetadata
from orbax.checkpoint._src.serialization import tensorstore_utils as _ts_utils

from orbax_tunix.keypaths import Path
from orbax_tunix.store import loops

# --- Orbax's on-disk schema: the names of its files and the values it records ---

CHECKPOINT_METADATA = '_CHECKPOINT_METADATA'
PYTREE_METADATA = '_METADATA'
AGGREGATE_FILE = 'checkpoint'  # msgpack tree of Orbax releases before _METADATA
ARRAY_METADATAS = 'array_metadatas'
TMP_MARKER = '.orbax-checkpoint-tmp'
COMMIT_SUCCESS = 'commit_success.txt'  # A step on a bucket is final once it holds this.

# `value_type` in `_METADATA` of an empty node: None, and the empty containers
# Orbax records as such (an optax state's `hyperparams_states: {}`, say).
EMPTY_VALUE_TYPES = frozenset({'None', 'Dict', 'List', 'Tuple', 'NamedTuple'})
# `key_type` in `_METADATA`: a sequence index or a dict key.
SEQUENCE_KEY = 1


# What a PyTree handler's `metadata()` returns (not exported by Orbax).
TreeMetadata = _tree_metadata.TreeMetadata


def tree_metadata_like(meta: TreeMetadata, tree: Any) -> TreeMetadata:
  """A `TreeMetadata` holding `tree` (of value metadata), keeping `meta`'s custom metadata."""
  return _tree_metadata.build_default_tree_metadata(tree, custom_metadata=meta.custom_metadata)


def standard_handler_over(pytree_handler: ocp.PyTreeCheckpointHandler) -> ocp.StandardCheckpointHandler:
  """Orbax's `StandardCheckpointHandler`, reading and describing through `pytree_handler`.

  Orbax's handler wraps a `PyTreeCheckpointHandler` as `_impl` and calls only
  its public `restore` and `metadata`; swapping it in gives `StandardRestore`
  exactly Orbax's semantics (type checks, shardings taken from the
  checkpoint's sharding metadata, `fallback_sharding`, `support_layout`,
  `strict`) on top of another PyTree handler.
  """
  standard = ocp.StandardCheckpointHandler()
  standard._impl = pytree_handler  # pylint: disable=protected-access
  return standard


def pytree_handler_of(standard: ocp.StandardCheckpointHandler) -> ocp.PyTreeCheckpointHandler:
  """The `PyTreeCheckpointHandler` a `StandardCheckpointHandler` reads with."""
  return standard._impl  # pylint: disable=protected-access


# What Orbax's PyTree handlers raise when an array restored without a target has
# no usable sharding: its saved one names devices this process does not have.
_NO_SHARDING = 'sharding passed to deserialization should be specified'
# What Orbax's StandardCheckpointHandler says in that case (its wording kept).
TOPOLOGY_MISMATCH = (
    'Topology mismatch detected. The checkpoint was saved with a different topology'
    ' than the current one. Please provide a target tree with the desired topology to'
    ' restore.'
)


def is_topology_mismatch(exc: BaseException) -> bool:
  """Whether a restore without a target failed for want of the saved devices."""
  return isinstance(exc, ValueError) and _NO_SHARDING in str(exc)


# --- handing Orbax the metadata this package parsed ------------------------------

# Metadata file path -> its JSON as this package parsed it, for the restores
# under way in this context (see `serving`).
_SERVED: contextvars.ContextVar[Mapping[str, Any]] = contextvars.ContextVar(
    'orbax_tunix_served_metadata', default=types.MappingProxyType({})
)


def _served(path: epath.PathLike) -> Any:
  return _SERVED.get().get(os.fspath(path))


async def _ready(value: Any) -> Any:
  return value


def serve_tree_reads(handler: ocp.PyTreeCheckpointHandler) -> None:
  """Makes `handler`'s reads of `_METADATA` answer from `serving` first. Idempotent.

  Orbax's PyTree handlers read `_METADATA` only through
  `BasePyTreeCheckpointHandler._read_metadata_file(directory)` (restore and
  metadata alike), a coroutine made where it is called: the lookup runs in
  the caller's context.
  """
  impl = handler._handler_impl  # pylint: disable=protected-access
  if getattr(impl, '_orbax_tunix_serves', False):
    return
  original = impl._read_metadata_file  # pylint: disable=protected-access

  def read_metadata_file(directory: epath.Path) -> Any:
    found = _served(epath.Path(directory) / PYTREE_METADATA)
    if found is None:
      return original(directory)
    options = impl._pytree_metadata_options  # pylint: disable=protected-access
    return _ready(InternalTreeMetadata.from_json(found, pytree_metadata_options=options))

  impl._read_metadata_file = read_metadata_file  # pylint: disable=protected-access
  impl._orbax_tunix_serves = True  # pylint: disable=protected-access


class _ServedStore:
  """A composite's metadata store that answers `serving`'s files first."""

  def __init__(self, store: Any):
    self._store = store

  def read(self, file_path: epath.PathLike) -> Any:
    found = _served(file_path)
    return self._store.read(file_path) if found is None else found

  def __getattr__(self, name: str) -> Any:
    return getattr(self._store, name)


def serve_step_reads(composite: ocp.CompositeCheckpointHandler) -> None:
  """Makes `composite`'s reads of `_CHECKPOINT_METADATA` answer from `serving` first.

  Orbax's composite reads a step's metadata only through its
  `_metadata_store.read(file_path)`. Idempotent.
  """
  store = composite._metadata_store  # pylint: disable=protected-access
  if not isinstance(store, _ServedStore):
    composite._metadata_store = _ServedStore(store)  # pylint: disable=protected-access


@contextlib.contextmanager
def serving(files: Mapping[epath.PathLike, Mapping[str, Any] | None]) -> Iterator[None]:
  """Orbax's reads of these metadata files (by handlers set up with
  `serve_tree_reads` / `serve_step_reads`) answered from their parsed JSON.

  So that a restore opens and parses each metadata file once: this package's
  parse serves Orbax's. A `_METADATA` may be served with only some of its
  entries (a partial restore of those leaves needs no others). Files mapped
  to None are read as usual.
  """
  found = {os.fspath(p): j for p, j in files.items() if j is not None}
  token = _SERVED.set({**_SERVED.get(), **found})
  try:
    yield
  finally:
    _SERVED.reset(token)


# --- where Orbax keeps an item's arrays ------------------------------------------


def array_name(path: Path) -> str:
  """The name Orbax stores a leaf's array under: its keys joined with '.'."""
  return '.'.join(path)


def is_ocdbt(directory: epath.Path) -> bool:
  """Whether an item's arrays sit in one OCDBT store (Orbax's default)."""
  return ocp.path.format_utils.is_ocdbt_checkpoint(directory)


def open_kvstore(directory: epath.Path, *, use_ocdbt: bool) -> ts.KvStore:
  """The key-value store Orbax's own read of the item uses (OCDBT, or per-array)."""
  spec = _ts_utils.build_kvstore_tspec(
      directory.as_posix(), name=None if use_ocdbt else '', use_ocdbt=use_ocdbt
  )
  return ts.KvStore.open(spec, context=_ts_utils.get_ts_context(use_ocdbt=use_ocdbt)).result()


def read_parts(
    directory: epath.Path,
    parts: Sequence[tuple[Path, tuple[Any, ...], np.dtype | None]],
    *,
    use_ocdbt: bool,
    use_zarr3: bool,
) -> list[np.ndarray]:
  """Parts of an item's arrays, read concurrently to the host.

  Orbax's restore reads an array whole (or a device's shards of it); this
  opens each array as Orbax's own read does (its key-value store spec and
  TensorStore context, the zarr driver it wrote) and reads `array[index]`
  only: the chunks under it.

  Args:
    directory: the item directory.
    parts: (path on disk, index into the array, dtype to cast to or None).

  Returns:
    One numpy array per part, in order.
  """
  context = _ts_utils.get_ts_context(use_ocdbt=use_ocdbt)
  opening = {}
  for path, _, _ in parts:
    if path not in opening:
      opening[path] = ts.open({
          'driver': 'zarr3' if use_zarr3 else 'zarr',
          'kvstore': _ts_utils.build_kvstore_tspec(
              directory.as_posix(), name=array_name(path), use_ocdbt=use_ocdbt),
          'recheck_cached_data': False,
          'recheck_cached_metadata': False,
      }, open=True, read=True, context=context)
  stores = {path: future.result() for path, future in opening.items()}
  reads = [(stores[path][index].read(), dtype) for path, index, dtype in parts]
  values = [(read.result(), dtype) for read, dtype in reads]
  return [v if dtype is None or v.dtype == dtype else v.astype(dtype) for v, dtype in values]


# --- the handler an item records ----------------------------------------------

# What Orbax's v1 API records for a PyTree item; v0 has no handler class for it.
V1_PYTREE_TYPESTR = 'orbax.checkpoint.experimental.v1._src.handlers.pytree_handler.PyTreeHandler'


# The typestrs PyTree items are recorded with: the v0 PyTree and Standard
# handlers' (as this Orbax writes them, and as Orbax releases that moved them
# under `orbax.checkpoint.v0` write them), and v1's.
_V0_TYPESTRS = (ocp.PyTreeCheckpointHandler.typestr(), ocp.StandardCheckpointHandler.typestr())
PYTREE_TYPESTRS = frozenset({*_V0_TYPESTRS, V1_PYTREE_TYPESTR}) | {
    t.replace('orbax.checkpoint._src.', 'orbax.checkpoint.v0._src.') for t in _V0_TYPESTRS}


def handler_class(typestr: str) -> type | None:
  """The handler class Orbax registered under a typestr, or None if unknown here."""
  from orbax.checkpoint._src.handlers import handler_type_registry  # pylint: disable=g-import-not-at-top

  try:
    return handler_type_registry.get_handler_type(typestr)
  except (KeyError, ValueError):
    return None


def is_pytree_handler(typestr: str | None) -> bool | None:
  """Whether a recorded handler reads PyTrees: True, False, or None when unknown."""
  if typestr is None:
    return None
  if typestr == V1_PYTREE_TYPESTR:
    return True
  cls = handler_class(typestr)
  if cls is None:
    return None
  return issubclass(cls, (ocp.PyTreeCheckpointHandler, ocp.StandardCheckpointHandler))


# What Orbax's composite logs, from `metadata()`, for each item with no handler
# bound in its registry, even one whose recorded handler it then restores with.
UNRESTORABLE_WARNING = 'Item "%s" was found in the checkpoint, but could not'


@contextlib.contextmanager
def silence_unrestorable_warnings(items: Collection[str]) -> Iterator[None]:
  """Drops Orbax's "could not be restored" warning for `items` (restorable ones).

  Only records logged by this thread are dropped; the warning for any other
  item, and every other record, passes.
  """
  thread, names = threading.get_ident(), frozenset(items)

  def keep(record: logging.LogRecord) -> bool:
    return not (
        record.thread == thread and isinstance(record.msg, str)
        and record.msg.startswith(UNRESTORABLE_WARNING)
        and bool(record.args) and record.args[0] in names
    )

  absl = logging.getLogger('absl')  # Orbax logs through absl.logging.
  absl.addFilter(keep)
  try:
    yield
  finally:
    absl.removeFilter(keep)


# --- writing one item in batches ----------------------------------------------


def merge_tree_metadata(
    files: Sequence[dict[str, Any]],
    key_types: Mapping[Path, Sequence[int]] | None = None,
    empty_nodes: Sequence[tuple[Path, Sequence[int], str]] = (),
) -> dict[str, Any]:
  """One item's `_METADATA` from those its batch saves wrote (each names its own leaves).

  Each batch is saved as nested dicts; `key_types` gives leaves the key types
  of the tree they came from (sequence positions), and `empty_nodes` puts back
  its empty nodes with their value types (`None` in a list, an empty dict:
  'None', 'Dict', ...), so that Orbax restores the original containers. This
  is the union Orbax's own partial-save finalization makes.
  """
  entries: dict[str, Any] = {}
  for meta in files:
    entries.update(meta['tree_metadata'])
  if key_types:
    for entry in entries.values():
      path = tuple(k['key'] for k in entry['key_metadata'])
      for key, kind in zip(entry['key_metadata'], key_types.get(path, ()), strict=False):
        key['key_type'] = kind
  for path, kinds, value_type in empty_nodes:
    entries[str(tuple(path))] = {  # `_METADATA` keys a leaf by the text of its key tuple.
        'key_metadata': [{'key': k, 'key_type': t} for k, t in zip(path, kinds, strict=True)],
        'value_metadata': {'value_type': value_type, 'skip_deserialize': True},
    }
  return {**files[0], 'tree_metadata': entries}


def serialize_step_metadata(meta: ocp.metadata.StepMetadata) -> dict[str, Any]:
  """A step's metadata as Orbax writes it in `_CHECKPOINT_METADATA`."""
  return _step_serialization.serialize(meta)


def commits_with_file(path: epath.Path) -> bool:
  """Whether Orbax finalizes a step at `path` by a commit file in place (buckets).

  Else by renaming a temporary sibling (local disks). Orbax's own choice for
  the kind of path.
  """
  cls = ocp.path.atomicity_defaults.get_default_temporary_path_class(path)
  return cls is ocp.path.atomicity.CommitFileTemporaryPath


# --- what a failed Orbax call leaves running ---------------------------------------

# Orbax runs each restore or save on a fresh event loop
# (`asyncio_utils._run_sync_via_new_loop`: `run_until_complete`, then `close`,
# without cancelling what is left). When one array read fails, its
# `asyncio.gather` fails and the reads of the other arrays are abandoned on the
# closed loop, still pending, or finished with their exception unretrieved.
# Python reports each when it collects it, long after the failure ("Task
# exception was never retrieved", "Exception ignored in: <coroutine object
# _read_array_index_and_device_put>", with tracebacks), at a time that depends
# on the garbage collector. Within `tidy_failures`, the loop of a call that
# fails is drained first: what is left is cancelled and awaited, and every
# exception retrieved, before the loop closes. That holds in the threads the call starts too
# (an Orbax save writes its arrays in a commit thread, on a new loop of its own; a context
# variable is not seen there): `_TIDY` counts the contexts open in the process, in any thread.
_TIDY = [0]
_TIDY_LOCK = threading.Lock()
_ORBAX_RUN_ON_NEW_LOOP = getattr(_asyncio_utils, '_run_sync_via_new_loop', None)


def _run_on_new_loop(coro: Any) -> Any:
  """Orbax's `_run_sync_via_new_loop` outside `tidy_failures` (exactly Orbax's own
  function); inside it, `loops.run_tidily`: the loop drained when the call fails,
  its tasks let finish when it is interrupted."""
  if not _TIDY[0]:
    return _ORBAX_RUN_ON_NEW_LOOP(coro)
  return loops.run_tidily(coro)


@contextlib.contextmanager
def tidy_failures() -> Iterator[None]:
  """Orbax calls made in this context leave nothing running when they fail.

  A failed (or interrupted) call's loop is drained (see `_TIDY`) and the
  threads it started (an Orbax save's commit futures) are waited for, up to
  `loops.PENDING_WRITES_TIMEOUT`: left running, they write on into the
  directory after the caller removed it (a temporary step reappears, and at
  exit Python reports "cannot schedule new futures after shutdown"). Installs
  the drain on first use (where Orbax has the function it wraps); Orbax calls
  made while no such context is open are untouched.
  """
  if _ORBAX_RUN_ON_NEW_LOOP is not None and _asyncio_utils._run_sync_via_new_loop is not _run_on_new_loop:  # pylint: disable=protected-access
    _asyncio_utils._run_sync_via_new_loop = _run_on_new_loop  # pylint: disable=protected-access
  before = set(threading.enumerate())
  with _TIDY_LOCK:
    _TIDY[0] += 1
  try:
    yield
  except BaseException:
    loops.wait_for_threads(before)
    raise
  finally:
    with _TIDY_LOCK:
      _TIDY[0] -= 1


# --- JAX's private API: its multi-controller runtime's own records --------------------------


def jax_cluster_types() -> tuple[type, ...]:
  """JAX's registry of cluster environments (`ClusterEnv._cluster_types`, private): the list
  its own `jax.distributed.initialize()` walks, each with `is_env_present()` and
  `opt_in_only_method`."""
  from jax._src.clusters import ClusterEnv  # pylint: disable=g-import-not-at-top

  return tuple(ClusterEnv._cluster_types)  # pylint: disable=protected-access


def jax_cache_writes_whole() -> None:
  """JAX's persistent compilation cache, made safe for processes that share it: each entry
  written to a temporary file and renamed into place (JAX 0.10's `LRUCache.put` writes the
  file in place, unlocked unless `jax_compilation_cache_max_size` is set and `filelock`
  installed: another process could read it half written). Local directories only (a
  bucket's cache is JAX's own); once per process, before the cache is first used (JAX's
  private `get_file_cache` makes it then)."""
  import tempfile  # pylint: disable=g-import-not-at-top

  from jax._src import compilation_cache, lru_cache  # pylint: disable=g-import-not-at-top

  made = compilation_cache.get_file_cache
  if getattr(made, 'orbax_tunix', False):
    return

  class WholeWrites(compilation_cache.CacheInterface):
    """An `LRUCache` without eviction whose entries appear whole, by a rename."""

    def __init__(self, inner: Any):
      self._inner, self._path = inner, inner._path  # pylint: disable=protected-access

    def get(self, key: str) -> bytes | None:
      return self._inner.get(key)

    def put(self, key: str, value: bytes) -> None:
      if not key:
        raise ValueError('key cannot be empty')
      final = os.path.join(os.fspath(self._inner.path), key + lru_cache._CACHE_SUFFIX)  # pylint: disable=protected-access
      if os.path.exists(final):
        return
      fd, tmp = tempfile.mkstemp(prefix=f'.{key}.', suffix='.tmp', dir=os.path.dirname(final))
      try:
        with os.fdopen(fd, 'wb') as f:
          f.write(value)
        os.replace(tmp, final)  # The same key holds the same program: the last one stays.
      except BaseException:
        with contextlib.suppress(OSError):
          os.unlink(tmp)
        raise

  def get_file_cache(path: str) -> Any:
    found = made(path)
    if found is None:
      return None
    cache, where = found
    if (type(cache) is lru_cache.LRUCache and not cache.eviction_enabled
        and '://' not in str(path)):
      cache = WholeWrites(cache)
    return cache, where

  get_file_cache.orbax_tunix = True
  compilation_cache.get_file_cache = get_file_cache


def jax_tpu_slice_hosts(env: type) -> list[str] | None:
  """The hosts of the TPU slice JAX's cluster `env` describes, as JAX itself lists them (its
  TPU clusters' private `_get_worker_list_in_slice`: `TPU_PROCESS_ADDRESSES` or
  `TPU_WORKER_HOSTNAMES` on GKE, the metadata server on GCE); None for another kind of
  cluster. JAX's process count is these hosts times the slices (`MEGASCALE_NUM_SLICES`)."""
  from jax._src.clusters import cloud_tpu_cluster  # pylint: disable=g-import-not-at-top

  if not (isinstance(env, type) and issubclass(env, cloud_tpu_cluster.BaseTpuCluster)):
    return None
  return list(env._get_worker_list_in_slice())  # pylint: disable=protected-access


def jax_process_claim() -> tuple[int, int]:
  """(process id, process count) as this process gave them to `jax.distributed.initialize`
  (JAX's private `global_state`): readable before the backends start, and when they never
  do (a peer gone)."""
  from jax._src import distributed as jax_distributed  # pylint: disable=g-import-not-at-top

  state = jax_distributed.global_state
  return state.process_id, state.num_processes

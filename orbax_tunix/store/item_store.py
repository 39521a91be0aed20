"""An item of a step as it sits on disk: its leaves (from `_METADATA`), their arrays' headers.

Read once from Orbax's own small files: the item's `_METADATA` (its leaves),
and, when shapes or dtypes are asked for, the key-value store's listing and
the arrays' zarr headers. An `Item` keeps what it read, so detection, the
handlers, the MaxText view and the tools share one reading. No array data is
read here.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import msgpack
import numpy as np
from etils import epath

from orbax_tunix import errors
from orbax_tunix.keypaths import Path, fmt
from orbax_tunix.store import _orbax, fileio, names, storage_errors, zarr_format
from orbax_tunix.store._orbax import (
  AGGREGATE_FILE,
  ARRAY_METADATAS,
  EMPTY_VALUE_TYPES,
  PYTREE_METADATA,
  SEQUENCE_KEY,
)
from orbax_tunix.store.fileio import as_path, found_at, no_gc, read_bytes, read_json

# Below this many leaves, shapes are checked against each array's zarr header;
# above it, against one listing of the item's store (`Item.mismatched_shapes`).
HEADER_READS_UP_TO = 256
# The most bytes one stored byte decodes to. Orbax compresses with zstd, whose blocks hold
# at most 128 KiB and take at least 4 bytes (an RLE block): 2**15; twice that is kept. (A
# 64 MiB array of zeros measured 13000x, metadata files included.)
MAX_EXPANSION = 1 << 16
# Claims this small are not checked against the stored bytes: holding them harms nothing.
CHECKED_ABOVE = 1 << 30


# --- an item's leaves ---------------------------------------------------------


class Leaf(NamedTuple):
  """One leaf of an item, as `_METADATA` records it.

  Attributes:
    path: its key path on disk.
    key_types: per key, `SEQUENCE_KEY` for a sequence index, else a dict key.
    value_type: Orbax's type name ('jax.Array', 'np.ndarray', 'scalar',
      'string', 'None' for an empty node, ...).
    key: its entry's key in `_METADATA` (the text of its key tuple).
  """

  path: Path
  key_types: tuple[int, ...]
  value_type: str
  key: str = ''

  @property
  def is_array(self) -> bool:
    return self.value_type in ('jax.Array', 'np.ndarray')

  @property
  def has_zarr(self) -> bool:
    """Stored as a zarr array (arrays and scalars), with a header of its own."""
    return self.is_array or self.value_type == 'scalar'

  @property
  def is_empty(self) -> bool:
    """An empty node (None, an empty dict, list, tuple or state): structure, not data."""
    return self.value_type in EMPTY_VALUE_TYPES


@dataclasses.dataclass(frozen=True)
class ArrayInfo:
  """An array's global shape and dtype, from its zarr header."""

  shape: tuple[int, ...]
  dtype: np.dtype
  chunks: tuple[int, ...] | None = None  # What a read decodes whole (None: unstated).


@dataclasses.dataclass(frozen=True)
class Item:
  """One item directory of a step, read once from its metadata.

  Attributes:
    name: the item's name (its directory name).
    directory: the item directory.
    leaves: every leaf, in `_METADATA`'s order.
    use_ocdbt: the arrays sit in one OCDBT key-value store.
    use_zarr3: the arrays are zarr v3 (else v2).
    stores_fill_chunks: every chunk was written, also those equal to the fill
      value (Orbax's `store_array_data_equal_to_fill_value`).
    legacy: the item predates `_METADATA` (only the msgpack tree exists).
    tree_json: `_METADATA` as parsed (handed to Orbax's restore, so that the
      file is parsed once; see `tree_json_of`).
    saved_by: the handler typestr its step records for it (None if none).
  """

  name: str
  directory: epath.Path
  leaves: tuple[Leaf, ...]
  use_ocdbt: bool = True
  use_zarr3: bool = False
  stores_fill_chunks: bool = False
  legacy: bool = False
  tree_json: Mapping[str, Any] | None = dataclasses.field(default=None, repr=False)
  saved_by: str | None = None

  def tree_json_of(self, paths: Iterable[Path] | None = None) -> Mapping[str, Any] | None:
    """`_METADATA` as parsed, with every entry or only those of `paths`.

    None for an item without `_METADATA`. A tree of rich types (its own
    structure record) is always whole: it cannot be cut to some leaves.
    """
    if self.tree_json is None or paths is None or 'value_metadata_tree' in self.tree_json:
      return self.tree_json
    entries = self.tree_json['tree_metadata']
    by_path = self.by_path
    return {**self.tree_json, 'tree_metadata': {
        by_path[p].key: entries[by_path[p].key] for p in paths}}

  @functools.cached_property
  def by_path(self) -> dict[Path, Leaf]:
    return {leaf.path: leaf for leaf in self.leaves}

  @functools.cached_property
  def paths(self) -> frozenset[Path]:
    return frozenset(self.by_path)

  @functools.cached_property
  def sequence_nodes(self) -> frozenset[Path]:
    """The nodes that are sequences (lists or tuples), not dicts."""
    return frozenset(
        leaf.path[:i] for leaf in self.leaves if SEQUENCE_KEY in leaf.key_types
        for i, kind in enumerate(leaf.key_types) if kind == SEQUENCE_KEY
    )

  @property
  def has_sequences(self) -> bool:
    return bool(self.sequence_nodes)

  @functools.cached_property
  def _store(self) -> Any:
    return _orbax.open_kvstore(self.directory, use_ocdbt=self.use_ocdbt)

  @functools.cached_property
  def _keys(self) -> list[str]:
    """Every key of the item's store, sorted (one listing; chunk keys included)."""
    try:
      return sorted(k.decode() for k in self._store.list().result())
    except Exception as e:  # pylint: disable=broad-except
      raise self._storage_error(e) from e

  def _storage_error(self, e: BaseException) -> errors.CorruptMetadataError:
    return errors.CorruptMetadataError(
        f'{self.directory}: the array store cannot be read: stored data is missing'
        f' or damaged ({storage_errors.failure_text(storage_errors.storage_failure(e) or e)}).'
        ' Use another step (`step`).'
    )

  def _span(self, name: str) -> tuple[int, int]:
    """Where the keys of array `name` sit in the sorted listing: [lo, hi).

    Its keys are `name/...`; '/' sorts just before '0', and other arrays'
    names (`name.x`) sort before `name/`.
    """
    keys = self._keys
    lo = bisect.bisect_left(keys, name + '/')
    return lo, bisect.bisect_left(keys, name + '0', lo)

  def _holds(self, key: str, span: tuple[int, int]) -> bool:
    keys = self._keys
    at = bisect.bisect_left(keys, key, *span)
    return at < span[1] and keys[at] == key

  @property
  def _header_name(self) -> str:
    return zarr_format.header_name(self.use_zarr3)

  def _no_data_error(self, absent: Sequence[Path]) -> errors.CorruptMetadataError:
    return errors.CorruptMetadataError(
        f'{self.directory}: {PYTREE_METADATA} lists {len(absent)} leaves that have no'
        f' array data in the store:\n{errors.list_paths([fmt(p) for p in absent])}\nThe item'
        ' is damaged or incomplete (or its metadata was edited); use another step (`step`).'
    )

  def check_arrays_exist(self, paths: Iterable[Path] | None = None) -> None:
    """Checks that every array leaf (or those in `paths`) has data in the store.

    One listing of the store, whatever the number of leaves.

    Raises:
      CorruptMetadataError: naming the leaves `_METADATA` lists that have no
        array data.
    """
    header = self._header_name
    absent = []
    for path in self.paths if paths is None else paths:
      name = _orbax.array_name(path)
      if self.by_path[path].has_zarr and not self._holds(f'{name}/{header}', self._span(name)):
        absent.append(path)  # Its header is not in the store's listing.
    if absent:
      raise self._no_data_error(sorted(absent))

  def arrays(self, paths: Iterable[Path] | None = None) -> dict[Path, ArrayInfo]:
    """Global shape and dtype of zarr leaves (arrays, scalars; all or those in `paths`).

    Reads each array's small zarr header, all at once; no array data.

    Raises:
      CorruptMetadataError: a header is missing or unreadable.
    """
    wanted = [
        leaf.path for leaf in (self.leaves if paths is None else (self.by_path[p] for p in paths))
        if leaf.has_zarr
    ]
    missing = [p for p in wanted if p not in self._headers]
    if missing:
      self._headers.update(self._read_headers(missing))
    return {p: self._headers[p] for p in wanted}

  @functools.cached_property
  def _headers(self) -> dict[Path, ArrayInfo]:
    return {}

  def _read_headers(self, paths: Sequence[Path]) -> dict[Path, ArrayInfo]:
    name = self._header_name
    try:
      reads = [(p, self._store.read(f'{_orbax.array_name(p)}/{name}')) for p in paths]
      found = {p: r.result().value for p, r in reads}
    except Exception as e:  # pylint: disable=broad-except
      raise self._storage_error(e) from e
    absent = [fmt(p) for p, value in found.items() if not value]
    if absent:
      self.check_arrays_exist(paths)  # Names every leaf without data.
      raise errors.CorruptMetadataError(
          f'{self.directory}: the zarr headers of {len(absent)} arrays are empty:\n'
          f'{errors.list_paths(absent)}\nThe item is damaged; use another step (`step`).'
      )
    infos, damaged = {}, []
    for p, value in found.items():
      try:
        infos[p] = ArrayInfo(*zarr_format.parse_header(value, self.use_zarr3))
      except ValueError as e:
        damaged.append(f'{fmt(p)}: {e}')
    if damaged:
      raise errors.CorruptMetadataError(
          f'{self.directory}: the zarr headers of {len(damaged)} arrays do not describe an'
          f' array:\n{errors.list_paths(damaged)}\nThe item is damaged (or its metadata was'
          ' edited); use another step (`step`).'
      )
    return infos

  def check_claims(self, infos: Mapping[Path, ArrayInfo]) -> None:
    """Refuses headers claiming more bytes than the item's files can hold.

    Where Orbax stored every chunk (`stores_fill_chunks`, every Orbax release since
    2024), the item's arrays decode from its files: at most `MAX_EXPANSION` bytes per
    stored byte. Older items may omit chunks equal to the fill value, so no bound
    holds for them (the tools' memory checks still do: `memory.check_machine`).
    Nothing is read but the item's listing (one request on a bucket).

    Args:
      infos: the arrays' headers (`arrays`).

    Raises:
      CorruptMetadataError: naming the largest claims, their total and the bytes stored.
    """
    claimed = {p: math.prod(i.shape) * i.dtype.itemsize for p, i in infos.items()}
    total = sum(claimed.values())
    if total <= CHECKED_ABOVE or not self.stores_fill_chunks:
      return
    stored = fileio.folder_bytes(self.directory)
    if stored is None or total <= stored * MAX_EXPANSION:
      return
    largest = sorted(claimed, key=claimed.get, reverse=True)[:5]
    shown = [f'{fmt(p)}: shape {infos[p].shape} {infos[p].dtype}, {claimed[p]} bytes'
             for p in largest]
    raise errors.CorruptMetadataError(
        f'{self.directory}: the arrays\' headers claim {total} bytes, and the item\'s files'
        f' hold {stored} bytes, which decode to at most {stored * MAX_EXPANSION} (Orbax stores'
        f' every chunk, zstd-compressed):\n{errors.list_paths(shown)}\nThe headers are damaged'
        ' or were edited; nothing was read or written. Use another step (`step`), or a'
        ' trusted copy of the checkpoint.'
    )

  def shapes(self, paths: Iterable[Path]) -> dict[Path, tuple[int, ...]]:
    """Global shapes of the zarr leaves in `paths` (from their headers)."""
    return {p: info.shape for p, info in self.arrays(paths).items()}

  def mismatched_shapes(
      self, expected: Mapping[Path, tuple[int, ...]]
  ) -> dict[Path, tuple[int, ...]]:
    """The leaves whose stored global shape is not the one expected, and theirs.

    No array data is read. A few leaves are checked against their zarr
    headers. Many are checked against one listing of the store: Orbax writes
    every chunk of an array (`store_array_data_equal_to_fill_value`) on the
    grid its chunk shape (`array_metadatas/`) lays over the global shape, so
    an array has the expected shape exactly when it has as many chunks as that
    shape's grid and the grid's last one. Leaves that check cannot settle, and
    every mismatch (for its message), are read from their headers.

    Raises:
      CorruptMetadataError: an array has no data, or its header is damaged.
    """
    wanted = {p: tuple(s) for p, s in expected.items() if self.by_path[p].has_zarr}
    listed = len(wanted) > HEADER_READS_UP_TO and self.stores_fill_chunks and self._chunk_shapes
    actual = self.shapes(self._off_grid(wanted) if listed else wanted)
    return {p: a for p, a in actual.items() if a != wanted[p]}

  def _off_grid(self, wanted: Mapping[Path, tuple[int, ...]]) -> list[Path]:
    """The arrays of `wanted` the listing does not show with exactly their shape's chunk grid.

    One pass over the sorted listing per array (a few bisections).

    Raises:
      CorruptMetadataError: arrays without a header in the store.
    """
    header, chunks, zarr3 = self._header_name, self._chunk_shapes, self.use_zarr3
    absent, unsure = [], []
    for path, shape in wanted.items():
      name = _orbax.array_name(path)
      span = self._span(name)
      if not self._holds(f'{name}/{header}', span):
        absent.append(path)
        continue
      chunk = chunks.get(name)
      if chunk is None or len(chunk) != len(shape) or not all(chunk):
        unsure.append(path)
        continue
      grid = [-(-s // c) for s, c in zip(shape, chunk, strict=True)]
      last = f'{name}/{zarr_format.chunk_key([g - 1 for g in grid], zarr3)}'
      # Exactly the grid's chunks, and the header: the shape is the expected one.
      if span[1] - span[0] - 1 != math.prod(grid) or not self._holds(last, span):
        unsure.append(path)
    if absent:
      raise self._no_data_error(sorted(absent))
    return unsure

  def chunk_shape(self, path: Path) -> tuple[int, ...] | None:
    """The chunk shape an array (by its path on disk) is stored in: from Orbax's array
    metadata, else its zarr header (numpy arrays have no array metadata); None when
    neither says (or the header is unreadable: the read then reports it)."""
    recorded = self._chunk_shapes.get(_orbax.array_name(path))
    if recorded is not None or path not in self.by_path or not self.by_path[path].has_zarr:
      return recorded
    try:
      return self.arrays([path])[path].chunks
    except errors.CorruptMetadataError:
      return None

  @functools.cached_property
  def _chunk_shapes(self) -> dict[str, tuple[int, ...]]:
    """Array name -> chunk shape, from `array_metadatas/process_*` ({} if absent)."""
    folder = self.directory / ARRAY_METADATAS
    out: dict[str, tuple[int, ...]] = {}
    if not folder.is_dir():
      return out
    for path in folder.iterdir():
      try:
        for entry in read_json(path, "Orbax's array metadata")[ARRAY_METADATAS]:
          meta = entry['array_metadata']
          chunk = tuple(meta['chunk_shape'])
          if not all(isinstance(c, int) and not isinstance(c, bool) and c >= 1 for c in chunk):
            return {}  # Not a chunk shape (sizes here are a stranger's, checked).
          out[meta['param_name']] = chunk
      except (errors.CorruptMetadataError, KeyError, TypeError):
        return {}  # Shapes then come from the headers.
    return out


def _tree_from_aggregate(path: epath.Path) -> tuple[Leaf, ...]:
  """Leaves of an old checkpoint's msgpack `checkpoint` file (no _METADATA)."""
  try:
    tree = msgpack.unpackb(read_bytes(path, "Orbax's msgpack tree"), raw=False,
                           strict_map_key=False)
  except (ValueError, msgpack.UnpackException) as e:
    raise errors.CorruptMetadataError(
        f'{path}: expected Orbax\'s msgpack tree file, found bytes that do not'
        f' decode ({e}). The file is damaged; use another step (`step`).'
    ) from e

  def walk(node: Any, prefix: Path) -> Iterator[Leaf]:
    if isinstance(node, dict) and node:
      for key, child in node.items():
        yield from walk(child, prefix + (str(key),))
    else:
      yield Leaf(prefix, (2,) * len(prefix), 'unknown')

  return tuple(walk(tree, ()))


def _leaves_of(entries: Mapping[str, Any]) -> tuple[Leaf, ...]:
  """The leaves of `_METADATA`'s `tree_metadata` (a hot loop: 50k-1M entries)."""
  shared: dict[tuple[int, ...], tuple[int, ...]] = {}  # One tuple per kind of path.
  leaves = []
  for key, entry in entries.items():
    keys = entry['key_metadata']
    path = tuple([str(k['key']) for k in keys])
    kinds = tuple([k.get('key_type', 2) for k in keys])
    value = entry.get('value_metadata') or {}
    leaves.append(
        Leaf(path, shared.setdefault(kinds, kinds), str(value.get('value_type', 'unknown')), key)
    )
  return tuple(leaves)


def _check_array_names(leaves: Iterable[Leaf], where: epath.Path) -> None:
  """Without OCDBT each array is a directory of the item named after its keys (joined by
  '.'): every such name must stay inside the item (`names.check_relative`).

  Raises:
    UnsafeNameError: naming the leaf's key path.
  """
  for leaf in leaves:
    if not leaf.path:
      continue  # A tree that is one leaf: the item's own directory.
    names.check_relative(_orbax.array_name(leaf.path), where,
                         f'the leaf {fmt(leaf.path)} is stored without OCDBT in the directory')


def has_tree(directory: epath.Path) -> bool:
  """Whether a directory holds PyTree metadata (`_METADATA` or the older msgpack)."""
  return (directory / PYTREE_METADATA).exists() or (directory / AGGREGATE_FILE).exists()


def open_item(directory: epath.PathLike, name: str | None = None) -> Item:
  """Reads one item's `_METADATA` (or, for old checkpoints, its msgpack tree).

  Args:
    directory: the item directory.
    name: its name in the step (the directory's name by default).

  Raises:
    CorruptMetadataError: the metadata is missing, damaged or not a PyTree's.
  """
  directory = as_path(directory)
  name = directory.name if name is None else name
  meta_file = directory / PYTREE_METADATA
  if not meta_file.exists() and (directory / AGGREGATE_FILE).exists():
    leaves = _tree_from_aggregate(directory / AGGREGATE_FILE)
    _check_array_names(leaves, directory / AGGREGATE_FILE)  # Releases before OCDBT.
    return Item(name, directory, leaves, legacy=True)
  if not directory.is_dir():
    raise errors.CorruptMetadataError(
        f'{directory}: expected an item directory holding {PYTREE_METADATA}, found'
        f' {found_at(directory)}. The step is damaged or incomplete; use another step (`step`).'
    )
  with no_gc():  # Parsing builds a million small objects for a large item.
    meta = read_json(meta_file, "Orbax's PyTree metadata")
    try:
      leaves = _leaves_of(meta['tree_metadata'])
    except (KeyError, TypeError, AttributeError, ValueError) as e:
      raise errors.CorruptMetadataError(
          f"{meta_file}: expected Orbax PyTree metadata ('tree_metadata' with"
          f" 'key_metadata' per leaf), found something else ({type(e).__name__}: {e})."
          ' The file is damaged or was not written by a PyTree handler; use'
          ' another step (`step`).'
      ) from e
  use_ocdbt = bool(meta.get('use_ocdbt', True)) and _orbax.is_ocdbt(directory)
  if not use_ocdbt:
    _check_array_names([leaf for leaf in leaves if leaf.has_zarr], meta_file)
  return Item(
      name=name,
      directory=directory,
      leaves=leaves,
      use_ocdbt=use_ocdbt,
      use_zarr3=bool(meta.get('use_zarr3', False)),
      stores_fill_chunks=bool(meta.get('store_array_data_equal_to_fill_value', False)),
      tree_json=meta,
  )

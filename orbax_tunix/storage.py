"""How a checkpoint sits on disk: roots of steps, steps of items, items of leaves.

Everything here is read from Orbax's own small files, once: a step's
`_CHECKPOINT_METADATA` (items and their handlers), each item's `_METADATA`
(its leaves), and, when shapes or dtypes are asked for, the item's key-value
store listing and the arrays' zarr headers. A `Step` and its `Item`s keep what
they read, so detection, the handlers, the MaxText view and the tools share
one reading. No array data is read here.

Every file is read with a cap on its size, and every failure names the file,
what was expected and what was found.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import functools
import gc
import json
import math
import operator
import os
import socket
import stat
import urllib.parse
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import msgpack
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from orbax_tunix import _orbax, errors
from orbax_tunix.conventions import RL_ROLES
from orbax_tunix.keypaths import Path, fmt

CHECKPOINT_METADATA = '_CHECKPOINT_METADATA'
PYTREE_METADATA = '_METADATA'
AGGREGATE_FILE = 'checkpoint'  # msgpack tree of Orbax releases before _METADATA
ARRAY_METADATAS = 'array_metadatas'
TMP_MARKER = '.orbax-checkpoint-tmp'
# No metadata file of a real checkpoint comes near this (a 1M-leaf _METADATA
# is ~250 MB); a larger one is damaged, or not a metadata file.
MAX_METADATA_BYTES = 1 << 30

# `value_type` in `_METADATA` of an empty node: None, and the empty containers
# Orbax records as such (an optax state's `hyperparams_states: {}`, say).
EMPTY_VALUE_TYPES = frozenset({'None', 'Dict', 'List', 'Tuple', 'NamedTuple'})
# `key_type` in `_METADATA`: a sequence index or a dict key.
SEQUENCE_KEY = 1
# Below this many leaves, shapes are checked against each array's zarr header;
# above it, against one listing of the item's store (`Item.mismatched_shapes`).
_HEADER_READS_UP_TO = 256


# --- reading files ----------------------------------------------------------


def as_path(path: epath.PathLike) -> epath.Path:
  """An `epath.Path`, made absolute when local (TensorStore's OCDBT needs it)."""
  path = epath.Path(path)
  return path if '://' in os.fspath(path) or path.is_absolute() else path.resolve()


def is_local(path: epath.Path) -> bool:
  """Whether a path is on a local disk (not a bucket)."""
  return '://' not in os.fspath(path)


# What to do about a damaged metadata file of a checkpoint (the default remedy).
_USE_ANOTHER_STEP = 'The checkpoint is damaged; use another step (`step`).'


def read_bytes(path: epath.Path, what: str, remedy: str = _USE_ANOTHER_STEP) -> bytes:
  """A metadata file's bytes, at most `MAX_METADATA_BYTES` of them.

  Args:
    path: the file.
    what: what it should be, for messages (e.g. "Orbax's PyTree metadata").
    remedy: what to do when it is damaged, for messages.

  Raises:
    CorruptMetadataError: missing, not a regular file, larger than the cap,
      or unreadable.
  """
  if is_local(path):
    try:
      info = os.stat(path)
    except OSError as e:
      raise _unreadable(path, what, e) from e
    if not stat.S_ISREG(info.st_mode):
      raise errors.CorruptMetadataError(
          f'{path}: expected {what} in a regular file, found {_kind(info.st_mode)}. {remedy}'
      )
    if info.st_size > MAX_METADATA_BYTES:
      raise _too_large(path, what, info.st_size, remedy)
  try:
    with path.open('rb') as f:
      data = f.read(MAX_METADATA_BYTES + 1)
  except OSError as e:
    raise _unreadable(path, what, e) from e
  if len(data) > MAX_METADATA_BYTES:
    raise _too_large(path, what, None, remedy)
  return data


def _kind(mode: int) -> str:
  if stat.S_ISDIR(mode):
    return 'a directory'
  if stat.S_ISREG(mode):
    return 'a file'
  return 'a device, pipe or socket'


def what_is_at(path: epath.Path) -> str:
  """What is at a path, for messages: 'a file', 'a directory', 'a device, pipe
  or socket', 'a broken link' or 'nothing' (links followed)."""
  if not is_local(path):
    return 'a directory' if path.is_dir() else 'a file' if path.exists() else 'nothing'
  try:
    return _kind(os.stat(path).st_mode)
  except OSError:
    return 'a broken link' if os.path.islink(path) else 'nothing'



def _unreadable(path: epath.Path, what: str, e: OSError) -> errors.CorruptMetadataError:
  if isinstance(e, FileNotFoundError):
    return errors.CorruptMetadataError(
        f'{path}: expected {what}, found nothing. The checkpoint is incomplete;'
        ' use another step (`step`) or re-save it.'
    )
  return errors.CorruptMetadataError(
      f'{path}: cannot read {what} ({e}). Check the path and its permissions.'
  )


def found_at(path: epath.Path) -> str:
  """What is at a path that should be a directory, for messages."""
  found = what_is_at(path)
  return 'nothing (or a broken link)' if found == 'nothing' else found


def _too_large(path: epath.Path, what: str, size: int | None,
               remedy: str = _USE_ANOTHER_STEP) -> errors.CorruptMetadataError:
  found = f'{size} bytes' if size is not None else 'more than that'
  return errors.CorruptMetadataError(
      f'{path}: expected {what}, found a file larger than the {MAX_METADATA_BYTES}'
      f' bytes a metadata file may hold ({found}). {remedy}'
  )


@contextlib.contextmanager
def no_gc() -> Iterator[None]:
  """Python's cyclic GC paused: building a million small objects (a large
  `_METADATA`) otherwise triggers collection after collection, 2-4x the time."""
  enabled = gc.isenabled()
  gc.disable()
  try:
    yield
  finally:
    if enabled:
      gc.enable()


def read_json(path: epath.Path, what: str = 'an Orbax metadata file',
              remedy: str = _USE_ANOTHER_STEP) -> Any:
  """A JSON metadata file, parsed, within the size cap.

  Args:
    path, what, remedy: as `read_bytes`.

  Raises:
    CorruptMetadataError: see `read_bytes`; or not JSON, or nested deeper
      than Python's parser allows.
  """
  data = read_bytes(path, what, remedy)
  try:
    return json.loads(data)
  except RecursionError as e:
    raise errors.CorruptMetadataError(
        f'{path}: expected {what}, found JSON nested deeper than the parser allows'
        f' (metadata is a few levels deep). {remedy}'
    ) from e
  except ValueError as e:
    raise errors.CorruptMetadataError(
        f'{path}: expected {what} as JSON, found {len(data)} bytes that do not'
        f' parse ({e}). {remedy}'
    ) from e


# --- steps under a root -----------------------------------------------------


@dataclasses.dataclass(frozen=True)
class StepEntry:
  """One step directory under a root.

  Attributes:
    step: its number.
    path: the directory.
    committed: whether Orbax counts it as finished (on a local disk: its name
      carries no tmp marker; on a bucket: it holds `commit_success.txt`).
    empty: committed by name, but holding no step: neither
      `_CHECKPOINT_METADATA` nor an item (see `holds_step`). Skipped, as an
      unfinished step is.
    unreadable: why the directory cannot be read (the system's error, e.g.
      'Permission denied'), '' when it can. Skipped too, and said so.
  """

  step: int
  path: epath.Path
  committed: bool
  empty: bool = False
  unreadable: str = ''

  @property
  def usable(self) -> bool:
    """A step the tools may read: committed, readable and not empty."""
    return self.committed and not self.empty and not self.unreadable

  @property
  def state(self) -> str:
    """'' for a usable step, else why it is skipped ('unfinished', 'unreadable', 'empty')."""
    if not self.committed:
      return 'unfinished'
    return 'unreadable' if self.unreadable else 'empty' if self.empty else ''


def step_number(name: str) -> int | None:
  """The step a directory name stands for, as Orbax reads it ('7', 'ckpt_7', tmp)."""
  try:
    return ocp.path.step.step_from_checkpoint_name(name)
  except ValueError:
    return None


def step_argument(step: Any, name: str = 'step') -> int | None:
  """A step number passed by a caller, as an int (None stays None).

  Accepts ints (numpy's too) and their decimal text ('7').

  Raises:
    TunixCheckpointError: anything else (a bool, a float, a negative number),
      naming the parameter.
  """
  if step is None:
    return None
  value = None
  if isinstance(step, str) and step.strip().isdigit():
    value = int(step)
  elif not isinstance(step, bool | float | np.bool_):
    with contextlib.suppress(TypeError):
      value = operator.index(step)
  if value is None or value < 0:
    raise errors.TunixCheckpointError(
        f'`{name}={step!r}`: expected a step number (an int >= 0, as in a step'
        f' directory\'s name) or None for the latest committed step.'
    )
  return value


def _is_item_dir(child: epath.Path) -> bool:
  """An entry of a step that is an item: a directory not named as Orbax's own files."""
  return not child.name.startswith(('.', '_')) and child.is_dir()


def holds_step(directory: epath.Path) -> bool:
  """Whether a directory named as a step holds one (the rule for every tool).

  A step holds `_CHECKPOINT_METADATA` (every Orbax release that writes it),
  or is one item saved alone (`_METADATA`), or holds at least one item
  directory (older releases). An empty numbered directory, or one holding
  stray files only, is not a step: Orbax's `CheckpointManager` would count
  it, and fail to restore it.
  """
  try:
    return _holds_step(directory)
  except OSError:
    return False


def _holds_step(directory: epath.Path) -> bool:
  """`holds_step`, raising the OSError that keeps the directory from being read."""
  if (directory / CHECKPOINT_METADATA).exists() or has_tree(directory):
    return True
  return any(_is_item_dir(child) for child in directory.iterdir())


def _why_unreadable(error: OSError) -> str:
  """An OSError that kept a directory from being read, in a few words."""
  return error.strerror or str(error) or type(error).__name__


def list_steps(root: epath.Path) -> list[StepEntry]:
  """Step directories directly under `root`, committed or not, by step number.

  "Committed" is Orbax's own decision for the kind of path
  (`ocp.path.step.is_path_finalized`); a committed one that holds no step
  (`holds_step`) is marked `empty`, one that cannot be read `unreadable`.
  """
  steps = []
  for child in root.iterdir():
    number = step_number(child.name)
    if number is None or not child.is_dir():
      continue
    committed = TMP_MARKER not in child.name and ocp.path.step.is_path_finalized(child)
    held, unreadable = True, ''
    if committed:
      try:
        held = _holds_step(child)
      except OSError as e:
        unreadable = _why_unreadable(e)
    steps.append(StepEntry(number, child, committed, not held, unreadable))
  return sorted(steps, key=lambda s: (s.step, s.usable, s.path.name))


def describe_steps(steps: Sequence[StepEntry]) -> str:
  """'1, 2, 3 (unfinished), 4 (empty)': the steps of a root, for messages."""
  if not steps:
    return 'none'
  return ', '.join(f'{s.step}' + (f' ({s.state})' if s.state else '') for s in steps)


def _reading_options(entry: StepEntry) -> str:
  """The `CheckpointManager` options under which Orbax reads this step's directory."""
  name = entry.path.name
  prefix, _, digits = name.rpartition('_')
  options = [f'step_prefix={prefix!r}'] if prefix else []
  if digits != str(entry.step):
    options.append(f'step_format_fixed_length={len(digits)}')
  return ', '.join(options) or 'its default options'


def _only_one(root: epath.Path, found: Sequence[StepEntry]) -> StepEntry:
  """The one directory of a step; several (`5` and `0005`) are refused.

  Raises:
    UnsupportedLayoutError: naming each directory and which Orbax reads.
  """
  if len(found) == 1:
    return found[0]
  which = '; '.join(f'{s.path.name} with {_reading_options(s)}' for s in found)
  raise errors.UnsupportedLayoutError(
      f'{root}: step {found[0].step} is held by {len(found)} directories,'
      f' {", ".join(s.path.name for s in found)}, so which one is meant is not'
      f" clear. Orbax's CheckpointManager reads {which}. Pass the step directory"
      ' itself (not the root), or remove or rename the other one.'
  )


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
        f' or damaged ({_orbax.failure_text(_orbax.storage_failure(e) or e)}).'
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
    return 'zarr.json' if self.use_zarr3 else '.zarray'

  def _without_data(self, paths: Iterable[Path]) -> list[Path]:
    """The zarr leaves among `paths` whose header is not in the store's listing."""
    header = self._header_name
    out = []
    for path in paths:
      name = _orbax.array_name(path)
      if self.by_path[path].has_zarr and not self._holds(f'{name}/{header}', self._span(name)):
        out.append(path)
    return out

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
    absent = self._without_data(self.paths if paths is None else paths)
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
    name = 'zarr.json' if self.use_zarr3 else '.zarray'
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
    return {p: ArrayInfo(*_orbax.parse_zarr_header(value, self.use_zarr3))
            for p, value in found.items()}

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
    if len(wanted) > _HEADER_READS_UP_TO and self.stores_fill_chunks and self._chunk_shapes:
      unsure = self._off_grid(wanted)
    else:
      unsure = list(wanted)
    actual = self.shapes(unsure)
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
      last = f'{name}/{_orbax.chunk_key([g - 1 for g in grid], zarr3)}'
      # Exactly the grid's chunks, and the header: the shape is the expected one.
      if span[1] - span[0] - 1 != math.prod(grid) or not self._holds(last, span):
        unsure.append(path)
    if absent:
      raise self._no_data_error(sorted(absent))
    return unsure

  def chunk_shape(self, path: Path) -> tuple[int, ...] | None:
    """The chunk shape an array (by its path on disk) is stored in, or None when not recorded."""
    return self._chunk_shapes.get(_orbax.array_name(path))

  @functools.cached_property
  def _chunk_shapes(self) -> dict[str, tuple[int, ...]]:
    """Array name -> chunk shape, from `array_metadatas/process_*` ({} if absent)."""
    folder = self.directory / ARRAY_METADATAS
    out: dict[str, tuple[int, ...]] = {}
    if not folder.is_dir():
      return out
    for path in folder.iterdir():
      try:
        entries = read_json(path, "Orbax's array metadata")['array_metadatas']
        for entry in entries:
          meta = entry['array_metadata']
          out[meta['param_name']] = tuple(meta['chunk_shape'])
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
  leaves: list[Leaf] = []

  def walk(node: Any, prefix: Path) -> None:
    if isinstance(node, dict) and node:
      for key, child in node.items():
        walk(child, prefix + (str(key),))
    else:
      leaves.append(Leaf(prefix, (2,) * len(prefix), 'unknown'))

  walk(tree, ())
  return tuple(leaves)


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
    return Item(name, directory, _tree_from_aggregate(directory / AGGREGATE_FILE), legacy=True)
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
    options = {k: v for k, v in meta.items() if k != 'tree_metadata'}
  return Item(
      name=name,
      directory=directory,
      leaves=leaves,
      use_ocdbt=bool(options.get('use_ocdbt', True)) and _orbax.is_ocdbt(directory),
      use_zarr3=bool(options.get('use_zarr3', False)),
      stores_fill_chunks=bool(options.get('store_array_data_equal_to_fill_value', False)),
      tree_json=meta,
  )


# --- a step's items -----------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Step:
  """One step directory, read once from its `_CHECKPOINT_METADATA`.

  Attributes:
    directory: the step directory.
    number: its step number, when its name carries one.
    recorded: item name -> the handler typestr recorded at save time (None
      when none was); None when the step records no items.
    custom_metadata: the user's custom metadata recorded with the step.
    single_item: the directory is one item saved on its own (by a
      `Checkpointer` over a PyTree handler): `_METADATA` and
      `_CHECKPOINT_METADATA` side by side. Its one item is named `item_name`.
    metadata_json: `_CHECKPOINT_METADATA` as parsed (None when there is none),
      handed to Orbax's composite so that the file is parsed once.
  """

  directory: epath.Path
  number: int | None
  recorded: Mapping[str, str | None] | None
  custom_metadata: Mapping[str, Any]
  single_item: bool = False
  metadata_json: Mapping[str, Any] | None = dataclasses.field(default=None, repr=False)

  @functools.cached_property
  def present(self) -> tuple[str, ...]:
    """Items on disk: subdirectories that are not Orbax's own files."""
    if self.single_item:
      return (self.item_name,)
    try:
      children = list(self.directory.iterdir())
    except OSError as e:
      raise errors.CorruptMetadataError(f'{self.directory}: cannot list it ({e}).') from e
    return tuple(sorted(c.name for c in children if _is_item_dir(c)))

  @property
  def item_name(self) -> str:
    return self.directory.name

  @property
  def items(self) -> tuple[str, ...]:
    """The items the step holds: those it records, else those on disk."""
    if self.recorded is not None and not self.single_item:
      return tuple(sorted(self.recorded))
    return self.present

  def item_dir(self, name: str) -> epath.Path:
    return self.directory if self.single_item else self.directory / name

  def handler(self, name: str) -> str | None:
    return None if self.recorded is None else self.recorded.get(name)

  def item(self, name: str) -> Item:
    """The item `name`, read once.

    Raises:
      CorruptMetadataError: it is recorded but absent, or its metadata is
        damaged (the message names the step).
    """
    if name not in self._items:
      item = open_item(self.item_dir(name), name)
      self._items[name] = dataclasses.replace(item, saved_by=self.handler(name))
    return self._items[name]

  @functools.cached_property
  def _items(self) -> dict[str, Item]:
    return {}

  def is_pytree(self, name: str) -> bool:
    """Whether the item holds a PyTree (its files, not only its recorded handler)."""
    return has_tree(self.item_dir(name))


def open_step(directory: epath.PathLike) -> Step:
  """Reads a step directory's `_CHECKPOINT_METADATA`.

  Raises:
    CorruptMetadataError: the file is damaged or not a JSON object.
  """
  directory = as_path(directory)
  meta_file = directory / CHECKPOINT_METADATA
  exists = meta_file.exists()
  meta = read_json(meta_file, "Orbax's step metadata") if exists else {}
  if not isinstance(meta, dict):
    raise errors.CorruptMetadataError(
        f'{meta_file}: expected a JSON object with "item_handlers", found'
        f' {type(meta).__name__}. The file is damaged; use another step (`step`).'
    )
  handlers = meta.get('item_handlers')
  # A Checkpointer over a PyTree handler writes both files into one directory.
  single = has_tree(directory)
  if isinstance(handlers, dict) and not single:
    recorded: dict[str, str | None] | None = {
        str(k): v if isinstance(v, str) else None for k, v in handlers.items()
    }
  elif single:
    recorded = {directory.name: handlers if isinstance(handlers, str) else None}
  else:
    recorded = None
  custom = meta.get('custom_metadata')
  return Step(
      directory=directory,
      number=step_number(directory.name),
      recorded=recorded,
      custom_metadata=dict(custom) if isinstance(custom, dict) else {},
      single_item=single,
      metadata_json=meta if exists else None,
  )


# --- what a path stands for -----------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Location:
  """What a path given by a user stands for.

  Attributes:
    path: the path given (absolute).
    step: the step it resolves to.
    item: the item, when the path was an item directory.
    root: the directory holding the step's siblings, when there is one.
    listed: the steps under that root, when resolving had to list them.
    notes: things a person should know (e.g. unfinished steps skipped).
  """

  path: epath.Path
  step: Step
  item: str | None
  root: epath.Path | None
  listed: tuple[StepEntry, ...] | None = None
  notes: tuple[str, ...] = ()

  @functools.cached_property
  def steps(self) -> tuple[StepEntry, ...]:
    """The steps under the root, committed or not (listed when first asked:
    a restore of a step does not need its siblings, one request each on a bucket)."""
    if self.listed is not None:
      return self.listed
    return tuple(list_steps(self.root)) if self.root is not None else ()


def step_roots(path: epath.Path) -> list[epath.Path]:
  """The directories whose children may be steps: the path, then RL roles."""
  return [path] + [path / role for role in RL_ROLES if (path / role).is_dir()]


def _is_step(path: epath.Path) -> bool:
  return (path / CHECKPOINT_METADATA).exists()


# How long `unreachable` waits for a bucket's storage service to answer a
# connection: the clients' own retries take ~50 s to give up.
PROBE_TIMEOUT = 5.0


def _storage_endpoint(path: epath.Path) -> tuple[str, int] | None:
  """(host, port) of the service gcsfs talks to for a gs:// path; None for others.

  As gcsfs chooses it: `STORAGE_EMULATOR_HOST` when set (an emulator), else
  Google's endpoint in the configured universe.
  """
  if os.fspath(path).split('://', 1)[0].lower() != 'gs':
    return None
  url = os.environ.get('STORAGE_EMULATOR_HOST', '')
  if url in ('', 'default'):
    url = 'https://storage.' + os.environ.get('GOOGLE_CLOUD_UNIVERSE_DOMAIN', 'googleapis.com')
  elif '://' not in url:
    url = 'http://' + url
  parts = urllib.parse.urlsplit(url)
  if not parts.hostname:
    return None
  return parts.hostname, parts.port or (443 if parts.scheme == 'https' else 80)


@functools.lru_cache(maxsize=8)
def _connects(host: str, port: int) -> None:
  """Opens (and closes) one connection; raises OSError if none can be made.

  Cached: a service reached once in this process is not probed again.
  """
  socket.create_connection((host, port), timeout=PROBE_TIMEOUT).close()


def unreachable(path: epath.Path) -> str | None:
  """Why a bucket path's storage service cannot be reached, or None.

  One connection attempt (at most `PROBE_TIMEOUT` seconds), before any
  client call: without a network the clients retry for about a minute
  before failing. Local paths, and services reached before, cost nothing.
  """
  if is_local(path):
    return None
  endpoint = _storage_endpoint(path)
  if endpoint is None:
    return None
  try:
    _connects(*endpoint)
  except OSError as e:
    reason = 'no answer' if isinstance(e, TimeoutError) else (e.strerror or str(e))
    return f'{endpoint[0]}:{endpoint[1]}: {reason}'
  return None


def resolve(path: epath.PathLike, step: int | None = None) -> Location:
  """Finds the step (and item) a path stands for.

  Args:
    path: a root (its latest committed step, or `step`), an RL root holding
      `actor/`, a step directory, an item directory, or one item saved alone.
    step: the step number wanted under a root; None for the latest.

  Raises:
    NotACheckpointError: nothing checkpoint-like is there, or no step `step`;
      or a bucket that cannot be reached.
    UncommittedStepError: the step is unfinished, or a root's steps all are.
    CorruptMetadataError: `_CHECKPOINT_METADATA` is damaged.
    UnsupportedLayoutError: the step asked for (or the latest) is held by
      two directories (`5` and `0005`).
    TunixCheckpointError: `step` is not a step number.
  """
  step = step_argument(step)
  path = as_path(path)
  problem = unreachable(path)
  if problem is not None:
    raise errors.NotACheckpointError(
        f'{path}: cannot reach the storage service ({problem}). Check the network'
        ' (and STORAGE_EMULATOR_HOST, if set); gs:// paths need gcsfs and Google'
        ' credentials.'
    )
  # A bucket's client raises errors of its own (gcsfs: HttpError, ...).
  failures = OSError if is_local(path) else Exception
  try:
    exists = path.exists()
  except failures as e:  # pylint: disable=broad-except
    raise errors.NotACheckpointError(
        f'{path}: cannot read it ({str(e).splitlines()[0] if str(e) else type(e).__name__}).'
        ' Check the path, the network and the credentials (gs:// paths need gcsfs'
        ' and Google credentials).'
    ) from e
  if not exists:
    raise errors.NotACheckpointError(
        f'{path}: no such file or directory. Expected an Orbax checkpoint'
        ' root, step or item directory; check the path.'
    )
  if not path.is_dir():
    raise errors.NotACheckpointError(
        f'{path}: expected a checkpoint directory, found a file. Pass the'
        ' directory that holds the steps, a step, or an item.'
    )
  if TMP_MARKER in path.name:
    raise errors.UncommittedStepError(
        f'{path}: this step is unfinished (its name contains {TMP_MARKER!r}):'
        ' its writer is still running or died. Restore a committed step.'
    )
  item = None
  if _is_step(path):
    step_dir = path
  elif has_tree(path) and _is_step(path.parent):
    step_dir, item = path.parent, path.name
  else:
    return _resolve_root(path, step)
  found = open_step(step_dir)
  root = step_dir.parent if found.number is not None and not found.single_item else None
  if step is not None and found.number != step:
    raise errors.NotACheckpointError(
        f'{path}: this is step {found.number}, but `step={step}` was asked for.'
        ' Pass the root directory that holds the steps, or drop `step`.'
    )
  if not ocp.path.step.is_path_finalized(step_dir) and not found.single_item:
    raise errors.UncommittedStepError(
        f'{step_dir}: this step is unfinished (Orbax does not count it as'
        ' committed: on a bucket, it has no commit_success.txt): its writer is'
        ' still running or died. Restore a committed step.'
    )
  return Location(path, found, item, root)


def _skip_notes(steps: Sequence[StepEntry]) -> list[str]:
  """What choosing the latest step skipped: unfinished and empty step directories."""
  notes = [f'skipped unfinished step {s.step} ({s.path.name})' for s in steps if not s.committed]
  notes += [f'skipped step directory {s.path.name}: it cannot be read ({s.unreadable})'
            for s in steps if s.unreadable]
  return notes + [
      f'skipped step directory {s.path.name}: it is empty (no {CHECKPOINT_METADATA} and'
      ' no item), not a step' for s in steps if s.empty
  ]


def _latest(path: epath.Path, root: epath.Path, steps: Sequence[StepEntry]) -> StepEntry:
  """The latest usable step of a root (see `StepEntry.usable`).

  Raises:
    UncommittedStepError: the root's steps are all unfinished (or empty).
    NotACheckpointError: they are all empty directories.
    UnsupportedLayoutError: the latest is held by two directories.
  """
  usable = [s for s in steps if s.usable]
  if usable:
    return _only_one(root, [s for s in usable if s.step == usable[-1].step])
  unreadable = [s for s in steps if s.unreadable]
  if unreadable:
    raise _cannot_read(path, unreadable, steps)
  empty = ', '.join(s.path.name for s in steps if s.empty)
  if all(s.empty for s in steps):
    raise errors.NotACheckpointError(
        f'{path}: expected a committed step, found only empty step directories'
        f' ({empty}): they hold no {CHECKPOINT_METADATA} and no item, so they are'
        ' not checkpoints. Check the path; a save that wrote nothing leaves these.'
    )
  raise errors.UncommittedStepError(
      f'{path}: expected a committed step, found only unfinished ones:'
      f' {", ".join(s.path.name for s in steps if not s.committed)}'
      + (f' (and empty directories {empty})' if empty else '')
      + '. Wait for the writer to finish, or restore from an earlier checkpoint.'
  )


def _cannot_read(path: epath.Path, unreadable: Sequence[StepEntry], steps: Sequence[StepEntry],
                 ) -> errors.NotACheckpointError:
  """The error for step directories that cannot be read (and no usable step instead)."""
  which = ', '.join(f'{s.path.name} ({s.unreadable})' for s in unreadable)
  return errors.NotACheckpointError(
      f'{path}: expected a readable committed step, found step directories that cannot be'
      f' read: {which}. Steps present: {describe_steps(steps)}. Check their permissions'
      ' (and mounts), or pass another step.'
  )


def _numbered(path: epath.Path, root: epath.Path, steps: Sequence[StepEntry], step: int
              ) -> StepEntry:
  """Step `step` of a root.

  Raises:
    NotACheckpointError: there is none, or only an empty directory.
    UncommittedStepError: it is unfinished.
    UnsupportedLayoutError: it is held by two directories.
  """
  matching = [s for s in steps if s.step == step]
  done = [s for s in matching if s.usable]
  if done:
    return _only_one(root, done)
  if any(s.unreadable for s in matching):
    raise _cannot_read(path, [s for s in matching if s.unreadable], steps)
  if any(s.empty for s in matching):
    raise errors.NotACheckpointError(
        f'{next(s.path for s in matching if s.empty)}: step {step} is an empty'
        f' directory (no {CHECKPOINT_METADATA} and no item), not a step. Pick'
        f' another: {describe_steps(steps)}.'
    )
  if matching:
    raise errors.UncommittedStepError(
        f'{matching[0].path}: step {step} is unfinished (its writer is still'
        f' running or died). Pick a committed step: {describe_steps(steps)}.'
    )
  raise errors.NotACheckpointError(
      f'{path}: expected a step {step}, found none. Steps present:'
      f' {describe_steps(steps)}. Pass one of these as `step`.'
  )


def _resolve_root(path: epath.Path, step: int | None) -> Location:
  for root in step_roots(path):
    steps = list_steps(root)
    if not steps:
      continue
    notes = [f'RL root: using {root.name}/'] if root != path else []
    if step is None:
      chosen = _latest(path, root, steps)
      notes += _skip_notes(steps)
    else:
      chosen = _numbered(path, root, steps, step)
    return Location(path, open_step(chosen.path), None, root, tuple(steps), tuple(notes))
  empty = not any(path.iterdir())
  raise errors.NotACheckpointError(
      f'{path}: expected an Orbax checkpoint (a root of numbered steps, a step'
      f' holding {CHECKPOINT_METADATA}, or an item holding {PYTREE_METADATA}),'
      f' found {"an empty directory" if empty else "none of these"}. Check the path.'
  )

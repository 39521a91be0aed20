"""A step as canonical leaves: listed from metadata, read in bounded batches.

The tools (inspect, convert, diff) share one view of a step: every PyTree item,
each leaf under its canonical path (the Tunix rewrites applied; other
checkpoints as they are) with its shape, dtype and size, known from metadata
alone. Reading is executing that listing in batches whose bytes fit a budget,
each batch one read through `planned_item.Reads`, so no tool ever holds
the whole checkpoint.
"""

from __future__ import annotations

import concurrent.futures
import contextvars
import dataclasses
import functools
import math
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from typing import Any, Protocol, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from orbax_tunix import conventions, errors
from orbax_tunix.keypaths import Path, fmt
from orbax_tunix.reading import quantized as quantized_lib
from orbax_tunix.reading import read_requests, timing
from orbax_tunix.reading.planned_item import Reads
from orbax_tunix.store import _orbax, item_store, step_store
from orbax_tunix.view.detection import Detection, detect

# Leaf kinds, from the Orbax value type of each leaf.
ARRAY = 'array'
SCALAR = 'scalar'
STRING = 'string'
# What JsonCheckpointHandler items record; their values are read whole.
JSON_TYPESTR = ocp.JsonCheckpointHandler.typestr()

T = TypeVar('T')
V = TypeVar('V')


@dataclasses.dataclass(frozen=True)
class LeafInfo:
  """One leaf of one item, from metadata only.

  Attributes:
    item: the item it belongs to (e.g. 'model_params').
    path: its canonical path within the item.
    disk_path: its path on disk (equal to `path` unless Tunix rewrites apply).
    shape: its global shape (() for scalars, None for strings).
    dtype: its dtype (None for strings).
    kind: ARRAY, SCALAR or STRING.
    numpy: the array was saved as an `np.ndarray` (else a `jax.Array`).
    quantized: how a weight saved quantized is (`quantized.Scheme`; its
      `disk_path` is then its qvalue's); None for any other leaf.
  """

  item: str
  path: Path
  disk_path: Path
  shape: tuple[int, ...] | None
  dtype: np.dtype | None
  kind: str = ARRAY
  numpy: bool = False
  quantized: quantized_lib.Scheme | None = None

  @property
  def nbytes(self) -> int:
    """Bytes of the array data (0 for strings)."""
    if self.shape is None or self.dtype is None:
      return 0
    return math.prod(self.shape) * self.dtype.itemsize

  @property
  def name(self) -> str:
    """'item/canonical/path', as the tools print it (one text per leaf)."""
    return fmt((self.item, *self.path))

  @property
  def stored(self) -> str:
    """'item/path/on/disk', for messages: the leaf as its checkpoint holds it,
    and its canonical path beside it where that differs."""
    disk = fmt((self.item, *self.disk_path))
    return disk if self.disk_path == self.path else f'{disk} (canonical {fmt(self.path)})'


@dataclasses.dataclass(frozen=True)
class Source:
  """One step of a checkpoint, opened once: what every plan reads (inspect, a layout, a
  merge, MaxText's restore), leaf by leaf in canonical form, from metadata only.

  Attributes:
    detection: what `detect()` found (kind, step, canonical maps, notes).
    items: PyTree item name -> its leaves, sorted by canonical path.
    side_leaves: item name -> on-disk paths left out of the canonical view
      (e.g. the inject_hyperparams scalars, read by `hyperparameters`).
    json_items: items saved by Orbax's JSON handler (read whole).
  """

  detection: Detection
  items: Mapping[str, tuple[LeafInfo, ...]]
  side_leaves: Mapping[str, tuple[Path, ...]]
  json_items: tuple[str, ...] = ()

  @functools.cached_property
  def step_dir(self) -> epath.Path:
    """The step directory (every plan's messages name it: kept once found)."""
    return self.detection.step_dir

  @property
  def step(self) -> int | None:
    """The number in the step directory's name, if any."""
    return self.detection.step

  @property
  def leaves(self) -> tuple[LeafInfo, ...]:
    return tuple(leaf for item in sorted(self.items) for leaf in self.items[item])

  @functools.cached_property
  def model_weights(self) -> tuple[tuple[LeafInfo, Path], ...]:
    """The model weights (`weights`), found once: every reader of the opened step shares
    them."""
    return _find_weights(self)

  @functools.cached_property
  def by_path(self) -> dict[tuple[str, ...], LeafInfo]:
    """`(item, *canonical path)` -> its leaf."""
    return {(leaf.item, *leaf.path): leaf for leaf in self.leaves}

  def derived(self, key: str, make: Callable[[Source], T]) -> T:
    """A value made from the opened step once, then shared by every plan that reads it (the
    decoder's layers: `mapping.step_layers.of`). Kept beside the fields, as
    `functools.cached_property` keeps its value."""
    if key not in self.__dict__:
      self.__dict__[key] = make(self)
    return self.__dict__[key]

  def paths(self, item: str) -> frozenset[Path] | None:
    """The canonical paths of `item` (every leaf its map covers; None: no such item)."""
    found = self.detection.maps.get(item)
    return None if found is None else frozenset(found.canonical_to_disk)

  @property
  def step_leaf(self) -> Path | None:
    """The optimizer's step, `(item, *canonical path)`, where the step holds one."""
    found = (conventions.OPTIMIZER_ITEM, *conventions.OPTIMIZER_STEP)
    optimizer = self.paths(conventions.OPTIMIZER_ITEM)
    return found if optimizer is not None and found[1:] in optimizer else None

  def stored(self, item: str, path: Path) -> str:
    """A canonical leaf as the checkpoint holds it: 'item/path/on/disk'."""
    return fmt((item, *self.detection.maps[item].canonical_to_disk[path]))

  def shapes(self, item: str, paths: Collection[Path]) -> dict[Path, tuple[int, ...]]:
    """Global shapes of some canonical leaves of `item` (their zarr headers)."""
    to_disk = self.detection.maps[item].canonical_to_disk
    found = self.detection.item_meta(item).shapes([to_disk[p] for p in paths])
    return {p: found[to_disk[p]] for p in paths if to_disk[p] in found}

  def mismatched_shapes(self, item: str, expected: Mapping[Path, tuple[int, ...]]
                        ) -> dict[Path, tuple[int, ...]]:
    """The canonical leaves of `item` whose stored shape is not the expected one (from one
    listing of the store where there are many: `Item.mismatched_shapes`)."""
    if not expected:
      return {}
    to_disk = self.detection.maps[item].canonical_to_disk
    found = self.detection.item_meta(item).mismatched_shapes(
        {to_disk[p]: shape for p, shape in expected.items()})
    return {p: found[to_disk[p]] for p in expected if to_disk[p] in found}



def _kind(leaf: item_store.Leaf) -> str | None:
  kinds = {'string': STRING, 'scalar': SCALAR}
  return kinds.get(leaf.value_type, ARRAY if leaf.is_array else None)


def _item_leaves(
    detection: Detection, name: str
) -> tuple[tuple[LeafInfo, ...], tuple[Path, ...]]:
  """One item's leaves in canonical form: `_METADATA`, one store listing, the headers.

  Raises:
    CorruptMetadataError: a leaf has no array data or its header is damaged, or the
      headers claim more bytes than the item's files hold (`Item.check_claims`).
    UnsupportedLayoutError: the item predates `_METADATA`, or holds leaves of
      a kind the tools do not read.
  """
  meta = detection.item_meta(name)
  if meta.legacy:
    raise errors.UnsupportedLayoutError(
        f'{meta.directory}: this item was written by an Orbax release older than'
        f' {_orbax.PYTREE_METADATA}, so its shapes and dtypes are not in metadata.'
        ' Restore it with orbax_tunix.TunixPyTreeHandler and save it with a current'
        ' Orbax, or leave the item out (`items`).'
    )
  cmap = detection.maps[name]
  arrays = meta.arrays([leaf.path for leaf in meta.leaves if _kind(leaf) != STRING])
  meta.check_claims(arrays)  # Before any tool sizes a read by them.
  leaves, side, odd = [], [], []
  parts_of_composed = set(cmap.parts.values())
  for leaf in meta.leaves:
    canon = cmap.disk_to_canonical[leaf.path]
    kind = _kind(leaf)
    if leaf.is_empty:
      continue  # Structure (an empty state), no data.
    if canon is None:
      if leaf.path not in parts_of_composed:
        side.append(leaf.path)
    elif canon in cmap.composed:  # A weight saved quantized: its parts make it.
      parts = cmap.composed[canon]
      qscheme = quantized_lib.scheme(
          {n: (arrays[d].shape, arrays[d].dtype) if d in arrays else None
           for n, d in parts.items()}, f'{meta.directory}: {fmt(canon)}')
      leaves.append(LeafInfo(name, canon, leaf.path, qscheme.shape, qscheme.dtype, ARRAY,
                             leaf.value_type == 'np.ndarray', qscheme))
    elif kind is None:
      odd.append(f'{fmt(leaf.path)} ({leaf.value_type})')
    elif kind == STRING:
      leaves.append(LeafInfo(name, canon, leaf.path, None, None, STRING))
    else:
      info = arrays[leaf.path]
      numpy = leaf.value_type == 'np.ndarray'
      leaves.append(LeafInfo(name, canon, leaf.path, info.shape, info.dtype, kind, numpy))
  if odd:
    raise errors.UnsupportedLayoutError(
        f'{meta.directory}: holds leaves of types the tools do not read:\n'
        f'{errors.list_paths(odd)}\nRestore the item with Orbax, or leave it out'
        ' (`items`).'
    )
  return tuple(sorted(leaves, key=lambda leaf: leaf.path)), tuple(sorted(side))


def open_checkpoint(detection: Detection) -> Source:
  """A detected step in canonical form, from metadata only (its location is not resolved
  again: `open_source` opens a path).

  Every item looked at is covered (see `detect`): a PyTree item is listed
  leaf by leaf, a JSON item by name; anything else is an error, unless
  the detection's `items` left it out. Items the step records but lacks are left out
  (`detection.absent`); callers that need the whole step check
  `detection.require()`.

  Returns:
    A `Source`.

  Raises:
    TunixCheckpointError subclasses: a recorded item is missing, damaged, or
      of a kind the tools cannot read; the message says which.
  """
  leaves, side = {}, {}
  for name in detection.maps:
    leaves[name], side[name] = _item_leaves(detection, name)
  unreadable = {n: t for n, t in detection.others.items() if t != JSON_TYPESTR}
  if unreadable:
    listed = ', '.join(f'{n!r} ({t})' for n, t in sorted(unreadable.items()))
    raise errors.UnsupportedLayoutError(
        f'{detection.step_dir}: the step holds items the tools cannot read: {listed}.'
        ' Only PyTree and JSON items can be inspected, converted or compared: name'
        ' the items to work on with `items` (that leaves these out).'
    )
  json_items = tuple(sorted(n for n in detection.others if n not in unreadable))
  return Source(detection, leaves, side, json_items)


def open_source(
    path: epath.PathLike,
    step: int | None = None,
    items: Iterable[str] | None = None,
    *,
    weights_only: bool = False,
    whole: bool = True,
) -> Source:
  """Opens a checkpoint's step once, as far as it is needed: the path resolved
  (`step_store.resolve`), the step detected (`detect`) and its items listed
  (`open_checkpoint`), each once, from metadata only. What is opened is handed down: the
  tools read, lay out and merge it without opening the path again.

  Args:
    path: a root, a step or an item directory (an item directory limits the view to that
      item).
    step: the step wanted under a root (None: the latest committed one).
    items: the items to open (default: every item the step records).
    weights_only: just the item holding the model weights (`weights`), when `items` is
      None: the others are not read, and may be absent.
    whole: with neither `items` nor `weights_only`, every item the step records must be
      on disk (`Detection.require`); else those it lacks are left out, with a note.

  Returns:
    A `Source`.

  Raises:
    MissingItemError: an item asked for (or, `whole`, recorded) is not on disk.
    TunixCheckpointError subclasses: as `detect` and `open_checkpoint`.
  """
  location = step_store.resolve(path, step)
  if weights_only and items is None:
    return open_checkpoint(detect(location, roles=(conventions.MODEL_ITEM,
                                                   conventions.MAXTEXT_ITEM)))
  source = open_checkpoint(detect(location, items=items))
  if items is None and whole:
    source.detection.require()
  return source


def weights(ckpt: Source) -> list[tuple[LeafInfo, Path]]:
  """The model weights of a checkpoint, without RNG state (found once per opened step).

  The weights are the model item (Tunix's `model_params`, or a canonical
  conversion) or, in a MaxText checkpoint, `items` below `params/params`.

  Returns:
    (leaf, path within the weight tree) pairs, sorted by path.

  Raises:
    MissingItemError: the weights' item is recorded but not on disk.
    UnsupportedLayoutError: neither place holds anything.
  """
  return list(ckpt.model_weights)


def _find_weights(ckpt: Source) -> tuple[tuple[LeafInfo, Path], ...]:
  """`weights`, found."""
  ckpt.detection.require([conventions.MODEL_ITEM, conventions.MAXTEXT_ITEM])
  item, prefix = ckpt.detection.source_kind.weights
  item = item if item in ckpt.items else _model_item(ckpt)
  n = len(prefix)
  found = [(leaf, leaf.path[n:]) for leaf in ckpt.items.get(item, ())
           if leaf.path[:n] == prefix and not conventions.is_rng_state(leaf.path[n:])]
  if not found:
    raise errors.UnsupportedLayoutError(
        f'{ckpt.step_dir}: expected model weights in item'
        f' {conventions.MODEL_ITEM!r} (Tunix or canonical) or in'
        f' {conventions.MAXTEXT_ITEM}/{fmt(conventions.MAXTEXT_PARAMS)} (MaxText),'
        f' found items {sorted(ckpt.items) or "none"} without them. Pass the step'
        ' (or root) of a model checkpoint, not an optimizer item.'
    )
  return tuple(sorted(found, key=lambda pair: pair[1]))


def _model_item(ckpt: Source) -> str | None:
  if conventions.MODEL_ITEM in ckpt.items:
    return conventions.MODEL_ITEM
  if ckpt.detection.source.single_item:
    (name,) = ckpt.items
    keys = {leaf.path[0] for leaf in ckpt.items[name] if leaf.path}
    if conventions.role(name, keys) == conventions.MODEL_ITEM and name != conventions.MAXTEXT_ITEM:
      return name
  return None


def json_scalar(value: Any) -> Any:
  """A numpy scalar as JSON holds it (float, int, bool; else its text)."""
  value = np.asarray(value)[()]
  if isinstance(value, np.floating):
    return float(value)
  if isinstance(value, np.integer | np.bool_):
    return value.item()
  return str(value)


# --- reading ----------------------------------------------------------------


class Progress(Protocol):
  """Where the streaming tools report bytes done (the command line draws it)."""

  def start(self, total_bytes: int, description: str) -> None:
    """Called once, before the first batch."""

  def advance(self, nbytes: int) -> None:
    """Called after each batch with the bytes it covered."""

  def finish(self) -> None:
    """Called once, after the last batch (also on failure)."""


class NullProgress:
  """A `Progress` that shows nothing."""

  def start(self, total_bytes: int, description: str) -> None:
    del total_bytes, description

  def advance(self, nbytes: int) -> None:
    del nbytes

  def finish(self) -> None:
    pass


def cast_dtype(leaf: LeafInfo, dtype: np.dtype | None) -> np.dtype | None:
  """The dtype a leaf is read as: `dtype` for floating leaves, else its own.

  Integer, boolean and PRNG-key leaves (an nnx RNG key is stored as uint32
  key data) keep their dtype: casting them would change what they mean.
  """
  if dtype is None or leaf.dtype is None or not jnp.issubdtype(leaf.dtype, jnp.floating):
    return leaf.dtype
  return np.dtype(dtype)


def request_for(leaf: LeafInfo, dtype: np.dtype | None, sharding: Any) -> tuple[Any, Any]:
  """(target leaf, RestoreArgs) for one leaf; numpy when `sharding` is None."""
  if leaf.kind == STRING:
    return '', ocp.RestoreArgs(restore_type=str)
  if leaf.kind == SCALAR:
    return 0, ocp.RestoreArgs(dtype=dtype)
  return read_requests.into(leaf.shape, dtype, sharding)


def read(
    ckpt: Source,
    item: str,
    leaves: Sequence[LeafInfo],
    *,
    as_numpy: bool = True,
    dtype: np.dtype | None = None,
) -> list[Any]:
  """Reads some leaves of one item with one Orbax restore.

  Only the named arrays are opened; the item's metadata was read once, when
  the checkpoint was opened.

  Args:
    ckpt: the opened checkpoint.
    item: the item the leaves belong to.
    leaves: the leaves to read (all of `item`).
    as_numpy: read arrays as `np.ndarray`; else as they were saved: numpy
      arrays as such, `jax.Array`s on one CPU device (PRNG keys stay typed).
    dtype: cast floating leaves to this dtype while reading (see `cast_dtype`).

  Returns:
    The values, in the order of `leaves`.
  """
  if not leaves:
    return []
  made = [leaf.name for leaf in leaves if leaf.quantized is not None]
  if made:  # Made from their parts by a transform: `mapping.dequantize.read_each`.
    raise ValueError(f'{made[0]}: a weight saved quantized is read as its parts and made'
                     ' from them (`mapping.dequantize`), not read as one leaf')
  sharding = None if as_numpy else jax.sharding.SingleDeviceSharding(jax.devices('cpu')[0])
  reads, det = Reads(), ckpt.detection
  for leaf in leaves:
    reads.want(det, item, leaf.path,
               request_for(leaf, cast_dtype(leaf, dtype), None if leaf.numpy else sharding))
  reads.read()
  return [as_stored(reads.got(det, item, leaf.path), leaf, cast_dtype(leaf, dtype))
          for leaf in leaves]


# What `read_each` gives for a leaf whose stored data cannot be read.
UNREADABLE = object()



def stream(
    batched: Iterable[Sequence[T]], read: Callable[[Sequence[T]], V], progress: Progress,
    done: Callable[[Sequence[T]], int], *, ahead: bool = False,
    size: Callable[[Sequence[T]], int] | None = None, limit: int = 0,
) -> Iterator[tuple[Sequence[T], V]]:
  """The one streaming loop of the host work (`writer.write`, `diff`, `checksums.verify`).

  Each batch is read once and handed over with what was read; once the
  caller asks for the next, `progress` advances by `done(batch)`. The caller
  drops its own references to a batch's values before asking for the next
  (`del`), so that one batch is held at a time, or two with `ahead`.

  Args:
    batched: the batches, in order (e.g. from `memory.batches`).
    read: a batch -> what was read for it.
    progress: told the bytes each batch took.
    done: a batch -> its bytes, for `progress`.
    ahead: read the next batch in a thread while the caller uses this one
      (reading is TensorStore's and the caller's writes are file I/O: both
      release the GIL). The caller sizes its batches for two in flight. Not
      across processes: a job's collectives must run in one order everywhere.
    size: a batch -> the bytes it holds; with `limit`, the next batch is read
      ahead only where the two hold at most `limit` bytes together (a batch larger
      than its share, one source alone, is read after the one before is released).
    limit: see `size`.

  Yields:
    (batch, what `read` gave for it).
  """
  def timed_read(batch: Sequence[T]) -> V:
    with timing.phase('read'):
      return read(batch)

  if not ahead:
    for batch in batched:
      values = timed_read(batch)
      yield batch, values
      del values
      progress.advance(done(batch))
    return
  batches_ = iter(batched)
  # The reading thread sees this thread's context (the parsed metadata Orbax is served).
  submit = lambda b: pool.submit(contextvars.copy_context().run, timed_read, b)  # noqa: E731
  with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix='orbax_tunix-read') as pool:
    batch = next(batches_, None)
    pending = submit(batch) if batch is not None else None
    try:
      while pending is not None:
        with timing.phase('waited'):
          values = pending.result()
        following = next(batches_, None)
        together = following is not None and (
            size is None or size(batch) + size(following) <= limit)
        pending = submit(following) if together else None
        yield batch, values
        del values
        progress.advance(done(batch))
        if following is not None and pending is None:  # Now that this one is released.
          pending = submit(following)
        batch = following
    finally:
      if pending is not None:  # Stopped early (an error, Ctrl-C): let the read end first.
        pending.cancel() or concurrent.futures.wait([pending])


def read_each(ckpt: Source, item: str, leaves: Sequence[LeafInfo]) -> list[Any]:
  """`read` (as numpy) that names every damaged leaf rather than failing at the first.

  One read for all; when stored data is missing or damaged, each leaf is read
  on its own, and those that fail come back as `UNREADABLE` (the tools that
  check data report them as damaged: `inspect --verify`, `diff`).
  """
  try:
    return read(ckpt, item, leaves)
  except errors.CorruptMetadataError:
    if len(leaves) == 1:
      return [UNREADABLE]
  return [value for leaf in leaves for value in read_each(ckpt, item, [leaf])]


def as_stored(value: Any, leaf: LeafInfo, dtype: np.dtype | None) -> Any:
  """A scalar as the numpy scalar it was saved as (Orbax hands back a Python number)."""
  if leaf.kind == SCALAR and dtype is not None:
    return np.asarray(value, dtype=dtype)[()]
  return value


def read_json_item(ckpt: Source, item: str) -> Any:
  """The value of a JSON item, as Orbax's JSON handler reads it.

  Raises:
    CorruptMetadataError: its file is missing or is not JSON.
  """
  directory = ckpt.detection.source.item_dir(item)
  try:
    return ocp.JsonCheckpointHandler().restore(directory, args=ocp.args.JsonRestore())
  except (OSError, ValueError, RecursionError) as e:
    raise errors.CorruptMetadataError(
        f'{directory}: expected the JSON item {item!r} as Orbax\'s JSON handler saves it,'
        f' found {"no file" if isinstance(e, FileNotFoundError) else "a file that does not parse"}'
        f' ({e}). The item is damaged; use another step (`step`), or leave the item'
        ' out (`items`).'
    ) from e

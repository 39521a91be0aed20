"""What a conversion writes, as values: each destination leaf and what makes it.

The currency between the layouts (which decide what goes where) and the
writer (which reads, transforms and writes in batches). An `Output` is one
destination leaf: the source leaves it is made from (`Input`s: a checkpoint
and a leaf of it), the `Transform` that makes it, its shape and dtype. An
`ItemOutput` is one destination item: its outputs in write order and the
containers its tree needs (lists, empty nodes). Nothing here reads anything.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from orbax_tunix import errors
from orbax_tunix.keypaths import Path, fmt
from orbax_tunix.mapping import transforms
from orbax_tunix.mapping.transforms import (
  IDENTITY,
  Shape,
  Transform,
  chain,
  leading_takes,
  per_input,
  take,
)
from orbax_tunix.reading import reader


@dataclasses.dataclass(frozen=True)
class Input:
  """One source leaf: the checkpoint it is in, and the leaf (or a slice of it).

  Attributes:
    takes: read only these `take(axis, index)` slices of it, one after
      another (`transforms.region`): one layer of a stacked weight.
    rows: then only entries start..stop-1 along one axis of what the takes
      leave, as (axis, start, stop): a block of a tensor too large for a batch.
  """

  ckpt: reader.Source
  leaf: reader.LeafInfo
  takes: tuple[tuple[int, int], ...] = ()
  rows: tuple[int, int, int] | None = None

  @property
  def key(self) -> tuple:
    """Identifies what is read across outputs (the same is read once per batch)."""
    return id(self.ckpt), self.leaf.item, self.leaf.path, self.takes, self.rows

  @property
  def partial(self) -> bool:
    return bool(self.takes) or self.rows is not None

  @property
  def index(self) -> tuple[Any, ...] | None:
    """The index into the leaf that is read (None: all of it)."""
    return self._region[0] if self.partial else None

  @property
  def shape(self) -> Shape:
    """The shape read."""
    return self._region[1]

  @property
  def _region(self) -> tuple[tuple[Any, ...], Shape]:
    return transforms.region(self.leaf.shape, self.takes, self.rows)

  @property
  def chunk_shape(self) -> tuple[int, ...] | None:
    """The shape of the chunks the leaf is stored in (None: not recorded)."""
    chunk = self.ckpt.detection.item_meta(self.leaf.item).chunk_shape(self.leaf.disk_path)
    return chunk if chunk is not None and len(chunk) == len(self.leaf.shape) else None

  def stored_axis(self, axis: int) -> int:
    """The leaf's axis that axis `axis` of the part read is (the takes drop axes)."""
    left = list(range(len(self.leaf.shape)))
    for taken, _ in self.takes:
      left.pop(taken)
    return left[axis]

  @property
  def touched_bytes(self) -> int:
    """Bytes of the stored chunks a read of this part decodes (a store reads whole
    chunks): the leaf's bytes when it is one chunk, or its chunks are not recorded."""
    if not self.partial or self.leaf.dtype is None:
      return self.leaf.nbytes
    chunk = self.chunk_shape  # (Only for parts: it may read the array's header.)
    if chunk is None:
      return self.leaf.nbytes
    elements = 1
    for size, c, at in zip(self.leaf.shape, chunk, self.index, strict=True):
      start, stop = (at, at + 1) if isinstance(at, int) else (at.start or 0, at.stop or size)
      elements *= min(((stop - 1) // c - start // c + 1) * c, size)
    return elements * self.leaf.dtype.itemsize

  @property
  def nbytes(self) -> int:
    """Bytes read (of the part, where one is)."""
    if not self.partial or self.leaf.dtype is None:
      return self.leaf.nbytes
    return math.prod(self.shape) * self.leaf.dtype.itemsize


@dataclasses.dataclass(frozen=True)
class Output:
  """One destination leaf.

  Attributes:
    path: where it is written in its item (for a safetensors file: (name,)).
    inputs: the source leaves, in the transform's order.
    transform: how they make it.
    shape: its shape (None for strings).
    dtype: its dtype (None for strings).
    kind: `reader.ARRAY`, `SCALAR` or `STRING` (strings and scalars are copied).
    numpy: written as an `np.ndarray` (as its source was saved), else a jax.Array.
    read_dtypes: the dtype each input is read in (None: its own); by
      default the output's dtype, so a cast happens in the read.
    rows: this output is rows start..stop-1 (along axis 0) of the tensor at
      `path`, made block by block (`row_blocks`); None: all of it.
  """

  path: Path
  inputs: tuple[Input, ...]
  transform: Transform = IDENTITY
  shape: Shape | None = None
  dtype: np.dtype | None = None
  kind: str = reader.ARRAY
  numpy: bool = False
  read_dtypes: tuple[np.dtype | None, ...] | None = None
  rows: tuple[int, int] | None = None

  @property
  def nbytes(self) -> int:
    if self.shape is None or self.dtype is None:
      return 0
    return math.prod(self.shape) * self.dtype.itemsize

  def input_dtypes(self) -> tuple[np.dtype | None, ...]:
    if self.read_dtypes is not None:
      return self.read_dtypes
    return tuple(reader.cast_dtype(i.leaf, self.dtype) for i in self.inputs)


def copied(leaf_input: Input, path: Path, dtype: np.dtype | None = None) -> Output:
  """An output that is its source leaf as it is (cast to `dtype` if floating)."""
  leaf = leaf_input.leaf
  return Output(
      path=path, inputs=(leaf_input,), shape=leaf.shape,
      dtype=reader.cast_dtype(leaf, dtype), kind=leaf.kind, numpy=leaf.numpy,
  )


def compose(
    sources: Mapping[Path, Output], mapped: Mapping[Path, Any], prefix: Path = ()
) -> list[Output]:
  """Outputs of layout rules (`patterns.map_paths`) over outputs already planned.

  Each destination takes its sources' inputs and applies, after theirs, the
  rule's transform (e.g. a LoRA merge, then a family's transpose). A gather
  (several sources) takes sources each made from one leaf (copied, or a layer
  taken from a stacked weight): each through its own transform, then the rule's.

  Args:
    sources: source path -> the output that makes it (copied or merged leaf).
    mapped: destination path -> `patterns.Mapped` over those source paths.
    prefix: put before each destination path.

  Raises:
    UnsupportedLayoutError: a gather over sources that are themselves made from several
      leaves (a LoRA merge).
  """
  out = []
  for dest, m in sorted(mapped.items()):
    parts = [sources[p] for p in m.sources]
    if len(parts) == 1:
      (one,) = parts
      out.append(dataclasses.replace(
          one, path=prefix + dest, transform=chain(one.transform, m.transform), shape=m.shape))
      continue
    made = [fmt(p) for p, o in zip(m.sources, parts, strict=True) if not o.transform.is_identity]
    transform = m.transform
    if made:
      # Parts each made from one leaf (a layer taken from a stacked weight: gpt-oss's scanned
      # `wi_0` and `wi_1` fused into one tensor per layer) are made first, each its own way.
      several = [fmt(p) for p, o in zip(m.sources, parts, strict=True) if len(o.inputs) != 1]
      if several:
        raise errors.UnsupportedLayoutError(
            f'{fmt(dest)}: made from {len(parts)} leaves that are themselves made from several'
            f' ({several[0]}, ...); write them as stored first, then re-lay them.'
        )
      transform = per_input(tuple(o.transform for o in parts), m.transform)
    out.append(Output(
        prefix + dest, tuple(i for o in parts for i in o.inputs), transform, m.shape,
        parts[0].dtype, parts[0].kind, parts[0].numpy,
    ))
  return out


def read_sliced(output: Output) -> Output:
  """The output reading only the slices its transform takes first (one layer of a
  stacked weight, of its LoRA adapters), not its sources whole: the same value,
  and the memory one layer needs rather than the whole stack.

  A source is read in part only where that decodes fewer stored bytes than
  reading it whole (`Input.touched_bytes`: a store reads whole chunks; a
  stack stored as one chunk is read once, whole). For host reads
  (`writer.read_inputs`); sources of other kinds than arrays are read whole.
  """
  if any(i.leaf.kind != reader.ARRAY or not i.leaf.shape for i in output.inputs):
    return output
  transform = output.transform
  first, *after = transform.steps or (transform,)
  if first.per is not None:  # Each source's own transform first (e.g. a LoRA merge's).
    each, then = first.per
    if len(each) != len(output.inputs):  # One takes several sources (a weight's parts).
      return output
  elif len(output.inputs) == 1:
    each, then, after = (transform,), None, ()
  else:
    return output
  inputs, rests = [], []
  for source, t in zip(output.inputs, each, strict=True):
    takes, rest = leading_takes(t)
    # The takes read that decode the fewest stored bytes, the fewest of them where several
    # do (the more outputs share the read): a layer of experts stored as one chunk is read
    # once, its experts then taken from it; an expert stored with all its layers in one
    # chunk is read once for them all, its layers then taken from it.
    best, left = source, ()
    for read, taken_after in _take_splits(len(source.shape), takes):
      part = dataclasses.replace(source, takes=source.takes + read)
      if part.touched_bytes < best.touched_bytes:
        best, left = part, taken_after
    inputs.append(best)
    rests.append(chain(*(take(a, i) for a, i in left), rest) if best is not source else t)
  if inputs == list(output.inputs):
    return output
  transform = rests[0] if then is None else chain(per_input(rests, then), *after)
  return dataclasses.replace(output, inputs=tuple(inputs), transform=transform)


def _take_splits(ndim: int, takes: Sequence[tuple[int, int]]
                 ) -> Iterator[tuple[tuple[tuple[int, int], ...], tuple[tuple[int, int], ...]]]:
  """Each way to read some of `takes` (slices of an `ndim`-d array, each axis counted after
  the ones before are taken) and take the others from what was read, fewest read first:
  (the takes read, the takes then applied), each counted as `take` counts its axis. The
  takes select different axes, so any of them may come first."""
  left = list(range(ndim))
  stored = [(left.pop(a), i) for a, i in takes]  # Each take's axis of the array as read.
  for k in range(1, len(stored) + 1):
    for read in itertools.combinations(stored, k):
      left, counted = list(range(ndim)), []
      for a, i in (*read, *(x for x in stored if x not in read)):
        counted.append((left.index(a), i))
        left.remove(a)
      yield tuple(counted[:k]), tuple(counted[k:])


def row_blocks(output: Output, budget: int) -> list[Output]:
  """A tensor larger than `budget` as blocks of its rows (axis 0), each made from the
  same block of its source, so that no batch holds it whole (e.g. an embedding).

  Where the transform cannot be made block by block (`Transform.source_axis`:
  a deinterleave of the rows, a merge of them) or the output has several
  sources or one row, it stays whole.
  """
  return list(iter_row_blocks(output, budget))


def iter_row_blocks(output: Output, budget: int) -> Iterator[Output]:
  """`row_blocks`, one block at a time (the first alone is what the smallest batch holds)."""
  if output.nbytes <= budget or len(output.inputs) != 1 or not output.shape:
    yield output
    return
  (source,) = output.inputs
  if source.leaf.kind != reader.ARRAY or source.rows is not None or source.leaf.dtype is None:
    yield output
    return
  axis = output.transform.source_axis(0, [source.shape])
  n = output.shape[0]
  if axis is None or n < 2 or source.shape[axis] < n:
    yield output
    return
  # Blocks of whole stored chunks (a store decodes whole chunks): none where the
  # rows are one chunk (the tensor is then read whole, once).
  chunk = source.chunk_shape
  rows_per_chunk = chunk[source.stored_axis(axis)] if chunk is not None else source.shape[axis]
  if rows_per_chunk >= n:
    yield output
    return
  # A block holds its source rows and the rows made: both within the budget.
  per_row = max(output.nbytes, source.nbytes * n // source.shape[axis]) // n
  step = max(1, budget // max(2 * per_row, 1))
  step = max(rows_per_chunk, step // rows_per_chunk * rows_per_chunk)
  for start in range(0, n, step):
    yield dataclasses.replace(
        output, inputs=(dataclasses.replace(source, rows=(axis, start, min(start + step, n))),),
        shape=(min(start + step, n) - start, *output.shape[1:]), rows=(start, min(start + step, n)))


@dataclasses.dataclass(frozen=True)
class ItemOutput:
  """One destination item.

  Attributes:
    name: the item's name in the new step (e.g. 'model_params', 'items').
    outputs: its leaves, in write order.
    sequences: nodes written as lists (their keys '0', '1', ...).
    empty: (path, key types, Orbax's value type) of empty nodes: `None` in a
      list, an empty state, an empty dict or list (value types 'None',
      'Dict', 'List', ...; see `store._orbax.EMPTY_VALUE_TYPES`).
    key_types: per leaf path, the key types of the tree it came from (when
      an item is written as it was read, its containers are kept as they were).
    json: the item is a JSON item copied whole from this (checkpoint, item name).
    zarr3: arrays are written as zarr v3 (as MaxText writes its steps).
  """

  name: str
  outputs: tuple[Output, ...] = ()
  sequences: frozenset[Path] = frozenset()
  empty: tuple[tuple[Path, tuple[int, ...], str], ...] = ()
  key_types: Mapping[Path, tuple[int, ...]] | None = None
  json: tuple[reader.Source, str] | None = None
  zarr3: bool = False

  @property
  def nbytes(self) -> int:
    return sum(o.nbytes for o in self.outputs)

  def check(self) -> None:
    """Each destination once (a bug in a layout otherwise)."""
    seen: set[Path] = set()
    twice = [fmt(o.path) for o in self.outputs if o.path in seen or seen.add(o.path)]
    if twice:
      raise ValueError(f'item {self.name!r}: outputs written twice: {twice[:5]}')


def describe(items: Iterable[ItemOutput]) -> list[str]:
  """One line per item: outputs, bytes, and how many are transformed."""
  lines = []
  for item in items:
    if item.json is not None:
      lines.append(f'{item.name}: JSON, copied')
      continue
    made = sum(not o.transform.is_identity for o in item.outputs)
    lines.append(f'{item.name}: {len(item.outputs)} leaves, {item.nbytes} bytes'
                 + (f', {made} made by a transform' if made else ''))
  return lines


"""Writing outputs: the host placement of the one executor, and the sinks of files.

`write` runs the outputs of a layout (see `outputs.py`) through the one
executor (`mapping/executor.py`) with the `OnHost` placement: each batch's
source leaves are read with one restore per source item (cast in the read
where the output's dtype says so), transformed on the host's device, and
handed to a sink, then released before the next batch is read. Outputs that
share sources (a stacked weight's layers, a fused weight's parts) stay in
one unit, so every source is read once. Sinks: `OrbaxItemSink` (an Orbax
PyTree item, written batch by batch with Orbax's own handler) and
`SafetensorsSink` (Hugging Face shards and their index; one file for a PEFT
adapter). Staging and commit are `commit.py`'s.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import json
import math
import os
import struct
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from orbax_tunix import errors
from orbax_tunix.keypaths import fmt, nest
from orbax_tunix.mapping import executor
from orbax_tunix.mapping import merge as merge_lib
from orbax_tunix.mapping.outputs import Input, ItemOutput, Output, iter_row_blocks, row_blocks
from orbax_tunix.reading import memory, reader
from orbax_tunix.reading.planned_item import Reads
from orbax_tunix.reading.read_requests import is_key
from orbax_tunix.store import _orbax, fileio, names
from orbax_tunix.writing import checksums, commit, consensus, global_arrays, job, staging


@contextlib.contextmanager
def streamed(dst: epath.Path, force: bool, kind: commit.Kind, total_bytes: int,
             sources: Sequence[epath.Path], progress: reader.Progress,
             description: str, progress_bytes: int | None = None,
             entries: Sequence[str] = ()) -> Iterator[Any]:
  """A destination written in a stage and committed once when the block succeeds
  (`staging.staged`: one process or several), progress started and finished
  around it; the one frame of `convert` and `export`. Yields the staging.

  Args: the destination, whether it may replace one of `kind`, the bytes it will
  hold (its free space is checked), the step directories read, the progress, its
  line, the bytes this process reads (default `total_bytes`), and the entries the
  destination will hold at its top (`commit.staged`).
  """
  progress.start(total_bytes if progress_bytes is None else progress_bytes, description)
  try:
    with staging.staged(dst, force, kind, total_bytes, sources, entries) as shared:
      yield shared
  finally:
    progress.finish()


def reads_ahead(memory_budget: int) -> bool:
  """Whether `write` reads the next batch while it writes one (`reader.stream`'s `ahead`):
  in one process (a job's processes keep their collectives in one order), with a budget
  that holds two batches (a smaller one is met as closely as one batch at a time can)."""
  return not job.active() and memory.holds_two_batches(memory_budget)


def batch_bytes(memory_budget: int, safetensors: bool = False) -> int:
  """Bytes of sources per batch so that a write fits `memory_budget` (in each process of a
  multi-process job too); half as much where two batches are in flight (`reads_ahead`).
  Safetensors written on the host (`SafetensorsSink`) hold fewer copies of a batch (`memory.HOST_WRITE_COPIES`)
  and the buffers of the threads that write them (`memory.write_threads` of
  `memory.copy_buffer_bytes` each)."""
  threads = memory.write_threads(memory_budget) if safetensors else 0
  return memory.batch_bytes(
      memory_budget, memory.HOST_WRITE_COPIES if safetensors else memory.WRITE_COPIES,
      job=job.active(), in_flight=2 if reads_ahead(memory_budget) else 1,
      held=threads * memory.copy_buffer_bytes(memory_budget))


def budget_note(memory_budget: int, largest: int, what: str) -> str | None:
  """A note when `memory_budget` cannot hold the largest `what` (each is written alone)."""
  return memory.shortfall(memory_budget, largest, what, memory.WRITE_COPIES,
                          job=job.active())


def check_machine(outputs: Iterable[Output], rows: bool) -> None:
  """Refuses, before anything is read or written, an output that no batch size lets this
  machine hold (`memory.check_machine`): what the writer holds of it at least (its
  smallest block of rows where `rows`, else all of it) and the stored chunks its sources'
  reads decode.

  Raises:
    TunixCheckpointError: naming the output, its source and both sizes.
  """
  machine = memory.machine_bytes()
  for output in outputs:
    biggest = max([output.nbytes, *(i.leaf.nbytes for i in output.inputs)])
    if machine is None or biggest <= machine:
      continue  # Fits whatever is read (the common case: nothing more is asked).
    unit = next(iter_row_blocks(output, 1)) if rows else output
    held = max([unit.nbytes, *(i.touched_bytes for i in unit.inputs)])
    sources = ', '.join(f'{i.leaf.name} (shape {i.leaf.shape} {i.leaf.dtype})'
                        for i in unit.inputs)
    where = output.inputs[0].ckpt.step_dir if output.inputs else 'the source'
    memory.check_machine(held, where, f'{sources or fmt(output.path)}, written as'
                         f' {fmt(output.path)}{" (its smallest block of rows)" if rows else ""},')


def units(outputs: Sequence[Output]) -> list[list[Output]]:
  """Outputs grouped so that those sharing a source are written in one batch.

  Consecutive outputs with the same sources form one unit (a layout lists a
  source's parts together); an output that shares a source with a unit
  further back joins it.
  """
  groups: list[list[Output]] = []
  where: dict[tuple, int] = {}
  for output in outputs:
    keys = [i.key for i in output.inputs]
    found = next((where[k] for k in keys if k in where), None)
    if found is None:
      found = len(groups)
      groups.append([])
    groups[found].append(output)
    for k in keys:
      where.setdefault(k, found)
  return groups


def read_inputs(batch: Sequence[Output], on_host: bool = False) -> dict[tuple, Any]:
  """Every source of a batch, once: one restore per source item.

  Onto one CPU device (leaves saved as jax arrays stay jax arrays), or to the
  host as numpy when `on_host`. Across processes, onto the global mesh: each
  process reads only its part (`global_arrays.placement`). Sources read in part
  (`Input.partial`: a layer of a stacked weight, a block of rows) are read to
  the host.

  Returns:
    `Input.key` -> the value read.
  """
  spread = job.active() and not on_host
  cpu = None if on_host or spread else jax.sharding.SingleDeviceSharding(jax.devices('cpu')[0])
  reads = Reads()
  read: dict[tuple, tuple[Input, Any]] = {}
  for output in batch:
    for source, dtype in zip(output.inputs, output.input_dtypes(), strict=True):
      if source.key in read:
        continue
      read[source.key] = (source, dtype)
      det, leaf = source.ckpt.detection, source.leaf
      if source.partial:
        reads.want_part(source.key, det, leaf.item, leaf.path, source.index, dtype)
      else:
        meta = det.item_meta(leaf.item)
        reads.want(det, leaf.item, leaf.path,
                   reader.request_for(leaf, dtype, _into(leaf, meta, cpu, spread)))
  reads.read()
  values: dict[tuple, Any] = {}
  for key, (source, dtype) in read.items():
    if source.partial:
      value = reads.part(key)
      values[key] = value if on_host else jax.device_put(value, cpu)
    else:
      det, leaf = source.ckpt.detection, source.leaf
      values[key] = reader.as_stored(reads.got(det, leaf.item, leaf.path), leaf, dtype)
  return values


def _into(leaf: reader.LeafInfo, meta: Any, cpu: Any, spread: bool) -> Any:
  """Where a leaf is read to: None (numpy), one CPU device, or across processes split
  where its stored chunks split (`global_arrays.placement`), so no chunk is read twice."""
  if leaf.numpy or not (cpu or spread):
    return None
  return cpu or global_arrays.placement(leaf.shape, meta.chunk_shape(leaf.disk_path))


def make(output: Output, values: dict[tuple, Any]) -> Any:
  """An output's value from its sources' values (as read)."""
  inputs = [values[i.key] for i in output.inputs]
  if output.transform.is_identity:
    value = global_arrays.for_saving(inputs[0])
  else:
    value = global_arrays.settle(output.transform.apply(inputs))
  have = getattr(value, 'dtype', None)
  if output.dtype is None or have is None or have == output.dtype or is_key(have):
    return value  # PRNG keys are written as read (their key data is the stored form).
  if output.numpy or isinstance(value, np.ndarray | np.generic):
    return np.asarray(value).astype(output.dtype)
  return global_arrays.for_saving(jnp.asarray(value).astype(output.dtype))


def _largest(dtype: Any) -> float:
  """The largest magnitude a numeric dtype holds (0 for others)."""
  if jnp.issubdtype(dtype, jnp.floating):
    return float(jnp.finfo(dtype).max)
  if jnp.issubdtype(dtype, jnp.integer):
    return float(jnp.iinfo(dtype).max)
  return 0.0


def _may_overflow(output: Output) -> bool:
  """Whether an output's floating values may leave its dtype's range: they
  are computed (a LoRA merge), or cast from a dtype holding larger values
  (float32 to float16 or bfloat16, int32 to float16). Re-laid values cast to
  a dtype as wide cannot, and are not checked."""
  dtype = output.dtype
  if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
    return False
  if not output.transform.moves_only:
    return True
  limit = _largest(dtype)
  return any(i.leaf.dtype is not None and _largest(i.leaf.dtype) > limit for i in output.inputs)


def _all_finite(value: Any) -> bool:
  """Whether a value read holds no inf or NaN (not floating: True)."""
  value = global_arrays.on_host(value)
  if not jnp.issubdtype(getattr(value, 'dtype', np.float32), jnp.floating):
    return True
  return bool(np.isfinite(value).all())


def _finite(values: np.ndarray) -> bool:
  """Whether every value of a floating array is finite, checked a block of rows at a time (no
  temporary the size of the tensor). `isfinite` rather than the extremes: ml_dtypes'
  bfloat16 min and max are 10x slower, numpy's float16 ones 7x (BENCHMARKS §23)."""
  if values.ndim == 0:
    return bool(np.isfinite(values))
  return all(np.isfinite(part).all() for _, part in row_pieces(values, memory.COPY_BUFFER_BYTES))


def check_range(output: Output, value: Any) -> None:
  """Refuses an output whose values left its dtype's range (became inf).

  Only where values may leave the range (see `_may_overflow`), and only when
  the written value holds non-finite elements (`_finite`): then the
  sources are read again in their own dtypes and compared, so that infs and
  NaNs the source holds itself are kept.

  Raises:
    InvalidOptionError: the output dtype cannot hold them (naming the source
      leaf, how many values, the largest and the dtype's limit), or the
      arithmetic overflowed (a merge: naming `lora_alpha` and `lora_scale`).
  """
  if not _may_overflow(output):
    return
  if isinstance(value, jax.Array) and not value.is_fully_addressable:
    if bool(jnp.isfinite(value).all()):  # Computed where the parts are; agreed by all.
      return
  written = global_arrays.on_host(value)
  if written.size == 0 or _finite(written):
    return
  finite = np.isfinite(written)
  own = dataclasses.replace(output, dtype=None,
                            read_dtypes=tuple(i.leaf.dtype for i in output.inputs))
  sources = read_inputs([own])
  exact = np.asarray(global_arrays.on_host(make(own, sources)), dtype=np.float64)
  # From finite sources, every value that is not finite left the range; from sources
  # holding infs or NaNs, only those their own arithmetic keeps finite.
  lost = ~finite if all(map(_all_finite, sources.values())) else np.isfinite(exact) & ~finite
  if not lost.any():
    return
  source = output.inputs[0]
  dtype = np.dtype(output.dtype)
  if not np.isfinite(exact[lost]).all():  # The arithmetic itself, not the cast, overflowed.
    why = ('the LoRA merge W + scale·(a⊗b) leaves float32\'s range: the scale is far larger'
           ' than the run\'s. Pass the alpha the run was trained with (`lora_alpha`, or'
           ' `lora_scale`).' if merge_lib.TRANSFORM_NAME in output.transform.name else
           f'{output.transform.name} leaves the range of its arithmetic.')
    raise errors.InvalidOptionError(
        f'{source.ckpt.step_dir}: {source.leaf.stored}: {int(lost.sum())} of {written.size}'
        f' values computed from finite ones are not finite ({dtype.name}): {why} Nothing was'
        ' committed.'
    )
  raise errors.InvalidOptionError(
      f'{source.ckpt.step_dir}: {source.leaf.stored}: {int(lost.sum())} of {written.size}'
      f' values are outside the range of {dtype.name} (largest magnitude'
      f' {float(np.max(np.abs(exact[lost]))):g}; {dtype.name} holds at most'
      f' {float(jnp.finfo(dtype).max):g}) and would be written as inf. Nothing was'
      ' committed. Convert without `dtype`, or with one whose range holds these values'
      ' (bfloat16 has about float32\'s range).'
  )


@dataclasses.dataclass(frozen=True)
class OnHost:
  """The placement of outputs made on the host (`executor.Placement`; see the module),
  each output checked for range (`check_range`).

  Attributes:
    numpy: read and transform as numpy (transposes stay views until the sink copies
      each tensor out), else on one CPU device.
  """

  numpy: bool = False

  def units(self, outputs: Sequence[Output]) -> list[list[Output]]:
    return units(outputs)

  def held_bytes(self, unit: Sequence[Output]) -> int:
    """The bytes a unit holds while written: its sources (the stored chunks a part of one
    decodes: `Input.touched_bytes`), and what transforms make anew."""
    inputs = {i.key: i.touched_bytes for o in unit for i in o.inputs}
    return sum(inputs.values()) + sum(o.nbytes for o in unit if not o.transform.is_identity)

  def read_bytes(self, batch: Sequence[Sequence[Output]]) -> int:
    return bytes_read(o for unit in batch for o in unit)

  def read(self, batch: Sequence[Sequence[Output]]) -> dict[tuple, Any]:
    return read_inputs([o for unit in batch for o in unit], self.numpy)

  def make(self, unit: Sequence[Output], values: dict[tuple, Any]) -> Iterator[executor.Made]:
    for output in unit:
      value = make(output, values)
      check_range(output, value)
      yield output, value


def write(
    outputs: Sequence[Output], sink: executor.Sink, budget: int, progress: reader.Progress,
    *, on_host: bool = False, ahead: bool = False,
) -> dict[str, Any]:
  """Streams outputs into a sink, a batch of at most `budget` bytes at a time (the one
  executor, `executor.run`, with the `OnHost` placement).

  Args:
    outputs: what to write, in order.
    sink: where.
    budget: bytes of sources (and of what transforms make) per batch.
    progress: told the bytes read after each batch.
    on_host: read and transform as numpy on the host (`OnHost.numpy`).
    ahead: read the next batch while this one is written (`reads_ahead`; the
      budget is then each of two batches').

  Returns:
    What the sink records (see `Sink.close`).

  Raises:
    InvalidOptionError: a value left its output dtype's range (see
      `check_range`); the caller's staging removes what was written.
  """
  if on_host:  # Host writes (safetensors) take a tensor too large for a batch in blocks.
    outputs = [block for o in outputs for block in row_blocks(o, budget)]
  return executor.run(outputs, OnHost(on_host), sink, budget, progress, ahead=ahead)


def bytes_read(outputs: Iterable[Output]) -> int:
  """The bytes of the sources `outputs` read, each source once."""
  read = {i.key: i.nbytes for o in outputs for i in o.inputs}
  return sum(read.values())


class OrbaxItemSink:
  """An Orbax PyTree item, written batch by batch with Orbax's own handler.

  With OCDBT (Orbax's default) every save adds its arrays to the item's
  per-process database, and Orbax appends to `_sharding` and
  `array_metadatas/` itself; each save writes `_METADATA` with its own
  leaves only, so every save's entries are kept and written once at the end
  (the union Orbax's own partial-save finalization makes), with the
  containers the item records, before Orbax's `finalize`. A CRC-32 of every
  value is taken beside the write (see `checksums`).
  """

  def __init__(self, item: ItemOutput, item_dir: epath.Path):
    self._item = item
    self._dir = item_dir
    self._writer = ocp.PyTreeCheckpointHandler(use_zarr3=item.zarr3)
    self._written: list[dict[str, Any]] = []
    self._sums: dict[str, str] = {}
    self._summer = concurrent.futures.ThreadPoolExecutor(1)
    item_dir.mkdir(parents=True, exist_ok=True)

  def write(self, batch: Sequence[executor.Made]) -> None:
    values = [v for _, v in batch]
    # Checksums beside the write (zlib releases the GIL); across processes,
    # each process's parts combined (`global_arrays.checksums_of`).
    summing = self._summer.submit(global_arrays.checksums_of, values)
    with _orbax.tidy_failures():
      self._writer.save(self._dir, args=ocp.args.PyTreeSave(
          nest((o.path, v) for o, v in batch)))
    self._sums.update(zip((checksums.key(o.path) for o, _ in batch), summing.result(),
                          strict=True))
    if job.is_primary():  # Orbax writes `_METADATA` on the primary process only.
      self._written.append(fileio.read_json(self._dir / _orbax.PYTREE_METADATA))

  def close(self) -> dict[str, Any]:
    self._summer.shutdown()
    # Across processes: every process's arrays are written before the
    # primary merges the per-process databases (Orbax's own finalize order).
    consensus.barrier(f'{self._dir.name} written')
    if not job.is_primary():
      return {'checksums': self._sums}
    item = self._item
    key_types = dict(item.key_types or {})
    for output in item.outputs:  # Lists: their positions are sequence keys.
      if output.path not in key_types and item.sequences:
        key_types[output.path] = _key_types(output.path, item.sequences)
    merged = _orbax.merge_tree_metadata(self._written, key_types=key_types or None,
                                        empty_nodes=item.empty)
    (self._dir / _orbax.PYTREE_METADATA).write_text(json.dumps(merged))
    with _orbax.tidy_failures():
      self._writer.finalize(self._dir)
    (self._dir / commit.COMMIT_SUCCESS).write_text(
        f'Checkpoint commit was successful to {self._dir}')
    return {'checksums': self._sums}


def _key_types(path: tuple[str, ...], sequences: frozenset) -> tuple[int, ...]:
  return tuple(
      _orbax.SEQUENCE_KEY if path[:i] in sequences else 2 for i in range(len(path))
  )


# --- safetensors --------------------------------------------------------------

# safetensors' dtype names (its format's `dtype` field).
SAFETENSORS_DTYPES = {
    'float64': 'F64', 'float32': 'F32', 'float16': 'F16', 'bfloat16': 'BF16',
    'int64': 'I64', 'int32': 'I32', 'int16': 'I16', 'int8': 'I8', 'uint8': 'U8',
    'uint16': 'U16', 'uint32': 'U32', 'uint64': 'U64', 'bool': 'BOOL',
    'float8_e4m3fn': 'F8_E4M3', 'float8_e5m2': 'F8_E5M2',
}
SINGLE_FILE = 'model.safetensors'
INDEX_FILE = 'model.safetensors.index.json'
# In every safetensors file an export writes (its header's `__metadata__`): the names of
# every file of that export, as a JSON list; what `force` may later replace (and only it).
FILES_RECORD = 'orbax_tunix.files'
# safetensors' own cap on a header (its readers refuse a larger one).
_MAX_HEADER = 100_000_000


@dataclasses.dataclass(frozen=True)
class Shard:
  """One safetensors file: its name and its tensors (name, dtype, shape), in write order."""

  name: str
  tensors: tuple[tuple[str, str, tuple[int, ...]], ...]

  @property
  def nbytes(self) -> int:
    return sum(math.prod(s) * jnp.dtype(d).itemsize for _, d, s in self.tensors)

  def header(self, metadata: Mapping[str, str] | None = None) -> bytes:
    """The file's JSON header, padded with spaces to 8 bytes (as safetensors writes it);
    `metadata` is added to its `__metadata__` (string values, as the format takes)."""
    entries: dict[str, Any] = {'__metadata__': {'format': 'pt', **(metadata or {})}}
    at = 0
    for name, dtype, shape in self.tensors:
      size = math.prod(shape) * jnp.dtype(dtype).itemsize
      entries[name] = {'dtype': SAFETENSORS_DTYPES[dtype], 'shape': list(shape),
                       'data_offsets': [at, at + size]}
      at += size
    data = json.dumps(entries, separators=(',', ':')).encode()
    return data + b' ' * (-len(data) % 8)


# A transposed view is copied out a block of rows (at most `memory.COPY_BUFFER_BYTES`) at a
# time, each block in strips of STRIP columns: a strip's rows are read from STRIP rows of the
# stored matrix, pages the processor keeps at hand (numpy's own copy of a transposed matrix,
# or square tiles, walks a whole stored row apart per element: 2.5-3.5x slower, measured in
# BENCHMARKS §23). The strips are one numpy call (`_strips`), not a Python loop of copies:
# with a loop, the threads that copy took the GIL for every strip, and on 13 threads together
# they copied slower than one (BENCHMARKS §30). The bytes are copied as unsigned integers of
# the same width: numpy's loops for them are faster than for ml_dtypes' bfloat16 (1.6x) and
# move the same bits.
STRIP = 8


def _raw(array: np.ndarray) -> np.ndarray:
  """The array's elements as unsigned integers of their width (the same bytes), where there
  is one."""
  return array.view(f'u{array.itemsize}') if array.itemsize in (1, 2, 4, 8) else array


def _transposed(array: np.ndarray) -> bool:
  """A 2-D view whose columns lie closer together in memory than its rows (`.T` of a matrix)."""
  return array.ndim == 2 and abs(array.strides[0]) < abs(array.strides[1])


def copy_rows(part: np.ndarray, out: np.ndarray) -> None:
  """`out[...] = part` for `out` C-contiguous: in strips where `part` is transposed."""
  src, dst = _raw(part), _raw(out)
  if not _transposed(part):
    dst[...] = src
    return
  whole = part.shape[1] - part.shape[1] % STRIP
  if whole and src.dtype.kind == 'u':
    np.positive(_strips(src[:, :whole]), out=_strips(dst[:, :whole]))
  else:  # No unsigned view of this width: a copy per strip.
    whole = 0
  for col in range(whole, part.shape[1], STRIP):
    dst[:, col:col + STRIP] = src[:, col:col + STRIP]


def _strips(matrix: np.ndarray) -> np.ndarray:
  """A 2-D view, its columns a multiple of STRIP, as (strip, row, column in the strip): a
  ufunc of unsigned integers copies it in that order (numpy keeps the given order of axes
  where its operands' strides disagree on it) in one call, the GIL released throughout."""
  rows, cols = matrix.shape
  row_stride, col_stride = matrix.strides
  return np.lib.stride_tricks.as_strided(
      matrix, (cols // STRIP, rows, STRIP), (STRIP * col_stride, row_stride, col_stride))


def row_pieces(array: np.ndarray, piece_bytes: int) -> list[tuple[int, np.ndarray]]:
  """An array as consecutive blocks of its rows of about `piece_bytes` each (at least one
  row), with the row each starts at: the pieces the safetensors sink copies and writes
  apart. A 0-d or empty array is one piece."""
  if array.ndim == 0 or array.size == 0:
    return [(0, array)]
  rows = max(1, piece_bytes // max(1, array[0].nbytes))
  return [(start, array[start:start + rows]) for start in range(0, array.shape[0], rows)]


def in_write_order(outputs: Sequence[Output]) -> list[Output]:
  """The outputs in the order `write` writes them (those sharing sources together)."""
  return [o for unit in units(outputs) for o in unit]


def shards(outputs: Sequence[Output], max_shard_size: int) -> list[Shard]:
  """Outputs (in write order) split into safetensors files as `transformers` splits them.

  A file holds tensors until the next would take it over
  `max_shard_size` bytes (a larger tensor gets a file of its own), and each
  file holds one dtype (Tunix's loader reads a file as its first tensor's
  dtype). One file is `model.safetensors`; several are
  `model-00001-of-0000N.safetensors`.
  """
  groups: list[list[Output]] = []
  size = 0
  for output in outputs:
    fits = groups and groups[-1][0].dtype == output.dtype and size + output.nbytes <= max_shard_size
    if not fits:
      groups.append([])
      size = 0
    groups[-1].append(output)
    size += output.nbytes
  n = len(groups)
  return [
      Shard(SINGLE_FILE if n == 1 else f'model-{i + 1:05d}-of-{n:05d}.safetensors',
            tuple((o.path[0], o.dtype.name, tuple(o.shape)) for o in group))
      for i, group in enumerate(groups)
  ]


def index(files: Sequence[Shard]) -> dict[str, Any]:
  """`model.safetensors.index.json` for several files, as `transformers` writes it."""
  return {
      'metadata': {'total_size': sum(f.nbytes for f in files)},
      'weight_map': {name: f.name for f in files for name, _, _ in f.tensors},
  }


def recorded_files(folder: epath.Path, single: str = SINGLE_FILE) -> frozenset[str] | None:
  """The files an export by this package wrote in `folder`, as its record says
  (`FILES_RECORD` in the header of its first safetensors file: `single`, or the
  first file the index names); None when there is no such record or it cannot be read."""
  try:
    index = folder / INDEX_FILE
    first = single
    if index.exists():
      weight_map = json.loads(index.read_text()).get('weight_map')
      first = min(weight_map.values())
    if names.why_not_plain(first) is not None:
      return None  # A file of another folder: no record of this one.
    with (folder / first).open('rb') as f:
      (size,) = struct.unpack('<Q', f.read(8))
      if size > _MAX_HEADER:
        return None
      files = json.loads(json.loads(f.read(size))['__metadata__'][FILES_RECORD])
  except (OSError, ValueError, KeyError, TypeError, AttributeError, struct.error):
    return None
  if not isinstance(files, list) or not all(isinstance(n, str) for n in files):
    return None
  return frozenset(files)


class _File:
  """One safetensors file being written: its header written at its start, its tensors'
  bytes each at the place the header gives it (`put`, from any thread on a local disk);
  elsewhere (an object store) in order, as they come."""

  def __init__(self, path: epath.Path, shard: Shard, metadata: Mapping[str, str]):
    header = shard.header(metadata)
    self.start = 8 + len(header)
    # Where each tensor's data starts in the file, in the order of `shard.tensors`.
    self.offsets = []
    at = self.start
    for _, dtype, shape in shard.tensors:
      self.offsets.append(at)
      at += math.prod(shape) * jnp.dtype(dtype).itemsize
    self.local = fileio.is_local(path)
    # Unbuffered where local: its bytes go straight from the arrays to the file.
    self._handle = (open(os.fspath(path), 'wb', buffering=0) if self.local  # noqa: SIM115
                    else path.open('wb'))
    self._at = 0
    self.put(0, np.frombuffer(struct.pack('<Q', len(header)) + header, np.uint8))

  def put(self, at: int, data: np.ndarray) -> None:
    """Writes a contiguous array's bytes at byte `at` of the file."""
    view = memoryview(data.reshape(-1).view(np.uint8))
    if not self.local:  # In order: an object store's file is one stream.
      if at != self._at:
        raise AssertionError(f'bytes at {at} written after {self._at}')
      self._handle.write(view)
      self._at += len(view)
      return
    fd = self._handle.fileno()
    while view:  # A write may take fewer bytes than asked (signals, some file systems).
      n = os.pwrite(fd, view, at)
      view, at = view[n:], at + n

  def close(self) -> None:
    self._handle.close()


class SafetensorsSink:
  """Hugging Face safetensors files, written tensor by tensor as batches arrive.

  Each file's header is known from the plan (`shards`), so a file is opened,
  given its header and then its tensors' bytes: no file, and no batch beyond
  the writer's budget, is held whole. On a local disk a batch's tensors are
  cut into blocks of rows (`row_pieces`), and `threads` threads copy each
  block into C order (`copy_rows`) and write it at its place in its file at
  once (`os.pwrite`; both release the GIL); elsewhere (an object store) they
  are written in order on the caller's thread. `write` returns once its batch
  is written.
  """

  def __init__(self, directory: epath.Path, files: Sequence[Shard],
               listed: Sequence[Shard] | None = None, write_index: bool = True,
               metadata: Mapping[str, str] | None = None, threads: int = 1,
               piece_bytes: int | None = None):
    """Args: the folder; the files to write; the whole export's files (default
    `files`; several processes each write some); whether to write their index;
    what every file's header adds to its `__metadata__`; the threads that copy
    and write (`memory.write_threads`); the bytes of the blocks of rows each copies
    and writes at once (`memory.copy_buffer_bytes`; default `memory.COPY_BUFFER_BYTES`)."""
    self._dir = directory
    self._metadata = dict(metadata or {})
    self._files = list(files)
    self._listed = list(files if listed is None else listed)
    self._write_index = write_index
    self._of = {name: f for f in self._files for name, _, _ in f.tensors}
    # file -> (the file, tensors written, rows written of the next)
    self._open: dict[str, tuple[_File, int, int]] = {}
    parallel = threads > 1 and fileio.is_local(directory)
    self._pool = (concurrent.futures.ThreadPoolExecutor(threads, 'orbax_tunix-write')
                  if parallel else None)
    self._buffers = threading.local()  # Each thread's buffer for `copy_rows`.
    self._piece_bytes = memory.COPY_BUFFER_BYTES if piece_bytes is None else piece_bytes
    directory.mkdir(parents=True, exist_ok=True)

  def write(self, batch: Sequence[executor.Made]) -> None:
    pieces: list[tuple[_File, int, np.ndarray]] = []
    complete: list[_File] = []
    for output, value in batch:
      shard = self._of[output.path[0]]
      file, done, row = self._open.get(shard.name) or (self._start(shard), 0, 0)
      name, dtype, shape = shard.tensors[done]
      start, stop = output.rows or (0, shape[0] if shape else 0)
      if name != output.path[0] or start != row:
        raise AssertionError(f'{shard.name}: expected {name} (from row {row}) next, got'
                             f' {output.path[0]} (from row {start})')
      array = np.asarray(value)
      want = (stop - start, *shape[1:]) if shape else shape
      if array.dtype != jnp.dtype(dtype) or array.shape != want:
        raise AssertionError(f'{name}: planned {dtype}{list(want)}, made {array.dtype}'
                             f'{list(array.shape)}')
      # A tensor made in blocks of rows is their bytes one after another (C order).
      row_bytes = math.prod(shape[1:]) * array.itemsize if shape else 0
      at = file.offsets[done] + start * row_bytes
      pieces += [(file, at + first * row_bytes, piece)
                 for first, piece in row_pieces(array, self._piece_bytes)]
      if shape and stop != shape[0]:
        self._open[shard.name] = (file, done, stop)
      elif done + 1 == len(shard.tensors):
        complete.append(file)
        self._open.pop(shard.name, None)
      else:
        self._open[shard.name] = (file, done + 1, 0)
    self._put_all(pieces)
    for file in complete:
      file.close()

  def _put_all(self, pieces: Sequence[tuple[_File, int, np.ndarray]]) -> None:
    """Every piece written (on the threads, where there are); the first failure raised once
    none is being written any more."""
    if self._pool is None or len(pieces) < 2:
      for piece in pieces:
        self._put(*piece)
      return
    futures = [self._pool.submit(self._put, *piece) for piece in pieces]
    try:
      concurrent.futures.wait(futures, return_when=concurrent.futures.FIRST_EXCEPTION)
    finally:  # Failed or interrupted: the pieces not started are dropped, the others end.
      for future in futures:
        future.cancel()
      concurrent.futures.wait(futures)
    for future in futures:
      if not future.cancelled() and future.exception() is not None:
        raise future.exception()

  def _put(self, file: _File, at: int, piece: np.ndarray) -> None:
    """A block of rows written at byte `at`, copied into C order first where it is strided."""
    if piece.size == 0:
      return
    if not piece.flags.c_contiguous:
      buffer = getattr(self._buffers, 'buffer', None)
      if buffer is None or buffer.nbytes < piece.nbytes:
        buffer = self._buffers.buffer = np.empty(piece.nbytes, np.uint8)
      out = buffer[:piece.nbytes].view(piece.dtype).reshape(piece.shape)
      copy_rows(piece, out)
      piece = out
    file.put(at, piece)

  def _start(self, shard: Shard) -> _File:
    return _File(self._dir / shard.name, shard, self._metadata)

  def close(self) -> dict[str, Any]:
    if self._pool is not None:
      self._pool.shutdown()
    if self._open:
      raise AssertionError(f'files not completed: {sorted(self._open)}')
    if len(self._listed) > 1 and self._write_index:
      (self._dir / INDEX_FILE).write_text(json.dumps(index(self._listed), indent=2))
    return {'files': [f.name for f in self._listed],
            'total_size': sum(f.nbytes for f in self._listed)}

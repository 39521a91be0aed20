"""Convert across processes: arrays on the global mesh of every process's devices.

Each array is split over the processes where its stored chunks split (`placement`), so
each process reads and writes only its own shards; Orbax's multi-host save writes them.
Its checksum is combined from one CRC-32 share per process (`checksums_of`).
"""

from __future__ import annotations

import itertools
import json
import math
import zlib
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import numpy as np

from orbax_tunix.writing import checksums, consensus, job


def _devices() -> np.ndarray:
  """Every process's CPU devices, grouped by process (process 0's first).

  The host's memory, as one process converts on its CPU device: accelerators
  stay free for whatever else the job runs.
  """
  return np.array(sorted(jax.devices('cpu'), key=lambda d: (d.process_index, d.id)))


def placement(shape: Sequence[int], chunks: Sequence[int] | None = None) -> jax.sharding.Sharding:
  """Where an array of `shape` lives while converted across processes.

  Split along one axis over the processes (and over every device when that
  divides too): the first axis whose per-process part is a whole number of
  the source's chunks (`chunks`, the stored chunk shape), so that no chunk
  is read by two processes; without chunks, the first axis that divides
  evenly. Whole on every process when none does (scalars, odd sizes).
  """
  devices = _devices()
  nproc, ndev = job.process_count(), devices.size
  chunks = tuple(chunks) if chunks is not None and len(chunks) == len(shape) else None

  def aligned(axis: int, parts: int) -> bool:
    if shape[axis] % parts:
      return False
    return chunks is None or (shape[axis] // parts) % max(chunks[axis], 1) == 0

  P = jax.sharding.PartitionSpec
  axis = next((a for a in range(len(shape)) if aligned(a, nproc)), None)
  if axis is not None and aligned(axis, ndev):
    return jax.sharding.NamedSharding(jax.sharding.Mesh(devices, ('all',)),
                                      P(*(None,) * axis, 'all'))
  mesh = jax.sharding.Mesh(devices.reshape(nproc, -1), ('processes', 'local'))
  if axis is None:
    return jax.sharding.NamedSharding(mesh, P())
  # Whole on each of the process's devices: read once per process (split
  # over its devices by another axis, every device would read whole chunks).
  # Every sharding spans all devices: JAX moves arrays between hosts only
  # within one device set.
  return jax.sharding.NamedSharding(mesh, P(*(None,) * axis, 'processes'))


def for_saving(value: Any) -> Any:
  """A global array whose process parts are whole on every local device, split over them.

  A part copied to every local device is a replica, which Orbax's save
  slices with one compiled slice per shape (slow); split along another axis
  that divides, a move within each process. Anything else as it is.
  """
  if not isinstance(value, jax.Array) or value.is_fully_addressable:
    return value
  sharding = value.sharding
  if not isinstance(sharding, jax.sharding.NamedSharding) or 'local' not in sharding.mesh.axis_names:
    return value
  spec = list(sharding.spec) + [None] * (value.ndim - len(sharding.spec))
  if 'processes' not in spec or 'local' in spec:
    return value
  local = sharding.mesh.shape['local']
  other = next((b for b, n in enumerate(value.shape) if spec[b] is None and n % local == 0), None)
  if other is None:
    return value
  spec[other] = 'local'
  return jax.device_put(value, jax.sharding.NamedSharding(sharding.mesh,
                                                          jax.sharding.PartitionSpec(*spec)))


def settle(value: Any) -> Any:
  """A global array a transform made (it may lie anywhere) at its `placement`, for saving."""
  if not isinstance(value, jax.Array) or value.is_fully_addressable:
    return value
  target = placement(value.shape)
  if not value.sharding.is_equivalent_to(target, value.ndim):
    value = jax.device_put(value, target)
  return for_saving(value)


def on_host(value: Any) -> np.ndarray:
  """A value whole, on every process (collective for a global array: error paths only)."""
  if isinstance(value, jax.Array) and not value.is_fully_addressable:
    from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top

    return np.asarray(multihost_utils.process_allgather(value, tiled=True))
  return np.asarray(value)


def _local_runs(value: jax.Array) -> Iterator[tuple[int, np.ndarray]]:
  """(byte offset, bytes) of each contiguous run of this process's primary shards."""
  for shard in value.addressable_shards:
    if shard.replica_id == 0:
      yield from _block_runs(shard.index, np.asarray(shard.data), value.shape)


def _process_block(value: jax.Array) -> tuple[tuple[slice, ...], np.ndarray] | None:
  """This process's primary shards as one block (index, data), when they tile a box."""
  shards = [s for s in value.addressable_shards if s.replica_id == 0]
  if not shards or not value.shape:
    return None
  bounds = [[s.indices(n)[:2] for s, n in zip(sh.index, value.shape, strict=True)]
            for sh in shards]
  box = [(min(b[d][0] for b in bounds), max(b[d][1] for b in bounds))
         for d in range(value.ndim)]
  size = math.prod(b - a for a, b in box)
  if sum(math.prod(b - a for a, b in bd) for bd in bounds) != size:
    return None
  data = np.empty([b - a for a, b in box], dtype=value.dtype)
  for shard, bd in zip(shards, bounds, strict=True):
    data[tuple(slice(a - o, b - o) for (a, b), (o, _) in zip(bd, box, strict=True))] = shard.data
  return tuple(slice(a, b) for a, b in box), data


def _block_runs(index: tuple[slice, ...], data: np.ndarray, shape: tuple[int, ...],
                ) -> Iterator[tuple[int, np.ndarray]]:
  """(byte offset, bytes) of each contiguous run of a block of an array.

  A block's elements are contiguous in C order along its trailing dims that it
  covers whole, and the one before them (from dim `k` on).
  """
  bounds = [s.indices(n)[:2] for s, n in zip(index, shape, strict=True)]
  k = len(shape)
  while k > 0 and bounds[k - 1] == (0, shape[k - 1]):
    k -= 1
  k = max(k - 1, 0)
  per_run = math.prod(b - a for a, b in bounds[k:])
  rows = np.ascontiguousarray(data).reshape(-1, per_run or 1)
  starts = [a for a, _ in bounds]
  outer = [range(a, b) for a, b in bounds[:k]]
  for row, lead in zip(rows, itertools.product(*outer), strict=True):
    offset = int(np.ravel_multi_index((*lead, *starts[k:]), shape)) if shape else 0
    yield offset * data.dtype.itemsize, row.view(np.uint8)


def _share_crc(value: jax.Array) -> int:
  """The CRC-32 of the array's bytes with this process's parts in place and zeros elsewhere.

  CRC-32 is affine over GF(2) for a fixed length, so the array's CRC is the
  XOR of every process's share (`checksums.combine_shares`): one number per process,
  however the array is split. The process's shards are joined into one block
  first where they tile one (one run when it spans whole rows).
  """
  block = _process_block(value)
  runs = _local_runs(value) if block is None else _block_runs(*block, value.shape)
  crc, at = 0, 0
  for offset, raw in sorted(runs, key=lambda r: r[0]):
    crc = zlib.crc32(raw, checksums.extend_zeros(crc, offset - at))
    at = offset + raw.size
  return checksums.extend_zeros(crc, value.nbytes - at)


def checksums_of(values: Sequence[Any]) -> list[str]:
  """`checksums.checksum` of each value; global arrays' from every process's share.

  Collective when some value is a global array: every process calls it with
  the same values in the same order.
  """
  spread = [isinstance(v, jax.Array) and not v.is_fully_addressable for v in values]
  if not any(spread):
    return [checksums.checksum(v) for v in values]
  local = [_share_crc(v) if s else 0 for v, s in zip(values, spread, strict=True)]
  everyone = [json.loads(t) for t in consensus.exchange('checksums', json.dumps(local))]
  return [
      f'{checksums.ALGORITHM}:{checksums.combine_shares([p[j] for p in everyone], v.nbytes):08x}'
      if s else checksums.checksum(v)
      for j, (v, s) in enumerate(zip(values, spread, strict=True))
  ]

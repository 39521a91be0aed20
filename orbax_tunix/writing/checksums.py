"""A checksum per array, for the checkpoints this package writes.

TensorStore checks the OCDBT index but not the array data in it: a flipped
byte in a data file comes back as a wrong value, silently, from every reader.
`convert` records a CRC-32 of every array it writes (of the array's bytes in
C order, in the dtype written) in the step's custom metadata; `verify` and
`diff` read the arrays again and compare. A checkpoint this package did not
write has no such record, and damage to its data cannot be detected.

An array split over the processes of a job is summed from one CRC-32 share per
process (`combine_shares`, on GF(2) arithmetic: `extend_zeros`, `crc32_combine`).
"""

from __future__ import annotations

import dataclasses
import functools
import zlib
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from etils import epath

from orbax_tunix import conventions, sizes
from orbax_tunix.keypaths import Path, fmt
from orbax_tunix.reading import memory, reader

# Where in `_CHECKPOINT_METADATA`'s custom metadata the checksums sit: under
# the record `convert` writes, {item: {formatted path: 'crc32:%08x'}}.
RECORD_KEY = conventions.PROVENANCE_KEY
KEY = 'checksums'
ALGORITHM = 'crc32'


def checksum(value: Any) -> str:
  """The checksum of one leaf's value as written: 'crc32:0123abcd'.

  Typed PRNG keys count as their key data; strings as their UTF-8 bytes.
  `zlib.crc32` releases the GIL on large buffers, so callers may run it in a
  thread beside the write.
  """
  if isinstance(value, str):
    data = value.encode()
  else:
    if isinstance(value, jax.Array) and jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key):
      value = jax.random.key_data(value)
    data = np.ascontiguousarray(np.asarray(value)).reshape(-1).view(np.uint8)
  return f'{ALGORITHM}:{zlib.crc32(data):08x}'


def recorded(custom_metadata: Mapping[str, Any]) -> dict[str, dict[str, str]]:
  """The checksums a step records ({item: {path text: checksum}}), or {} when none."""
  record = custom_metadata.get(RECORD_KEY)
  found = record.get(KEY) if isinstance(record, dict) else None
  if not isinstance(found, dict):
    return {}
  return {item: dict(sums) for item, sums in found.items() if isinstance(sums, dict)}


def key(path: Path) -> str:
  """How a canonical path is written in the record."""
  return fmt(path)


@dataclasses.dataclass(frozen=True)
class Verification:
  """What `verify` found.

  Attributes:
    step_dir: the step checked.
    checked: leaves read and compared with their checksum.
    damaged: leaves whose data does not match the checksum recorded.
    unrecorded: leaves the record has no checksum for (not checked).
    missing: leaves the record names that the step does not hold.
    unreadable: leaves whose stored data could not be read (a truncated or
      missing data file): damaged too.
  """

  step_dir: epath.Path
  checked: int
  damaged: tuple[str, ...]
  unrecorded: tuple[str, ...]
  missing: tuple[str, ...]
  unreadable: tuple[str, ...] = ()

  @property
  def ok(self) -> bool:
    return not (self.damaged or self.missing or self.unreadable)


def verify(
    ckpt: reader.Source,
    *,
    memory_budget: int | float | str,
    progress: reader.Progress | None = None,
) -> Verification | None:
  """Reads every array of a step and compares it with its recorded checksum.

  Args:
    ckpt: the step, opened (only its items are checked: a step opened with
      some `items`, or through an item directory, is checked for those).
    memory_budget: bytes the streaming may hold at once (`sizes.parse_size`).
    progress: told the bytes checked after each batch.

  Returns:
    A `Verification`, or None when the step records no checksums (it was not
    written by `convert`).
  """
  memory_budget = sizes.parse_size(memory_budget, 'memory_budget')
  sums = recorded(ckpt.detection.source.custom_metadata)
  if not sums:
    return None
  progress = progress or reader.NullProgress()
  damaged, unreadable, checked = [], [], 0
  listed = {(item, key(leaf.path)) for item, leaves in ckpt.items.items() for leaf in leaves}
  # Only the items opened are checked (`items`, an item directory), and those
  # the step records but lacks: another item's checksums say nothing of these.
  looked_at = set(ckpt.items) | set(ckpt.detection.absent)
  missing = sorted(
      f'{item}/{path}' for item, paths in sums.items() if item in looked_at
      for path in paths if (item, path) not in listed
  )
  every = [leaf for item in sorted(ckpt.items) for leaf in ckpt.items[item]]
  todo = [leaf for leaf in every if key(leaf.path) in sums.get(leaf.item, {})]
  unrecorded = [leaf.name for leaf in every if key(leaf.path) not in sums.get(leaf.item, {})]
  if todo:  # Each is read whole to be checked.
    largest = max(todo, key=lambda leaf: leaf.nbytes)
    memory.check_machine(largest.nbytes, ckpt.step_dir, f'{largest.name} (shape'
                         f' {largest.shape} {largest.dtype}), read whole to be checked,')
  progress.start(sum(leaf.nbytes for leaf in todo), 'verifying')
  try:
    for item in sorted(ckpt.items):
      leaves = [leaf for leaf in todo if leaf.item == item]
      for batch, values in reader.stream(
          memory.batches(leaves, memory.batch_bytes(memory_budget, memory.READ_COPIES)),
          lambda batch, item=item: reader.read_each(ckpt, item, batch), progress,
          lambda batch: sum(leaf.nbytes for leaf in batch)):
        for leaf, value in zip(batch, values, strict=True):
          if value is reader.UNREADABLE:
            unreadable.append(leaf.name)
            continue
          checked += 1
          if checksum(value) != sums[item][key(leaf.path)]:
            damaged.append(leaf.name)
        del values, value
  finally:
    progress.finish()
  return Verification(ckpt.step_dir, checked, tuple(damaged), tuple(unrecorded), tuple(missing),
                      tuple(unreadable))


def as_record(value: Any) -> Any:
  """A side leaf's value as JSON keeps it: a number (or its text), or, for an
  array, its shape, dtype and checksum (`checksum`)."""
  array = np.asarray(value)
  if array.ndim == 0:
    item = array[()]
    if isinstance(item, np.floating):
      return float(item)
    if isinstance(item, np.integer | np.bool_):
      return item.item()
    return str(item)
  return {'shape': list(array.shape), 'dtype': str(array.dtype),
          'checksum': checksum(array)}


# --- CRC-32 arithmetic: checksums of arrays split over processes, from their parts ------


def combine_shares(shares: Sequence[int], nbytes: int) -> int:
  """The whole array's CRC-32 from every process's share: each the CRC-32 of the array's
  bytes with that process's parts in place and zeros elsewhere (`global_arrays.checksums_of`).

  CRC-32 is affine over GF(2) for a fixed length, so the array's CRC is the XOR of the
  shares, one f(0) added back where their count is even.
  """
  crc = 0
  for share in shares:
    crc ^= share
  # f(a ^ b) = f(a) ^ f(b) ^ f(0): an even number of shares leaves one f(0) out.
  return crc ^ extend_zeros(0, nbytes) if len(shares) % 2 == 0 else crc


def _gf2_times(matrix: Sequence[int], vector: int) -> int:
  total, i = 0, 0
  while vector:
    if vector & 1:
      total ^= matrix[i]
    vector >>= 1
    i += 1
  return total


def _gf2_square(matrix: Sequence[int]) -> list[int]:
  return [_gf2_times(matrix, row) for row in matrix]


@functools.lru_cache(maxsize=256)
def _zeros_operator(nbytes: int) -> tuple[int, ...]:
  """The GF(2) matrix that advances a CRC-32 register over `nbytes` zero bytes."""
  result = [1 << i for i in range(32)]  # Identity.
  power = [0xEDB88320] + [1 << n for n in range(31)]  # One zero bit.
  for _ in range(3):
    power = _gf2_square(power)  # One zero byte.
  n = nbytes
  while n:
    if n & 1:
      result = [_gf2_times(power, col) for col in result]
    n >>= 1
    if n:
      power = _gf2_square(power)
  return tuple(result)


def extend_zeros(crc: int, nbytes: int) -> int:
  """crc32(A + bytes(nbytes)) from crc32(A), without the zeros."""
  if nbytes <= 0:
    return crc
  return _gf2_times(_zeros_operator(nbytes), crc ^ 0xFFFFFFFF) ^ 0xFFFFFFFF


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
  """The CRC-32 of A+B from crc32(A), crc32(B) and len(B) (zlib's crc32_combine)."""
  if len2 <= 0:
    return crc1
  return _gf2_times(_zeros_operator(len2), crc1) ^ crc2

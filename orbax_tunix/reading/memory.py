"""How much memory streaming holds: one set of constants, one batching by bytes.

Everything here that reads arrays reads them in batches sized by bytes and
released before the next: the device executor (restore into MaxText's state,
LoRA merge), the streaming writer (convert, export), `diff` and `verify`. Each
holds a fixed overhead whatever the batch, a number of bytes per byte of a
batch while it is read and used (its copies in flight), and, in a process of a
multi-process job, the job's own overhead once. All measured with
`benchmarks/convert_memory.py` and `benchmarks/multihost.py` (BENCHMARKS §§6, 12).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from orbax_tunix import errors

DEFAULT_MEMORY_BUDGET = 1 << 30
# Held whatever the batch size: TensorStore's thread pools and caches, allocator slack.
FIXED_OVERHEAD = 64 << 20
# Held by a process of a multi-process job beyond one process alone, whatever the batch:
# JAX's distributed client, gloo's buffers, the programs that place global arrays and
# Orbax's multi-host save (55 to 120 MiB measured, budgets 128M to 512M).
JOB_OVERHEAD = 128 << 20
# Bytes held per byte of a batch. Writing: TensorStore holds the compressed bytes and the
# decoded array while reading, the host copy and the compressed bytes while writing, and
# freed buffers are not all returned at once (2.5 to 4.5 measured; sized for the worst).
WRITE_COPIES = 5
# Writing host files (safetensors): TensorStore holds the compressed bytes and the decoded
# array while reading, the array alone while its file is written (its blocks are copied into
# C order in the writing threads' own buffers, `COPY_BUFFER_BYTES`); 1.5 to 2 measured per
# byte of the two batches in flight (BENCHMARKS §23), sized with the same margin as above.
HOST_WRITE_COPIES = 3
# Comparing or checksumming: the compressed bytes and the decoded array.
READ_COPIES = 2
# The device executor (a restore has no budget of its own: the caller's state is the
# target): sources held at once beside the outputs they make, at least one group. A group
# is one Orbax restore, whose fixed cost at 64 MiB groups was a quarter of a QLoRA read's
# time on a TPU v5e host; at 256 MiB it is within noise of one restore (BENCHMARKS §28).
DEVICE_GROUP_BYTES = 256 << 20
# Held by each thread that writes host files (safetensors), whatever the batch: the block of
# rows of a transposed tensor it copies into C order before writing it (less under a small
# budget: `copy_buffer_bytes`).
COPY_BUFFER_BYTES = 4 << 20
# At most this share of the budget goes to those threads' buffers (the rest to the batches).
THREAD_BUFFER_SHARE = 8
# Overrides `host_threads` (e.g. 4; at least 1).
THREADS_VARIABLE = 'ORBAX_TUNIX_THREADS'


def host_threads() -> int:
  """The threads the host work may use: the CPUs this process may run on (its affinity, as
  `taskset` and container limits set it), or `ORBAX_TUNIX_THREADS` where set.

  Raises:
    InvalidOptionError: `ORBAX_TUNIX_THREADS` is not a whole number of at least 1.
  """
  given = os.environ.get(THREADS_VARIABLE)
  if given is not None:
    try:
      threads = int(given)
    except ValueError:
      threads = 0
    if threads < 1:
      raise errors.InvalidOptionError(
          f'{THREADS_VARIABLE}={given!r}: expected a whole number of threads, at least 1.'
          f' Set it to the threads to use (e.g. 8), or unset it to use every CPU this process'
          ' may run on.')
    return threads
  affinity = getattr(os, 'sched_getaffinity', None)
  return max(1, len(affinity(0)) if affinity is not None else os.cpu_count() or 1)


def write_threads(memory_budget: int) -> int:
  """Threads that copy and write host files (`host_threads`), as many as a share of the budget
  (`THREAD_BUFFER_SHARE`) holds buffers for (`COPY_BUFFER_BYTES` each); at least 1."""
  return max(1, min(host_threads(),
                    memory_budget // THREAD_BUFFER_SHARE // COPY_BUFFER_BYTES))


def copy_buffer_bytes(memory_budget: int) -> int:
  """Bytes of the block each writing thread copies and writes at once: `COPY_BUFFER_BYTES`,
  or less where a budget's share (`THREAD_BUFFER_SHARE`) does not hold one (a block is at
  least a row, as a batch is); at least 1."""
  return max(1, min(COPY_BUFFER_BYTES, memory_budget // THREAD_BUFFER_SHARE))


# glibc's `mallopt` parameter, and the size from which it maps each allocation apart.
_M_MMAP_THRESHOLD = -3
MMAP_FROM = 1 << 20


def return_freed_memory() -> bool:
  """Has this process's allocator give back each freed batch (glibc: every buffer from
  `MMAP_FROM` bytes mapped apart, and unmapped when freed), for a process that streams
  batches (the command line). glibc otherwise raises that size to 32 MiB as large buffers
  are freed, then keeps freed batches of up to that in its heaps: the process's memory
  grows by batches it no longer holds (~150 MiB measured exporting a 128-expert MoE,
  BENCHMARKS §22). Returns whether it was set (False elsewhere than glibc)."""
  if not sys.platform.startswith('linux'):
    return False
  try:
    return bool(ctypes.CDLL(None).mallopt(_M_MMAP_THRESHOLD, MMAP_FROM))
  except (OSError, AttributeError):  # Another C library (musl has no mallopt).
    return False


def batch_bytes(memory_budget: int, copies: int, *, job: bool = False,
                in_flight: int = 1, held: int = 0) -> int:
  """Bytes of array data per batch so that streaming fits `memory_budget`.

  Args:
    memory_budget: bytes the streaming may use above the process's start-up.
    copies: bytes held per byte of a batch while it is read and used.
    job: this process is one of a multi-process job (`JOB_OVERHEAD` is held once).
    in_flight: batches held at once (2 where the next is read while one is written).
    held: bytes held whatever the batch beside `FIXED_OVERHEAD` (the writing threads'
      buffers).

  Returns:
    (budget - overheads) / copies / in_flight, and at least budget / (4 * copies)
    / in_flight so that small budgets still make progress; at least 1.
  """
  budget = max(memory_budget - (JOB_OVERHEAD if job else 0) - held, 1)
  per = max(budget // (4 * copies), (budget - FIXED_OVERHEAD) // copies, 1)
  return max(per // in_flight, 1)


def holds_two_batches(memory_budget: int) -> bool:
  """Whether a budget holds two batches above the fixed overhead (one read ahead)."""
  return memory_budget >= 2 * FIXED_OVERHEAD


def shortfall(memory_budget: int, largest: int, what: str, copies: int, *,
              job: bool = False) -> str | None:
  """A note when `memory_budget` cannot hold the largest `what` (each is streamed alone)."""
  fixed = FIXED_OVERHEAD + (JOB_OVERHEAD if job else 0)
  needed = fixed + copies * largest
  if memory_budget >= needed:
    return None
  return (f'`memory_budget` {memory_budget} bytes cannot be met: streaming needs about'
          f' {needed} ({fixed >> 20} MiB whatever the batch, and'
          f' {copies}x the largest {what}, {largest} bytes, in flight); each'
          f' {what} is copied alone, and the peak will be about that')


# Where a container's memory limit is (cgroup v2, then v1; "max" or a huge number: none).
_CGROUP_LIMITS = ('/sys/fs/cgroup/memory.max', '/sys/fs/cgroup/memory/memory.limit_in_bytes')


def machine_bytes() -> int | None:
  """The memory this process may ever have: the machine's, or its container's limit where
  lower; None where neither can be told."""
  found = []
  with contextlib.suppress(ValueError, OSError, AttributeError):
    found.append(os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES'))
  for path in _CGROUP_LIMITS:
    with contextlib.suppress(OSError, ValueError), open(path) as f:
      text = f.read().strip()
      if text != 'max':
        found.append(int(text))
  return min((n for n in found if n > 0), default=None)


def check_machine(held: int, where: object, what: str) -> None:
  """Refuses work that must hold `held` bytes at once where the machine has less memory.

  A lower bound is passed (what any batch size holds: the array itself where it is held
  whole, else the stored chunks one read decodes), so that nothing that could run is
  refused; a size beyond the machine is either a checkpoint for a larger machine or
  metadata claiming what its data is not (an edited header).

  Args:
    held: bytes that must be held at once.
    where: the checkpoint (its step directory), for messages.
    what: what holds them, for messages (e.g. "model_params/w (shape (4, 4) float32),
      written whole").

  Raises:
    TunixCheckpointError: naming `what`, both sizes and what to do; before anything is
      read or written.
  """
  machine = machine_bytes()
  if machine is None or held <= machine:
    return
  raise errors.TunixCheckpointError(
      f'{where}: {what} must be held at once, {held} bytes, and this machine has {machine}'
      " bytes of memory (its RAM, or its container's limit): no batch size fits it, and"
      ' nothing was read or written. Run it on a machine with more memory; or, if the'
      ' checkpoint should not hold an array this large, its metadata is damaged or was'
      ' edited (use another step, or a trusted copy).'
  )


def batches(items: Sequence[Any], budget: int, size: Callable[[Any], int] | None = None
            ) -> Iterator[list[Any]]:
  """Groups items, in order, into batches of at most `budget` bytes.

  An item larger than the budget forms a batch of its own: it cannot be split. Items that
  hold no bytes (a read straight into its output) join the batch at hand, and a batch
  that holds no bytes yet takes the next item whatever its size.

  Args:
    items: what is to be read, in order.
    budget: bytes per batch (at least 1).
    size: an item's bytes (default: its `nbytes`).

  Yields:
    Lists of consecutive items.
  """
  size = size or (lambda item: item.nbytes)
  batch: list[Any] = []
  total = 0
  for item in items:
    nbytes = size(item)
    if batch and total and nbytes and total + nbytes > budget:
      yield batch
      batch, total = [], 0
    batch.append(item)
    total += nbytes
  if batch:
    yield batch

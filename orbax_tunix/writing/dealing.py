"""Export across processes: the files dealt out to the processes by bytes, so each reads
whole tensors for its own files only."""

from __future__ import annotations

from collections.abc import Sequence

from orbax_tunix.writing import job


def deal(sizes: Sequence[int], count: int) -> list[int]:
  """The process each item goes to: largest first, to the least loaded (ties: lowest index).

  Deterministic, so every process computes the same deal.
  """
  load = [0] * count
  owner = [0] * len(sizes)
  for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
    p = min(range(count), key=lambda p: (load[p], p))
    owner[i] = p
    load[p] += sizes[i]
  return owner


def mine(sizes: Sequence[int]) -> list[int]:
  """The indices of the items (of these sizes) this process handles."""
  me = job.process_index()
  return [i for i, p in enumerate(deal(sizes, job.process_count())) if p == me]

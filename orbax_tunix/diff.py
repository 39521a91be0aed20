"""Diff: two checkpoints compared leaf by leaf in canonical form, streaming.

Both sides are opened with `reader.open_checkpoint` (Tunix checkpoints in
their canonical form, any other Orbax checkpoint as it is), their leaves are
matched by `item/path`, and the leaves both sides hold with one shape are read
in batches that fit the memory budget and compared value by value (the largest
absolute difference per leaf). `params_only` compares the weights alone (see
`reader.weights`), which matches a Tunix step against its MaxText
parameter conversion.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Iterable, Sequence

import numpy as np
from etils import epath

from orbax_tunix import checksums, reader
from orbax_tunix.keypaths import fmt

DEFAULT_MEMORY_BUDGET = reader.DEFAULT_MEMORY_BUDGET
# Bytes held per byte read from either side: the compressed bytes and the
# decoded array. A batch (A's and B's leaves together) is sized budget / this.
COPIES_IN_FLIGHT = 2
# Elements compared at once, so that the float64 working copies stay small.
_CHUNK = 1 << 18


@dataclasses.dataclass(frozen=True)
class Mismatch:
  """One leaf that differs.

  Attributes:
    path: 'item/canonical/path' (the weight path with `params_only`).
    a: what A holds, e.g. '(8, 8) float32'.
    b: what B holds.
  """

  path: str
  a: str
  b: str


@dataclasses.dataclass(frozen=True)
class ValueDiff:
  """A leaf whose values differ by more than the tolerance."""

  path: str
  max_abs_diff: float
  differing: int
  size: int


@dataclasses.dataclass(frozen=True)
class DiffResult:
  """What `diff_checkpoints` found.

  Attributes:
    a, b: the two step directories compared.
    only_a, only_b: paths present on one side only.
    shape: leaves whose shapes differ (values not compared).
    dtype: leaves whose dtypes differ (values compared after upcasting).
    values: leaves whose values differ by more than `atol`.
    damaged_a, damaged_b: leaves whose data does not match the checksum their
      checkpoint records (see `checksums`; only checkpoints `convert` wrote
      record them).
    compared: number of leaves whose values were compared.
    bytes_compared: array bytes read from A for them.
    atol: the tolerance.
    max_abs_diff: the largest difference over every compared leaf.
    seconds: wall time.
  """

  a: epath.Path
  b: epath.Path
  only_a: tuple[str, ...]
  only_b: tuple[str, ...]
  shape: tuple[Mismatch, ...]
  dtype: tuple[Mismatch, ...]
  values: tuple[ValueDiff, ...]
  compared: int
  bytes_compared: int
  atol: float
  max_abs_diff: float
  seconds: float
  ignore_dtype: bool = False
  damaged_a: tuple[str, ...] = ()
  damaged_b: tuple[str, ...] = ()

  @property
  def match(self) -> bool:
    return not (
        self.only_a
        or self.only_b
        or self.shape
        or self.values
        or self.damaged_a
        or self.damaged_b
        or (self.dtype and not self.ignore_dtype)
    )


def _describe(leaf: reader.LeafInfo) -> str:
  if leaf.kind == reader.STRING:
    return 'string'
  return f'{leaf.shape} {leaf.dtype}'


def _as_comparable(x: np.ndarray) -> np.ndarray:
  """A copy of `x` that subtracts meaningfully with a float: float64 (complex128)."""
  if np.issubdtype(x.dtype, np.complexfloating):
    return x.astype(np.complex128)
  return x.astype(np.float64)


def _is_integral(x: np.ndarray) -> bool:
  return x.dtype.kind in 'biu'


def _integer_deltas(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """|x - y| of two integer (or bool) arrays, exactly, as uint64.

  No int64 overflow and no float rounding: each side is widened to int64 or
  uint64 and the difference of the larger and the smaller is taken in
  uint64 arithmetic, which is exact while it is below 2**64 (always, when
  both are signed or both unsigned).

  Returns:
    (deltas, wrapped): where `wrapped` (a signed side negative against an
    unsigned one) the true difference is the delta plus 2**64.
  """
  x = x.astype(np.int64 if x.dtype.kind == 'i' else np.uint64)
  y = y.astype(np.int64 if y.dtype.kind == 'i' else np.uint64)
  if x.dtype == y.dtype:
    hi, lo = np.maximum(x, y), np.minimum(x, y)
    return hi.view(np.uint64) - lo.view(np.uint64), np.zeros(x.shape, bool)
  signed, unsigned = (x, y) if x.dtype.kind == 'i' else (y, x)
  negative = signed < 0
  as_unsigned = signed.view(np.uint64)
  apart = np.maximum(unsigned, as_unsigned) - np.minimum(unsigned, as_unsigned)
  beyond = unsigned + (np.uint64(0) - as_unsigned)  # u + |s| for s < 0 (mod 2**64).
  deltas = np.where(negative, beyond, apart)
  return deltas, negative & (beyond < unsigned)


def _compare_integers(x: np.ndarray, y: np.ndarray, atol: float) -> tuple[float, int]:
  """(max |x - y|, how many differ by more than `atol`) of integer arrays, exactly."""
  deltas, wrapped = _integer_deltas(x, y)
  if not deltas.size:
    return 0.0, 0
  exact = [int(d) + 2**64 for d in deltas[wrapped]]  # Rare: Python ints, exact.
  plain = deltas[~wrapped]
  worst = max(([int(plain.max())] if plain.size else []) + exact)
  limit = math.floor(atol) if math.isfinite(atol) else None  # d > atol <=> d > floor(atol)
  if limit is None or limit >= 2**64:
    beyond = 0
  else:
    beyond = int(np.count_nonzero(plain > np.uint64(limit)))
  beyond += sum(d > atol for d in exact)
  return float(worst), beyond


def _compare_floats(x: np.ndarray, y: np.ndarray, atol: float) -> tuple[float, int]:
  """(max |x - y|, how many differ by more than `atol`), in float64 (complex128)."""
  x, y = _as_comparable(x), _as_comparable(y)
  with np.errstate(invalid='ignore', over='ignore'):
    delta = np.abs(x - y)
  beyond = delta > atol
  x_nan, y_nan = np.isnan(x), np.isnan(y)
  delta = np.where(x_nan & y_nan, 0.0, np.where(x_nan ^ y_nan, np.inf, delta))
  beyond = (beyond & ~(x_nan | y_nan)) | (x_nan ^ y_nan)
  if not delta.size:
    return 0.0, 0
  return float(np.max(delta)), int(np.count_nonzero(beyond))


def compare_values(a: object, b: object, atol: float = 0.0) -> tuple[float, int]:
  """Largest absolute difference between two same-shaped values, and how many differ.

  Integers (and booleans) against integers are compared exactly, whatever
  their width and sign (`2**62` against `-2**62`, `2**63 + 1` against
  `2**63 + 3`). Anything against a float is compared in float64: NaNs at the
  same place count as equal; a NaN against a number differs whatever the
  tolerance (its difference counts as infinite). Worked through in chunks,
  so the working copies stay at `_CHUNK` elements whatever the size of the
  arrays.

  Args:
    a, b: arrays (or scalars, or strings) of one shape.
    atol: elements differ when |a - b| > atol.

  Returns:
    (max |a - b| over all elements, as a float; number of elements that differ).
  """
  if isinstance(a, str) or isinstance(b, str):
    return (0.0, 0) if a == b else (float('inf'), 1)
  a = np.asarray(a).reshape(-1)
  b = np.asarray(b).reshape(-1)
  exact = _is_integral(a) and _is_integral(b)
  worst, differing = 0.0, 0
  for start in range(0, a.size, _CHUNK):
    x, y = a[start : start + _CHUNK], b[start : start + _CHUNK]
    most, beyond = (_compare_integers if exact else _compare_floats)(x, y, atol)
    worst, differing = max(worst, most), differing + beyond
  return worst, differing


def _damaged(sums: dict[str, dict[str, str]], leaf: reader.LeafInfo, value: object) -> bool:
  """Whether a value read disagrees with the checksum its checkpoint records."""
  want = sums.get(leaf.item, {}).get(checksums.key(leaf.path))
  return want is not None and checksums.checksum(value) != want


def _views(
    ckpt: reader.CanonicalCheckpoint, params_only: bool
) -> dict[str, reader.LeafInfo]:
  if params_only:
    return {fmt(path): leaf for leaf, path in reader.weights(ckpt)}
  return {leaf.name: leaf for leaf in ckpt.leaves}


def _read_side(
    ckpt: reader.CanonicalCheckpoint, leaves: Sequence[reader.LeafInfo]
) -> list[object]:
  """Reads leaves that may span items: one partial restore per item."""
  by_item: dict[str, list[int]] = {}
  for i, leaf in enumerate(leaves):
    by_item.setdefault(leaf.item, []).append(i)
  values: list[object] = [None] * len(leaves)
  for item, indices in by_item.items():
    got = reader.read(ckpt, item, [leaves[i] for i in indices], as_numpy=True)
    for i, value in zip(indices, got, strict=True):
      values[i] = value
  return values


def _open(
    side: epath.PathLike | reader.CanonicalCheckpoint, items: Iterable[str] | None,
    params_only: bool,
) -> reader.CanonicalCheckpoint:
  """One side, opened as far as the comparison needs (a whole step must be whole)."""
  if isinstance(side, reader.CanonicalCheckpoint):
    return side
  if params_only and items is None:
    return reader.open_weights(side)
  ckpt = reader.open_checkpoint(side, items=items)
  if items is None:
    ckpt.detection.require()
  return ckpt


def diff_checkpoints(
    a: epath.PathLike | reader.CanonicalCheckpoint,
    b: epath.PathLike | reader.CanonicalCheckpoint,
    *,
    atol: float = 0.0,
    params_only: bool = False,
    ignore_dtype: bool = False,
    memory_budget: int = DEFAULT_MEMORY_BUDGET,
    progress: reader.Progress | None = None,
    items: Iterable[str] | None = None,
) -> DiffResult:
  """Compares two checkpoints in canonical form.

  Args:
    a, b: checkpoints (root, step or item directory) or opened ones.
    atol: a leaf differs when some element differs by more than this
      (0: exact equality).
    params_only: compare the weights only (no optimizer state, no RNG state);
      a Tunix step then matches its MaxText parameter conversion.
    ignore_dtype: do not count dtype differences (values are still compared,
      upcast to float64, against `atol`): for checking a `--dtype` conversion.
    memory_budget: bytes the streaming may hold at once.
    progress: told the bytes of A compared after each batch.
    items: compare only these items (default: every item of each side).

  Returns:
    A `DiffResult`; `.match` says whether they match.

  Raises:
    TunixCheckpointError subclasses: a side cannot be read.
  """
  start = time.monotonic()
  progress = progress or reader.NullProgress()
  ckpt_a, ckpt_b = (_open(side, items, params_only) for side in (a, b))
  view_a, view_b = _views(ckpt_a, params_only), _views(ckpt_b, params_only)
  only_a = tuple(sorted(set(view_a) - set(view_b)))
  only_b = tuple(sorted(set(view_b) - set(view_a)))
  shape, dtype, pairs = [], [], []
  for path in sorted(set(view_a) & set(view_b)):
    la, lb = view_a[path], view_b[path]
    if la.shape != lb.shape or (la.kind == reader.STRING) != (lb.kind == reader.STRING):
      shape.append(Mismatch(path, _describe(la), _describe(lb)))
      continue
    if la.dtype != lb.dtype:
      dtype.append(Mismatch(path, _describe(la), _describe(lb)))
    pairs.append((path, la, lb))
  values, worst, compared_bytes = [], 0.0, 0
  sums_a = checksums.recorded(ckpt_a.detection.source.custom_metadata)
  sums_b = checksums.recorded(ckpt_b.detection.source.custom_metadata)
  damaged_a: list[str] = []
  damaged_b: list[str] = []
  budget = reader.batch_bytes(memory_budget, COPIES_IN_FLIGHT)
  progress.start(sum(la.nbytes for _, la, _ in pairs), 'comparing')
  try:
    for batch in reader.batches(pairs, budget, size=lambda p: p[1].nbytes + p[2].nbytes):
      got_a = _read_side(ckpt_a, [la for _, la, _ in batch])
      got_b = _read_side(ckpt_b, [lb for _, _, lb in batch])
      for (path, la, lb), x, y in zip(batch, got_a, got_b, strict=True):
        if _damaged(sums_a, la, x):
          damaged_a.append(path)
        if _damaged(sums_b, lb, y):
          damaged_b.append(path)
        max_diff, differing = compare_values(x, y, atol)
        worst = max(worst, max_diff)
        if differing:
          values.append(ValueDiff(path, max_diff, differing, max(1, int(np.size(x)))))
        compared_bytes += la.nbytes
      del got_a, got_b
      progress.advance(sum(la.nbytes for _, la, _ in batch))
  finally:
    progress.finish()
  return DiffResult(
      a=ckpt_a.step_dir,
      b=ckpt_b.step_dir,
      only_a=only_a,
      only_b=only_b,
      shape=tuple(shape),
      dtype=tuple(dtype),
      values=tuple(values),
      compared=len(pairs),
      bytes_compared=compared_bytes,
      atol=atol,
      max_abs_diff=worst,
      seconds=time.monotonic() - start,
      ignore_dtype=ignore_dtype,
      damaged_a=tuple(damaged_a),
      damaged_b=tuple(damaged_b),
  )

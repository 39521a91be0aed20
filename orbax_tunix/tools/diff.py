"""Diff: two checkpoints compared leaf by leaf in canonical form, streaming.

Both sides are opened with `reader.open_checkpoint` (Tunix checkpoints in
their canonical form, any other Orbax checkpoint as it is), their leaves are
matched by `item/path`, and the leaves both sides hold with one shape are read
in batches that fit the memory budget and compared value by value
(`compare_values`: the largest absolute difference per leaf). Beside the arrays:
JSON items, value by value, and the leaves the canonical view leaves out (the
inject_hyperparams values and counts, `hyperparams.side_leaves`, or the record
`convert` keeps of them). `params_only` compares the weights alone (see
`reader.weights`), which matches a Tunix step against its MaxText parameter
conversion.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
from etils import epath

from orbax_tunix import errors, sizes
from orbax_tunix.keypaths import fmt, natural_key
from orbax_tunix.mapping import dequantize
from orbax_tunix.reading import hyperparams, memory, reader
from orbax_tunix.writing import checksums

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
      record them), or whose stored data cannot be read (values not compared).
    compared: number of leaves whose values were compared.
    bytes_compared: array bytes read from A for them.
    atol: the tolerance.
    max_abs_diff: the largest difference over every compared leaf.
    seconds: wall time.
    json: values of JSON items that differ ('item/key/...'; a and b as JSON
      text). Keys on one side only are in `only_a` / `only_b`, as is a JSON
      item one side lacks (its name).
    hyperparameters: leaves outside the canonical view that differ (the
      inject_hyperparams values and counts, labelled as
      `hyperparams.side_leaves` does), a or b ABSENT where one side lacks it.
    notes: what was not compared, and why.
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
  json: tuple[Mismatch, ...] = ()
  hyperparameters: tuple[Mismatch, ...] = ()
  notes: tuple[str, ...] = ()

  @property
  def match(self) -> bool:
    differences = (self.only_a, self.only_b, self.shape, self.values, self.damaged_a,
                   self.damaged_b, self.json, self.hyperparameters)
    return not (any(differences) or (self.dtype and not self.ignore_dtype))


# What a side holds where the other has a value (hyperparameters).
ABSENT = '(absent)'


def _describe(leaf: reader.LeafInfo) -> str:
  if leaf.kind == reader.STRING:
    return 'string'
  return f'{leaf.shape} {leaf.dtype}'


def _is_integral(x: np.ndarray) -> bool:
  return x.dtype.kind in 'biu'


def _widen(x: np.ndarray) -> np.ndarray:
  """An integer (or bool) array as int64 or uint64 (exact)."""
  return x.astype(np.int64 if x.dtype.kind in 'bi' else np.uint64)


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
  x, y = _widen(x), _widen(y)
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


def _greater(x: np.ndarray, y: np.ndarray) -> np.ndarray:
  """x > y of two integer arrays, exactly (numpy compares int64 with uint64 in float64)."""
  x, y = _widen(x), _widen(y)
  if x.dtype == y.dtype:
    return x > y
  if x.dtype.kind == 'i':
    return (x >= 0) & (x.view(np.uint64) > y)
  return (y < 0) | (x > y.view(np.uint64))


def _exact_summary(
    deltas: np.ndarray, wrapped: np.ndarray, atol: float
) -> tuple[float, int]:
  """(max, how many exceed `atol`) of exact differences (`_integer_deltas`' form)."""
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


def _compare_integers(x: np.ndarray, y: np.ndarray, atol: float) -> tuple[float, int]:
  """(max |x - y|, how many differ by more than `atol`) of integer arrays, exactly."""
  return _exact_summary(*_integer_deltas(x, y), atol)


# float64 values that anchor a float to an integer both sides hold exactly:
# the lowest int64, and the largest float64 below 2**64 (a uint64).
_LOWEST, _HIGHEST = -(2.0**63), 2.0**64 - 2048


def _compare_integer_float(
    ints: np.ndarray, floats: np.ndarray, atol: float
) -> tuple[float, int]:
  """(max |i - f|, how many differ by more than `atol`) of integers against real floats.

  Each float is split as f = c + r, c its integer part held to the
  integers' range (a value float64, int64 or uint64 hold exactly) and r the
  rest (exact in float64: a fraction, or beyond that range the distance to
  its edge). i - c is taken exactly (`_integer_deltas`), so a float
  equals an integer only when it is that integer, at any magnitude
  (`float(2**62)` against `2**62 + 1` differs). Where r is 0 (every
  integral float in the integers' range) the whole comparison is exact;
  elsewhere only the final |i - c - r| is rounded to float64. NaNs and infinities are
  compared as floats are.
  """
  f = floats.astype(np.float64)
  finite = np.isfinite(f)
  worst, beyond = _compare_floats(ints[~finite], f[~finite], atol) if not finite.all() else (0.0, 0)
  ints, f = ints[finite], f[finite]
  c = np.clip(np.trunc(f), _LOWEST, _HIGHEST)
  r = f - c  # In (-1, 1) in range; >= 2048 above it; <= -2048 below it.
  for part, kind in ((c < 2.0**63, np.int64), (c >= 2.0**63, np.uint64)):
    if not part.any():
      continue
    i, whole, rest = ints[part], c[part].astype(kind), r[part]
    deltas, wrapped = _integer_deltas(i, whole)
    on_whole = rest == 0
    most, over = _exact_summary(deltas[on_whole], wrapped[on_whole], atol)
    apart = deltas[~on_whole].astype(np.float64) + np.where(wrapped[~on_whole], 2.0**64, 0.0)
    signed = np.where(_greater(i[~on_whole], whole[~on_whole]), apart, -apart)  # i - c
    away = np.abs(signed - rest[~on_whole])
    if away.size:
      most = max(most, float(away.max()))
      over += int(np.count_nonzero(away > atol))
    worst, beyond = max(worst, most), beyond + over
  return worst, beyond


def _compare_floats(x: np.ndarray, y: np.ndarray, atol: float) -> tuple[float, int]:
  """(max |x - y|, how many differ by more than `atol`), in float64 (complex128)."""
  x, y = (v.astype(np.complex128 if np.iscomplexobj(v) else np.float64) for v in (x, y))
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
  `2**63 + 3`); integers against floats too, up to the rounding of a
  non-integral difference (`_compare_integer_float`). Floats against floats
  are compared in float64 (complex128): NaNs at the same place count as
  equal; a NaN against a number differs whatever the tolerance (its
  difference counts as infinite). Worked through in chunks,
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
  if _is_integral(a) and _is_integral(b):
    compare = _compare_integers
  elif _is_integral(a) != _is_integral(b) and not np.iscomplexobj(a) and not np.iscomplexobj(b):
    compare = _compare_integer_float
    a, b = (a, b) if _is_integral(a) else (b, a)  # |a - b| is symmetric.
  else:
    compare = _compare_floats
  worst, differing = 0.0, 0
  for start in range(0, a.size, _CHUNK):
    x, y = a[start : start + _CHUNK], b[start : start + _CHUNK]
    most, beyond = compare(x, y, atol)
    worst, differing = max(worst, most), differing + beyond
  return worst, differing


def _damaged(sums: dict[str, dict[str, str]], leaf: reader.LeafInfo, value: object) -> bool:
  """Whether a value read disagrees with the checksum its checkpoint records."""
  want = sums.get(leaf.item, {}).get(checksums.key(leaf.path))
  return want is not None and checksums.checksum(value) != want


def _views(
    ckpt: reader.Source, params_only: bool
) -> dict[str, reader.LeafInfo]:
  if params_only:
    return {fmt(path): leaf for leaf, path in reader.weights(ckpt)}
  return {leaf.name: leaf for leaf in ckpt.leaves}


def _read_side(
    ckpt: reader.Source, leaves: Sequence[reader.LeafInfo]
) -> list[object]:
  """Reads leaves that may span items: one partial restore per item."""
  by_item: dict[str, list[int]] = {}
  for i, leaf in enumerate(leaves):
    by_item.setdefault(leaf.item, []).append(i)
  values: list[object] = [None] * len(leaves)
  for item, indices in by_item.items():
    got = dequantize.read_each(ckpt, item, [leaves[i] for i in indices])
    for i, value in zip(indices, got, strict=True):
      values[i] = value
  return values


# --- JSON items ---------------------------------------------------------------


def _same_json(x: Any, y: Any) -> bool:
  """Two JSON scalars are the same value (numbers by value, NaN as NaN; a bool is no number)."""
  if type(x) in (int, float) and type(y) in (int, float):
    return x == y or (x != x and y != y)  # pylint: disable=comparison-with-itself
  return type(x) is type(y) and x == y


def _json_text(value: Any, limit: int = 120) -> str:
  text = json.dumps(value, sort_keys=True)
  return text if len(text) <= limit else text[: limit - 3] + '...'


@dataclasses.dataclass
class _Found:
  """What a comparison collects: paths on one side only, and values that differ."""

  only_a: list[str] = dataclasses.field(default_factory=list)
  only_b: list[str] = dataclasses.field(default_factory=list)
  differ: list[Mismatch] = dataclasses.field(default_factory=list)


def _children(value: Any) -> dict[str, Any] | None:
  """A JSON container's children by key (a list's positions as '0', '1', ...); None for a scalar."""
  if isinstance(value, dict):
    return {str(k): v for k, v in value.items()}
  if isinstance(value, list):
    return {str(i): v for i, v in enumerate(value)}
  return None


def _compare_json(a: Any, b: Any, path: tuple[str, ...], found: _Found) -> None:
  """Compares two JSON values key by key, into `found`."""
  kids_a, kids_b = _children(a), _children(b)
  if kids_a is None or kids_b is None or isinstance(a, list) != isinstance(b, list):
    if kids_a is not None or kids_b is not None or not _same_json(a, b):
      found.differ.append(Mismatch(fmt(path), _json_text(a), _json_text(b)))
    return
  for key in sorted(kids_a.keys() | kids_b.keys(), key=natural_key):
    if key not in kids_b:
      found.only_a.append(fmt(path + (key,)))
    elif key not in kids_a:
      found.only_b.append(fmt(path + (key,)))
    else:
      _compare_json(kids_a[key], kids_b[key], path + (key,), found)


def _compare_json_items(
    ckpt_a: reader.Source, ckpt_b: reader.Source, found: _Found
) -> int:
  """Compares the JSON items of both sides (`convert` copies them); returns how many."""
  names_a, names_b = set(ckpt_a.json_items), set(ckpt_b.json_items)
  found.only_a += sorted(names_a - names_b)
  found.only_b += sorted(names_b - names_a)
  for name in sorted(names_a & names_b):
    _compare_json(reader.read_json_item(ckpt_a, name), reader.read_json_item(ckpt_b, name),
                  (name,), found)
  return len(names_a & names_b)


# --- the leaves outside the canonical view -----------------------------------------


def _recorded_side(ckpt: reader.Source) -> dict[str, Any] | None:
  """The side leaves a step `convert` wrote records of its source, or None."""
  record = ckpt.detection.source.custom_metadata.get(checksums.RECORD_KEY)
  found = record.get(hyperparams.RECORD_KEY) if isinstance(record, dict) else None
  return dict(found) if isinstance(found, dict) else None


def _side_of(
    ckpt: reader.Source, items: Iterable[str] | None
) -> dict[str, Any] | None:
  """The leaves outside a side's canonical view, by label (`hyperparams.side_leaves`).

  Read from the step when it holds them (Tunix); else as a conversion's
  record keeps them. None when the side holds no such information.
  """
  detection = ckpt.detection
  leaves = hyperparams.side_leaves(detection)
  if leaves:
    return hyperparams.read_side_leaves(detection, leaves)
  if detection.is_tunix:
    return {}  # Its optimizer (if any) has no inject_hyperparams shell.
  recorded = _recorded_side(ckpt)
  if recorded is None or items is None:
    return recorded
  wanted = set(items)
  return {k: v for k, v in recorded.items() if k.split('/', 1)[0] in wanted}


def _side_value(value: Any) -> Any:
  """A side leaf's value in one form for both sources (`checksums.as_record`)."""
  return value if isinstance(value, dict) else checksums.as_record(value)


def _compare_side(
    a: dict[str, Any], b: dict[str, Any], atol: float
) -> list[Mismatch]:
  """The side leaves that differ (by more than `atol`), or that one side lacks."""
  out = []
  for label in sorted(set(a) | set(b)):
    x = _side_value(a[label]) if label in a else ABSENT
    y = _side_value(b[label]) if label in b else ABSENT
    if isinstance(x, dict | str) or isinstance(y, dict | str):
      same = x == y
    else:
      same = compare_values(x, y, atol)[1] == 0
    if not same:
      out.append(Mismatch(label, _side_text(x), _side_text(y)))
  return out


def _side_text(value: Any) -> str:
  if isinstance(value, dict):
    return f'{tuple(value.get("shape", ()))} {value.get("dtype")} ({value.get("checksum")})'
  return value if isinstance(value, str) else repr(value)


def _compare_sides(
    ckpt_a: reader.Source, ckpt_b: reader.Source, atol: float,
    items: Iterable[str] | None,
) -> tuple[list[Mismatch], list[str]]:
  """(side leaves that differ, notes): compared when both sides hold them."""
  side_a, side_b = _side_of(ckpt_a, items), _side_of(ckpt_b, items)
  if side_a is None and side_b is None:
    return [], []
  if side_a is None or side_b is None:
    lacking, holding = ('A', 'B') if side_a is None else ('B', 'A')
    count = len(side_b if side_a is None else side_a)
    return [], [
        f'{count} leaves outside the canonical view (inject_hyperparams values and counts)'
        f' in {holding} not compared: {lacking} holds none (it is neither a Tunix step nor'
        ' a step orbax-tunix convert wrote from one)'
    ] if count else []
  return _compare_side(side_a, side_b, atol), []


def _compare_leaves(
    ckpt_a: reader.Source, ckpt_b: reader.Source,
    pairs: Sequence[tuple[str, reader.LeafInfo, reader.LeafInfo]], atol: float, budget: int,
    progress: reader.Progress,
) -> tuple[list[ValueDiff], float, int, list[str], list[str]]:
  """The values of paired leaves compared, streamed in batches of `budget` bytes: (the
  leaves that differ, the largest difference, the bytes compared, the leaves of A and of B
  whose stored data is missing, unreadable or fails its recorded checksum)."""
  values, worst, compared_bytes = [], 0.0, 0
  sums_a = checksums.recorded(ckpt_a.detection.source.custom_metadata)
  sums_b = checksums.recorded(ckpt_b.detection.source.custom_metadata)
  damaged_a: list[str] = []
  damaged_b: list[str] = []
  progress.start(sum(la.nbytes for _, la, _ in pairs), 'comparing')
  try:
    for batch, (got_a, got_b) in reader.stream(
        memory.batches(pairs, budget, size=lambda p: p[1].nbytes + p[2].nbytes),
        lambda batch: (_read_side(ckpt_a, [la for _, la, _ in batch]),
                       _read_side(ckpt_b, [lb for _, _, lb in batch])),
        progress, lambda batch: sum(la.nbytes for _, la, _ in batch)):
      for (path, la, lb), x, y in zip(batch, got_a, got_b, strict=True):
        unreadable = x is reader.UNREADABLE or y is reader.UNREADABLE
        if x is reader.UNREADABLE or (not unreadable and _damaged(sums_a, la, x)):
          damaged_a.append(path)
        if y is reader.UNREADABLE or (not unreadable and _damaged(sums_b, lb, y)):
          damaged_b.append(path)
        if unreadable:  # Stored data missing or damaged: nothing to compare.
          continue
        max_diff, differing = compare_values(x, y, atol)
        worst = max(worst, max_diff)
        if differing:
          values.append(ValueDiff(path, max_diff, differing, max(1, int(np.size(x)))))
        compared_bytes += la.nbytes
      del got_a, got_b
  finally:
    progress.finish()
  return values, worst, compared_bytes, damaged_a, damaged_b


def diff_checkpoints(
    a: epath.PathLike | reader.Source,
    b: epath.PathLike | reader.Source,
    *,
    atol: float = 0.0,
    params_only: bool = False,
    ignore_dtype: bool = False,
    memory_budget: int | float | str = memory.DEFAULT_MEMORY_BUDGET,
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
    ignore_dtype: do not count dtype differences (values are still compared
      against `atol`, as `compare_values` does): for checking a `--dtype`
      conversion.
    memory_budget: bytes the streaming may hold at once.
    progress: told the bytes of A compared after each batch.
    items: compare only these items (default: every item of each side).

  Returns:
    A `DiffResult`; `.match` says whether they match.

  Raises:
    InvalidOptionError: `atol` is not a number >= 0 (a NaN would make every
      value match), or `memory_budget` is not a size >= 1; before anything is read.
    TunixCheckpointError subclasses: a side cannot be read.
  """
  if not atol >= 0:
    raise errors.InvalidOptionError(f'`atol` {atol!r}: expected a number >= 0 (0: exact).')
  memory_budget = sizes.parse_size(memory_budget, 'memory_budget')
  start = time.monotonic()
  progress = progress or reader.NullProgress()
  items = None if items is None else tuple(items)  # read for both sides
  ckpt_a, ckpt_b = (side if isinstance(side, reader.Source)
                    else reader.open_source(side, None, items, weights_only=params_only)
                    for side in (a, b))
  view_a, view_b = _views(ckpt_a, params_only), _views(ckpt_b, params_only)
  shape, dtype, pairs = [], [], []
  for path in sorted(set(view_a) & set(view_b)):
    la, lb = view_a[path], view_b[path]
    if la.shape != lb.shape or (la.kind == reader.STRING) != (lb.kind == reader.STRING):
      shape.append(Mismatch(path, _describe(la), _describe(lb)))
      continue
    if la.dtype != lb.dtype:
      dtype.append(Mismatch(path, _describe(la), _describe(lb)))
    pairs.append((path, la, lb))
  if pairs:  # Each pair is read whole on both sides to be compared: before any read.
    path, la, lb = max(pairs, key=lambda p: p[1].nbytes + p[2].nbytes)
    memory.check_machine(la.nbytes + lb.nbytes, ckpt_a.step_dir, f'{path} (A: {_describe(la)},'
                         f' B: {_describe(lb)}), read whole on each side to be compared,')
  found = _Found(sorted(set(view_a) - set(view_b)), sorted(set(view_b) - set(view_a)))
  json_compared = 0 if params_only else _compare_json_items(ckpt_a, ckpt_b, found)
  side, notes = ([], []) if params_only else _compare_sides(
      ckpt_a, ckpt_b, atol, None if items is None else list(items))
  values, worst, compared_bytes, damaged_a, damaged_b = _compare_leaves(
      ckpt_a, ckpt_b, pairs, atol, memory.batch_bytes(memory_budget, memory.READ_COPIES),
      progress)
  if not pairs and not json_compared and not (found.only_a or found.only_b or shape):
    notes.append('nothing was compared: neither side holds a leaf or JSON item')
  return DiffResult(
      a=ckpt_a.step_dir,
      b=ckpt_b.step_dir,
      only_a=tuple(sorted(found.only_a)),
      only_b=tuple(sorted(found.only_b)),
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
      json=tuple(found.differ),
      hyperparameters=tuple(side),
      notes=tuple(notes),
  )

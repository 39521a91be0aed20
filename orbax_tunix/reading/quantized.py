"""Weights qwix saved quantized (a QLoRA run's frozen base), read as the weights they are.

qwix keeps a quantized weight `W` (a `QArray`) as stored parts (`view.rules.QUANTIZED`):
`qvalue` (W's shape, in the quantized type: int8, int4, float8_e4m3fn; nf4 as uint4 bucket
indices), `scale` (W's rank and the model's dtype; on each axis W's size, 1, or W's size over
a tile) and, with minmax calibration, `zero_point` (scale's shape, qvalue's dtype). `W` is
qwix's `dequantize`:

    (convert_from(qvalue) in scale's dtype - zero_point) * scale,  scale repeated over W

in scale's dtype (`convert_from` is the identity but for nf4: a table of 16 values). Here it is
computed in float32 and rounded once to scale's dtype: that is qwix's value bit for bit (the
difference of two quantized integers, or a table entry in scale's dtype, is exact, as is its
product with a scale of bfloat16 or float16 in float32; qwix rounds that product once), then
cast to the dtype asked for. This module knows the parts (`Scheme`, `parts_of`: checked from
their headers before any read, `part_index`) and qwix's recipes (`Recipe`, `requantize`); a
weight is made from its parts as any output is made from its sources, by a transform
(`mapping.dequantize`): on the devices one compiled program per kind of weight, fused with
what follows it.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from orbax_tunix import errors
from orbax_tunix.conventions import QARRAY_PARTS, QVALUE, SCALE, ZERO_POINT
from orbax_tunix.keypaths import Path, flat_dict, fmt, nest

Shape = tuple[int, ...]

# qwix's nf4 buckets (`qwix._src.core.numerics.get_nf4_buckets`, from the QLoRA paper's
# appendix E), float32: an nf4 qvalue (stored as uint4) is an index into them.
NF4_BUCKETS = np.array([
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
], dtype=np.float32)
NF4 = 'nf4'
_NF4_STORAGE = np.dtype(ml_dtypes.uint4)


def nf4_values(index: Any) -> Any:
  """`NF4_BUCKETS[index]`, float32, element by element: numpy indexes on the host; on the
  devices one select per bucket, not a gather, which an index sharded over a mesh of explicit
  axes (`jax.make_mesh`'s) cannot take without an output sharding."""
  if isinstance(index, np.ndarray | np.generic):
    return NF4_BUCKETS[np.asarray(index).astype(np.int32)]
  index = index.astype(np.int32)
  out = jnp.full_like(index, NF4_BUCKETS[0], dtype=np.float32)
  for k, value in enumerate(NF4_BUCKETS[1:], 1):
    out = jnp.where(index == k, value, out)
  return out


@dataclasses.dataclass(frozen=True)
class Scheme:
  """How one weight is quantized, as its stored parts say (nothing else records it).

  Attributes:
    shape: the weight's shape (qvalue's).
    qvalue_dtype: qvalue's stored dtype.
    scale_shape: scale's shape.
    dtype: scale's dtype, the weight's (qwix dequantizes into it).
    zero_point: whether a zero point is stored (minmax calibration).
  """

  shape: Shape
  qvalue_dtype: np.dtype
  scale_shape: Shape
  dtype: np.dtype
  zero_point: bool

  @property
  def qtype(self) -> str:
    """The quantized type as qwix names it (int8, int4, float8_e4m3fn, nf4)."""
    return NF4 if self.qvalue_dtype == _NF4_STORAGE else self.qvalue_dtype.name

  @property
  def calibration(self) -> str:
    return 'minmax' if self.zero_point else 'absmax'

  @property
  def tiles(self) -> dict[int, int]:
    """Axis -> tile size, for the axes quantized in tiles (scale neither 1 nor W's size)."""
    return {a: n // s for a, (n, s) in enumerate(zip(self.shape, self.scale_shape, strict=True))
            if s not in (1, n)}

  @property
  def reduced(self) -> tuple[int, ...]:
    """The axes one scale covers whole (W's contracting axes, but a tiled one)."""
    return tuple(a for a, (n, s) in enumerate(zip(self.shape, self.scale_shape, strict=True))
                 if s == 1 and n != 1)

  def describe(self) -> str:
    """E.g. 'int8, tiles of 4 on axis 1, axis 0 reduced, minmax', 'int4, per channel, axis 0
    reduced, absmax', or 'int8, per element, absmax' (a scale of qvalue's own shape)."""
    parts = [f'tiles of {t} on axis {a}' for a, t in self.tiles.items()]
    if not parts:
      parts.append('per channel' if self.reduced else 'per element')
    if self.reduced:
      parts.append(f'{_axes(self.reduced)} reduced')
    return ', '.join([self.qtype, *parts, self.calibration])

  @property
  def stored_bytes(self) -> int:
    """The parts' bytes on disk (int4 and uint4 take one byte a value)."""
    n = int(np.prod(self.shape))
    s = int(np.prod(self.scale_shape))
    q = max(1, self.qvalue_dtype.itemsize)
    return n * q + s * self.dtype.itemsize + (s * q if self.zero_point else 0)

  @property
  def parts(self) -> tuple[tuple[Shape, np.dtype], ...]:
    """Each stored part's (shape, dtype), in qwix's order (qvalue, scale, zero point)."""
    return ((self.shape, self.qvalue_dtype), (self.scale_shape, self.dtype),
            *(((self.scale_shape, self.qvalue_dtype),) if self.zero_point else ()))

  @property
  def dequantized_bytes(self) -> int:
    return int(np.prod(self.shape)) * self.dtype.itemsize


def _axes(axes: Sequence[int]) -> str:
  return (f'axis {axes[0]}' if len(axes) == 1 else
          'axes ' + ', '.join(map(str, axes[:-1])) + f' and {axes[-1]}')


# A part as its metadata gives it: (shape, dtype); None where it is no array.
PartInfo = tuple[Shape, np.dtype] | None


def scheme(parts: Mapping[str, PartInfo], where: str = 'a weight saved quantized') -> Scheme:
  """The `Scheme` of a weight from its parts' (shape, dtype), by part name, checked: the
  parts qwix saves and nothing else, a scale of qvalue's rank that tiles it, a zero point
  of the scale's shape in qvalue's dtype (`damage`).

  Args:
    parts: part name -> (stored shape, stored dtype), None for a part that is no array.
    where: the weight, for messages (its item directory and path).

  Raises:
    CorruptMetadataError: the parts are not one quantized weight's; naming `where`, each
      part's shape and dtype, and what is wrong.
  """
  problems = damage(parts)
  if problems:
    found = ', '.join(f'{name} {_shown(info)}' for name, info in sorted(parts.items(),
                                                                     key=_part_order))
    raise errors.CorruptMetadataError(
        f'{where}: saved quantized by qwix (a QLoRA run\'s base), found parts that are not'
        f' one weight\'s: {found}: {"; ".join(problems)}. Expected {QVALUE}, a {SCALE} of its'
        ' rank in a float type whose every axis is 1, qvalue\'s size, or a divisor of it'
        f' (one scale a tile), and with minmax calibration a {ZERO_POINT} of the scale\'s'
        ' shape in qvalue\'s dtype; nothing else. The step is damaged (or its metadata was'
        ' edited): the weight cannot be read; use another step (`step`).')
  qshape, qdtype = parts[QVALUE]
  sshape, sdtype = parts[SCALE]
  return Scheme(tuple(qshape), np.dtype(qdtype), tuple(sshape), np.dtype(sdtype),
                ZERO_POINT in parts)


def _shown(info: PartInfo) -> str:
  return '(no array)' if info is None else f'{tuple(info[0])} {np.dtype(info[1]).name}'


def _part_order(item: tuple[str, Any]) -> tuple[int, str]:
  name = item[0]
  return (QARRAY_PARTS.index(name) if name in QARRAY_PARTS else len(QARRAY_PARTS), name)


def damage(parts: Mapping[str, PartInfo]) -> list[str]:
  """What makes `parts` not one quantized weight's (`scheme`), one text each; [] if nothing.

  qwix's `QArray` is a qvalue, a scale and, with minmax calibration, a zero point; its scale
  has qvalue's rank, and on each axis one entry (reduced), qvalue's size (per channel), or
  qvalue's size over a tile (tiled: a divisor of it); its zero point is the scale's shape in
  qvalue's type."""
  problems = [f'no {name}' for name in (QVALUE, SCALE) if name not in parts]
  problems += [f'{name} is no part of qwix\'s quantized weight ({", ".join(QARRAY_PARTS)})'
               for name in sorted(set(parts) - set(QARRAY_PARTS))]
  problems += [f'{name} is no array' for name, info in sorted(parts.items(), key=_part_order)
               if info is None and name in QARRAY_PARTS]
  if problems:
    return problems
  (qshape, qdtype), (sshape, sdtype) = parts[QVALUE], parts[SCALE]
  qshape, sshape = tuple(qshape), tuple(sshape)
  if not jnp.issubdtype(np.dtype(sdtype), jnp.floating):
    problems.append(f'scale is {np.dtype(sdtype).name}, not a float type')
  if len(sshape) != len(qshape):
    problems.append(f'scale has rank {len(sshape)}, qvalue {len(qshape)}')
  else:
    problems += [f'scale\'s axis {a} ({s}) does not tile qvalue\'s ({n})'
                 for a, (n, s) in enumerate(zip(qshape, sshape, strict=True))
                 if s not in (1, n) and not (0 < s < n and n % s == 0)]
  if ZERO_POINT in parts:
    zshape, zdtype = parts[ZERO_POINT]
    if tuple(zshape) != sshape:
      problems.append(f'zero_point {tuple(zshape)} is not the scale\'s shape {sshape}')
    if np.dtype(zdtype) != np.dtype(qdtype):
      problems.append(f'zero_point is {np.dtype(zdtype).name}, qvalue {np.dtype(qdtype).name}')
  return problems


# --- the parts of a weight, checked --------------------------------------------------


def parts_of(meta: Any, cmap: Any, paths: Iterable[Path] | None = None
             ) -> dict[Path, tuple[tuple[Path, ...], Scheme]]:
  """The weights saved quantized of an item (all, or those among `paths`): each one's
  stored parts in qwix's order (qvalue, scale, zero point: their paths on disk) and its
  `Scheme`, checked from the parts' headers (read in one batch, once per item: `meta` is
  its `item_store.Item`, `cmap` its `CanonicalMap`), before any array is read.

  Raises:
    CorruptMetadataError: parts that are not one quantized weight's, naming it
      (`scheme`).
  """
  composed = cmap.composed
  wanted = [p for p in (composed if paths is None else paths) if p in composed]
  infos = meta.arrays([d for p in wanted for d in composed[p].values()])
  out = {}
  for path in wanted:
    stored = {name: (infos[d].shape, infos[d].dtype) if d in infos else None
              for name, d in composed[path].items()}
    qscheme = scheme(stored, f'{meta.directory}: {fmt(path)}')
    out[path] = tuple(composed[path][n] for n in QARRAY_PARTS if n in composed[path]), qscheme
  return out


def as_read(tree: Any, stored: Any, cmap: Any, where: str = '') -> Any:
  """An item's canonical metadata tree with each weight saved quantized described as a read
  gives it: qvalue's shape in scale's dtype (`stored`: the metadata tree as on disk; `cmap`:
  its `CanonicalMap`). No store is read.

  Raises:
    CorruptMetadataError: a weight's parts are not one weight's (`scheme`); `where` (the
      item) names it.
  """
  if not cmap.composed:
    return tree
  on_disk = flat_dict(stored)
  weights = flat_dict(tree)
  for path, parts in cmap.composed.items():
    infos = {name: (tuple(m.shape), m.dtype) if getattr(m, 'shape', None) is not None
             and getattr(m, 'dtype', None) is not None else None
             for name, m in ((name, on_disk.get(d)) for name, d in parts.items())}
    dtype = scheme(infos, f'{where}: {fmt(path)}').dtype
    if path in weights and dataclasses.is_dataclass(weights[path]):
      weights[path] = dataclasses.replace(weights[path], dtype=dtype)
  return nest(weights.items())


def part_index(index: Sequence[Any], qscheme: Scheme) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
  """For a region of the weight (ints and slices, one per axis), the region of its scale
  that covers it, and where the weight's region sits in that scale region repeated.

  Returns:
    (index into scale, index into the repeated scale region's result) per axis.
  """
  into, crop = [], []
  for at, n, s in zip(index, qscheme.shape, qscheme.scale_shape, strict=True):
    per = n // s  # Weight entries per scale entry on this axis.
    if isinstance(at, int | np.integer):
      into.append(int(at) // per)
      continue
    start, stop, _ = at.indices(n)
    if s == 1:  # One scale for the whole axis: it broadcasts as it is.
      into.append(slice(0, 1))
      crop.append(slice(None))
      continue
    first = start // per
    into.append(slice(first, -(-stop // per)))
    crop.append(slice(start - first * per, stop - first * per))
  return tuple(into), tuple(crop)


# --- quantizing a float base as the run did (an adapters-only QLoRA save) -------------

@dataclasses.dataclass(frozen=True)
class QType:
  """One of qwix's quantized types (`qwix._src.core.numerics`).

  Attributes:
    storage: the dtype its values are stored in.
    bound: what absmax calibration divides by (`get_symmetric_bound`).
    asymmetric: (qmin, qmax) that minmax calibration maps to (`get_asymmetric_bound`;
      None: qwix calibrates it by absmax only).
    rounds: its values are integers (rounded half to even and saturated); else a
      float type (clipped to its range and cast) or nf4's table.
  """

  storage: np.dtype
  bound: float
  asymmetric: tuple[float, float] | None = None
  rounds: bool = False


_QTYPES: dict[str, QType] = {
    'int8': QType(np.dtype(np.int8), 127.5, (-128.0, 127.0), rounds=True),
    'int4': QType(np.dtype(ml_dtypes.int4), 7.5, (-8.0, 7.0), rounds=True),
    'float8_e4m3fn': QType(np.dtype(ml_dtypes.float8_e4m3fn),
                           float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)),
    NF4: QType(_NF4_STORAGE, 1.0),
}
QTYPES = tuple(_QTYPES)
CALIBRATIONS = ('absmax', 'minmax')


@dataclasses.dataclass(frozen=True)
class Recipe:
  """How a QLoRA run quantized its base (qwix `LoraProvider`'s `weight_qtype`, `tile_size`,
  `weight_calibration_method`): what an adapters-only save does not record.

  Raises (on construction):
    ValueError: a qtype, tile size or calibration qwix does not take for weights.
  """

  qtype: str
  tile_size: int | None = None
  calibration: str = 'absmax'

  def __post_init__(self):
    if self.qtype not in _QTYPES:
      raise ValueError(f'qtype {self.qtype!r}: expected one of {", ".join(QTYPES)} (as qwix'
                       ' names them in LoraProvider(weight_qtype=...)).')
    if self.calibration not in CALIBRATIONS:
      raise ValueError(f'calibration {self.calibration!r}: expected absmax or minmax (qwix\'s'
                       ' weight_calibration_method).')
    if self.calibration == 'minmax' and _QTYPES[self.qtype].asymmetric is None:
      raise ValueError(f'calibration minmax with qtype {self.qtype}: qwix calibrates only'
                       ' integer types (int8, int4) by minmax; pass absmax.')
    if self.tile_size is not None and (isinstance(self.tile_size, bool) or
                                       not isinstance(self.tile_size, int | np.integer)
                                       or self.tile_size < 1):
      raise ValueError(f'tile size {self.tile_size!r}: expected a positive integer (qwix\'s'
                       ' tile_size), or none for one scale per channel.')

  def describe(self) -> str:
    tile = f'tiles of {self.tile_size}' if self.tile_size else 'per channel'
    return f'{self.qtype}, {tile}, {self.calibration}'

  def tiled_axes(self, shape: Shape, contracting: Sequence[int]) -> dict[int, int]:
    """qwix's tiling of a weight: the tile on its last contracting axis (none per channel).

    Raises:
      ValueError: the tile does not divide that axis.
    """
    if not self.tile_size or not contracting:
      return {}
    axis = contracting[-1]
    if shape[axis] % self.tile_size:
      raise ValueError(f'tile size {self.tile_size} does not divide axis {axis} of a weight'
                       f' of shape {tuple(shape)} (its last contracting axis)')
    return {axis: self.tile_size}


def requantize(w: Any, recipe: Recipe, contracting: Sequence[int]) -> Any:
  """`dequantize(quantize(w))` as qwix quantizes a frozen weight (`qarray.quantize` with the
  op's how-to-quantize: one scale per channel, reduced over the contracting axes, or per tile
  of the last one): the base a QLoRA run trained on, from its float base.

  Computed by XLA as qwix's own eager steps are (a host array on JAX's default device, and
  back): each step in float32, rounded to `w`'s dtype where qwix computes in it
  (`lax.reduce_precision`, which compiled code keeps), its divisions in that dtype, and each
  step fenced from the next, as eager programs are (inside a caller's compiled merge too); so
  the values are the run's bit for bit where XLA divides as it did for the run (the same kind
  of device: CPU, TPU and GPU divide differently; checked on a TPU v5e and the CPU).

  Returns:
    float32 values, each one of `w`'s dtype (the run's base weight, exactly).
  """
  if isinstance(w, np.ndarray | np.generic):
    return np.asarray(_requantize_compiled(recipe, tuple(contracting))(w))
  return _requantize(w, recipe, tuple(contracting))


@functools.lru_cache(maxsize=64)
def _requantize_compiled(recipe: Recipe, contracting: tuple[int, ...]) -> Any:
  return jax.jit(lambda w: _requantize(w, recipe, contracting))


def _requantize(w: Any, recipe: Recipe, contracting: tuple[int, ...]) -> Any:
  qtype = _QTYPES[recipe.qtype]
  dtype = np.dtype(w.dtype)
  info = ml_dtypes.finfo(dtype)
  narrower = dtype.itemsize < 4

  def rnd(x: Any) -> Any:
    """One of qwix's steps in `dtype`: its float32 result, rounded, and fenced: qwix runs each
    step as a program of its own (eagerly), and a TPU computes a step fused with the next
    otherwise (a float32 scale's last bit, measured on a v5e)."""
    x = jax.lax.reduce_precision(x, info.nexp, info.nmant) if narrower else x
    return jax.lax.optimization_barrier(x)

  shape = tuple(w.shape)
  tiled = recipe.tiled_axes(shape, contracting)
  split, reduce = [], []
  for axis, n in enumerate(shape):
    if axis in tiled:
      split += [n // tiled[axis], tiled[axis]]
      reduce.append(len(split) - 1)  # Within a tile, not over the tiles.
    else:
      split.append(n)
      if axis in contracting:
        reduce.append(len(split) - 1)
  x = w.astype(np.float32).reshape(split)
  reduce = tuple(reduce)
  tiny = np.float32(np.sqrt(float(info.tiny)))  # A power of two: exact in every dtype.
  zero_point = None
  if recipe.calibration == 'minmax':
    qmin, qmax = qtype.asymmetric
    low = rnd(jnp.minimum(x.min(axis=reduce, keepdims=True), 0))
    high = rnd(jnp.maximum(x.max(axis=reduce, keepdims=True), 0))
    scale = rnd(_by_bound(rnd(high - low), qmax - qmin, narrower))
    scale = rnd(jnp.where(scale < tiny, np.float32(1), scale))
    zero_point = _to_qtype(rnd(np.float32(qmin) - rnd(_divide(low, scale, dtype))),
                           recipe.qtype)
    zero_point = rnd(zero_point.astype(np.float32))
  else:
    absmax = rnd(jnp.abs(x).max(axis=reduce, keepdims=True))
    scale = rnd(_by_bound(absmax, qtype.bound, narrower))
    scale = rnd(jnp.where(scale < tiny, np.float32(1), scale))
  q = rnd(_divide(x, scale, dtype))
  if zero_point is not None:
    q = rnd(q + zero_point)
  q = jax.lax.optimization_barrier(_to_qtype(q, recipe.qtype))
  value = rnd(nf4_values(q) if recipe.qtype == NF4
              else q.astype(np.float32))
  if zero_point is not None:
    value = rnd(value - zero_point)
  # The barrier keeps the product rounded where a caller adds to it in the same compiled
  # function (a LoRA merge): the compiler would fuse the two into one multiply-add.
  return jax.lax.optimization_barrier(rnd(value * scale).reshape(shape))


def _divide(a: Any, b: Any, dtype: np.dtype) -> Any:
  """qwix's `a / b` of two arrays of `dtype` (float32 values of it), as float32 values, to be
  rounded by the caller's step (`rnd`).

  A division in the narrower dtype itself: a TPU divides bfloat16 by a method of its own, which
  differs from float32's division rounded to bfloat16 in about 1e-4 of the quotients (TPU v5e,
  `benchmarks/requantize_devices.py`); the CPU's is float32's, rounded.
  """
  if np.dtype(dtype).itemsize >= 4:
    return a / b
  return (jnp.asarray(a).astype(dtype) / jnp.asarray(b).astype(dtype)).astype(np.float32)


def _by_bound(x: Any, bound: float, narrower: bool) -> Any:
  """`x / bound` as qwix's eager `calibration / qmax` computes it on this JAX and device.

  Eagerly, a Python number is a constant to some JAX versions on the CPU (0.10: XLA multiplies
  by its float32 reciprocal) and a runtime operand elsewhere (0.12: a true division; a TPU: its
  own division, neither of the two); a float32 scale's last bit differs. The product is written
  out, not left to the compiler: whether XLA folds a hidden constant depends on the program
  around it (JAX 0.10 on 8 CPU devices: the second of two re-quantizations in one program
  divided, the first multiplied; BENCHMARKS.md §32). A runtime division keeps the bound from
  the compiler. Narrower dtypes are rounded from float32 either way (checked equal on both
  versions and on a TPU v5e).
  """
  bound = np.float32(bound)
  how = 'constant' if narrower else _eager_division()
  if how == 'reciprocal':
    return x * (np.float32(1) / bound)
  if how == 'runtime':
    return x / jax.lax.optimization_barrier(jnp.asarray(bound))
  return x / bound


@functools.cache
def _eager_division() -> str:
  """How an eager `array / python_float` divides on this JAX and default device: 'reciprocal'
  (a product with the float32 reciprocal, as numpy computes it), 'runtime' (as a compiled
  division by a runtime operand), or 'constant' (as neither: by the constant as XLA folds it)."""
  x = np.concatenate([np.linspace(1, 2, 1025, dtype=np.float32),
                      np.random.default_rng(0).standard_normal(4096).astype(np.float32)])
  bound = np.float32(127.5)
  with jax.ensure_compile_time_eval():  # Eager even where first asked while tracing.
    eager = np.asarray(jnp.asarray(x) / float(bound))  # A Python number, as qwix divides by.
  if np.array_equal(eager, x * (np.float32(1) / bound)) and not np.array_equal(eager, x / bound):
    return 'reciprocal'
  hidden = jax.jit(lambda v: v / jax.lax.optimization_barrier(jnp.asarray(bound)))
  runtime = np.asarray(hidden.lower(x).compile()(x))  # Run now, even while tracing.
  return 'runtime' if np.array_equal(eager, runtime) else 'constant'


def _to_qtype(x: Any, qtype: str) -> Any:
  """qwix's `numerics.convert_to` (no stochastic rounding) of float32 values: nf4's nearest
  bucket, a float type clipped to its range, an integer rounded half to even and saturated."""
  storage = _QTYPES[qtype].storage
  if qtype == NF4:
    return _nearest_bucket(x).astype(storage)
  if not _QTYPES[qtype].rounds:
    info = ml_dtypes.finfo(storage)
    return jnp.clip(x, np.float32(info.min), np.float32(info.max)).astype(storage)
  info = ml_dtypes.iinfo(storage)
  return jnp.clip(jnp.round(x), int(info.min), int(info.max)).astype(storage)


def _nearest_bucket(x: Any) -> Any:
  """qwix's `fp_to_nf4`: the index of the nearest nf4 bucket (`argmin |bucket - x|` in
  float32, the first on a tie), from the two buckets around each value, not all sixteen."""
  # The first bucket not below x (a search of the sorted buckets, as a count: elementwise; a
  # NaN counts none, and its scale, NaN too, makes its value NaN whichever bucket it takes).
  above = sum((x > b).astype(np.int32) for b in NF4_BUCKETS)
  hi = jnp.clip(above, 1, len(NF4_BUCKETS) - 1)
  lo = hi - 1
  return jnp.where(jnp.abs(nf4_values(lo) - x) <= jnp.abs(nf4_values(hi) - x), lo, hi)

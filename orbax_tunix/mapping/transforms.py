"""Transforms: how source arrays become one destination array, as small values.

A `Transform` is an optax-style pair of pure functions: `shape` works on shapes
only (planning: it says what the destination's shape is, or why the sources
do not fit) and `apply` on arrays: with `jax.numpy` on jax arrays (on the
devices, in the destination's sharding), with numpy on host arrays (where a
transpose is a view, copied only when written). Transforms compose with
`chain`. Layouts (`layouts/`) are rules from canonical paths to destinations,
each with a transform; nothing else here knows a layout.

  IDENTITY                      one source, unchanged
  transpose(perm)               axes permuted (reversed by default)
  merge_axes(start, stop)       axes start..stop-1 flattened into one
  take(axis, index)             one slice along an axis, the axis dropped
  move_axis(source, dest)       one axis moved to another position (`jnp.moveaxis`)
  stack(axis)                   several sources stacked along a new axis
  constant(value)               no source: a known value
  filled(value, axis)           a vector of `value`, as long as the source's axis
  concat(axis[, scaled])        several sources one after another along an axis (with
                                `scaled`, the last a vector each row is multiplied by: computed)
  shift(delta)                  x + delta                (computed)
  divide(name, divisor)         x / divisor(x's shape)   (computed)
  head(axis, size)              the first `size` entries along an axis
  interleave(axis)              two sources' entries alternating along an axis
  regroup(axis, groups, sizes, take)  per-block parts gathered part by part
  per_input((t1, t2, ...), t)   each source through its own transform, then t on them all
  cast(dtype)                   the values in another dtype (a source read as another reads it)
  chain(t1, t2, ...)            t1 first (it may take several sources), then the rest

`leading_takes` and `region` let a reader read only the slices a transform
takes first (one layer of a stacked weight), rather than the whole source.

Rounding rule of the computed ones (`shift`, `divide`): the value is taken to
float32, computed there, and cast back to the dtype it came in (one rounding
from the float32 result); the writer reads such an output's sources in their
stored dtype, so a cast to `dtype` happens once, after the arithmetic.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from orbax_tunix.mapping import effort

Shape = tuple[int, ...]


class TransformError(ValueError):
  """The sources' shapes do not fit a transform (raised while planning)."""


@dataclasses.dataclass(frozen=True)
class Transform:
  """Source arrays onto one destination array.

  Attributes:
    name: how `describe()` and messages show it (e.g. 'take(axis=1, index=3)').
    shape: `(source shapes) -> destination shape`; raises `TransformError`
      when the sources cannot be transformed so.
    apply: `(source arrays) -> destination array`, with `jax.numpy`.
    arity: how many sources it takes (None: one or more).
    The other fields are described where they are declared.
  """

  name: str
  shape: Callable[[Sequence[Shape]], Shape] = dataclasses.field(repr=False)
  apply: Callable[[Sequence[Any]], Any] = dataclasses.field(repr=False)
  arity: int | None = 1
  # Values are only moved (re-laid), never computed: they stay within their
  # dtype's range. Every transform here; a LoRA merge computes.
  moves_only: bool = True
  # What a reader can do instead of the transform, by reading less (see
  # `leading_takes`): the (axis, index) slices a pure `take` (or a chain of
  # them) takes, one after another; a chain's own steps; a `per_input`'s
  # (transforms, then).
  takes: tuple[tuple[int, int], ...] = ()
  # `(destination axis, source shapes) -> source axis or None`: a block of
  # the destination along that axis is the transform of the same block of the
  # (one) source along the axis returned; None: it is not. A writer makes a
  # tensor too large for its budget block by block (see `outputs.row_blocks`).
  source_axis: Callable[[int, Sequence[Shape]], int | None] = dataclasses.field(
      repr=False, default=lambda axis, shapes: None)
  steps: tuple[Transform, ...] = dataclasses.field(default=(), repr=False)
  per: tuple[tuple[Transform, ...], Transform] | None = dataclasses.field(default=None, repr=False)
  # `(destination spec, number of sources) -> each source's spec`: the partition of
  # each source (a `PartitionSpec` as a tuple, one entry per axis) that lines up with
  # the destination's, so that reading the sources so the transform moves no data between
  # devices; None for a source read to the host and put whole on every device (a LoRA
  # merge's small adapters). Most transforms give every source one spec (`each`).
  source_specs: Callable[[tuple, int], tuple[tuple | None, ...]] = dataclasses.field(
      repr=False, default=lambda spec, n: (spec,) * n)
  # What it computes, where `name` (what people read) leaves something out: a
  # transform made with a function says which (`divide`, `multiply`); composites
  # are their parts'. Two transforms of one `computes` are one compiled program.
  what: Hashable = dataclasses.field(default=None, repr=False)

  def __str__(self) -> str:
    return self.name

  @property
  def computes(self) -> Hashable:
    """What the transform computes, as a hashable value (`on_devices` compiles once per)."""
    return self.name if self.what is None else self.what

  @property
  def is_identity(self) -> bool:
    return self is IDENTITY

  def check(self, shapes: Sequence[Shape]) -> Shape:
    """The destination shape for these sources (also checks their number)."""
    shapes = [tuple(s) for s in shapes]
    if self.arity is not None and len(shapes) != self.arity:
      raise TransformError(f'{self.name} takes {self.arity} source(s), given {len(shapes)}')
    if not shapes and self.arity is None:
      raise TransformError(f'{self.name} takes one or more sources, given none')
    return tuple(self.shape(shapes))


def _one(fn: Callable[[Shape], Shape]) -> Callable[[Sequence[Shape]], Shape]:
  return lambda shapes: fn(shapes[0])


def each(fn: Callable[[tuple], tuple]) -> Callable[[tuple, int], tuple[tuple, ...]]:
  """`Transform.source_specs` giving every source `fn(destination spec)`."""
  return lambda spec, n: (fn(spec),) * n


def xp(*arrays: Any) -> Any:
  """The array namespace for these arrays: numpy for host arrays, else jax.numpy."""
  return np if all(isinstance(a, np.ndarray | np.generic) for a in arrays) else jnp


def _same_axis(axis: int, shapes: Sequence[Shape]) -> int | None:
  return axis if len(shapes) == 1 else None


IDENTITY = Transform('identity', _one(lambda s: s), lambda xs: xs[0], source_axis=_same_axis)


def _permuted(order: Callable[[int], Sequence[int]]) -> Callable[[tuple], tuple]:
  """The source spec of a transform whose axis i is source axis `order(ndim)[i]`."""
  return lambda spec: tuple(spec[order(len(spec)).index(a)] for a in range(len(spec)))


def _whole(axis: int) -> Callable[[tuple], tuple]:
  """The source spec of a transform that needs axis `axis` whole on each device."""
  return lambda spec: tuple(None if i == axis % len(spec) else p for i, p in enumerate(spec))


def transpose(perm: Sequence[int] | None = None) -> Transform:
  """Axes permuted as `jnp.transpose(x, perm)` (None: reversed, as `.T`)."""
  perm = None if perm is None else tuple(perm)

  def order(ndim: int) -> tuple[int, ...]:
    return tuple(reversed(range(ndim))) if perm is None else perm

  def shape(s: Shape) -> Shape:
    if sorted(order(len(s))) != list(range(len(s))):
      raise TransformError(f'transpose{perm}: does not fit a {len(s)}-d array {s}')
    return tuple(s[i] for i in order(len(s)))

  def source_axis(axis: int, shapes: Sequence[Shape]) -> int:
    return order(len(shapes[0]))[axis]

  name = 'transpose' if perm is None else f'transpose{perm}'
  return Transform(name, _one(shape), lambda xs: xp(*xs).transpose(xs[0], perm),
                   source_specs=each(_permuted(order)), source_axis=source_axis)


def merge_axes(start: int, stop: int) -> Transform:
  """Axes `start` .. `stop - 1` flattened into one (a reshape, C order)."""

  def shape(s: Shape) -> Shape:
    if not 0 <= start < stop <= len(s):
      raise TransformError(f'merge_axes({start}, {stop}): does not fit a {len(s)}-d array {s}')
    return (*s[:start], math.prod(s[start:stop]), *s[stop:])

  return Transform(
      f'merge_axes({start}, {stop})', _one(shape),
      lambda xs: xp(*xs).reshape(xs[0], shape(xs[0].shape)),
      # The merged axes unpartitioned: a partition of their product does not
      # split into partitions of each.
      source_specs=each(lambda spec: (*spec[:start], *(None,) * (stop - start), *spec[start + 1:])),
      source_axis=lambda axis, shapes: (
          axis if axis < start else None if axis == start else axis + stop - start - 1),
  )


def split_axis(axis: int, sizes: Sequence[int]) -> Transform:
  """Axis `axis` split into axes of `sizes` (a reshape, C order: `merge_axes` undone)."""
  sizes = tuple(sizes)

  def shape(s: Shape) -> Shape:
    if not 0 <= axis < len(s) or math.prod(sizes) != s[axis]:
      raise TransformError(f'split_axis({axis}, {sizes}): does not fit a {len(s)}-d array {s}')
    return (*s[:axis], *sizes, *s[axis + 1:])

  return Transform(
      f'split_axis({axis}, {sizes})', _one(shape),
      lambda xs: xp(*xs).reshape(xs[0], shape(xs[0].shape)),
      # The split axis unpartitioned, as `merge_axes` leaves its merged axes.
      source_specs=each(lambda spec: (*spec[:axis], None, *spec[axis + len(sizes):])),
      source_axis=lambda d, shapes: (
          d if d < axis else None if d < axis + len(sizes) else d - len(sizes) + 1),
  )


def take(axis: int, index: int) -> Transform:
  """Slice `index` along `axis`, the axis dropped (`jnp.take`, as MaxText unrolls layers)."""

  def shape(s: Shape) -> Shape:
    if not -len(s) <= axis < len(s):
      raise TransformError(f'take(axis={axis}): a {len(s)}-d array {s} has no such axis')
    if not 0 <= index < s[axis]:
      raise TransformError(f'take(axis={axis}, index={index}): axis {axis} of {s} has {s[axis]}')
    return s[:axis] + s[axis + 1:] if axis != -1 else s[:-1]

  def source_spec(spec: tuple) -> tuple:
    at = axis if axis >= 0 else len(spec) + 1 + axis
    return (*spec[:at], None, *spec[at:])  # The taken axis whole on each device.

  def run(xs):
    if xp(*xs) is np:  # A view: a layer of a stack read whole is not copied out (`np.take` would).
      return xs[0][(slice(None),) * (axis % xs[0].ndim) + (index,)]
    return jnp.take(xs[0], index, axis=axis)

  return Transform(f'take(axis={axis}, index={index})', _one(shape), run,
                   source_specs=each(source_spec),
                   takes=((axis, index),),
                   source_axis=lambda d, shapes: d if d < axis % len(shapes[0]) else d + 1)


def leading_takes(transform: Transform) -> tuple[tuple[tuple[int, int], ...], Transform]:
  """The slices a one-source transform takes first, and what it does after them.

  A reader that reads only those slices (a layer of a stacked weight, not the
  weight) and applies the rest makes the same value: `take` only selects.
  """
  steps = transform.steps or (transform,)
  takes: list[tuple[int, int]] = []
  for i, step in enumerate(steps):
    if not step.takes:
      return tuple(takes), chain(*steps[i:])
    takes.extend(step.takes)
  return tuple(takes), IDENTITY


def region(shape: Shape, takes: Sequence[tuple[int, int]],
           rows: tuple[int, int, int] | None = None) -> tuple[tuple[Any, ...], Shape]:
  """The index into an array of `shape` that `take`s one after another select (then
  entries start..stop-1 along axis `rows[0]` of what they leave), and the shape it
  leaves: `x[index]` equals the takes (and the slice) applied to `x`."""
  axes = list(range(len(shape)))  # The source axes not taken yet, in order.
  index: list[Any] = [slice(None)] * len(shape)
  for axis, i in takes:
    index[axes.pop(axis)] = i
  left = [shape[a] for a in axes]
  if rows is not None:
    axis, start, stop = rows
    index[axes[axis]] = slice(start, stop)
    left[axis] = stop - start
  return tuple(index), tuple(left)


def move_axis(source: int, dest: int) -> Transform:
  """Axis `source` moved to position `dest`, the others in their order (`jnp.moveaxis`)."""

  def order(ndim: int) -> list[int]:
    rest = [a for a in range(ndim) if a != source]
    return rest[:dest] + [source] + rest[dest:]

  def shape(s: Shape) -> Shape:
    if not (0 <= source < len(s) and 0 <= dest < len(s)):
      raise TransformError(f'move_axis({source}, {dest}): does not fit a {len(s)}-d array {s}')
    return tuple(s[a] for a in order(len(s)))

  return Transform(f'move_axis({source}, {dest})', _one(shape),
                   lambda xs: xp(*xs).moveaxis(xs[0], source, dest),
                   source_specs=each(_permuted(order)),
                   source_axis=lambda axis, shapes: order(len(shapes[0]))[axis])


def stack(axis: int) -> Transform:
  """The sources, all of one shape, stacked along a new axis `axis` (in their order)."""

  def shape(shapes: Sequence[Shape]) -> Shape:
    first = shapes[0]
    if any(s != first for s in shapes):
      raise TransformError(f'stack(axis={axis}): sources of different shapes {sorted(set(shapes))}')
    if not 0 <= axis <= len(first):
      raise TransformError(f'stack(axis={axis}): does not fit {len(first)}-d sources {first}')
    return (*first[:axis], len(shapes), *first[axis:])

  return Transform(f'stack(axis={axis})', shape, lambda xs: xp(*xs).stack(list(xs), axis=axis),
                   arity=None, source_specs=each(lambda spec: (*spec[:axis], *spec[axis + 1:])))


def constant(value: Any) -> Transform:
  """No source: the value itself (a count Tunix never wrote, filled from a known number)."""
  return Transform(f'constant({value})', lambda shapes: (), lambda xs: np.asarray(value),
                   arity=0)


def filled(value: float, axis: int) -> Transform:
  """A vector of `value` as long as the source's axis `axis`, in the source's dtype (a weight
  a checkpoint lacks, made in the shape a sibling weight gives: DeepSeek's routing bias, one
  entry per expert of its router's kernel). The source's values are not read into it."""

  def shape(s: Shape) -> Shape:
    if not -len(s) <= axis < len(s):
      raise TransformError(f'filled(axis={axis}): a {len(s)}-d array {s} has no such axis')
    return (s[axis],)

  def apply(xs: Sequence[Any]) -> Any:
    x = xs[0]
    return xp(x).full((x.shape[axis],), value, dtype=x.dtype)

  return Transform(f'filled({value:g}, axis={axis})', _one(shape), apply, moves_only=False,
                   source_specs=each(lambda spec: (None,) * len(spec)))


def concat(axis: int = 0, scaled: bool = False) -> Transform:
  """The sources one after another along `axis` (`jnp.concatenate`, in their order), of one
  shape but along it: Qwen3-VL's vision query, key and value (D, D) as its fused `qkv`
  (3D, D). With `scaled`, the last source is no part: a vector as long as the parts' axis 0,
  each row of the joined array multiplied by its entry, in float32 (a norm's scale folded into
  the projection that reads the norm's output: DeepSeek V4's hyper-connections,
  `(x * s) @ W == x @ (s[:, None] * W)`)."""

  def parts(shapes: Sequence[Shape]) -> Sequence[Shape]:
    return shapes[:-1] if scaled else shapes

  def shape(shapes: Sequence[Shape]) -> Shape:
    joined = parts(shapes)
    if not joined:
      raise TransformError(f'concat(axis={axis}): no part to join')
    first = joined[0]
    if not -len(first) <= axis < len(first):
      raise TransformError(f'concat(axis={axis}): does not fit {len(first)}-d sources {first}')
    at = axis % len(first)
    if any(len(s) != len(first) or s[:at] + s[at + 1:] != first[:at] + first[at + 1:]
           for s in joined):
      raise TransformError(f'concat(axis={axis}): sources differ off axis {axis}:'
                           f' {sorted(set(map(tuple, joined)))}')
    out = (*first[:at], sum(s[at] for s in joined), *first[at + 1:])
    if scaled and tuple(shapes[-1]) != out[:1]:
      raise TransformError(f'concat(axis={axis}, scaled): a scale {shapes[-1]} for rows'
                           f' {out[:1]}')
    return out

  def apply(xs: Sequence[Any]) -> Any:
    np_ = xp(*xs)
    if not scaled:
      return np_.concatenate(list(xs), axis=axis)
    joined = np_.concatenate([x.astype(np.float32) for x in xs[:-1]], axis=axis)
    return (joined * xs[-1].astype(np.float32)[:, None]).astype(xs[0].dtype)

  if not scaled:  # Each source read whole along the axis, in the destination's other blocks.
    return Transform(f'concat(axis={axis})', shape, apply, arity=None,
                     source_specs=each(_whole(axis)))
  # A scale vector is of another shape than the destination: every source read whole.
  return Transform(f'concat(axis={axis}, scaled)', shape, apply, arity=None, moves_only=False,
                   source_specs=lambda spec, n: (None,) * n)


def _in_float32(name: str, fn: Callable[[Any, Shape], Any], reads: int | None = None,
                what: Hashable = None) -> Transform:
  """An elementwise computation in float32 (see the module's rounding rule); `fn` reads
  the size of axis `reads` only (None: no size), so blocks along other axes are its own."""

  def apply(xs: Sequence[Any]) -> Any:
    x = xs[0]
    return fn(x.astype(np.float32), tuple(x.shape)).astype(x.dtype)

  def source_axis(axis: int, shapes: Sequence[Shape]) -> int | None:
    return None if reads is not None and axis == reads % len(shapes[0]) else axis

  return Transform(name, _one(lambda s: s), apply, moves_only=False, source_axis=source_axis,
                   what=what)


def shift(delta: float) -> Transform:
  """`x + delta` (e.g. -1: a norm MaxText stores as `1 + w`, where the target stores `w`)."""
  return _in_float32(f'shift({delta:g})', lambda x, _: x + np.float32(delta))


def divide(name: str, divisor: Callable[[int], float], axis: int) -> Transform:
  """`x / divisor(size of axis)`, the divisor taken to float32 (e.g. an embedding's
  sqrt(hidden)); `name` says how the divisor is made, for `describe()` (and the compile
  cache: one name, one function)."""
  return _in_float32(f'divide({name})',
                     lambda x, shape: x / np.float32(divisor(shape[axis])), reads=axis,
                     what=('divide', divisor, axis))


def multiply(name: str, factor: Callable[[int], float], axis: int) -> Transform:
  """`x * factor(size of axis)`, the factor taken to float32 (e.g. a query kernel MaxText
  stores divided by sqrt(head_dim))."""
  return _in_float32(f'multiply({name})',
                     lambda x, shape: x * np.float32(factor(shape[axis])), reads=axis,
                     what=('multiply', factor, axis))


def deinterleave(axis: int = -1) -> Transform:
  """Along `axis`, the even entries, then the odd ones: rotary pairs stored interleaved
  (MaxText's llama: (x0, y0, x1, y1, ...)) put in halves (Hugging Face's rotate_half:
  (x0, x1, ..., y0, y1, ...))."""

  def shape(s: Shape) -> Shape:
    if not -len(s) <= axis < len(s) or s[axis] % 2:
      raise TransformError(f'deinterleave(axis={axis}): expected an even axis {axis}, found {s}')
    return s

  def apply(xs: Sequence[Any]) -> Any:
    x = xs[0]
    n = x.shape[axis]
    return xp(x).take(x, np.concatenate([np.arange(0, n, 2), np.arange(1, n, 2)]), axis=axis)

  return Transform(f'deinterleave(axis={axis})', _one(shape), apply,
                   source_specs=each(_whole(axis)),
                   source_axis=lambda d, shapes: None if d == axis % len(shapes[0]) else d)


def interleave(axis: int = -1) -> Transform:
  """Two sources of one shape, their entries alternating along `axis`: the first's at the even
  positions, the second's at the odd (`deinterleave` of the result gives them back, one after
  the other). gpt-oss's gate and up projections (MaxText's `wi_0`, `wi_1`) fused as Hugging
  Face's `gate_up_proj`, which reads the gate at `[..., ::2]` and the up at `[..., 1::2]`."""

  def shape(shapes: Sequence[Shape]) -> Shape:
    first, second = shapes
    if first != second or not -len(first) <= axis < len(first):
      raise TransformError(f'interleave(axis={axis}): expected two sources of one shape with an'
                           f' axis {axis}, found {first} and {second}')
    at = axis % len(first)
    return (*first[:at], 2 * first[at], *first[at + 1:])

  def apply(xs: Sequence[Any]) -> Any:
    first, second = xs
    np_or_jnp = xp(first, second)
    at = axis % first.ndim
    pairs = np_or_jnp.stack([first, second], axis=at + 1)  # (..., n, 2, ...): pairs in order.
    return np_or_jnp.reshape(pairs, shape([first.shape, second.shape]))

  return Transform(f'interleave(axis={axis})', shape, apply, arity=2,
                   source_specs=each(_whole(axis)))


def head(axis: int, size: int) -> Transform:
  """The first `size` entries along `axis` (a padded vocabulary cut to the real one)."""

  def shape(s: Shape) -> Shape:
    if not -len(s) <= axis < len(s):
      raise TransformError(f'head(axis={axis}): a {len(s)}-d array {s} has no such axis')
    if not 0 < size <= s[axis]:
      raise TransformError(f'head(axis={axis}, size={size}): axis {axis} of {s} has {s[axis]}')
    return tuple(size if i == axis % len(s) else n for i, n in enumerate(s))

  def apply(xs: Sequence[Any]) -> Any:
    x = xs[0]
    index = [slice(None)] * x.ndim
    index[axis] = slice(0, size)
    return x[tuple(index)]

  # A block of the destination is the same block of the source, also along the
  # cut axis (the destination's rows are the source's first `size`).
  return Transform(f'head(axis={axis}, size={size})', _one(shape), apply,
                   source_specs=each(_whole(axis)), source_axis=_same_axis)


def per_input(transforms: Sequence[Transform], then: Transform) -> Transform:
  """Each source through its own transform, then `then` on what they make (e.g. one layer
  taken from a stacked weight and from each of its adapters, then merged). Each transform
  takes as many sources as its arity says, in order (a weight saved quantized: its parts)."""
  transforms = tuple(transforms)
  counts = tuple(1 if t.arity is None else t.arity for t in transforms)

  def split(xs: Sequence[Any]) -> list[Sequence[Any]]:
    if len(xs) != sum(counts):
      raise TransformError(f'{name} takes {sum(counts)} source(s), given {len(xs)}')
    starts = np.cumsum((0, *counts))
    return [xs[a:b] for a, b in zip(starts[:-1], starts[1:], strict=True)]

  def shape(shapes: Sequence[Shape]) -> Shape:
    return then.check([t.check(s) for t, s in zip(transforms, split(shapes), strict=True)])

  def apply(xs: Sequence[Any]) -> Any:
    return then.apply([t.apply(x) for t, x in zip(transforms, split(xs), strict=True)])

  def source_specs(spec: tuple, n: int) -> tuple[tuple | None, ...]:
    del n
    out: list[tuple | None] = []
    for t, k, s in zip(transforms, counts, then.source_specs(spec, len(transforms)), strict=True):
      # What `then` reads to the host, its sources too.
      out += [None] * k if s is None else t.source_specs(s, k)
    return tuple(out)

  name = f'per_input({", ".join(t.name for t in transforms)}) -> {then.name}'
  return Transform(name, shape, apply, arity=sum(counts),
                   moves_only=then.moves_only and all(t.moves_only for t in transforms),
                   per=(transforms, then), source_specs=source_specs,
                   what=('per_input', tuple(t.computes for t in transforms), then.computes))


def cast(dtype: Any) -> Transform:
  """The values in `dtype` (`x.astype(dtype)`): a source as a reader in that dtype gets it."""
  dtype = jnp.dtype(dtype)
  return Transform(f'astype({dtype.name})', _one(lambda s: s), lambda xs: xs[0].astype(dtype),
                   source_axis=_same_axis)


def chain(*transforms: Transform) -> Transform:
  """The transforms one after the other; only the first may take several sources."""
  transforms = tuple(t for t in transforms if not t.is_identity)
  if not transforms:
    return IDENTITY
  if len(transforms) == 1:
    return transforms[0]
  if any(t.arity != 1 for t in transforms[1:]):
    raise ValueError('chain: only the first transform may take several sources')
  first, rest = transforms[0], transforms[1:]

  def shape(shapes: Sequence[Shape]) -> Shape:
    return functools.reduce(lambda out, t: t.check([out]), rest, first.check(shapes))

  def apply(xs: Sequence[Any]) -> Any:
    return functools.reduce(lambda out, t: t.apply([out]), rest, first.apply(xs))

  def source_specs(spec: tuple, n: int) -> tuple[tuple | None, ...]:
    for t in reversed(rest):
      (spec,) = t.source_specs(spec, 1)
      if spec is None:  # Read to the host: its sources too.
        return (None,) * n
    return first.source_specs(spec, n)

  def source_axis(axis: int, shapes: Sequence[Shape]) -> int | None:
    if first.arity != 1:
      return None
    made = [tuple(shapes[0])]  # The shape each transform is given.
    for t in transforms[:-1]:
      made.append(t.check([made[-1]]))
    at: int | None = axis
    for t, given in zip(reversed(transforms), reversed(made), strict=True):
      at = t.source_axis(at, [given])
      if at is None:
        return None
    return at

  takes = tuple(k for t in transforms for k in t.takes)
  pure = all(t.takes for t in transforms)
  return Transform(' -> '.join(t.name for t in transforms), shape, apply, first.arity,
                   moves_only=all(t.moves_only for t in transforms), source_axis=source_axis,
                   what=('chain', tuple(t.computes for t in transforms)),
                   source_specs=source_specs,
                   takes=takes if pure else (),
                   steps=tuple(s for t in transforms for s in (t.steps or (t,))))


def source_shardings(
    transform: Transform, dest: jax.sharding.Sharding, dest_ndim: int, n: int = 1
) -> tuple[jax.sharding.Sharding, ...]:
  """The shardings to read a transform's `n` sources in, for a destination in `dest`.

  On a mesh, the partition that lines up with the destination's (the
  transform then moves no data between devices; `Transform.source_specs`
  where the sources differ); any other sharding is used as it is when its
  devices hold whole arrays, else the sources are replicated over them.
  """
  spec = tuple(getattr(dest, 'spec', ()))
  spec += (None,) * (dest_ndim - len(spec))
  specs = transform.source_specs(spec, n)
  if isinstance(dest, jax.sharding.NamedSharding):
    return tuple(None if s is None else jax.sharding.NamedSharding(
        dest.mesh, jax.sharding.PartitionSpec(*s)) for s in specs)
  whole = dest if dest.is_fully_replicated else everywhere(dest)
  return tuple(None if s is None else whole for s in specs)


def everywhere(sharding: jax.sharding.Sharding) -> jax.sharding.Sharding:
  """The whole array on every device of `sharding`."""
  if isinstance(sharding, jax.sharding.NamedSharding):
    return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())
  devices = sorted(sharding.device_set, key=lambda d: d.id)
  if len(devices) == 1:
    return jax.sharding.SingleDeviceSharding(devices[0])
  mesh = jax.sharding.Mesh(np.array(devices), ('devices',))
  return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())


@dataclasses.dataclass(frozen=True, eq=False)
class Program:
  """A jitted function of sources (`on_devices`), with what it is made of.

  Attributes:
    key: what it computes, as data (`Transform.computes` of each transform, the
      destinations' shardings and dtypes, the donated sources, the sources' shardings,
      XLA's options: `effort.compiler_options`): two
      programs of one key compute the same (`executables` keeps them across processes by it).
    jitted: the function, jitted.
  """

  key: tuple
  jitted: Callable

  def __call__(self, *xs: Any) -> Any:
    return self.jitted(*xs)

  def lower(self, *abstract: Any) -> Any:
    return self.jitted.lower(*abstract)


_COMPILED: dict[tuple, Program] = {}


def on_devices(
    transforms: Sequence[Transform], shardings: Sequence[jax.sharding.Sharding],
    dtypes: Sequence[Any], donate: Sequence[int] = (),
    in_shardings: Sequence[jax.sharding.Sharding] | None = None,
) -> Program:
  """Several transforms of the same sources, compiled as one function on the devices.

  `(sources...) -> (destination in sharding i and dtype i, ...)`. Compiled once
  per set of transforms (by what each computes: `Transform.computes`), shardings,
  dtypes and donated sources (`donate`: their buffers are reused, e.g. a
  weight a LoRA merge adds to), and per source shapes (jit's own cache): the
  layers of one stacked weight are one compilation, its `mu` and `nu` reuse it.
  `in_shardings`: where the sources are put (None: as they are).
  """
  options = effort.compiler_options(shardings)
  key = (tuple(t.computes for t in transforms), tuple(shardings), tuple(np.dtype(d) for d in dtypes),
         tuple(donate), None if in_shardings is None else tuple(in_shardings), options)
  if key not in _COMPILED:
    if len(_COMPILED) > 256:
      _COMPILED.clear()
    ts, ds = list(transforms), list(dtypes)
    placed = {} if in_shardings is None else {'in_shardings': tuple(in_shardings)}
    _COMPILED[key] = Program(key, jax.jit(
        lambda *xs: tuple(t.apply(xs).astype(d) for t, d in zip(ts, ds, strict=True)),
        out_shardings=tuple(shardings), donate_argnums=tuple(donate),
        compiler_options=dict(options) or None, **placed))
  return _COMPILED[key]


def regroup(axis: int, groups: int, sizes: Sequence[int], take: Sequence[int]) -> Transform:
  """Along `axis`, `groups` blocks one after another, each of parts of `sizes`: the parts
  `take` names, one after another, each of them as every block holds it (in block order).

  E.g. Qwen3.5's fused linear-attention projection holds, per key head, [q k v z]: taking
  (0, 1, 2) gives [q of every head, k of every head, v of every head], (3,) every head's z.
  """
  sizes, take = tuple(sizes), tuple(take)
  block = sum(sizes)
  starts = [sum(sizes[:t]) for t in range(len(sizes))]
  if groups < 1 or any(n < 1 for n in sizes) or not take or any(
      not 0 <= t < len(sizes) for t in take):
    raise ValueError(f'regroup: {groups} groups of parts {sizes}, taking {take}: expected'
                     ' positive sizes and parts among them')

  def shape(s: Shape) -> Shape:
    if not -len(s) <= axis < len(s) or s[axis] != groups * block:
      raise TransformError(
          f'regroup(axis={axis}): expected {groups} groups of {block} ({" + ".join(map(str, sizes))})'
          f' = {groups * block} along axis {axis}, found {s}')
    at = axis % len(s)
    return (*s[:at], groups * sum(sizes[t] for t in take), *s[at + 1:])

  def apply(xs: Sequence[Any]) -> Any:
    x = xs[0]
    ops, at = xp(x), axis % x.ndim
    blocks = ops.reshape(x, (*x.shape[:at], groups, block, *x.shape[at + 1:]))
    parts = [ops.reshape(
        ops.take(blocks, np.arange(starts[t], starts[t] + sizes[t]), axis=at + 1),
        (*x.shape[:at], groups * sizes[t], *x.shape[at + 1:])) for t in take]
    return parts[0] if len(parts) == 1 else ops.concatenate(parts, axis=at)

  return Transform(f'regroup(axis={axis}, groups={groups}, sizes={sizes}, take={take})',
                   _one(shape), apply, source_specs=each(_whole(axis)),
                   source_axis=lambda d, shapes: None if d == axis % len(shapes[0]) else d)

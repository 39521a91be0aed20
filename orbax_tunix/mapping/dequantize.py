"""Weights qwix saved quantized, made from their stored parts by a transform.

In the canonical view a weight a QLoRA run saved quantized (`reading.quantized`: its qvalue,
scale and, with minmax, zero point) is one leaf. It is read as its parts and made by
`transform`, qwix's `dequantize` bit for bit (`reading/quantized.py` says why), as any output
is made from its sources: on the devices one compiled program per kind of weight, in the
target's sharding (the parts read in the partition that lines up with it:
`Transform.source_specs`), fused with what follows it (a LoRA merge, a layout's re-lay); on
the host with numpy. `with_parts` turns an output over such weights into one over their
parts (the executor runs every output so); `read_each` reads them for the tools that read
leaves rather than outputs (`diff`), and `mapping.device.plan_read` for the handlers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from orbax_tunix.conventions import QARRAY_PARTS
from orbax_tunix.mapping import transforms
from orbax_tunix.mapping.outputs import Input, Output
from orbax_tunix.mapping.transforms import IDENTITY, Transform, cast, chain, per_input
from orbax_tunix.reading import quantized, reader

Shape = tuple[int, ...]


def _broadcast(op: Any, x: Any, y: Any) -> Any:
  """`op(x, y)` with `y` repeated over `x` along each axis where it is smaller (a tile of
  `x` per entry of `y`). On the host without making the repeated `y` (qwix's generic
  broadcast: reshapes, which are views); on the devices `y` repeated (a reshape of a
  partitioned axis is no option there; the compiler fuses the repeat into `op`)."""
  if not isinstance(x, np.ndarray):
    for axis, (a, b) in enumerate(zip(x.shape, y.shape, strict=True)):
      if b not in (a, 1):
        y = transforms.xp(y).repeat(y, a // b, axis=axis)
    return op(x, y)
  xs, ys = [], []
  for a, b in zip(x.shape, y.shape, strict=True):
    if a == b or b == 1:
      xs.append(a)
      ys.append(b)
    else:
      xs += [b, a // b]
      ys += [b, 1]
  return op(x.reshape(xs), y.reshape(ys)).reshape(x.shape)


def dequantize(qvalue: Any, scale: Any, zero_point: Any = None, *, nf4: bool = False) -> Any:
  """qwix's `dequantize` of stored parts, `(qvalue in scale's dtype - zero_point) * scale`
  with scale (zero point) repeated over qvalue, computed in float32 and rounded once to
  scale's dtype (nf4's qvalue an index into its table); numpy on the host, jax.numpy on
  the devices (`transforms.xp`)."""
  xp = transforms.xp(qvalue, scale, *(() if zero_point is None else (zero_point,)))
  if nf4:
    qvalue = quantized.nf4_values(qvalue)
  value = qvalue.astype(scale.dtype).astype(np.float32)
  if zero_point is not None:
    value = _broadcast(xp.subtract, value, zero_point.astype(np.float32))
  return _broadcast(xp.multiply, value, scale.astype(np.float32)).astype(scale.dtype)


def _spread(x: Any, per: Sequence[int], crop: Sequence[tuple[int, int] | None]) -> Any:
  """A region of scale (zero point) as the region of the weight it covers: each entry
  repeated over its tile (`per` entries of the weight each, on the axes tiled), then cut
  (`crop`: (start, stop) per axis, None: whole)."""
  for axis, n in enumerate(per):
    if n > 1:
      x = transforms.xp(x).repeat(x, n, axis=axis)
  return x[tuple(slice(None) if c is None else slice(*c) for c in crop)]


def transform(scheme: quantized.Scheme, index: Sequence[Any] | None = None) -> Transform:
  """qwix's `dequantize` of a weight's parts (qvalue, scale[, zero point]) as a `Transform`,
  in scale's dtype.

  Args:
    scheme: the weight's, as its parts say.
    index: the region of the weight made (ints and slices, `Input.index`), from the same
      region of qvalue and the region of scale (zero point) that covers it (`part_inputs`);
      None: the whole weight.
  """
  nf4 = scheme.qtype == quantized.NF4
  n = 3 if scheme.zero_point else 2
  region = None
  if index is not None:
    _, crop = quantized.part_index(index, scheme)
    kept = [a for a, at in enumerate(index) if not isinstance(at, int | np.integer)]
    per = tuple(scheme.shape[a] // scheme.scale_shape[a] if scheme.scale_shape[a] != 1 else 1
                for a in kept)
    region = per, tuple(None if c == slice(None) else (c.start, c.stop) for c in crop)

  def apply(xs: Sequence[Any]) -> Any:
    qvalue, scale, *zero_point = xs
    if region is not None:
      scale, zero_point = _spread(scale, *region), [_spread(z, *region) for z in zero_point]
    value = dequantize(qvalue, scale, zero_point[0] if zero_point else None, nf4=nf4)
    # On the devices, kept rounded where what follows in the same program adds to it (a
    # LoRA merge): the compiler would fuse the product and the add into one multiply-add.
    return value if isinstance(value, np.ndarray) else jax.lax.optimization_barrier(value)

  def shape(shapes: Sequence[Shape]) -> Shape:
    if any(len(s) != len(shapes[0]) for s in shapes):
      raise transforms.TransformError(f'dequantize: parts of different ranks {list(shapes)}')
    return tuple(shapes[0])

  # Scale (zero point) partitioned as the weight where it has the weight's size, whole on
  # each device where it is 1 or tiled: no data moves between devices.
  lined = [s == w for s, w in zip(scheme.scale_shape, scheme.shape, strict=True)]

  def source_specs(spec: tuple, count: int) -> tuple[tuple, ...]:
    scale_spec = tuple(p if keep else None for p, keep in zip(spec, lined, strict=False))
    return (spec, *(scale_spec,) * (count - 1))

  name = f'dequantize({scheme.describe()})'
  # Its values are the stored weight's, in its dtype: nothing leaves the range a reader of
  # the weight sees (a cast to a narrower dtype is checked as ever: `writer.check_range`).
  return Transform(name, shape, apply, arity=n, source_specs=source_specs,
                   what=('dequantize', nf4, scheme.zero_point, region))


def _parts_of(ckpt: reader.Source, leaf: reader.LeafInfo
              ) -> tuple[reader.LeafInfo, ...]:
  """A weight saved quantized (`leaf.quantized`: its scheme, checked when the step was
  opened) as its stored parts, in qwix's order (qvalue, scale, zero point): leaves as stored,
  each under the path it has without the composing rule (`<w>/array/qvalue`, which a read
  finds)."""
  cmap = ckpt.detection.maps[leaf.item]
  named = cmap.composed[leaf.path]
  disk = [named[name] for name in QARRAY_PARTS if name in named]
  path_of = {d: p for p, d in cmap.parts.items()}
  return tuple(reader.LeafInfo(leaf.item, path_of[d], d, shape, dtype, reader.ARRAY, leaf.numpy)
               for d, (shape, dtype) in zip(disk, leaf.quantized.parts, strict=True))


def part_inputs(source: Input) -> tuple[Input, ...]:
  """A weight saved quantized read as its parts: qvalue the region `source` reads, scale
  (zero point) the region that covers it."""
  scheme = source.leaf.quantized
  parts = _parts_of(source.ckpt, source.leaf)
  if not source.partial:
    return tuple(dataclasses.replace(source, leaf=p) for p in parts)
  per = [n // s for n, s in zip(scheme.shape, scheme.scale_shape, strict=True)]
  axes = list(range(len(scheme.shape)))  # The weight's axes not taken yet.
  takes = []
  for axis, i in source.takes:
    takes.append((axis, i // per[axes.pop(axis)]))
  rows = None
  if source.rows is not None:
    axis, start, stop = source.rows
    p = per[axes[axis]]
    rows = (axis, start // p, -(-stop // p))
  return (dataclasses.replace(source, leaf=parts[0]),
          *(dataclasses.replace(source, leaf=p, takes=tuple(takes), rows=rows)
            for p in parts[1:]))


def with_parts(output: Output) -> Output:
  """An output over weights saved quantized as one over their parts: each such source
  replaced by its parts (read as stored) and made by `transform` first, in the dtype it was
  to be read in where a computation follows (a LoRA merge adds to it as read), before the
  output's own transform. Any other output as it is."""
  made = [i.leaf.quantized is not None and i.leaf.kind == reader.ARRAY for i in output.inputs]
  if not any(made):
    return output
  dtypes = output.input_dtypes()
  inputs: list[Input] = []
  each: list[Transform] = []
  read: list[np.dtype | None] = []
  for source, quantized_, dtype in zip(output.inputs, made, dtypes, strict=True):
    if not quantized_:
      inputs.append(source)
      each.append(IDENTITY)
      read.append(dtype)
      continue
    parts = part_inputs(source)
    made_by = transform(source.leaf.quantized, source.index)
    if (not output.transform.is_identity and dtype is not None
        and np.dtype(dtype) != source.leaf.dtype):
      made_by = chain(made_by, cast(dtype))
    inputs += parts
    each.append(made_by)
    read += [p.leaf.dtype for p in parts]
  if len(each) == 1:
    made_by = chain(each[0], output.transform)
  else:
    made_by = per_input(each, output.transform)
  return dataclasses.replace(output, inputs=tuple(inputs), transform=made_by,
                             read_dtypes=tuple(read))


def read_each(ckpt: reader.Source, item: str, leaves: Sequence[reader.LeafInfo]
              ) -> list[Any]:
  """`reader.read_each` (numpy; a leaf whose data cannot be read as `reader.UNREADABLE`)
  where weights saved quantized are made from their parts."""
  made = [leaf.quantized is not None for leaf in leaves]
  plain = reader.read_each(ckpt, item, [leaf for leaf, m in zip(leaves, made, strict=True)
                                        if not m])
  parts = [_parts_of(ckpt, leaf) for leaf, m in zip(leaves, made, strict=True) if m]
  values = iter(reader.read_each(ckpt, item, [p for ps in parts for p in ps]))
  got = []
  for ps, leaf in zip(parts, (leaf for leaf, m in zip(leaves, made, strict=True) if m),
                      strict=True):
    read = [next(values) for _ in ps]
    got.append(reader.UNREADABLE if any(v is reader.UNREADABLE for v in read)
               else transform(leaf.quantized).apply(read))
  plain_values, made_values = iter(plain), iter(got)
  return [next(made_values) if m else next(plain_values) for m in made]

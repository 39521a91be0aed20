"""LoRA adapters as a PEFT adapter: each adapted weight's `a`, `b` as Hugging Face's `lora_A`, `lora_B`.

qwix computes `base + s * lhs·a·b` (s = alpha / rank), `a` holding the
weight's dimensions the input contracts then the rank, `b` the rank then the
others (`lora.py`). PEFT's `Linear` computes `W x + (lora_alpha / r) * B A x`,
`A` (r, in) and `B` (out, r), for a Hugging Face weight `W` (out, in) that the
family's rule makes from the Tunix weight by moving its axes (transposes,
merges, one part of a fused weight taken). So no product is formed: the
family's own transform is applied to the *positions* of the weight (which row
of `a`, which column of `b` each entry of `a ⊗ b` takes), and the adapter is
expressible when every column of the Hugging Face weight takes one row of `a`
(that column's `A`) and every row one column of `b` (that row's `B`). A fused
weight (Gemma's `kv_einsum`) then gives each part the shared `a` and its own
slice of `b`. A transform that scales the weight (MaxText llama's query) scales
`B`. What does not factor so (a column of the weight mixing rows of `a`) is
not a PEFT adapter (`Factors.of` says why). The adapter has one `r` and one
`lora_alpha` (`Scaling`: what vLLM reads), lower ranks padded with zeros and a
module's own scale carried by its `B`. Nothing here reads an array.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import Collection, Mapping, Sequence

import numpy as np

from orbax_tunix.mapping import lora
from orbax_tunix.mapping.transforms import Shape, Transform, TransformError, leading_takes, xp

# PEFT's names: the adapter file (vLLM reads this name only), its config, and the tensors'.
ADAPTER_FILE = 'adapter_model.safetensors'
CONFIG_FILE = 'adapter_config.json'
# What a person serving the adapter should know (a QLoRA run's quantized base), beside it.
README_FILE = 'README.md'
PREFIX = 'base_model.model.'
WEIGHT = '.weight'


def tensor_names(module: str) -> tuple[str, str]:
  """(lora_A, lora_B) tensor names of one Hugging Face module (e.g. 'model.layers.0.mlp.up_proj')."""
  return f'{PREFIX}{module}.lora_A{WEIGHT}', f'{PREFIX}{module}.lora_B{WEIGHT}'


def einsum_contraction(einsum: str, a: Shape, b: Shape) -> lora.Contraction | None:
  """The `Contraction` an einsum `a, b -> weight` (a `huggingface.LoraWeight`) states, or None
  when the adapters' shapes do not fit it."""
  try:
    ins, out = einsum.replace(' ', '').split('->')
    sa, sb = ins.split(',')
  except ValueError:
    return None
  if len(sa) != len(a) or len(sb) != len(b) or sa[-1] != sb[0] or a[-1] != b[0]:
    return None
  product = sa[:-1] + sb[1:]
  if sorted(product) != sorted(out) or len(set(product)) != len(product):
    return None
  sizes = dict(zip(product, (*a[:-1], *b[1:]), strict=True))
  return lora.Contraction(tuple(sizes[c] for c in out), False,
                          tuple(product.index(c) for c in out))


def _coefficients(contraction: lora.Contraction, a: Shape, b: Shape
                  ) -> tuple[list[int], list[int]] | None:
  """Per axis of the weight, its stride in `a` flattened to (-1, rank) and in `b` flattened to
  (rank, -1) (0: the axis is not one of theirs); None: an arrangement this cannot follow."""
  weight, stacked = contraction.weight, contraction.stacked
  a_stride = [math.prod(a[j + 1:-1]) for j in range(len(a) - 1)]
  b_stride = [0] + [math.prod(b[j + 1:]) for j in range(1, len(b))]
  ca, cb = [0] * len(weight), [0] * len(weight)
  a_axes = [j for j in range(len(a) - 1) if j not in stacked]
  b_axes = [j for j in range(1, len(b)) if j not in stacked]
  inner = [k for k in range(len(weight)) if k not in stacked]
  for k in stacked:
    ca[k], cb[k] = a_stride[k], b_stride[k]
  if contraction.reshape:  # One flattened axis each (qwix's dot_general): a's lead the weight.
    if len(a_axes) != 1 or len(b_axes) != 1:
      return None
    sizes = [weight[k] for k in inner]
    split = next((n for n in range(len(sizes) + 1) if math.prod(sizes[:n]) == a[a_axes[0]]
                  and math.prod(sizes[n:]) == b[b_axes[0]]), None)
    if split is None:
      return None
    for n, k in enumerate(inner):
      if n < split:
        ca[k] = math.prod(sizes[n + 1:split]) * a_stride[a_axes[0]]
      else:
        cb[k] = math.prod(sizes[n + 1:]) * b_stride[b_axes[0]]
    return ca, cb
  for k, p in zip(inner, contraction.permutation, strict=True):
    if p < len(a_axes):
      ca[k] = a_stride[a_axes[p]]
    else:
      cb[k] = b_stride[b_axes[p - len(a_axes)]]
  return ca, cb


def _positions(shape: Shape, coefficients: Sequence[int]) -> np.ndarray:
  """The array of `shape` whose entry at each index is `sum(coefficient * index)`: a read-only
  view that holds only the axes with a coefficient (broadcast along the others), so that `a`'s
  positions in a weight cost the size of `a`, not of the weight, while transforms only move
  them (int32 where that holds every entry)."""
  largest = sum((n - 1) * c for n, c in zip(shape, coefficients, strict=True))
  dtype = np.int32 if largest < 2**31 else np.int64
  own = np.zeros([n if c else 1 for n, c in zip(shape, coefficients, strict=True)], dtype)
  for axis, (n, c) in enumerate(zip(shape, coefficients, strict=True)):
    if c:
      own += (np.arange(n, dtype=dtype) * c).reshape([-1 if i == axis else 1
                                                       for i in range(len(shape))])
  return np.broadcast_to(own, tuple(shape))


def _constant_along(positions: np.ndarray, axis: int) -> bool:
  """Whether every entry equals the first along `axis` (a broadcast axis, at no cost)."""
  if positions.strides[axis] == 0 or positions.shape[axis] <= 1:
    return True
  first = positions[:1] if axis == 0 else positions[:, :1]
  return bool(np.all(positions == first))


@dataclasses.dataclass(frozen=True)
class Factors:
  """One Hugging Face module's `lora_A` and `lora_B` out of `a` and `b`.

  Attributes:
    a_rows: `a` flattened to (-1, rank): the row of each input feature (A is
      `a_rows`' rows, transposed: (rank, in)).
    b_columns: `b` flattened to (rank, -1): the column of each output feature
      (B is those columns, transposed: (out, rank)).
    factor: what the family's transform multiplies the weight by (B carries it).
  """

  a_rows: np.ndarray
  b_columns: np.ndarray
  factor: float = 1.0

  @staticmethod
  def of(contraction: lora.Contraction, transform: Transform, a: Shape, b: Shape
         ) -> Factors | str:
    """The factors of `transform(a ⊗ b arranged by contraction)`, or why there are none.

    The transform's steps that move values are applied to the positions of the
    weight; a step that computes must be a scaling by one number (checked on ones
    and zeros), which `B` takes.
    """
    found = _coefficients(contraction, tuple(a), tuple(b))
    if found is None:
      return 'its adapters are arranged in a way a linear module\'s cannot follow'
    shape, ca, cb = list(contraction.weight), list(found[0]), list(found[1])
    # The transform's leading takes (a layer of a stacked weight, a part of a fused one) only
    # add a constant to the positions: the rest is computed once per layer shape (cached).
    takes, rest = leading_takes(transform)
    offset_a = offset_b = 0
    for axis, index in takes:
      axis %= len(shape)
      if not 0 <= index < shape[axis]:
        return f'take(axis={axis}, index={index}) does not fit the weight {tuple(shape)}'
      offset_a, offset_b = offset_a + index * ca[axis], offset_b + index * cb[axis]
      del shape[axis], ca[axis], cb[axis]
    key = (tuple(shape), tuple(ca), tuple(cb), rest.name)
    if key not in _FACTORS:
      if len(_FACTORS) > 256:
        _FACTORS.clear()
      _FACTORS[key] = _positions_through(rest, tuple(shape), ca, cb)
    made = _FACTORS[key]
    if isinstance(made, str):
      return made
    return Factors(made.a_rows + offset_a, made.b_columns + offset_b, made.factor)


# (weight shape, coefficients, transform name) -> its Factors (a name says all a transform
# does, as for `transforms.on_devices`): every layer of a model shares a handful.
_FACTORS: dict[tuple, Factors | str] = {}


def _positions_through(transform: Transform, shape: Shape, ca: Sequence[int],
                       cb: Sequence[int]) -> Factors | str:
  """`Factors.of` for one weight shape: the positions of `a` and of `b`, one after the other
  (each the weight's size, in the narrowest integers that hold them), through `transform`."""
  found, factor = [], 1.0
  for coefficients, axis in ((ca, 0), (cb, 1)):
    positions = _positions(shape, coefficients)
    try:
      for step in transform.steps or (transform,):
        if step.moves_only:
          positions = step.apply([positions])
          continue
        if axis == 0:  # A computed step: a scaling by one number, which B takes.
          ones = np.asarray(step.apply([np.ones(positions.shape, np.float32)]))
          zeros = np.asarray(step.apply([np.zeros(positions.shape, np.float32)]))
          if (ones.shape != positions.shape or np.any(zeros != 0)
              or np.any(ones != ones.flat[0])):
            return f'the weight is made by {step.name}, which is not a scaling of it'
          factor *= float(ones.flat[0])
    except TransformError as e:
      return str(e)
    if positions.ndim != 2:
      return f'the Hugging Face tensor has {positions.ndim} dimensions (a linear module\'s has 2)'
    if not _constant_along(positions, axis):
      return ('a feature of the Hugging Face module mixes several rows of lora_a (or columns of'
              ' lora_b): not B·A for any rank')
    first = positions[0] if axis == 0 else positions[:, 0]
    found.append(np.array(first, np.int64))
  return Factors(found[0], found[1], factor)


def _digest(*arrays: np.ndarray) -> str:
  h = hashlib.sha1()
  for x in arrays:
    h.update(np.ascontiguousarray(x).tobytes())
  return h.hexdigest()[:12]


def _padded(x, r: int, axis: int):
  """`x` with zeros appended along `axis` up to `r` (a lower-rank module at the adapter's r)."""
  missing = r - x.shape[axis]
  if missing == 0:
    return x
  ops = xp(x)
  shape = list(x.shape)
  shape[axis] = missing
  return ops.concatenate([x, ops.zeros(shape, x.dtype)], axis=axis)


def lora_a(factors: Factors, rank: int, r: int | None = None) -> Transform:
  """`a` -> PEFT's `lora_A` (r, in): its `rank` rows, then zeros up to the adapter's `r`."""
  rows = factors.a_rows
  r = rank if r is None else r

  def shape(shapes: Sequence[Shape]) -> Shape:
    (a,) = shapes
    if not a or a[-1] != rank or math.prod(a[:-1]) <= int(rows.max(initial=0)) or r < rank:
      raise TransformError(f'lora_A: {a} is not the adapter planned (rank {rank}, r {r})')
    return (r, len(rows))

  def apply(xs):
    (a,) = xs
    return _padded(a.reshape(-1, rank)[rows].T, r, 0)

  return Transform(f'peft_lora_A(rank={rank}, r={r}, in={len(rows)}, {_digest(rows)})', shape,
                   apply)


def lora_b(factors: Factors, rank: int, r: int | None = None, fold: float = 1.0) -> Transform:
  """`b` -> PEFT's `lora_B` (out, r): times the family transform's factor and `fold` (the
  module's scale over the adapter's one `lora_alpha / r`), then zero columns up to `r`."""
  columns, factor = factors.b_columns, factors.factor * fold
  r = rank if r is None else r

  def shape(shapes: Sequence[Shape]) -> Shape:
    (b,) = shapes
    if not b or b[0] != rank or math.prod(b[1:]) <= int(columns.max(initial=0)) or r < rank:
      raise TransformError(f'lora_B: {b} is not the adapter planned (rank {rank}, r {r})')
    return (len(columns), r)

  def apply(xs):
    (b,) = xs
    out = b.reshape(rank, -1)[:, columns].T
    if factor != 1.0:
      out = (out.astype(np.float32) * np.float32(factor)).astype(b.dtype)
    return _padded(out, r, 1)

  return Transform(f'peft_lora_B(rank={rank}, r={r}, out={len(columns)}, factor={factor!r},'
                   f' {_digest(columns)})', shape, apply, moves_only=factor == 1.0)


@dataclasses.dataclass(frozen=True)
class Scaling:
  """One `r` and `lora_alpha` for every module of an adapter, and what each module's `B`
  carries so that `lora_alpha / r` serves its own scale.

  vLLM reads `r` and `lora_alpha` alone (its PEFTHelper drops `rank_pattern` and
  `alpha_pattern`): it scales every module by `lora_alpha / r` and checks `r` against
  `--max-lora-rank`. So the adapter has one `r`, the largest rank (lower-rank modules are
  padded with zeros: `B A` unchanged, and zero rows and columns get zero gradients, so they
  stay zero if trained on), and a module whose trained scale `s` differs from
  `lora_alpha / r` has `B` times `s / (lora_alpha / r)` (`folds`): PEFT, vLLM and any reader
  of `r` and `lora_alpha` serve `s B A`, the update the run trained.

  Attributes:
    r: the adapter's rank (every module's `lora_A` has `r` rows).
    alpha: its `lora_alpha`.
    folds: module -> the factor its `B` carries (1: none).
  """

  r: int
  alpha: float
  folds: Mapping[str, float]

  @staticmethod
  def of(modules: Mapping[str, tuple[int, float]], alpha: float | None) -> Scaling:
    """For modules {name: (rank, scale)}: `r` the largest rank; `lora_alpha` the alpha given
    where it is the largest-rank modules' (qwix's alpha / rank), else their scale times `r`
    (the commonest, nonzero where one is)."""
    r = max(rank for rank, _ in modules.values())
    top = [s for rank, s in modules.values() if rank == r]
    candidates = ([s for s in top if s != 0] or [s for _, s in modules.values() if s != 0]
                  or [0.0])
    one = max(sorted(set(candidates)), key=candidates.count)
    if alpha is None or not math.isclose(float(alpha) / r, one, rel_tol=1e-12):
      alpha = one * r
    return Scaling(r, float(alpha), {
        name: 1.0 if s == one or one == 0 else s / one for name, (_, s) in modules.items()})


def config(modules: Collection[str], scaling: Scaling, base_model: str | None
           ) -> dict[str, object]:
  """PEFT's adapter_config.json for these modules (full names, e.g.
  'model.layers.0.self_attn.q_proj').

  `target_modules` lists each module by its full name: PEFT then adapts exactly these
  (bare names would match every layer's, and any other tower's, module of that name). One
  `r` and `lora_alpha` (`Scaling`): no `rank_pattern` or `alpha_pattern`, which vLLM ignores.
  """
  return {
      'peft_type': 'LORA',
      'task_type': 'CAUSAL_LM',
      'base_model_name_or_path': base_model,
      'r': scaling.r,
      'lora_alpha': _number(scaling.alpha),
      'target_modules': sorted(modules),
      'rank_pattern': {},
      'alpha_pattern': {},
      'bias': 'none',
      'lora_dropout': 0.0,
      'use_rslora': False,
      'use_dora': False,
      'inference_mode': True,
      'modules_to_save': None,
      'fan_in_fan_out': False,
      'init_lora_weights': True,
      'layers_to_transform': None,
  }


def _number(value: float) -> int | float:
  """A whole number as an int (alpha 16, not 16.0), as PEFT's own configs hold it."""
  value = float(value)
  return int(value) if value.is_integer() else value


def readme(notes: Sequence[str]) -> str:
  """The adapter folder's README: what serving it should know, one paragraph a note."""
  return '# LoRA adapter (written by orbax-tunix)\n\n' + '\n\n'.join(notes) + '\n'

"""LoRA adapters among the weights: where each writer puts them, and their merge.

Two writers, two namings (both read from their code, and pinned by tests that
run them):

- qwix (Tunix's LoRA, `LoraProvider(rank, alpha)`): beside a weight `<w>` of a
  module, `<w>_lora_a` and `<w>_lora_b`. The layer computes
  `base + (alpha / rank) * lhs·a·b`, where `a` holds the weight's dimensions
  that the input contracts (in the weight's order) then the rank, and `b` the
  rank then the weight's other dimensions; `nnx.Linear`-style layers
  (`dot_general`) flatten each group to one dimension. `alpha` is not stored.
- flax (`nnx.LoRA`, `nnx.LoRALinear`): `lora_a` (in, rank) and `lora_b`
  (rank, out), no scaling (`x @ a @ b`). `nnx.LoRALinear` is a `Linear` with
  its adapter in a `lora` submodule (`<m>/kernel`, `<m>/lora/lora_a`);
  `nnx.LoRA(base_module=...)` wraps the layer (`<m>/base_module/kernel`,
  `<m>/lora_a`), which the plain model holds as `<m>/kernel`.

The merged weight is `W + scale * (a ⊗ b)`, where `a ⊗ b` contracts `a`'s
last axis with `b`'s first and is arranged into `W`'s shape (see
`Contraction`).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Iterable, Mapping

import numpy as np

from orbax_tunix import errors
from orbax_tunix.keypaths import Path, fmt
from orbax_tunix.mapping import stacks
from orbax_tunix.mapping.merge_options import LORA_ALPHA, LORA_SCALE, SCALING

QWIX = 'qwix'
FLAX = 'flax'
QWIX_SUFFIXES = ('_lora_a', '_lora_b')
FLAX_KEYS = frozenset({'lora_a', 'lora_b'})
# Where flax's adapters keep the layer they adapt (see the module docstring).
FLAX_LORA_MODULE = 'lora'
FLAX_BASE_MODULE = 'base_module'
FLAX_KERNEL = 'kernel'

Shape = tuple[int, ...]


def is_adapter(path: Path) -> bool:
  """Whether a weight path is a LoRA adapter leaf (either writer's naming)."""
  return any(key.endswith(QWIX_SUFFIXES) or key in FLAX_KEYS for key in path)


def adapters_only(paths: Iterable[Path]) -> bool:
  """Whether there are weights and every one is an adapter (a LoRA-only save)."""
  paths = list(paths)
  return bool(paths) and all(is_adapter(p) for p in paths)


@dataclasses.dataclass(frozen=True)
class Adapter:
  """One adapted weight.

  Attributes:
    weight: the weight's path in the plain model (the merged weight's path).
    saved_base: where a full save of the LoRA model keeps the base weight
      (differs from `weight` under an `nnx.LoRA(base_module=...)`).
    a: the path of `lora_a`.
    b: the path of `lora_b`.
    style: QWIX or FLAX.
    rank: the rank (`a`'s last dimension).
  """

  weight: Path
  saved_base: Path
  a: Path
  b: Path
  style: str
  rank: int


def _qwix(path: Path) -> tuple[Path, Path, Path] | None:
  name = path[-1]
  if not name.endswith('_lora_a'):
    return None
  weight = path[:-1] + (name[: -len('_lora_a')],)
  return weight, weight, path[:-1] + (weight[-1] + '_lora_b',)


def _flax(path: Path, present: Mapping[Path, Shape]) -> tuple[Path, Path, Path] | None:
  if path[-1] != 'lora_a':
    return None
  module, b = path[:-1], path[:-1] + ('lora_b',)
  wrapped = module + (FLAX_BASE_MODULE, FLAX_KERNEL)
  if wrapped in present or module[-1:] != (FLAX_LORA_MODULE,):
    return module + (FLAX_KERNEL,), wrapped, b  # nnx.LoRA(base_module=...)
  return module[:-1] + (FLAX_KERNEL,), module[:-1] + (FLAX_KERNEL,), b  # nnx.LoRALinear


def find_adapters(shapes: Mapping[Path, Shape]) -> dict[Path, Adapter]:
  """Finds every adapter pair among a model's canonical weights.

  Args:
    shapes: canonical weight path -> shape.

  Returns:
    The plain model's weight path -> its `Adapter`.

  Raises:
    LoraError: an `a` without its `b` (or the reverse), or ranks that
      disagree between them.
  """
  found, problems, reported = {}, [], set()
  for path, shape in shapes.items():
    located = _qwix(path) or _flax(path, shapes)
    if located is None:
      continue
    weight, saved_base, b = located
    style = QWIX if path[-1] != 'lora_a' else FLAX
    reported.update((path, b))
    if b not in shapes:
      problems.append(f'{fmt(path)}: its pair {fmt(b)} is missing')
    elif not shape or not shapes[b] or shape[-1] != shapes[b][0]:
      problems.append(
          f'{fmt(path)} {shape} and {fmt(b)} {shapes[b]}: ranks disagree (expected'
          " a's last dimension to equal b's first)"
      )
    else:
      found[weight] = Adapter(weight, saved_base, path, b, style, int(shape[-1]))
  problems += [
      f'{fmt(path)}: its lora_a pair is missing'
      for path in shapes
      if path[-1].endswith('lora_b') and path not in reported
  ]
  if problems:
    raise errors.LoraError(
        f'{len(problems)} LoRA adapters cannot be paired:\n{errors.list_paths(problems)}\n'
        'Expected <w>_lora_a with <w>_lora_b (qwix) or lora_a with lora_b (flax),'
        ' with a rank shared by both. Use the checkpoint the LoRA run wrote, unedited.'
    )
  return found


@dataclasses.dataclass(frozen=True)
class Contraction:
  """How `tensordot(a, b, 1)` is arranged into the weight's shape.

  Attributes:
    weight: the weight's shape.
    reshape: the product's shape is reshaped to `weight` (qwix's flattened
      `dot_general` adapters); else it is only transposed.
    permutation: the axes of the product, in the weight's order (after any
      reshape: the identity).
  """

  weight: Shape
  reshape: bool
  permutation: tuple[int, ...]
  # Axes the weight, `a` and `b` share (at the same positions): stacked layers
  # (a scanned MaxText layer's adapters are stacked on `param_scan_axis` as its
  # weight is), one product per layer; `reshape` and `permutation` are then a
  # layer's (the weight without these axes).
  stacked: tuple[int, ...] = ()


# How many stacked axes a scanned layer's adapters may have: as many as a layer form's
# stack holds layers on (`stacks.MAX_DEPTH`: a scan within a scan).
MAX_STACKED = stacks.MAX_DEPTH


def contraction(weight: Shape, a: Shape, b: Shape) -> Contraction | None:
  """`_contraction`, or else the one run of shared stacked axes that makes it fit.

  Stacked axes: 1 to `MAX_STACKED` consecutive axes at the same position in
  the weight, `a` and `b`, of the same sizes, never `a`'s last or `b`'s
  first (the rank); the rest must contract as one layer's adapters.
  """
  direct = _contraction(weight, a, b)
  if direct is not None or len(a) < 3 or len(b) < 3:
    return direct
  fits = []
  for count in range(1, MAX_STACKED + 1):
    for start in range(1, min(len(a) - 1, len(b), len(weight)) - count + 1):
      axes = tuple(range(start, start + count))
      if any(not (a[i] == b[i] == weight[i]) for i in axes) or start + count > len(a) - 1:
        continue
      inner = _contraction(_drop(weight, axes), _drop(a, axes), _drop(b, axes))
      if inner is not None:
        fits.append(dataclasses.replace(inner, weight=tuple(weight), stacked=axes))
  return fits[0] if len(fits) == 1 else None


def contracting_axes(arranged: Contraction, a: Shape) -> tuple[int, ...]:
  """The weight's axes its layer's input contracts: those whose sizes `a` holds (but the
  rank and any stacked axes), in the weight's order (qwix quantizes a frozen weight with one
  scale per channel of the others)."""
  layer = [i for i in range(len(arranged.weight)) if i not in arranged.stacked]
  left = _drop(tuple(a), arranged.stacked)[:-1]
  if arranged.reshape:  # Leading axes flattened into `a`'s first (the first that fit).
    one = [arranged.weight[i] for i in layer]
    k = next(k for k in range(len(one) + 1) if math.prod(one[:k]) == math.prod(left))
    return tuple(layer[:k])
  return tuple(layer[w] for w, p in enumerate(arranged.permutation) if p < len(left))


def _drop(shape: Shape, axes: tuple[int, ...]) -> Shape:
  return tuple(n for i, n in enumerate(shape) if i not in axes)


def _contraction(weight: Shape, a: Shape, b: Shape) -> Contraction | None:
  """Works out how `a ⊗ b` reproduces a weight of shape `weight`.

  The weight's dimensions split into those of `a` (but the rank) and those
  of `b` (but the rank), each group in the weight's order: `a`'s first when
  that fits (the layout of every einsum qwix sees whose input dims lead);
  else the one interleaving that fits; else, for 2-D adapters, leading
  dimensions whose product is `a`'s and trailing ones whose product is `b`'s
  (flattened `dot_general`).

  Returns:
    The `Contraction`, or None if no arrangement, or more than one
    interleaving, reproduces the weight.
  """
  if not a or not b or a[-1] != b[0]:
    return None
  left, right = tuple(a[:-1]), tuple(b[1:])
  product = left + right
  identity = tuple(range(len(product)))
  if product == tuple(weight):
    return Contraction(tuple(weight), False, identity)
  if len(product) == len(weight):
    fits = []
    for chosen in itertools.combinations(range(len(weight)), len(left)):
      rest = [i for i in range(len(weight)) if i not in chosen]
      if tuple(weight[i] for i in chosen) == left and tuple(weight[i] for i in rest) == right:
        order = list(chosen) + rest  # weight axis of each product axis
        fits.append(tuple(order.index(axis) for axis in range(len(weight))))
    if len(fits) == 1:
      return Contraction(tuple(weight), False, fits[0])
    if fits:
      return None  # Ambiguous: the shapes alone cannot say which.
  if len(a) == 2 and len(b) == 2 and math.prod(weight) == a[0] * b[1]:
    for k in range(len(weight) + 1):
      if math.prod(weight[:k]) == a[0] and math.prod(weight[k:]) == b[1]:
        return Contraction(tuple(weight), True, (0, 1))
  return None


def check_scaling_applies(adapters: Mapping[Path, Adapter], alpha: float | None,
                          scale: float | None) -> None:
  """Refuses an alpha or scale for adapters that have none (flax's add `a ⊗ b` unscaled).

  Raises:
    LoraError: `alpha` or `scale` given, and every adapter is flax's (it would be ignored).
  """
  given = [o.named() for o, v in zip(SCALING, (alpha, scale), strict=True) if v is not None]
  if not given or any(a.style != FLAX for a in adapters.values()):
    return
  first = next(iter(adapters.values()))
  raise errors.LoraError(
      f'{" and ".join(given)} given, but these adapters are flax\'s (nnx.LoRA or'
      f' nnx.LoRALinear: e.g. {fmt(first.a)}), which have no alpha: flax adds a·b unscaled,'
      ' and so do the merge and a PEFT adapter of them (lora_alpha = r). Drop'
      f' {" and ".join(given)} (they apply to qwix\'s adapters).'
  )


# The merge's arithmetic is float32 (`merge.combine`): its largest finite value.
_FLOAT32_MAX = float(np.finfo(np.float32).max)


def scale_of(adapter: Adapter, alpha: float | None, scale: float | None) -> float:
  """The factor of `a ⊗ b`: qwix's `alpha / rank` (or `scale`), flax's 1.

  Args:
    adapter: the adapter.
    alpha, scale: as given (None: not given).

  Raises:
    LoraError: a qwix adapter, and neither `alpha` nor `scale` given; or a
      scale float32 (the merge's arithmetic) cannot hold: beyond its range, or
      a nonzero scale it rounds to 0.
  """
  if adapter.style == FLAX:
    return 1.0
  if scale is None and alpha is None:
    raise errors.LoraError(
        f'{fmt(adapter.a)}: qwix LoRA scales the adapters by alpha / rank, and alpha'
        f' is not stored in the checkpoint. Pass {LORA_ALPHA.named()} (the LoraProvider\'s'
        f' alpha of the run), or {LORA_SCALE.named()} (alpha / rank) directly.'
    )
  value = float(scale) if scale is not None else float(alpha) / adapter.rank
  with np.errstate(over='ignore', under='ignore'):
    held = float(np.float32(value))
  if abs(value) > _FLOAT32_MAX or (value != 0 and held == 0):
    option, given = (LORA_SCALE, scale) if scale is not None else (LORA_ALPHA, alpha)
    what = '' if scale is not None else f' (alpha / rank {adapter.rank})'
    raise errors.LoraError(
        f'{option.named(repr(given))}: the scale {value:g}{what} of {fmt(adapter.a)} is outside'
        f' what float32, the merge\'s arithmetic, holds ({"at most" if held else "at least"}'
        f' {_FLOAT32_MAX if held else float(np.finfo(np.float32).smallest_subnormal):g}):'
        ' every merged weight would be inf, NaN or unchanged. Pass the alpha the run was'
        ' trained with.'
    )
  return value

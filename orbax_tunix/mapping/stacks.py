"""MaxText's stacked decoder layers, as data: every form onto one per-layer naming.

MaxText 0.2.5 stores a decoder's layers in one of several forms (printed from
`nnx.state` of tiny models built with MaxText itself; `A` is
`param_scan_axis`, 1 by default):

  form                      arrays                                          layer
  unscanned                 decoder/layers_{i}/<w>                          i
  scanned                   decoder/layers/<w>, layers on A                 a
  gemma3 scanned            decoder/layers/layers_{j}/<w>, blocks on A      6a + j
                            decoder/layers_remainder/layers_{j}/<w>         6·blocks + j
  gemma4 scanned            decoder/scanned_blocks/local_layers/<w>,        6a + k
                              blocks on A, the 5 local layers on A+1
                            decoder/scanned_blocks/global_layer/<w>, on A   6a + 5
                            decoder/layers_remainder/local_layers/<w>, on A 6·blocks + a

A `Stack` names one such group of arrays and where its layers go; a form is a
tuple of stacks. `unstack` makes every layer's weights, named
`decoder/layers_{i}/<w>` (the unscanned form), from any of them: the rest of a
model (embedding, final norm) is passed through. Planning only: the result
says which source array and which `take`s make each per-layer weight.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence

from orbax_tunix import errors
from orbax_tunix.keypaths import Path, fmt
from orbax_tunix.mapping.patterns import Mapped, Pattern
from orbax_tunix.mapping.transforms import IDENTITY, Shape, chain, take

DEFAULT_AXIS = 1
UNSCANNED_LAYER: tuple[str, ...] = ('decoder', 'layers_{i}')


@dataclasses.dataclass(frozen=True)
class Stack:
  """Layers stacked in arrays under one prefix.

  Attributes:
    prefix: the arrays' path up to the weight's own name (`{j}`: a number in
      the path, e.g. gemma3's position in the block).
    axes: the array axes holding layers, as offsets from `param_scan_axis`,
      outermost first: (0,) scanned; (0, 1) a scan within a scan; () none
      (layers numbered in the path only).
    layer: (the path's numbers and the axes' indices by name: `j`, `a0`,
      `a1`, ..., and `scanned`: how many layers the non-remainder stacks
      hold) -> the layer's number.
    remainder: numbered after the other stacks' layers (uses `scanned`).
  """

  prefix: tuple[str, ...]
  axes: tuple[int, ...]
  layer: Callable[[Mapping[str, int]], int]
  remainder: bool = False

  @property
  def pattern(self) -> Pattern:
    return Pattern.parse((*self.prefix, '...'))


SCANNED = (Stack(('decoder', 'layers'), (0,), lambda n: n['a0']),)


def blocks(period: int) -> tuple[Stack, ...]:
  """Gemma3's scanned form: blocks of `period` layers `layers_{j}`, then a remainder."""
  return (
      Stack(('decoder', 'layers', 'layers_{j}'), (0,), lambda n: period * n['a0'] + n['j']),
      Stack(('decoder', 'layers_remainder', 'layers_{j}'), (), lambda n: n['scanned'] + n['j'],
            remainder=True),
  )


def local_global(period: int) -> tuple[Stack, ...]:
  """Gemma4's scanned form: per block, `period - 1` local layers (an inner scan), a global one."""
  return (
      Stack(('decoder', 'scanned_blocks', 'local_layers'), (0, 1),
            lambda n: period * n['a0'] + n['a1']),
      Stack(('decoder', 'scanned_blocks', 'global_layer'), (0,),
            lambda n: period * n['a0'] + period - 1),
      Stack(('decoder', 'layers_remainder', 'local_layers'), (0,),
            lambda n: n['scanned'] + n['a0'], remainder=True),
  )


# Every stacked form, the most specific first (gemma3's `decoder/layers/layers_{j}`
# is also under plain `decoder/layers`).
FORMS: tuple[tuple[Stack, ...], ...] = (local_global(6), blocks(6), SCANNED)


def describe(shapes: Mapping[Path, Shape], axis: int = DEFAULT_AXIS) -> tuple[str, int]:
  """('scanned' or 'unscanned', how many layers) of a MaxText model's weights."""
  form = next((f for f in FORMS if any(f[0].pattern.match(p) for p in shapes)), ())
  try:
    per_layer = unstack(shapes, form, axis)
  except errors.UnsupportedLayoutError:
    return 'scanned', 0
  return ('scanned' if form else 'unscanned'), layer_count(per_layer)


def unstack(
    shapes: Mapping[Path, Shape], stacks: Sequence[Stack], axis: int = DEFAULT_AXIS,
    *, where: str = '',
) -> dict[Path, Mapped]:
  """Every weight per layer (`decoder/layers_{i}/<w>`), from stacked arrays or as stored.

  Args:
    shapes: the model's weights (canonical paths) -> shapes.
    stacks: the forms the family stores layers in (e.g. `SCANNED`).
    axis: MaxText's `param_scan_axis`.
    where: the checkpoint, for messages.

  Returns:
    path -> `Mapped` (one source, `take`s or identity), for every weight.

  Raises:
    UnsupportedLayoutError: a stacked array without the layer axes, or two
      arrays making one layer's weight.
  """
  out: dict[Path, Mapped] = {}
  problems: list[str] = []
  pending = []
  for path, shape in shapes.items():
    found = next(((s, m) for s in stacks if (m := s.pattern.match(path))), None)
    if found is None:
      _put(out, path, Mapped((path,), IDENTITY, tuple(shape)), problems)
      continue
    stack, (bound, rest) = found
    axes = [axis + a for a in stack.axes]
    if axes and max(axes) >= len(shape):
      problems.append(f'{fmt(path)} {tuple(shape)}: expected layers on axes {axes}'
                      f' (param_scan_axis={axis})')
      continue
    pending.append((stack, path, tuple(shape), {k: int(v) for k, v in bound.items()}, rest, axes))
  # The remainder's layers come after every layer the other stacks hold.
  scanned: set[int] = set()
  for remainder in (False, True):
    made = set()
    for stack, path, shape, bound, rest, axes in pending:
      if stack.remainder != remainder:
        continue
      for index in _indices([shape[a] for a in axes]):
        names = {**bound, **{f'a{n}': i for n, i in enumerate(index)}, 'scanned': len(scanned)}
        i = stack.layer(names)
        made.add(i)
        # Taken innermost first: an outer take would move the inner axis.
        transform = chain(*(take(a, k) for a, k in sorted(zip(axes, index, strict=True),
                                                          reverse=True)))
        kept = tuple(n for d, n in enumerate(shape) if d not in axes)
        _put(out, ('decoder', f'layers_{i}', *rest), Mapped((path,), transform, kept), problems)
    scanned |= made
  if problems:
    raise errors.UnsupportedLayoutError(
        f'{where}: the decoder\'s stacked layers do not fit MaxText\'s forms:\n'
        f'{errors.list_paths(problems)}\nPass the param_scan_axis the model was built with.'
    )
  return out


def layer_axes(path: Path, stacks: Sequence[Stack], axis: int = DEFAULT_AXIS) -> tuple[int, ...]:
  """The axes of the array at `path` that hold layers, outermost first (none: a weight of
  one layer, or no layer's)."""
  stack = next((s for s in stacks if s.pattern.match(path)), None)
  return () if stack is None else tuple(axis + a for a in stack.axes)


def _indices(sizes: Sequence[int]) -> list[tuple[int, ...]]:
  out: list[tuple[int, ...]] = [()]
  for size in sizes:
    out = [(*o, i) for o in out for i in range(size)]
  return out


def _put(out: dict[Path, Mapped], dest: Path, mapped: Mapped, problems: list[str]) -> None:
  if dest in out:
    problems.append(f'{fmt(dest)}: made from both {fmt(out[dest].sources[0])} and'
                    f' {fmt(mapped.sources[0])}')
  else:
    out[dest] = mapped


def layer_count(paths: Sequence[Path]) -> int:
  """How many `decoder/layers_{i}` layers per-layer paths hold."""
  pattern = Pattern.parse((*UNSCANNED_LAYER, '...'))
  return len({m[0]['i'] for p in paths if (m := pattern.match(p))})

"""MaxText's stacked decoder layers, as data: every form, onto one per-layer naming.

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
tuple of stacks (`SCANNED_FORM`, `blocks`, `local_global`). `unstack` makes
every layer's weights, named `decoder/layers_{i}/<w>` (the unscanned form),
from any of them: the rest of a model (embedding, final norm) is passed
through. Planning only: the result says which source array and which `take`s
make each per-layer weight.

SCANNED and UNSCANNED (the plain decoder's forms) are told apart by paths
(`form_of`) and turned into each other by layout rules (`rules`).
`param_scan_axis` names the layer axis of the scanned side; a stored step's is
its custom metadata's (`SCAN_AXIS_KEY`) or the one along which every stacked
weight has one size (`stacked_axes`); one that does not fit, or layer counts
that differ, are refused naming the weights (`check_stacked`,
`check_unscanned`). `stackings` pairs a model's leaves in one form with those
of the other under any layer naming (`layers_0`, `layers/0`), for messages.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import re
from collections.abc import Callable, Iterable, Mapping, Sequence

from orbax_tunix import errors
from orbax_tunix.errors import LayerScanMismatchError
from orbax_tunix.keypaths import Path, fmt
from orbax_tunix.mapping.patterns import LayoutRule, Mapped, Pattern
from orbax_tunix.mapping.transforms import IDENTITY, Shape, chain, move_axis, stack, take

# MaxText's `param_scan_axis` default.
DEFAULT_AXIS = 1
SCANNED = 'scanned'
UNSCANNED = 'unscanned'
# Custom metadata keys of a converted step: the form (MaxText's own key) and the axis.
SCAN_LAYERS_KEY = 'scan_layers'
SCAN_AXIS_KEY = 'param_scan_axis'
# The plain decoder's forms, as path patterns.
_KEYS = {SCANNED: ('decoder', 'layers', '...'), UNSCANNED: ('decoder', 'layers_{i}', '...')}
_MATCH = {form: Pattern.parse(keys) for form, keys in _KEYS.items()}
AS_STORED = LayoutRule.of(('...',), ('...',))


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


SCANNED_FORM = (Stack(_KEYS[SCANNED][:-1], (0,), lambda n: n['a0']),)


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
FORMS: tuple[tuple[Stack, ...], ...] = (local_global(6), blocks(6), SCANNED_FORM)


def describe(shapes: Mapping[Path, Shape], axis: int = DEFAULT_AXIS) -> tuple[str, int]:
  """(SCANNED or UNSCANNED, how many layers) of a MaxText model's weights."""
  form = next((f for f in FORMS if any(f[0].pattern.match(p) for p in shapes)), ())
  try:
    return (SCANNED if form else UNSCANNED), len(_numbers(unstack(shapes, form, axis)))
  except errors.UnsupportedLayoutError:
    return SCANNED, 0


def unstack(
    shapes: Mapping[Path, Shape], stacks: Sequence[Stack], axis: int = DEFAULT_AXIS,
    *, where: str = '',
) -> dict[Path, Mapped]:
  """Every weight per layer (`decoder/layers_{i}/<w>`), from stacked arrays or as stored.

  Args:
    shapes: the model's weights (canonical paths) -> shapes.
    stacks: the form the family stores layers in (e.g. `SCANNED_FORM`).
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
      for index in itertools.product(*(range(shape[a]) for a in axes)):
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


def _put(out: dict[Path, Mapped], dest: Path, mapped: Mapped, problems: list[str]) -> None:
  if dest in out:
    problems.append(f'{fmt(dest)}: made from both {fmt(out[dest].sources[0])} and'
                    f' {fmt(mapped.sources[0])}')
  else:
    out[dest] = mapped


def check_axis(axis: int | None) -> None:
  """Refuses a `param_scan_axis` that is not a non-negative int (None: not given).

  MaxText counts it from the front; from the back it would name another axis
  in weights of different ranks (a kernel's and a norm's scale).

  Raises:
    InvalidOptionError: naming the value.
  """
  if axis is not None and (isinstance(axis, bool) or not isinstance(axis, int) or axis < 0):
    raise errors.InvalidOptionError(
        f'`param_scan_axis` {axis!r}: expected a non-negative axis, counted from the front'
        f' as MaxText counts it ({DEFAULT_AXIS} by default: query/kernel is (emb, layers,'
        ' heads, head_dim)).'
    )


def rules(to: str, axis: int = DEFAULT_AXIS, source_axis: int | None = None,
          ) -> tuple[LayoutRule, ...]:
  """The layout rules that put the decoder's layers in form `to` (the rest as it is).

  Args:
    to: SCANNED or UNSCANNED.
    axis: the layer axis of the scanned side (the written one when `to` is
      SCANNED, else the stored one).
    source_axis: for SCANNED from scanned weights, their stored layer axis
      (moved to `axis`); None: the stored weights are unscanned.
  """
  if to == SCANNED and source_axis is not None:
    if source_axis == axis:
      return (AS_STORED,)
    relaid = LayoutRule.of(_KEYS[SCANNED], _KEYS[SCANNED], move_axis(source_axis, axis))
  elif to == SCANNED:
    relaid = LayoutRule.of(_KEYS[UNSCANNED], _KEYS[SCANNED], stack(axis))
  elif to == UNSCANNED:
    relaid = LayoutRule.of(_KEYS[SCANNED], _KEYS[UNSCANNED], fan_out=('i', axis),
                           transform_for=lambda i: take(axis, i))
  else:
    raise ValueError(f'form {to!r}: expected {SCANNED!r} or {UNSCANNED!r}')
  return (relaid, AS_STORED)


def form_of(paths: Iterable[Path]) -> str | None:
  """SCANNED, UNSCANNED, or None when the paths hold no MaxText decoder layers."""
  found = {form for p in paths for form, pattern in _MATCH.items() if pattern.match(p)}
  return found.pop() if len(found) == 1 else None


def stacked_axes(shapes: Mapping[Path, Shape | None]) -> tuple[int, ...]:
  """The axes along which every scanned weight has one size: where the layers can be."""
  stacked = in_form(shapes, SCANNED)
  if not stacked:
    return ()
  rank = min(len(s) for s in stacked.values())
  return tuple(a for a in range(rank) if len({s[a] for s in stacked.values()}) == 1)


def scan_axis(shapes: Mapping[Path, Shape | None], recorded: int | None = None) -> int | None:
  """The layer axis of scanned weights: as recorded, else the one their shapes allow.

  Args:
    shapes: weights (canonical paths) -> shapes.
    recorded: the step's custom metadata `param_scan_axis`, if any.

  Returns:
    The axis, or None when the shapes allow none, or several and none of them
    is recorded (nothing is guessed that the shapes do not determine).
  """
  axes = stacked_axes(shapes)
  if recorded in axes:
    return recorded
  return axes[0] if len(axes) == 1 else None


def layer_count(shapes: Mapping[Path, Shape | None], axis: int | None = None) -> int | None:
  """How many layers the weights hold: layers_<i> counted, or the size of the layer
  axis of the stacked ones (`axis`, or `scan_axis`); None when they do not agree."""
  form = form_of(shapes)
  if form == UNSCANNED:
    return len(_numbers(shapes))
  if form == SCANNED:
    axis = scan_axis(shapes) if axis is None else axis
    if axis is None:
      return None
    sizes = {s[axis] if len(s) > axis else None for s in in_form(shapes, SCANNED).values()}
    return sizes.pop() if len(sizes) == 1 else None
  return None


def check_stacked(shapes: Mapping[Path, Shape | None], axis: int | None, where: str,
                  count: int | None = None) -> int:
  """The layer axis of stored scanned weights, checked against the axis given.

  Args:
    shapes: the stored weights -> shapes (those outside decoder/layers ignored).
    axis: the axis the caller names (None: the one the shapes allow).
    where: the checkpoint, for messages.
    count: the layer count wanted (a target's), to choose between axes the
      shapes allow alike when `axis` is None.

  Returns:
    The axis: `axis`, or the one found.

  Raises:
    LayerScanMismatchError: a weight lacks the axis or holds another number of
      layers along it than the rest (naming each such weight and its shape);
      the message suggests another axis only when every weight agrees on it.
  """
  stacked = in_form(shapes, SCANNED)
  axes = stacked_axes(stacked)
  if axis is None:
    fits = [a for a in axes if count is None or stacked[next(iter(stacked))][a] == count]
    if count is not None and not fits and axes:
      # No axis holds the target's count: refused by the caller, which names both counts.
      fits = [DEFAULT_AXIS if DEFAULT_AXIS in axes else axes[0]]
    if len(fits) > 1:
      raise LayerScanMismatchError(
          f'{where}: the scanned layers could be stacked along any of axes {fits} (every'
          ' stacked weight has one size along each). Pass `param_scan_axis`.'
      )
    axis = fits[0] if fits else None
  if axis is not None and axis in axes:
    return axis
  if axis is not None and axes:
    sizes = ', '.join(f'{fmt(p)} {s}' for p, s in sorted(stacked.items())[:6])
    raise LayerScanMismatchError(
        f'{where}: the scanned layers are stacked along axis {" or ".join(map(str, axes))}'
        f' (every stacked weight has {stacked[next(iter(stacked))][axes[0]]} there), not along'
        f' param_scan_axis={axis}, where the weights differ: {sizes}'
        f'{", ..." if len(stacked) > 6 else ""}\nPass `param_scan_axis={axes[0]}`, or leave it'
        ' out.'
    )
  axis = DEFAULT_AXIS if axis is None else axis
  along = {p: s[axis] if len(s) > axis else None for p, s in stacked.items()}
  counted = collections.Counter(v for v in along.values() if v is not None)
  common, held = (counted.most_common(1) or [(None, 0)])[0]
  odd = [f'{fmt(p)} {s}: ' + (f'no axis {axis}' if along[p] is None else f'{along[p]} along it')
         for p, s in sorted(stacked.items()) if along[p] != common]
  raise LayerScanMismatchError(
      f'{where}: expected every scanned weight (decoder/layers/...) to hold the same number'
      f' of layers along param_scan_axis={axis}; {held} of {len(stacked)} hold {common},'
      f' {len(odd)} do not:\n{errors.list_paths(odd)}\nThese weights are not one scanned'
      ' MaxText decoder: check how the step was written.'
  )


def check_unscanned(shapes: Mapping[Path, Shape | None], where: str) -> int:
  """The layer count of unscanned weights, checked: layers 0..n-1, each with the same weights.

  Returns:
    The number of layers.

  Raises:
    LayerScanMismatchError: a layer number missing, or a layer lacking a
      weight the others hold (naming them).
  """
  per_layer: dict[int, set[Path]] = collections.defaultdict(set)
  per_weight: dict[Path, dict[int, Shape]] = collections.defaultdict(dict)
  for p, s in shapes.items():
    found = _MATCH[UNSCANNED].match(p)
    if found is not None and s is not None:
      i, w = int(found[0]['i']), tuple(found[1])
      per_layer[i].add(w)
      per_weight[w][i] = tuple(s)
  if not per_layer:
    return 0
  names = set().union(*per_layer.values())
  problems = [f'layers_{i}: missing' for i in range(max(per_layer) + 1) if i not in per_layer]
  problems += [f'layers_{i}: lacks {", ".join(fmt(w) for w in sorted(names - held))}'
               for i, held in sorted(per_layer.items()) if held != names]
  for w, by_layer in sorted(per_weight.items()):
    common = collections.Counter(by_layer.values()).most_common(1)[0][0]
    problems += [f'layers_{i}/{fmt(w)}: {s}, the other layers {common}'
                 for i, s in sorted(by_layer.items()) if s != common]
  if problems:
    raise LayerScanMismatchError(
        f'{where}: expected the unscanned layers decoder/layers_0 .. layers_{max(per_layer)}'
        f' to hold the same {len(names)} weights each, of one shape a weight, found:\n{errors.list_paths(problems)}\n'
        'These weights are not one unscanned MaxText decoder: check how the step was written.'
    )
  return len(per_layer)


def in_form(shapes: Mapping[Path, Shape | None], form: str) -> dict[Path, Shape]:
  """The weights of `shapes` in `form` (those of unknown shape left out)."""
  return {p: tuple(s) for p, s in shapes.items() if s is not None and _MATCH[form].match(p)}


def _numbers(paths: Iterable[Path]) -> set[str]:
  """The layer numbers `i` of the paths `decoder/layers_{i}/...` among `paths`."""
  return {m[0]['i'] for p in paths if (m := _MATCH[UNSCANNED].match(p))}


# A layer index as a key of its own ('layers/0/...', nnx.List) or a name
# suffix ('layers_0/...', Linen's unscanned layers).
_INDEXED_NAME = re.compile(r'(.+)_(\d+)')


def _unindexed(path: Path) -> tuple[Path, int] | None:
  """The path without its first layer index, and that index ('layers/0' or 'layers_0')."""
  for i, key in enumerate(path):
    if key.isdigit():
      return path[:i] + path[i + 1 :], int(key)
    if m := _INDEXED_NAME.fullmatch(key):
      return path[:i] + (m.group(1),) + path[i + 1 :], int(m.group(2))
  return None


def _layer_axis(stacked: Shape | None, per_layer: Shape | None, n: int) -> int | None:
  """The axis of `stacked` that holds `n` layers of shape `per_layer`, if any."""
  if stacked is None or per_layer is None:
    return None
  return next((axis for axis, size in enumerate(stacked)
               if size == n and stacked[:axis] + stacked[axis + 1 :] == per_layer), None)


@dataclasses.dataclass(frozen=True)
class Stacking:
  """Evidence of scanned vs unscanned: one stacked leaf and its per-layer leaves."""

  stacked: str
  stacked_shape: Shape | None
  per_layer: tuple[str, ...]
  per_layer_shape: Shape | None
  axis: int | None

  def __str__(self) -> str:
    axis = f'layer axis {self.axis}' if self.axis is not None else 'no layer axis fits'
    return (
        f'{self.stacked} {self.stacked_shape} <-> {len(self.per_layer)} per-layer leaves'
        f' {self.per_layer[0]}, ... {self.per_layer_shape} ({axis})'
    )


def stackings(
    per_layer: Mapping[Path, tuple[str, Shape | None]],
    stacked: Mapping[Path, tuple[str, Shape | None]],
) -> list[Stacking]:
  """Pairs each stacked leaf with the per-layer leaves that would make it.

  Args:
    per_layer: path -> (name for messages, shape) on the per-layer side.
    stacked: path -> (name for messages, shape) on the other side.
  """
  groups: dict[Path, list[tuple[int, Path]]] = {}
  for path in per_layer:
    if (unindexed := _unindexed(path)) is not None:
      groups.setdefault(unindexed[0], []).append((unindexed[1], path))
  found = []
  for path, (name, shape) in sorted(stacked.items()):
    layers = sorted(groups.get(path, ()))
    if not layers:
      continue
    per_shape = per_layer[layers[0][1]][1]
    found.append(
        Stacking(
            stacked=name,
            stacked_shape=shape,
            per_layer=tuple(per_layer[p][0] for _, p in layers),
            per_layer_shape=per_shape,
            axis=_layer_axis(shape, per_shape, len(layers)),
        )
    )
  return found

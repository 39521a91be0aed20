"""MaxText's two forms of the decoder's layers, as layout rules.

Scanned (`scan_layers=True`): `decoder/layers/<w>`, one array per weight, the
layers stacked along `param_scan_axis` (1 by default: `query/kernel` is
(emb, L, heads, head_dim), a norm's `scale` (emb, L)). Unscanned:
`decoder/layers_<i>/<w>`, one array per layer. One rule each way, and one
that moves the layer axis of scanned weights; the plan applies the same rules
under every optimizer subtree that mirrors the weights (`mu`, `nu`).

`param_scan_axis` always names the layer axis of the scanned side: of the
weights written (or restored into) when they are scanned, of the stored ones
when only those are. A stored scanned step's own axis is read from its custom
metadata (convert records it) or from its shapes: the axis along which every
stacked weight has one size, the layer count (`stacked_axes`). An axis that
does not fit, or a layer count that differs between weights, is refused
naming the weights, before any read.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Mapping

from orbax_tunix import errors
from orbax_tunix.keypaths import Path, fmt
from orbax_tunix.mapping import patterns
from orbax_tunix.mapping.patterns import LayoutRule, Mapped, Pattern
from orbax_tunix.mapping.transforms import Shape, move_axis, stack, take
from orbax_tunix.maxtext.errors import LayerScanMismatchError

SCANNED = 'scanned'
UNSCANNED = 'unscanned'
# MaxText's `param_scan_axis` default.
DEFAULT_AXIS = 1
# Custom metadata keys of a converted step: the form (MaxText's own key) and the axis.
SCAN_LAYERS_KEY = 'scan_layers'
SCAN_AXIS_KEY = 'param_scan_axis'

_FORMS = {
    SCANNED: ('decoder', 'layers', '...'),
    UNSCANNED: ('decoder', 'layers_{i}', '...'),
}
_MATCH = {form: Pattern.parse(keys) for form, keys in _FORMS.items()}
AS_STORED = LayoutRule.of(('...',), ('...',))


def check_axis(axis: int | None) -> None:
  """Refuses a `param_scan_axis` that is not a non-negative int (None: not given).

  MaxText counts it from the front; from the back it would name another axis
  in weights of different ranks (a kernel's and a norm's scale).

  Raises:
    InvalidOptionError: naming the value.
  """
  if axis is None:
    return
  if isinstance(axis, bool) or not isinstance(axis, int) or axis < 0:
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
    relaid = LayoutRule.of(_FORMS[SCANNED], _FORMS[SCANNED], move_axis(source_axis, axis))
  elif to == SCANNED:
    relaid = LayoutRule.of(_FORMS[UNSCANNED], _FORMS[SCANNED], stack(axis))
  elif to == UNSCANNED:
    relaid = LayoutRule.of(_FORMS[SCANNED], _FORMS[UNSCANNED], fan_out=('i', axis),
                           transform_for=lambda i: take(axis, i))
  else:
    raise ValueError(f'form {to!r}: expected {SCANNED!r} or {UNSCANNED!r}')
  return (relaid, AS_STORED)


def form_of(paths: Iterable[Path]) -> str | None:
  """SCANNED, UNSCANNED, or None when the paths hold no MaxText decoder layers."""
  found = {form for p in paths for form, pattern in _MATCH.items() if pattern.match(p)}
  return found.pop() if len(found) == 1 else None


def _stacked(shapes: Mapping[Path, Shape | None]) -> dict[Path, Shape]:
  return {p: tuple(s) for p, s in shapes.items() if s is not None and _MATCH[SCANNED].match(p)}


def stacked_axes(shapes: Mapping[Path, Shape | None]) -> tuple[int, ...]:
  """The axes along which every scanned weight has one size: where the layers can be."""
  stacked = _stacked(shapes)
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
    return len({_MATCH[UNSCANNED].match(p)[0]['i'] for p in shapes if _MATCH[UNSCANNED].match(p)})
  if form == SCANNED:
    axis = scan_axis(shapes) if axis is None else axis
    if axis is None:
      return None
    sizes = {s[axis] if len(s) > axis else None for s in _stacked(shapes).values()}
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
  stacked = _stacked(shapes)
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
  common, held = collections.Counter(v for v in along.values() if v is not None).most_common(1)[0] \
      if any(v is not None for v in along.values()) else (None, 0)
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


def relayout(
    source: Mapping[Path, Shape],
    target: Mapping[Path, Shape | None],
    axis: int | None = None,
    *,
    where: str = '',
) -> dict[Path, Mapped]:
  """The target weights the source holds in the other form, and how to make them.

  Args:
    source: the checkpoint's weights (canonical paths) -> shapes.
    target: the target's weights (same naming, no `params` level) -> shapes.
    axis: MaxText's `param_scan_axis`, of whichever side is scanned (None: the
      stored weights' own when they are scanned, else the target's).
    where: the checkpoint, for messages.

  Returns:
    target weight -> `Mapped` (its sources and transform) for each target
    weight that is not in the source as it is but is the other form of some;
    {} when the two sides are in one form.

  Raises:
    LayerScanMismatchError: the forms differ, but a layer count differs
      between the sides or between weights, or the layer axis does not fit
      the shapes (naming the weights, before any read).
  """
  check_axis(axis)
  missing = [t for t in target if t not in source]
  if not missing:
    return {}
  want, have = form_of(missing), form_of(p for p in source if p not in target)
  if want is None or have is None or want == have:
    return {}
  stored = {p: s for p, s in source.items() if _MATCH[have].match(p)}
  if have == SCANNED:
    axis = check_stacked(stored, axis, where, layer_count(_only(target, want)))
  elif axis is None:
    count = check_unscanned(stored, where)
    wanted = _only(target, SCANNED)
    fits = [a for a in stacked_axes(wanted) if next(iter(wanted.values()))[a] == count]
    axis = DEFAULT_AXIS if DEFAULT_AXIS in fits or len(fits) != 1 else fits[0]
  else:
    check_unscanned(stored, where)
  try:
    mapped = patterns.map_paths(stored, rules(want, axis), where=where).outputs
  except errors.UnsupportedLayoutError as e:
    raise LayerScanMismatchError(
        f'{where}: the checkpoint is {have.upper()} and the target {want.upper()}, but the'
        f' layers cannot be re-laid along param_scan_axis={axis}:\n{e}\nPass the'
        ' param_scan_axis the model was built with.'
    ) from e
  found = {t: m for t, m in mapped.items() if t in target}
  problems = [
      f'{fmt(t)}: target {target[t]}, from {", ".join(fmt(s) for s in m.sources[:2])}'
      f'{", ..." if len(m.sources) > 2 else ""} {source[m.sources[0]]} by {m.transform} gives'
      f' {m.shape}'
      for t, m in sorted(found.items()) if target[t] is not None and tuple(target[t]) != m.shape
  ]
  unmade = sorted(t for t in missing if t not in found and _MATCH[want].match(t))
  if problems or unmade:
    parts = [
        f'{where}: the checkpoint is {have.upper()} ({layer_count(stored, axis)} layers) and'
        f' the target {want.upper()} ({layer_count(_only(target, want), axis)} layers),'
        f' re-laid along param_scan_axis={axis}, but they do not fit:'
    ]
    if problems:
      parts.append(f'{len(problems)} weights differ in shape:\n{errors.list_paths(problems)}')
    if unmade:
      parts.append(f'{len(unmade)} target weights have no layer in the checkpoint:\n'
                   + errors.list_paths([fmt(t) for t in unmade]))
    parts.append('Build the target with the number of layers and the param_scan_axis the run'
                 ' trained with.')
    raise LayerScanMismatchError('\n'.join(parts))
  return found


def _only(shapes: Mapping[Path, Shape | None], form: str) -> dict[Path, Shape]:
  return {p: s for p, s in shapes.items() if s is not None and _MATCH[form].match(p)}

"""MaxText's two forms of the decoder's layers, as layout rules.

Scanned (`scan_layers=True`): `decoder/layers/<w>`, one array per weight, the
layers stacked along `param_scan_axis` (1 by default: `query/kernel` is
(emb, L, heads, head_dim), a norm's `scale` (emb, L)). Unscanned:
`decoder/layers_<i>/<w>`, one array per layer. One rule each way; the plan
applies the same rules under every optimizer subtree that mirrors the weights
(`mu`, `nu`). The axis is a parameter: nothing is inferred that the shapes do
not determine, and shapes that do not fit it are refused.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping

from orbax_tunix import errors, patterns
from orbax_tunix.keypaths import Path, fmt
from orbax_tunix.maxtext.errors import LayerScanMismatchError
from orbax_tunix.patterns import LayoutRule, Mapped, Pattern
from orbax_tunix.transforms import Shape, stack, take

SCANNED = 'scanned'
UNSCANNED = 'unscanned'
# MaxText's `param_scan_axis` default.
DEFAULT_AXIS = 1

_FORMS = {
    SCANNED: ('decoder', 'layers', '...'),
    UNSCANNED: ('decoder', 'layers_{i}', '...'),
}
_MATCH = {form: Pattern.parse(keys) for form, keys in _FORMS.items()}
AS_STORED = LayoutRule.of(('...',), ('...',))


def rules(to: str, axis: int = DEFAULT_AXIS) -> tuple[LayoutRule, ...]:
  """The layout rules that put the decoder's layers in form `to` (the rest as it is)."""
  if to == SCANNED:
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


def layer_count(shapes: Mapping[Path, Shape], axis: int = DEFAULT_AXIS) -> int | None:
  """How many layers the weights hold: layers_<i> counted, or the stacked axis' size."""
  form = form_of(shapes)
  if form == UNSCANNED:
    return len({_MATCH[UNSCANNED].match(p)[0]['i'] for p in shapes if _MATCH[UNSCANNED].match(p)})
  if form == SCANNED:
    sizes = {s[axis] for p, s in shapes.items() if _MATCH[SCANNED].match(p) and len(s) > axis}
    return sizes.pop() if len(sizes) == 1 else None
  return None


def relayout(
    source: Mapping[Path, Shape],
    target: Mapping[Path, Shape | None],
    axis: int = DEFAULT_AXIS,
    *,
    where: str = '',
) -> dict[Path, Mapped]:
  """The target weights the source holds in the other form, and how to make them.

  Args:
    source: the checkpoint's weights (canonical paths) -> shapes.
    target: the target's weights (same naming, no `params` level) -> shapes.
    axis: MaxText's `param_scan_axis`.
    where: the checkpoint, for messages.

  Returns:
    target weight -> `Mapped` (its sources and transform) for each target
    weight that is not in the source as it is but is the other form of some;
    {} when the two sides are in one form.

  Raises:
    LayerScanMismatchError: the forms differ, but a layer count differs
      between the sides or the layer axis does not fit the shapes (naming
      the weights, before any read).
  """
  missing = [t for t in target if t not in source]
  if not missing:
    return {}
  want, have = form_of(missing), form_of(p for p in source if p not in target)
  if want is None or have is None or want == have:
    return {}
  stored = {p: s for p, s in source.items() if _MATCH[have].match(p)}
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


def holds_layers(paths: Collection[Path]) -> bool:
  return form_of(paths) is not None

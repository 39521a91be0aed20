"""A MaxText restore target whose decoder layers are in the other form than the step's.

The forms (scanned, unscanned), their layer axis and the rules between them are
`mapping/stacks.py`'s; here a target asking for the other form is matched to
the stored weights, every mismatch refused before any read.
"""

from __future__ import annotations

from collections.abc import Mapping

from orbax_tunix import errors
from orbax_tunix.keypaths import Path, fmt
from orbax_tunix.mapping import patterns, stacks
from orbax_tunix.mapping.patterns import Mapped
from orbax_tunix.mapping.transforms import Shape


def relayout(
    source: Mapping[Path, Shape],
    target: Mapping[Path, Shape | None],
    axis: int | None = None,
    *,
    where: str = '',
) -> tuple[tuple[patterns.LayoutRule, ...], dict[Path, Mapped]]:
  """The rules laying the source's decoder layers out as the target's, and the target
  weights the source holds in the other form, each with how it is made.

  Args:
    source: the checkpoint's weights (canonical paths) -> shapes.
    target: the target's weights (same naming, no `params` level) -> shapes.
    axis: MaxText's `param_scan_axis`, of whichever side is scanned (None: the
      stored weights' own when they are scanned, else the target's).
    where: the checkpoint, for messages.

  Returns:
    (the layer rules, `stacks.rules`, or `stacks.AS_STORED` alone when the two
    sides are in one form; target weight -> `Mapped` (its sources and
    transform) for each target weight that is the other form of some).

  Raises:
    LayerScanMismatchError: the forms differ, but a layer count differs
      between the sides or between weights, or the layer axis does not fit
      the shapes (naming the weights, before any read).
  """
  stacks.check_axis(axis)
  missing = [t for t in target if t not in source]
  want, have = stacks.form_of(missing), stacks.form_of(p for p in source if p not in target)
  if not missing or want is None or have is None or want == have:
    return (stacks.AS_STORED,), {}
  stored = {p: s for p, s in source.items() if stacks.form_of([p]) == have}
  if have == stacks.SCANNED:
    axis = stacks.check_stacked(stored, axis, where,
                                stacks.layer_count(stacks.in_form(target, want)))
  elif axis is None:
    count = stacks.check_unscanned(stored, where)
    wanted = stacks.in_form(target, stacks.SCANNED)
    fits = [a for a in stacks.stacked_axes(wanted) if next(iter(wanted.values()))[a] == count]
    axis = stacks.DEFAULT_AXIS if stacks.DEFAULT_AXIS in fits or len(fits) != 1 else fits[0]
  else:
    stacks.check_unscanned(stored, where)
  rules = stacks.rules(want, axis)
  try:
    mapped = patterns.map_paths(stored, rules, where=where).outputs
  except errors.UnsupportedLayoutError as e:
    raise errors.LayerScanMismatchError(
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
  unmade = sorted(t for t in missing if t not in found and stacks.form_of([t]) == want)
  if problems or unmade:
    counts = [stacks.layer_count(stored, axis),
              stacks.layer_count(stacks.in_form(target, want), axis)]
    parts = [
        f'{where}: the checkpoint is {have.upper()} ({counts[0]} layers) and the target'
        f' {want.upper()} ({counts[1]} layers), re-laid along param_scan_axis={axis}, but they'
        ' do not fit:'
    ]
    if problems:
      parts.append(f'{len(problems)} weights differ in shape:\n{errors.list_paths(problems)}')
    if unmade:
      parts.append(f'{len(unmade)} target weights have no layer in the checkpoint:\n'
                   + errors.list_paths([fmt(t) for t in unmade]))
    parts.append('Build the target with the number of layers and the param_scan_axis the run'
                 ' trained with.')
    raise errors.LayerScanMismatchError('\n'.join(parts))
  return rules, found

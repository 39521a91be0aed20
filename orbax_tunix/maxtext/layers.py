"""A restore target whose decoder layers are in another form than the step's.

The forms, their layer axis and the re-laying are `mapping/stacks.py`'s `LayerForm`s (the
families' forms: `huggingface.layer_form`); here the target's form is matched to the stored
weights, every mismatch refused before any read.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from orbax_tunix import conventions, errors
from orbax_tunix.keypaths import Path, fmt
from orbax_tunix.mapping import huggingface, stacks
from orbax_tunix.mapping.patterns import Mapped
from orbax_tunix.mapping.transforms import IDENTITY, Shape
from orbax_tunix.maxtext.view import CheckpointView


def relayout(view: CheckpointView, target: Mapping[Path, Shape | None], aux: Collection[Path],
             axis: int | None = None) -> tuple[dict[Path, Mapped], dict[Path, Shape]]:
  """The checkpoint's weights in the target's layer form, and the stored shapes read for it.

  Args:
    view: the checkpoint.
    target: the target's weights (canonical paths, no `params` level) -> shapes.
    aux: the checkpoint's non-weight variables (not laid out).
    axis: MaxText's `param_scan_axis`, of whichever side is scanned (None: the
      stored weights' own when they are scanned, else the target's).

  Returns:
    (weight in the target's form -> its stored weights and transform, for every
    weight: as stored where the forms agree; stored weight -> shape, read for the
    weights re-laid).

  Raises:
    LayerScanMismatchError: the forms differ, but a layer count differs between the
      sides or between weights, or the layer axis does not fit the shapes (naming the
      weights, before any read).
  """
  stacks.check_axis(axis)
  weights = [w for w in view.model if w not in aux]
  missing = [w for w in target if w not in view.model]
  unwanted = [w for w in weights if w not in target]
  have, want = huggingface.layer_form(unwanted), huggingface.layer_form(missing)
  if not missing or None in (have, want) or have == want:
    return {w: Mapped((w,), IDENTITY, None) for w in weights}, {}
  where = str(view.step_dir)
  stored = view.shapes(conventions.MODEL_ITEM, unwanted)
  wanted = {w: s for w, s in target.items() if want.holds(w) or stacks.layer_of(w) is not None}
  if have.scanned:
    axis = have.axis(stored, axis, count=want.count(wanted), where=where)
  elif axis is None:
    axis = want.axis(wanted, count=len(want.layers(stored, where)), where=where)
  try:
    relaid = stacks.relay({w: stored.get(w) for w in weights}, have, want, axis, where=where)
  except errors.UnsupportedLayoutError as e:
    raise errors.LayerScanMismatchError(
        f'{where}: the checkpoint is {have.kind.upper()} and the target {want.kind.upper()},'
        f' but the layers cannot be re-laid along param_scan_axis={axis}:\n{e}\nPass the'
        ' param_scan_axis the model was built with.'
    ) from e
  _check(relaid, stored, wanted, (have, want), axis, where)
  return relaid, stored


def _check(relaid: Mapping[Path, Mapped], stored: Mapping[Path, Shape],
           wanted: Mapping[Path, Shape | None], forms: tuple[stacks.LayerForm, ...], axis: int,
           where: str) -> None:
  """Refuses re-laid weights whose shape is not the target's, and target layers no stored
  layer makes (with both sides' layer counts)."""
  problems = [
      f'{fmt(w)}: target {s}, from {", ".join(fmt(p) for p in m.sources[:2])}'
      f'{", ..." if len(m.sources) > 2 else ""} {stored[m.sources[0]]} by {m.transform}'
      f' gives {m.shape}'
      for w, s in sorted(wanted.items()) if (m := relaid.get(w)) is not None and s is not None
      and m.shape is not None and tuple(s) != m.shape]
  unmade = sorted(fmt(w) for w in wanted if w not in relaid)
  if not (problems or unmade):
    return
  (have, want), counts = forms, (forms[0].count(stored, axis), forms[1].count(wanted, axis))
  parts = [
      f'{where}: the checkpoint is {have.kind.upper()} ({counts[0]} layers) and the target'
      f' {want.kind.upper()} ({counts[1]} layers), re-laid along param_scan_axis={axis}, but'
      ' they do not fit:'
  ]
  if problems:
    parts.append(f'{len(problems)} weights differ in shape:\n{errors.list_paths(problems)}')
  if unmade:
    parts.append(f'{len(unmade)} target weights have no layer in the checkpoint:\n'
                 + errors.list_paths(unmade))
  parts.append('Build the target with the number of layers and the param_scan_axis the run'
               ' trained with.')
  raise errors.LayerScanMismatchError('\n'.join(parts))

"""The model of an opened step: whose model code named its weights, and its decoder's layers
(their form, layer axis and count), resolved here.

Every plan that reads a step's layers takes them from this module: `inspect` reports them
(`of`: once per opened step, shared by every reader of it), a layout unstacks them (`resolve`)
or re-lays them (`conversion`), MaxText's restore re-lays them into its target's form
(`relayout`). The inputs are put together here alone: what the caller names
(`param_scan_axis`), what the step records (a converted step's custom metadata,
`recorded`), and what the arrays' shapes tell (`LayerForm.axis`, `mapping/stacks.py`); the
forms are the families' (`huggingface.layer_form`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping

from orbax_tunix import conventions, errors
from orbax_tunix.keypaths import Path, fmt
from orbax_tunix.mapping import huggingface, stacks, trainers
from orbax_tunix.mapping.hf_naming import Family, Naming
from orbax_tunix.mapping.patterns import Mapped
from orbax_tunix.mapping.transforms import IDENTITY, Shape
from orbax_tunix.reading import reader


@dataclasses.dataclass(frozen=True)
class Layers:
  """The decoder's layers as a step stores them, and the trainer that named its weights.

  Attributes:
    trainer: the trainer whose model code named the weights (`trainers.of`: a family's naming
      by it is what a layout maps them by); None: the step holds no weights.
    form: their form (`stacks.LayerForm`: a family's scanned one, or UNSCANNED); None: the
      weights hold no MaxText decoder layers.
    axis: the layer axis of scanned layers: the recorded one, else the one the shapes tell;
      where the arrays contradict the record, theirs. None: unscanned, or no axis fits.
    count: how many layers (None: the weights do not agree on one).
    problem: why the record or the shapes do not stand (a `LayerScanMismatchError`'s
      message), else None.
  """

  trainer: trainers.Trainer | None = None
  form: stacks.LayerForm | None = None
  axis: int | None = None
  count: int | None = None
  problem: str | None = None


def recorded(source: reader.Source) -> int | None:
  """The layer axis a converted step records (its custom metadata), if any."""
  found = source.detection.source.custom_metadata.get(stacks.SCAN_AXIS_KEY)
  return found if isinstance(found, int) and not isinstance(found, bool) else None


def of(source: reader.Source) -> Layers:
  """The step's own layers (its weights, adapters too), resolved once per opened step from
  what it records and what its arrays tell; a record the arrays contradict, or weights that
  are not one decoder, are named in `problem` (the arrays' axis kept where they tell one)."""
  return source.derived('layers', _of)


def _of(source: reader.Source) -> Layers:
  try:
    pairs = reader.weights(source)
  except (errors.UnsupportedLayoutError, errors.MissingItemError):
    pairs = []  # No weights here: no layers.
  if not pairs:
    return Layers()
  trainer = trainers.of([p for _, p in pairs])
  known = {p: leaf.shape for leaf, p in pairs if leaf.shape is not None}
  form = huggingface.layer_form(known)
  if form is None:
    return Layers(trainer)
  axis, problem, where = None, None, str(source.step_dir)
  if form.scanned:
    record = recorded(source)
    try:
      axis = form.axis(known, recorded=record, where=where)
    except errors.LayerScanMismatchError as e:
      problem = str(e)
      try:  # A record the arrays contradict: what the arrays say.
        axis = None if record is None else form.axis(known, where=where)
      except errors.LayerScanMismatchError:
        pass
      if axis is None:
        return Layers(trainer, form, problem=problem)
  count = form.count(known, stacks.DEFAULT_AXIS if axis is None else axis)
  return Layers(trainer, form, axis, count, problem)


def naming(source: reader.Source, family: Family) -> Naming:
  """The family's naming by the trainer that named the step's weights (`Layers.trainer`).

  Raises:
    UnsupportedLayoutError: the step holds no weights, or the family has no naming by that
      trainer (as `huggingface.naming_by`).
  """
  trainer, where = of(source).trainer, str(source.step_dir)
  if trainer is None:
    raise errors.UnsupportedLayoutError(
        f'{where}: expected model weights to lay out as {family.name}, found none'
        ' (no weights item, or an empty one). Export a step that holds the model.')
  return huggingface.naming_by(family, trainer, where)


def resolve(source: reader.Source, form: stacks.LayerForm, shapes: Mapping[Path, Shape | None],
            given: int | None = None) -> int:
  """The layer axis of `shapes`' stacked layers in `form`, as a layout lays them out:
  `given` (`param_scan_axis`), else as the step records it, else the one the shapes tell.

  Raises:
    InvalidOptionError, LayerScanMismatchError: as `LayerForm.axis`.
  """
  return form.axis(shapes, given, where=str(source.step_dir), recorded=recorded(source))


@dataclasses.dataclass(frozen=True)
class Conversion:
  """How a conversion to MaxText's step stores and writes the decoder's layers.

  Attributes:
    have: the stored form (None: no MaxText decoder layers).
    want: the form written (None: no MaxText decoder layers).
    axis: the stored layer axis (None: unscanned, or not told by the shapes).
    to_axis: the written one (None: unscanned, or not told).
  """

  have: stacks.LayerForm | None = None
  want: stacks.LayerForm | None = None
  axis: int | None = None
  to_axis: int | None = None

  @property
  def relaid(self) -> bool:
    return self.have != self.want or self.axis != self.to_axis


def conversion(source: reader.Source, shapes: Mapping[Path, Shape], given: int | None,
               scan: bool | None) -> Conversion:
  """The layers' form and axis, stored and written, for MaxText's step (`scan_layers`).

  `given` (`param_scan_axis`) names the layer axis of the scanned side: the written one when
  writing scanned, else the stored one (its own is the step's recorded one, else the one its
  shapes tell: `LayerForm.axis`, which refuses one that does not fit). Unscanned layers are
  written scanned in their family's form (`huggingface.scanned_form`).

  Raises:
    InvalidOptionError: a negative `param_scan_axis`, or one no side of the
      conversion is scanned on.
    UnsupportedLayoutError: `scan_layers` for weights without MaxText layers.
    LayerScanMismatchError: the stored layers are not one decoder (a weight
      with another layer count or shape), or the axis does not fit them.
  """
  where = str(source.step_dir)
  stacks.check_axis(given)
  have = huggingface.layer_form(shapes)
  if have is None and scan is not None:
    raise errors.UnsupportedLayoutError(
        f'{where}: `scan_layers` asks for MaxText\'s'
        f' {stacks.SCANNED if scan else stacks.UNSCANNED_NAME} layers, but the weights hold'
        ' no MaxText decoder layers (decoder/layers/... or decoder/layers_<i>/...).'
        ' Leave `scan_layers` out.'
    )
  want = have if scan is None or have is None else (
      stacks.UNSCANNED if not scan else have if have.scanned
      else huggingface.scanned_form(shapes, where))
  if given is not None and not (have and have.scanned) and not (want and want.scanned):
    raise errors.InvalidOptionError(
        f'`param_scan_axis` {given}: '
        + ('the layers are written as stored (no `scan_layers`), and the weights hold no'
           ' scanned layers' if scan is None else 'neither the stored nor the written layers'
           ' are scanned')
        + ', so no layer axis is used. Leave `param_scan_axis` out'
        + (', or pass `scan_layers` too.' if scan is None else '.')
    )
  if have is None or not (have.scanned or want.scanned):
    return Conversion(have, want)
  record = recorded(source)
  named = None if scan else given  # Writing scanned, `given` names the written axis ...
  if scan and have.scanned and record is not None and given is not None:
    fit = have.axes(shapes)  # ... and the stored one, where the arrays fit it, not the record.
    named = given if given in fit and record not in fit else None
  axis = None
  if have.scanned and scan is None and named is None and record is None:
    try:  # As stored: the axis is only recorded, when the shapes tell it.
      axis = have.axis(shapes, where=where)
    except errors.LayerScanMismatchError:
      pass
  elif have.scanned:
    axis = have.axis(shapes, named, recorded=record, where=where)
  to_axis = None if not want.scanned else given if scan and given is not None else (
      stacks.DEFAULT_AXIS if axis is None and not have.scanned else axis)
  return Conversion(have, want, axis, to_axis)


def relayout(source: reader.Source, target: Mapping[Path, Shape | None], aux: Collection[Path],
             axis: int | None = None) -> tuple[dict[Path, Mapped], dict[Path, Shape]]:
  """A restore target whose decoder layers are in another form than the step's: the step's
  weights in the target's layer form, and the stored shapes read for it, every mismatch
  refused before any read.

  Args:
    source: the checkpoint.
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
  model = source.paths(conventions.MODEL_ITEM)
  weights = [w for w in model if w not in aux]
  missing = [w for w in target if w not in model]
  unwanted = [w for w in weights if w not in target]
  have, want = huggingface.layer_form(unwanted), huggingface.layer_form(missing)
  if not missing or None in (have, want) or have == want:
    return {w: Mapped((w,), IDENTITY, None) for w in weights}, {}
  where = str(source.step_dir)
  stored = source.shapes(conventions.MODEL_ITEM, unwanted)
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

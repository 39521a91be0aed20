"""The MaxText layout: the step MaxText itself writes, from a Tunix run.

One item, `items`, as MaxText 0.2.5 saves its train state (zarr3 arrays):
`params/params/<weights>` (no RNG state), and unless weights only, the
optimizer and `step` as MaxText's adamw chain saves them (`maxtext.train_state`).
`nnx_aux` is left out: MaxText keeps its own initial values for it
(a Tunix run's RNG keys are of another kind). The custom metadata records
`scan_layers`, which MaxText's `from_pretrained` checks.

The mapping is the MaxText view's (`maxtext.plan.make_plan`), the one that
restores a Tunix step into an abstract state a caller gives: here the target
is MaxText's own train state for these weights (`maxtext.train_state`),
optionally with the decoder's layers in the other form (`mapping.stacks`).
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from orbax_tunix import conventions, errors
from orbax_tunix.keypaths import Path, fmt
from orbax_tunix.layouts.base import LaidOut, Layout, Option, Request, register
from orbax_tunix.layouts.base import weights as layout_weights
from orbax_tunix.layouts.canonical import rng_note
from orbax_tunix.layouts.step import STEP
from orbax_tunix.mapping import lora, patterns, stacks
from orbax_tunix.mapping import outputs as outputs_lib
from orbax_tunix.mapping.outputs import Input, ItemOutput, Output
from orbax_tunix.maxtext import train_state
from orbax_tunix.maxtext.plan import RestorePlan, make_plan
from orbax_tunix.maxtext.view import read_view
from orbax_tunix.reading import reader

ITEM = conventions.MAXTEXT_ITEM


@dataclasses.dataclass(frozen=True)
class _Layers:
  """How the decoder's layers are written.

  Attributes:
    rules: the layout rules from the stored weights to the written ones.
    form: the form written (None: no MaxText decoder layers).
    axis: the layer axis written when scanned (else None).
    relaid: the layers are written in another form or axis than stored.
    scan_axis: the layer axis of the scanned side, stored or written (None:
      neither is scanned).
  """

  rules: tuple[patterns.LayoutRule, ...]
  form: str | None
  axis: int | None
  relaid: bool
  scan_axis: int | None = None


def _layers(request: Request, shapes: dict[Path, tuple[int, ...]]) -> _Layers:
  """The layers' form and axis to write, from the request and the stored shapes.

  `param_scan_axis` names the layer axis of the scanned side: the written one
  when writing scanned, else the stored one. A stored scanned step's own axis
  is the one its custom metadata records (a converted step), else the one its
  shapes allow (`stacks.check_stacked`); a given axis that does not fit it is
  refused, naming the weights.

  Raises:
    InvalidOptionError: a negative `param_scan_axis`, or one no side of the
      conversion is scanned on.
    UnsupportedLayoutError: `scan_layers` for weights without MaxText layers.
    LayerScanMismatchError: the stored layers are not one decoder (a weight
      with another layer count or shape), or the axis does not fit them.
  """
  given = request.option(PARAM_SCAN_AXIS)
  stacks.check_axis(given)
  where = str(request.source.step_dir)
  stored = stacks.form_of(shapes)
  scan_layers = request.option(SCAN_LAYERS)
  want = None if scan_layers is None else stacks.SCANNED if scan_layers else stacks.UNSCANNED
  if stored is None and want is not None:
    raise errors.UnsupportedLayoutError(
        f'{where}: `scan_layers` asks for MaxText\'s {want} layers, but the weights hold'
        ' no MaxText decoder layers (decoder/layers/... or decoder/layers_<i>/...).'
        ' Leave `scan_layers` out.'
    )
  if given is not None and stacks.SCANNED not in (stored, want):
    raise errors.InvalidOptionError(
        f'`param_scan_axis` {given}: '
        + ('the layers are written as stored (no `scan_layers`), and the weights hold no'
           ' scanned layers' if want is None else 'neither the stored nor the written layers'
           ' are scanned')
        + ', so no layer axis is used. Leave `param_scan_axis` out'
        + (', or pass `scan_layers` too.' if want is None else '.')
    )
  if stored is None:
    return _Layers((stacks.AS_STORED,), None, None, False)
  if stored == stacks.UNSCANNED:
    if want != stacks.SCANNED:
      return _Layers((stacks.AS_STORED,), stored, None, False)
    stacks.check_unscanned(shapes, where)
    axis = stacks.DEFAULT_AXIS if given is None else given
    return _Layers(stacks.rules(stacks.SCANNED, axis), want, axis, True, axis)
  recorded = request.source.detection.source.custom_metadata.get(stacks.SCAN_AXIS_KEY)
  recorded = recorded if isinstance(recorded, int) and not isinstance(recorded, bool) else None
  names_stored = want != stacks.SCANNED  # The axis given names the stored layers.
  if names_stored and given is not None and recorded is not None and given != recorded:
    raise errors.LayerScanMismatchError(
        f'{where}: `param_scan_axis` {given}, but the step records its layers stacked along'
        f' axis {recorded} (custom metadata {stacks.SCAN_AXIS_KEY!r}). Pass'
        f' `param_scan_axis={recorded}`, or leave it out.'
    )
  named = given if names_stored and given is not None else recorded
  if want is None and named is None:
    try:  # As stored: the axis is only recorded, when the shapes tell it.
      axis = stacks.check_stacked(shapes, None, where)
    except errors.LayerScanMismatchError:
      axis = None
    return _Layers((stacks.AS_STORED,), stored, axis, False, axis)
  source_axis = stacks.check_stacked(shapes, named, where)
  if want == stacks.UNSCANNED:
    return _Layers(stacks.rules(stacks.UNSCANNED, source_axis), want, None, True, source_axis)
  axis = source_axis if want is None or given is None else given
  if axis != source_axis and not request.params_only:
    raise errors.UnsupportedLayoutError(
        f'{where}: the layers are stacked along axis {source_axis}; moving them to'
        f' param_scan_axis={axis} is done for the weights only (the optimizer state is not'
        ' re-laid so). Add `params_only` (MaxText then starts its optimizer afresh), or'
        f' pass `param_scan_axis={source_axis}`.'
    )
  return _Layers(stacks.rules(stacks.SCANNED, axis, source_axis), stacks.SCANNED, axis,
                 axis != source_axis, axis)


def _relaid(request: Request, weights, laid: _Layers) -> dict[Path, patterns.Mapped]:
  """The weights as MaxText holds them in the form `laid` says."""
  shapes = {w: leaf.shape for w, leaf in weights.items()}
  try:
    return patterns.map_paths(shapes, laid.rules, where=str(request.source.step_dir)).outputs
  except errors.UnsupportedLayoutError as e:
    raise errors.LayerScanMismatchError(
        f'{e}\nThe decoder\'s layers cannot be re-laid so: check how the step was written.'
    ) from e


def _outputs(request: Request, plan: RestorePlan, target: dict) -> tuple[Output, ...]:
  """Every target leaf of a MaxText plan as an output of the writer."""
  source = request.source
  leaves = {(leaf.item, leaf.path): leaf for leaf in source.leaves}

  def input_of(s):
    return Input(source, leaves[(s[0], s[1:])])

  def made_as(path, m):  # Counts and step as MaxText has them; the rest as stored (cast).
    fixed = target[path].dtype
    dtype = fixed if not m.sources or np.issubdtype(fixed, np.integer) else reader.cast_dtype(
        input_of(m.sources[0]).leaf, request.dtype)
    return jax.ShapeDtypeStruct(target[path].shape, dtype)

  return plan.outputs(input_of, {p: made_as(p, m) for p, m in plan.leaves.items()})


def lay_out(request: Request) -> LaidOut:
  source = request.source
  weights = {path: leaf for leaf, path in reader.weights(source)}
  if request.merge is not None:
    # The merged model's weights (the plain model's paths), the layers as stored.
    weights = {p: s.leaf for p, s in request.merge.weights.items()}
  laid = _layers(request, {w: tuple(leaf.shape) for w, leaf in weights.items()})
  first = tuple(rng_note(source)) + tuple(_not_maxtext_note(weights))
  if laid.relaid:
    first += (f'decoder layers written {laid.form}'
              + (f' (param_scan_axis={laid.axis})' if laid.axis is not None else ''),)
  if request.params_only:  # params/params/<weights> (merged for a LoRA merge)
    mapped = _relaid(request, weights, laid)  # A layer refusal before any output is made.
    made = outputs_lib.relay(layout_weights(request), mapped, conventions.MAXTEXT_PARAMS)
    return LaidOut((ItemOutput(ITEM, tuple(made), zarr3=True),), first, _scan_record(laid))
  _refuse_what_maxtext_cannot_continue(source, weights)
  shapes = {w: jax.ShapeDtypeStruct(m.shape, reader.cast_dtype(weights[m.sources[0]], request.dtype))
            for w, m in _relaid(request, weights, laid).items()}
  target = train_state.template(shapes)
  view = read_view(source.detection)
  try:
    plan = make_plan(view, {p: tuple(s.shape) for p, s in target.items()},
                     param_scan_axis=laid.scan_axis)
  except errors.TargetMismatchError as e:
    if isinstance(e, errors.LayerScanMismatchError):
      raise
    raise errors.UnsupportedLayoutError(
        f'{source.step_dir}: the Tunix optimizer state cannot be laid out as MaxText\'s'
        f' adamw (what MaxText 0.2.5 trains with):\n{e}\nConvert the weights only'
        ' (`params_only=True`): MaxText then starts its optimizer afresh.'
    ) from e
  sequences, empty = train_state.containers()
  item = ItemOutput(ITEM, _outputs(request, plan, target), sequences=sequences, empty=empty,
                    zarr3=True)
  notes = list(first) + [f'{fmt(p)}: filled from {f}'
                         for p, f in sorted(plan.fills.items())]
  notes += [n for n in plan.left_out if 'RNG' not in n]
  return LaidOut((item,), tuple(notes), _scan_record(laid))


def _scan_record(laid: _Layers) -> dict[str, bool | int]:
  """The step's custom metadata: whether its decoder layers are scanned (MaxText's own
  key, which its `from_pretrained` checks) and, when they are, along which axis."""
  if laid.form is None:
    return {}
  record: dict[str, bool | int] = {stacks.SCAN_LAYERS_KEY: laid.form == stacks.SCANNED}
  if laid.axis is not None:
    record[stacks.SCAN_AXIS_KEY] = laid.axis
  return record


# The top-level modules of every MaxText decoder model (`models.Transformer`).
MAXTEXT_MODULES = ('decoder', 'token_embedder')


def _not_maxtext_note(weights) -> list[str]:
  """A note when the weights are not a MaxText model's: MaxText's loaders read the
  step, but no MaxText model finds its weights under these names."""
  tops = sorted({w[0] for w in weights if w})
  if not weights or all(m in tops for m in MAXTEXT_MODULES):
    return []
  return [
      f'the weights are not a MaxText model\'s (expected top-level {" and ".join(MAXTEXT_MODULES)},'
      f' found {", ".join(tops[:6])}{", ..." if len(tops) > 6 else ""}): MaxText\'s loaders read'
      ' this step, but a MaxText model will not find its weights in it. For a MaxText model of'
      ' this architecture, export to Hugging Face (orbax-tunix export) and convert that with'
      ' MaxText\'s own checkpoint conversion'
  ]


def _refuse_what_maxtext_cannot_continue(
    source: reader.CanonicalCheckpoint, weights: dict[Path, reader.LeafInfo]
) -> None:
  """A full train state needs the run's optimizer state, for MaxText's weights.

  Raises:
    LoraError: a LoRA run (its optimizer state is the adapters').
    UnsupportedLayoutError: the step holds no optimizer state.
  """
  adapters = [fmt(w) for w in weights if lora.is_adapter(w)]
  if adapters:
    raise errors.LoraError(
        f'{source.step_dir}: a LoRA run ({len(adapters)} adapter leaves, e.g. {adapters[0]}):'
        ' its optimizer state belongs to the adapters, which MaxText\'s model does not'
        ' have, so no MaxText train state continues it. Write the merged weights'
        ' (`merge_lora=True`, `params_only=True`) and start MaxText\'s optimizer afresh.'
    )
  if conventions.OPTIMIZER_ITEM not in source.items:
    raise errors.UnsupportedLayoutError(
        f'{source.step_dir}: expected the run\'s optimizer state (item'
        f' {conventions.OPTIMIZER_ITEM!r}) for a full MaxText train state, found items'
        f' {sorted(source.items)}. Convert the weights only (`params_only=True`).'
    )


def _true_or_false(text: str) -> bool:
  value = text.strip().lower()
  if value not in ('true', 'false'):
    raise ValueError(f'{text!r}: expected true or false.')
  return value == 'true'


SCAN_LAYERS = Option(
    'scan_layers', _true_or_false, '{true,false}',
    "write the decoder's layers scanned (true: stacked along --param-scan-axis) or unscanned"
    ' (false: one array per layer); default: as stored')
PARAM_SCAN_AXIS = Option(
    'param_scan_axis', int, 'AXIS',
    "MaxText's param_scan_axis, the layer axis of the scanned side: of the layers written"
    " with --scan-layers true (default 1, or the stored step's axis when it is scanned too),"
    ' else of the stored scanned layers (default: read from the step; an axis that does'
    ' not fit is refused)')

LAYOUT = register(Layout(
    name='maxtext',
    description="MaxText's own step: item 'items', params/params/<weights> and, unless"
                ' weights only, opt_state as its adamw chain and step',
    lay_out=lay_out,
    destination=STEP,
    options=(SCAN_LAYERS, PARAM_SCAN_AXIS),
))

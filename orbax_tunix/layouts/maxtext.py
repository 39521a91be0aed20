"""The MaxText layout: the step MaxText itself writes, from a Tunix run.

One item, `items`, as MaxText 0.2.5 saves its train state (zarr3 arrays):
`params/params/<weights>` (no RNG state), and unless weights only, the
optimizer and `step` as MaxText's adamw chain saves them (`maxtext.train_state`).
`nnx_aux` is left out: MaxText keeps its own initial values for it
(a Tunix run's RNG keys are of another kind). The custom metadata records
`scan_layers`, which MaxText's `from_pretrained` checks, and the layer axis.

The leaves are MaxText's rules applied to the run (`maxtext.plan.made`, as a restore
applies them), its optimizer matched to MaxText's adamw chain; the decoder's layers in
the form asked for (`scan_layers`): the family's scanned form or one array per layer
(`mapping.stacks.LayerForm`, the families' forms: `huggingface.layer_form`).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from orbax_tunix import conventions, errors
from orbax_tunix.keypaths import Path, fmt
from orbax_tunix.layouts.base import LaidOut, Layout, Option, Request, register
from orbax_tunix.layouts.base import weights as layout_weights
from orbax_tunix.layouts.canonical import rng_note
from orbax_tunix.layouts.step import STEP
from orbax_tunix.mapping import huggingface, lora, patterns, stacks
from orbax_tunix.mapping import outputs as outputs_lib
from orbax_tunix.mapping.outputs import Input, ItemOutput, Output
from orbax_tunix.mapping.transforms import IDENTITY
from orbax_tunix.maxtext import plan, train_state
from orbax_tunix.maxtext.view import read_view
from orbax_tunix.reading import reader

ITEM = conventions.MAXTEXT_ITEM


@dataclasses.dataclass(frozen=True)
class _Layers:
  """How the decoder's layers are stored and written.

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


def _layers(request: Request, shapes: dict[Path, tuple[int, ...]]) -> _Layers:
  """The layers' form and axis, stored and written, from the request and the stored shapes.

  `param_scan_axis` names the layer axis of the scanned side: the written one when writing
  scanned, else the stored one (its own is the step's recorded one, else the one its shapes
  tell: `LayerForm.axis`, which refuses one that does not fit). Unscanned layers are written
  scanned in their family's form (`huggingface.scanned_form`).

  Raises:
    InvalidOptionError: a negative `param_scan_axis`, or one no side of the
      conversion is scanned on.
    UnsupportedLayoutError: `scan_layers` for weights without MaxText layers.
    LayerScanMismatchError: the stored layers are not one decoder (a weight
      with another layer count or shape), or the axis does not fit them.
  """
  given, scan = request.option(PARAM_SCAN_AXIS), request.option(SCAN_LAYERS)
  where = str(request.source.step_dir)
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
    return _Layers(have, want)
  recorded = stacks.recorded_axis(request.source.detection.source.custom_metadata)
  named = None if scan else given  # Writing scanned, `given` names the written axis ...
  if scan and have.scanned and recorded is not None and given is not None:
    fit = have.axes(shapes)  # ... and the stored one, where the arrays fit it, not the record.
    named = given if given in fit and recorded not in fit else None
  axis = None
  if have.scanned and scan is None and named is None and recorded is None:
    try:  # As stored: the axis is only recorded, when the shapes tell it.
      axis = have.axis(shapes, where=where)
    except errors.LayerScanMismatchError:
      pass
  elif have.scanned:
    axis = have.axis(shapes, named, recorded=recorded, where=where)
  to_axis = None if not want.scanned else given if scan and given is not None else (
      stacks.DEFAULT_AXIS if axis is None and not have.scanned else axis)
  return _Layers(have, want, axis, to_axis)


def _relaid(request: Request, shapes, laid: _Layers) -> dict[Path, patterns.Mapped]:
  """The weights as MaxText holds them in the form `laid` says."""
  if laid.have is None or not laid.relaid:
    return {w: patterns.Mapped((w,), IDENTITY, s) for w, s in shapes.items()}
  try:
    return stacks.relay(shapes, laid.have, laid.want, stacks.DEFAULT_AXIS
                        if laid.axis is None else laid.axis, laid.to_axis,
                        where=str(request.source.step_dir))
  except errors.UnsupportedLayoutError as e:
    raise errors.LayerScanMismatchError(
        f'{e}\nThe decoder\'s layers cannot be re-laid so: check how the step was written.'
    ) from e


def lay_out(request: Request) -> LaidOut:
  source = request.source
  weights = {path: leaf for leaf, path in reader.weights(source)}
  if request.merge is not None:
    # The merged model's weights (the plain model's paths), the layers as stored.
    weights = {p: s.leaf for p, s in request.merge.weights.items()}
  shapes = {w: tuple(leaf.shape) for w, leaf in weights.items()}
  laid = _layers(request, shapes)
  first = tuple(rng_note(source)) + tuple(_not_maxtext_note(weights))
  if laid.relaid:
    first += (f'decoder layers written {laid.want.kind}'
              + (f' (param_scan_axis={laid.to_axis})' if laid.to_axis is not None else ''),)
  relaid = _relaid(request, shapes, laid)  # A layer refusal before any output is made.
  if request.params_only:  # params/params/<weights> (merged for a LoRA merge)
    made = outputs_lib.relay(layout_weights(request), relaid, conventions.MAXTEXT_PARAMS)
    return LaidOut((ItemOutput(ITEM, tuple(made), zarr3=True),), first, _scan_record(laid))
  _refuse_what_maxtext_cannot_continue(source, weights)
  state = plan.made(read_view(source.detection), relaid, train_state.adamw(), every_weight=True)
  if state.problems:
    raise errors.UnsupportedLayoutError(
        f'{source.step_dir}: the Tunix optimizer state cannot be laid out as MaxText\'s'
        ' adamw (what MaxText 0.2.5 trains with):\n' + '\n'.join(state.problems)
        + '\nConvert the weights only (`params_only=True`): MaxText then starts its'
        ' optimizer afresh.')
  sequences, empty = train_state.containers()
  item = ItemOutput(ITEM, _outputs(request, state), sequences=sequences, empty=empty,
                    zarr3=True)
  notes = list(first) + [f'{fmt(p)}: filled from {f}' for p, f in sorted(state.fills.items())]
  notes += [n for n in state.left_out if 'RNG' not in n]
  return LaidOut((item,), tuple(notes), _scan_record(laid))


def _outputs(request: Request, state: plan.Made) -> tuple[Output, ...]:
  """Every leaf of the state as an output of the writer: counts and step as MaxText has
  them (int32), the rest as stored (cast)."""
  leaves = {(leaf.item, *leaf.path): leaf for leaf in request.source.leaves}
  out = []
  for path, m in sorted(state.leaves.items()):
    inputs = tuple(Input(request.source, leaves[s]) for s in m.sources)
    counter = not inputs or np.issubdtype(inputs[0].leaf.dtype, np.integer)
    dtype = train_state.COUNT_DTYPE if counter else reader.cast_dtype(inputs[0].leaf,
                                                                      request.dtype)
    out.append(Output(path, inputs, m.transform,
                      inputs[0].leaf.shape if m.shape is None else m.shape, dtype))
  return tuple(out)


def _scan_record(laid: _Layers) -> dict[str, bool | int]:
  """The step's custom metadata: whether its decoder layers are scanned (MaxText's own
  key, which its `from_pretrained` checks) and, when they are, along which axis."""
  if laid.want is None:
    return {}
  record: dict[str, bool | int] = {stacks.SCAN_LAYERS_KEY: laid.want.scanned}
  if laid.to_axis is not None:
    record[stacks.SCAN_AXIS_KEY] = laid.to_axis
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

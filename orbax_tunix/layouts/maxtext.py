"""The MaxText layout: the step MaxText itself writes, from a Tunix run.

One item, `items`, as MaxText 0.2.5 saves its train state (zarr3 arrays):
`params/params/<weights>` (no RNG state), and unless weights only, the
optimizer and `step` as MaxText's adamw chain saves them (`maxtext.train_state`).
`nnx_aux` is left out: MaxText keeps its own initial values for it
(a Tunix run's RNG keys are of another kind). The custom metadata records
`scan_layers`, which MaxText's `from_pretrained` checks, and the layer axis.

The leaves are MaxText's rules applied to the run (`maxtext.plan.state_leaves`, as a restore
applies them), its optimizer matched to MaxText's adamw chain; the decoder's layers in
the form asked for (`scan_layers`): the family's scanned form or one array per layer
(`mapping.stacks.LayerForm`; their axis and form: `mapping.step_layers.conversion`).
"""

from __future__ import annotations

import numpy as np

from orbax_tunix import conventions, errors
from orbax_tunix.keypaths import Path, fmt
from orbax_tunix.layouts.base import LaidOut, Layout, Option, Request, register
from orbax_tunix.layouts.base import weights as layout_weights
from orbax_tunix.layouts.canonical import rng_note
from orbax_tunix.layouts.step import STEP
from orbax_tunix.mapping import lora, patterns, stacks, step_layers
from orbax_tunix.mapping import outputs as outputs_lib
from orbax_tunix.mapping.outputs import Input, ItemOutput, Output
from orbax_tunix.mapping.transforms import IDENTITY
from orbax_tunix.maxtext import plan, train_state
from orbax_tunix.reading import reader

ITEM = conventions.MAXTEXT_ITEM


def _relaid(request: Request, shapes, laid: step_layers.Conversion
            ) -> dict[Path, patterns.Mapped]:
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
  laid = step_layers.conversion(source, shapes, request.option(PARAM_SCAN_AXIS),
                                request.option(SCAN_LAYERS))
  first = tuple(rng_note(source)) + tuple(_not_maxtext_note(weights))
  if laid.relaid:
    first += (f'decoder layers written {laid.want.kind}'
              + (f' (param_scan_axis={laid.to_axis})' if laid.to_axis is not None else ''),)
  relaid = _relaid(request, shapes, laid)  # A layer refusal before any output is made.
  if request.params_only:  # params/params/<weights> (merged for a LoRA merge)
    made = outputs_lib.compose(layout_weights(request), relaid, conventions.MAXTEXT_PARAMS)
    return LaidOut((ItemOutput(ITEM, tuple(made), zarr3=True),), first, _scan_record(laid))
  _refuse_what_maxtext_cannot_continue(source, weights)
  state = plan.state_leaves(source, relaid, train_state.adamw(), every_weight=True)
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


def _outputs(request: Request, state: plan.StateLeaves) -> tuple[Output, ...]:
  """Every leaf of the state as an output of the writer: counts and step as MaxText has
  them (int32), the rest as stored (cast)."""
  out = []
  for path, m in sorted(state.leaves.items()):
    inputs = tuple(Input(request.source, request.source.by_path[s]) for s in m.sources)
    counter = not inputs or np.issubdtype(inputs[0].leaf.dtype, np.integer)
    dtype = train_state.COUNT_DTYPE if counter else reader.cast_dtype(inputs[0].leaf,
                                                                      request.dtype)
    out.append(Output(path, inputs, m.transform,
                      inputs[0].leaf.shape if m.shape is None else m.shape, dtype))
  return tuple(out)


def _scan_record(laid: step_layers.Conversion) -> dict[str, bool | int]:
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
    source: reader.Source, weights: dict[Path, reader.LeafInfo]
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

"""The MaxText layout: the step MaxText itself writes, from a Tunix run.

One item, `items`, as MaxText 0.2.5 saves its train state (zarr3 arrays):
`params/params/<weights>` (no RNG state), and unless weights only, the
optimizer laid out as MaxText's adamw chain saves it (`opt_state` a list:
`[{count, mu: {params: ..}, nu: {params: ..}}, None, {count}]`) and `step`
(int32). `nnx_aux` is left out: MaxText keeps its own initial values for it
(a Tunix run's RNG keys are of another kind). The custom metadata records
`scan_layers`, which MaxText's `from_pretrained` checks.

The mapping is the MaxText view's (`maxtext.plan.make_plan`), the one that
restores a Tunix step into an abstract state a caller gives: here the target
is MaxText's own train state for these weights (`maxtext.train_state`),
optionally with the decoder's layers in the other form (`maxtext.layers`).
"""

from __future__ import annotations

import jax
import numpy as np

from orbax_tunix import conventions, errors, lora, patterns, reader
from orbax_tunix import outputs as outputs_lib
from orbax_tunix.keypaths import Path, fmt
from orbax_tunix.layouts import OPTIONS, LaidOut, Layout, Request, register
from orbax_tunix.layouts import weights as layout_weights
from orbax_tunix.layouts.canonical import rng_note
from orbax_tunix.maxtext import layers, train_state
from orbax_tunix.maxtext.plan import RestorePlan, make_plan
from orbax_tunix.maxtext.view import read_view
from orbax_tunix.outputs import Input, ItemOutput, Output
from orbax_tunix.transforms import IDENTITY, constant

ITEM = conventions.MAXTEXT_ITEM


def _form(request: Request, weights: dict[Path, reader.LeafInfo]) -> str | None:
  """The layer form to write (None: as stored, or no MaxText decoder layers)."""
  stored = layers.form_of(weights)
  if request.scan_layers is None and request.param_scan_axis != OPTIONS['param_scan_axis']:
    raise errors.InvalidOptionError(
        f'`param_scan_axis` {request.param_scan_axis}: the layers are written as stored'
        ' (no `scan_layers`), so no layer axis is used. Pass `scan_layers` too, or leave'
        ' `param_scan_axis` out.'
    )
  if request.scan_layers is None or stored is None:
    if request.scan_layers is not None:
      raise errors.UnsupportedLayoutError(
          f'{request.source.step_dir}: `scan_layers` asks for MaxText\'s'
          f' {"scanned" if request.scan_layers else "unscanned"} layers, but the weights hold'
          ' no MaxText decoder layers (decoder/layers/... or decoder/layers_<i>/...).'
          ' Leave `scan_layers` out.'
      )
    return stored
  return layers.SCANNED if request.scan_layers else layers.UNSCANNED


def _relaid(request: Request, weights, form) -> dict[Path, patterns.Mapped]:
  """The weights as MaxText holds them in `form` (as stored when None)."""
  shapes = {w: leaf.shape for w, leaf in weights.items()}
  rules = (layers.AS_STORED,) if form is None else layers.rules(form, request.param_scan_axis)
  try:
    return patterns.map_paths(shapes, rules, where=str(request.source.step_dir)).outputs
  except errors.UnsupportedLayoutError as e:
    raise layers.LayerScanMismatchError(
        f'{e}\nPass the param_scan_axis the model was built with.') from e


def _weights_item(request: Request, weights, form) -> ItemOutput:
  """params/params/<weights> (merged for a LoRA merge), in the layer form asked for."""
  mapped = _relaid(request, weights, form)
  return ItemOutput(ITEM, tuple(outputs_lib.relay(
      layout_weights(request), mapped, conventions.MAXTEXT_PARAMS)), zarr3=True)


def _outputs(request: Request, plan: RestorePlan, target: dict) -> tuple[Output, ...]:
  """Every target leaf of a MaxText plan as an output of the writer."""
  source = request.source
  leaves = {(leaf.item, leaf.path): leaf for leaf in source.leaves}

  def inputs(*sources):
    return tuple(Input(source, leaves[(s.item, s.path)]) for s in sources)

  def dtype(path, leaf):  # Counts and step as MaxText has them; the rest as stored (cast).
    fixed = target[path].dtype
    return fixed if np.issubdtype(fixed, np.integer) else reader.cast_dtype(leaf, request.dtype)

  out = []
  for path in sorted(target):
    shape = tuple(target[path].shape)
    if path in plan.reads:
      (i,) = inputs(plan.reads[path])
      out.append(Output(path, (i,), shape=shape, dtype=dtype(path, i.leaf)))
    elif path in plan.derived:
      derived = plan.derived[path]
      ins = inputs(*derived.sources)
      out.append(Output(path, ins, derived.transform, shape, dtype(path, ins[0].leaf)))
    elif path in plan.fills:
      fill = plan.fills[path]
      ins = () if fill.source is None else inputs(fill.source)
      out.append(Output(path, ins, IDENTITY if ins else constant(fill.value), shape,
                        np.dtype(target[path].dtype)))
  return tuple(out)


def lay_out(request: Request) -> LaidOut:
  source = request.source
  weights = {path: leaf for leaf, path in reader.weights(source)}
  if request.merge is not None:
    # The merged model's weights (the plain model's paths), the layers as stored.
    weights = {p: s.leaf for p, s in request.merge.weights.items()}
  form = _form(request, weights)
  if request.params_only:
    item = _weights_item(request, weights, form)
    return LaidOut((item,), tuple(rng_note(source)),
                   _scan_record({o.path[2:]: o.shape for o in item.outputs}))
  _refuse_what_maxtext_cannot_continue(source, weights)
  shapes = {w: jax.ShapeDtypeStruct(m.shape, reader.cast_dtype(weights[m.sources[0]], request.dtype))
            for w, m in _relaid(request, weights, form).items()}
  target = train_state.template(shapes)
  view = read_view(source.detection)
  try:
    plan = make_plan(view, {p: tuple(s.shape) for p, s in target.items()},
                     param_scan_axis=request.param_scan_axis)
  except errors.TargetMismatchError as e:
    if isinstance(e, layers.LayerScanMismatchError):
      raise
    raise errors.UnsupportedLayoutError(
        f'{source.step_dir}: the Tunix optimizer state cannot be laid out as MaxText\'s'
        f' adamw (what MaxText 0.2.5 trains with):\n{e}\nConvert the weights only'
        ' (`params_only=True`): MaxText then starts its optimizer afresh.'
    ) from e
  sequences, empty = train_state.containers()
  item = ItemOutput(ITEM, _outputs(request, plan, target), sequences=sequences, empty=empty,
                    zarr3=True)
  notes = list(rng_note(source)) + [f'{fmt(p)}: filled from {f.describe()}'
                                    for p, f in sorted(plan.fills.items())]
  notes += [n for n in plan.left_out if 'RNG' not in n]
  if plan.derived:
    notes.append(f'decoder layers written {form} (param_scan_axis={request.param_scan_axis})')
  return LaidOut((item,), tuple(notes), _scan_record(shapes))


def _scan_record(weights) -> dict[str, bool]:
  """MaxText's own step metadata: whether its decoder layers are scanned."""
  form = layers.form_of(weights)
  return {} if form is None else {'scan_layers': form == layers.SCANNED}


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


LAYOUT = register(Layout(
    name='maxtext',
    description="MaxText's own step: item 'items', params/params/<weights> and, unless"
                ' weights only, opt_state as its adamw chain and step',
    lay_out=lay_out,
    options=frozenset({'scan_layers', 'param_scan_axis'}),
))

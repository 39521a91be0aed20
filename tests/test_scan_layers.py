"""Scanned <-> unscanned MaxText layers at read time, on 8 simulated devices.

Tunix saves of a MaxText-shaped model in both forms (real nnx, optax, Orbax:
`decoder/layers_<i>/...` per layer, or `decoder/layers/...` stacked along
MaxText's `param_scan_axis`), restored into MaxText train states of the other
form. Expected values: the raw Tunix arrays read by plain Orbax, stacked or
sliced with numpy in the test.
"""

from __future__ import annotations

import json
import pathlib
import threading

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from orbax_tunix import errors, maxtext
from orbax_tunix.keypaths import flatten, fmt
from orbax_tunix.mapping import device, huggingface, step_layers, trainers, transforms
from orbax_tunix.reading import memory, reader
from tests import builders
from tests.test_cli import run
from tests.test_maxtext import sharded

D, F, L = 8, 12, 3  # No two alike: each axis is told by its size.
SCHEDULE = optax.linear_schedule(1e-2, 1e-3, 10)


def _param(rngs, *shape):
  return nnx.Param(jax.random.normal(rngs.params(), shape))


class Layer(nnx.Module):
  def __init__(self, rngs):
    self.mlp = nnx.Dict(wi=nnx.Dict(kernel=_param(rngs, D, F)))
    self.norm = nnx.Dict(scale=_param(rngs, D))


class Stacked(nnx.Module):
  """The same weights as `L` layers, stacked along `axis` (MaxText's scanned form)."""

  def __init__(self, rngs, axis):
    kernel = list(np.moveaxis(np.zeros((L, D, F)), 0, axis).shape)
    scale = list(np.moveaxis(np.zeros((L, D)), 0, axis).shape)
    self.mlp = nnx.Dict(wi=nnx.Dict(kernel=_param(rngs, *kernel)))
    self.norm = nnx.Dict(scale=_param(rngs, *scale))


class Decoder(nnx.Module):
  def __init__(self, rngs, scanned, axis):
    if scanned:
      self.layers = Stacked(rngs, axis)
    else:
      for i in range(L):
        setattr(self, f'layers_{i}', Layer(rngs))
    self.decoder_norm = nnx.Dict(scale=_param(rngs, D))


class Model(nnx.Module):
  """A MaxText-shaped model: token_embedder, decoder/{layers...,decoder_norm}."""

  def __init__(self, rngs, scanned, axis=1):
    self.token_embedder = nnx.Dict(embedding=_param(rngs, 16, D))
    self.decoder = Decoder(rngs, scanned, axis)


def _train(model):
  """Two real adamw updates (MaxText's chain: adam, decayed weights, schedule)."""
  def loss(m):
    return sum(jnp.sum(jnp.sin(p[...])) for p in jax.tree.leaves(nnx.state(m, nnx.Param)))

  optimizer = nnx.Optimizer(model, optax.adamw(SCHEDULE), wrt=nnx.Param)
  for _ in range(2):
    optimizer.update(model, nnx.grad(loss)(model))
  return optimizer


@pytest.fixture(scope='module')
def saved(tmp_path_factory):
  root = tmp_path_factory.mktemp('scan')
  out = {}
  for name, scanned, axis in (('unscanned', False, 1), ('scanned', True, 1), ('axis0', True, 0)):
    model = builders.Adapter(Model(nnx.Rngs(0), scanned, axis))  # MaxText's Tunix adapter: `base`
    optimizer = _train(model)
    out[name] = builders.save_tunix(root / name, 2, model, optimizer)
  return out


def _weights(scanned: bool, axis: int = 1) -> dict:
  def sds(*s):
    return jax.ShapeDtypeStruct(s, jnp.float32)

  if scanned:
    kernel = np.moveaxis(np.zeros((L, D, F)), 0, axis).shape
    scale = np.moveaxis(np.zeros((L, D)), 0, axis).shape
    layers = {'layers': {'mlp': {'wi': {'kernel': sds(*kernel)}}, 'norm': {'scale': sds(*scale)}}}
  else:
    layers = {f'layers_{i}': {'mlp': {'wi': {'kernel': sds(D, F)}}, 'norm': {'scale': sds(D)}}
              for i in range(L)}
  return {'token_embedder': {'embedding': sds(16, D)},
          'decoder': {**layers, 'decoder_norm': {'scale': sds(D)}}}


def _abstract(mesh, scanned, axis=1, dtype=None):
  """MaxText's train state layout: params/params, adamw's opt_state list, step."""
  params = {'params': _weights(scanned, axis)}
  state = {'params': params, 'opt_state': list(jax.eval_shape(optax.adamw(SCHEDULE).init, params)),
           'step': jax.ShapeDtypeStruct((), jnp.int32)}
  return sharded(state, mesh, dtype)


def _raw(step_dir):
  return {item: builders.raw_leaves(step_dir / item) for item in ('model_params', 'optimizer_state')}


def _expected(raw, target_path, from_scanned, axis):
  """The value a target leaf must hold, from the raw Tunix arrays (numpy only)."""
  s = fmt(target_path)
  if s == 'step':
    return raw['optimizer_state']['step/value']
  if s.startswith('opt_state/'):
    if target_path[-1] == 'count':  # adam's; the schedule's is Tunix's own (both saved)
      return raw['optimizer_state'][f'{s}/value']
    _, pos, field, _, *w = target_path  # opt_state/<pos>/<field>/params/<w>
    source, prefix = raw['optimizer_state'], f'opt_state/{pos}/{field}/base/'
  else:
    w, source, prefix = target_path[2:], raw['model_params'], 'base/'
  w = list(w)
  if len(w) > 1 and w[1].startswith('layers'):
    rest = '/'.join(w[2:])
    if from_scanned:
      i = int(w[1].split('_')[1])
      return np.take(source[f'{prefix}decoder/layers/{rest}/value'], i, axis=axis)
    return np.stack([source[f'{prefix}decoder/layers_{i}/{rest}/value'] for i in range(L)],
                    axis=axis)
  return source[f'{prefix}{"/".join(w)}/value']


@pytest.mark.parametrize('have, want, axis', [
    ('unscanned', True, 1), ('scanned', False, 1), ('axis0', False, 0)])
@pytest.mark.parametrize('params_only', [False, True], ids=['full', 'params'])
def test_the_other_form_at_read_time(saved, mesh, have, want, axis, params_only):
  abstract = _abstract(mesh, scanned=want, axis=axis, dtype=jnp.bfloat16)
  got = maxtext.restore_train_state(saved[have], abstract, params_only=params_only,
                                    param_scan_axis=axis)
  raw = _raw(saved[have])
  targets = dict(flatten(abstract)[0])
  checked = 0
  for path, leaf in flatten(got)[0]:
    want_leaf = targets[path]
    if params_only and path[0] != 'params':
      assert leaf is want_leaf
      continue
    assert isinstance(leaf, jax.Array), fmt(path)
    assert leaf.sharding == want_leaf.sharding and leaf.dtype == want_leaf.dtype, fmt(path)
    expected = np.asarray(_expected(raw, path, have != 'unscanned', axis)).astype(leaf.dtype)
    np.testing.assert_array_equal(np.asarray(leaf), expected, err_msg=fmt(path))
    checked += 1
  assert checked >= (4 if params_only else 15)


@pytest.mark.parametrize('group_bytes', [0, 1 << 40], ids=['each-group-alone', 'all-at-once'])
def test_the_device_executor_reads_groups_alone_or_together_alike(
    saved, mesh, monkeypatch, group_bytes):
  """`mapping.device` batches the groups of derived leaves by the bytes they hold: one
  restore per item when they fit together, one per group (and item) when none do; the
  same state either way, every source read once."""
  raw = _raw(saved['scanned'])  # (Plain Orbax, before the spy.)
  monkeypatch.setattr(memory, 'DEVICE_GROUP_BYTES', group_bytes)
  calls = builders.spy_restores(monkeypatch)
  abstract = _abstract(mesh, scanned=False)
  got = maxtext.restore_train_state(saved['scanned'], abstract)
  read = [leaf for _, leaves in calls for leaf in leaves]
  assert len(read) == len(set(read))  # Each source once.
  stacked = [p for p in read if '/layers/' in p]  # The scanned sources of derived leaves.
  # 2 stacked weights, and mu and nu of each.
  assert len(stacked) == 6
  if group_bytes:
    assert [item for item, _ in calls] == ['model_params', 'optimizer_state']
  else:  # The first batch holds the direct reads and the first group.
    assert len(calls) == 2 + 5
  targets = dict(flatten(abstract)[0])
  for path, leaf in flatten(got)[0]:
    assert leaf.sharding == targets[path].sharding and leaf.dtype == targets[path].dtype
    np.testing.assert_array_equal(
        np.asarray(leaf), np.asarray(_expected(raw, path, True, 1)).astype(leaf.dtype),
        err_msg=fmt(path))


def compiled_on_threads(monkeypatch, call):
  """`call()`, and the threads XLA compiled on meanwhile (programs no earlier test compiled)."""
  monkeypatch.setattr(transforms, '_COMPILED', {})
  threads = []

  def listener(event, duration, **kwargs):
    del duration, kwargs
    if event == '/jax/core/compile/backend_compile_duration':
      threads.append(threading.current_thread().name)

  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    return call(), threads
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)


def test_the_device_executor_compiles_its_programs_while_it_reads(saved, mesh, monkeypatch):
  """Every program the executor runs (here: a layer taken from each stacked weight) is known
  before any read, and compiled on its compile thread meanwhile: none after the read, on the
  caller's thread."""
  abstract = _abstract(mesh, scanned=False)
  got, threads = compiled_on_threads(
      monkeypatch, lambda: maxtext.restore_train_state(saved['scanned'], abstract))
  assert threads and all(t.startswith('orbax_tunix-compile') for t in threads), threads
  raw = _raw(saved['scanned'])
  for path, leaf in flatten(got)[0]:
    np.testing.assert_array_equal(
        np.asarray(leaf), np.asarray(_expected(raw, path, True, 1)).astype(leaf.dtype),
        err_msg=fmt(path))


def test_a_program_that_fails_to_compile_ahead_fails_in_its_own_call():
  """A compile ahead that fails is not the caller's error: the program's own call raises its
  own (here: a reshape that does not fit)."""
  program = jax.jit(lambda x: x.reshape(7))
  abstract = [jax.ShapeDtypeStruct((3,), np.float32)]
  with device.compiling() as compiler:
    compiler.submit(program, abstract)
    compiler.ready(program, abstract)  # Waits, and does not raise.
    with pytest.raises(TypeError, match='reshape'):
      program(np.zeros(3, np.float32))


def test_a_layer_sharded_target_axis(saved, mesh):
  """Layers split over a mesh axis in the target: sliced on the devices into it."""
  abstract = _abstract(mesh, scanned=True)
  kernel = abstract['params']['params']['decoder']['layers']['mlp']['wi']['kernel']
  spec = PartitionSpec('model', None, 'data')  # (D=8, L=3, F=12): L cannot be split.
  abstract['params']['params']['decoder']['layers']['mlp']['wi']['kernel'] = (
      jax.ShapeDtypeStruct(kernel.shape, kernel.dtype, sharding=NamedSharding(mesh, spec)))
  got = maxtext.restore_train_state(saved['unscanned'], abstract, params_only=True)
  leaf = got['params']['params']['decoder']['layers']['mlp']['wi']['kernel']
  assert leaf.sharding == NamedSharding(mesh, spec)
  raw = _raw(saved['unscanned'])['model_params']
  np.testing.assert_array_equal(leaf, np.stack(
      [raw[f'base/decoder/layers_{i}/mlp/wi/kernel/value'] for i in range(L)], axis=1))


def _fail_reads(monkeypatch):
  def fail(*args, **kwargs):
    raise AssertionError('an array was read before the error')

  monkeypatch.setattr(ocp.PyTreeCheckpointHandler, 'restore', fail)


@pytest.fixture
def no_reads(monkeypatch):
  _fail_reads(monkeypatch)


def test_layer_counts_or_axes_that_do_not_fit_are_refused_before_any_read(saved, mesh, no_reads):
  # The target has one layer more than the checkpoint.
  abstract = _abstract(mesh, scanned=False)
  extra = abstract['params']['params']['decoder']['layers_0']
  abstract['params']['params']['decoder'][f'layers_{L}'] = extra
  with pytest.raises(maxtext.LayerScanMismatchError) as e:
    maxtext.restore_train_state(saved['scanned'], abstract, params_only=True)
  msg = str(e.value)
  assert 'SCANNED (3 layers)' in msg and 'UNSCANNED (4 layers)' in msg
  assert f'decoder/layers_{L}/mlp/wi/kernel' in msg and str(saved['scanned']) in msg
  # The layers stacked along axis 1, read as if along axis 0: the shapes say no.
  with pytest.raises(maxtext.LayerScanMismatchError) as e:
    maxtext.restore_train_state(saved['scanned'], _abstract(mesh, scanned=False),
                                params_only=True, param_scan_axis=0)
  assert 'param_scan_axis=0' in str(e.value) and 'decoder/layers/mlp/wi/kernel' in str(e.value)
  # An axis the arrays do not have.
  with pytest.raises(maxtext.LayerScanMismatchError, match='param_scan_axis=5'):
    maxtext.restore_train_state(saved['scanned'], _abstract(mesh, scanned=False),
                                params_only=True, param_scan_axis=5)


# --- layers that are not one decoder, and which side the axis names -----------------------


class _OddStacked(nnx.Module):
  """Scanned on axis 1 as MaxText stacks (wi (emb, L, mlp), wo (mlp, L, emb)), but the
  norm holds one layer fewer than the kernels."""

  def __init__(self, rngs):
    self.mlp = nnx.Dict(wi=nnx.Dict(kernel=_param(rngs, D, L, F)),
                        wo=nnx.Dict(kernel=_param(rngs, F, L, D)))
    self.norm = nnx.Dict(scale=_param(rngs, D, L - 1))


class _Ragged(Decoder):
  """Unscanned, but `how` spoils the last layer: 'lacks' a weight, or 'odd' shape."""

  def __init__(self, rngs, how):
    super().__init__(rngs, False, 1)
    last = getattr(self, f'layers_{L - 1}')
    if how == 'lacks':
      del last.norm
    else:
      last.norm = nnx.Dict(scale=_param(rngs, D + 1))


def _with_decoder(decoder):
  model = Model(nnx.Rngs(0), False)
  model.decoder = decoder
  return builders.Adapter(model)


@pytest.fixture(scope='module')
def spoiled(tmp_path_factory):
  """Tunix saves (real nnx, weights only) of decoders whose layers do not agree."""
  root = tmp_path_factory.mktemp('spoiled')
  scanned = Model(nnx.Rngs(0), True)
  scanned.decoder.layers = _OddStacked(nnx.Rngs(1))
  models = {'odd_count': builders.Adapter(scanned),
            'lacks': _with_decoder(_Ragged(nnx.Rngs(0), 'lacks')),
            'odd_shape': _with_decoder(_Ragged(nnx.Rngs(0), 'odd'))}
  return {name: builders.save_tunix(root / name, 1, m) for name, m in models.items()}


def test_a_weight_with_another_layer_count_is_refused_naming_it(spoiled, mesh, tmp_path, capsys):
  """One stacked weight holds 2 layers, the rest 3: no unscanned form has them all."""
  msg = 'decoder/layers/norm/scale (8, 2): 2 along it'
  with pytest.raises(maxtext.LayerScanMismatchError) as e:
    maxtext.restore_train_state(spoiled['odd_count'], _abstract(mesh, scanned=False),
                                params_only=True)
  assert msg in str(e.value) and 'param_scan_axis=1' in str(e.value)
  assert 'Pass `param_scan_axis' not in str(e.value)  # The axis is fine: no advice about it.
  status, _, err = run(capsys, 'convert', spoiled['odd_count'], tmp_path / 'o' / '0',
                        '--layout', 'maxtext', '--params-only', '--scan-layers', 'false')
  assert status == 2 and msg in err and 'Pass --param-scan-axis' not in err, err
  assert not (tmp_path / 'o').exists()
  status, out, _ = run(capsys, 'inspect', spoiled['odd_count'])
  assert status == 0 and 'stacked on axis ?' in out and 'layers  ?' in out


@pytest.mark.parametrize('how, named', [
    ('lacks', 'layers_2: lacks norm/scale'),
    ('odd_shape', 'layers_2/norm/scale: (9,), the other layers (8,)'),
])
def test_unscanned_layers_that_differ_are_refused_naming_the_layer(
    spoiled, mesh, tmp_path, capsys, how, named):
  with pytest.raises(maxtext.LayerScanMismatchError) as e:
    maxtext.restore_train_state(spoiled[how], _abstract(mesh, scanned=True), params_only=True)
  assert named in str(e.value) and 'param_scan_axis' not in str(e.value)
  status, _, err = run(capsys, 'convert', spoiled[how], tmp_path / 'o' / '0',
                        '--layout', 'maxtext', '--params-only', '--scan-layers', 'true')
  assert status == 2 and named in err and 'scan-axis' not in err, err
  assert not (tmp_path / 'o').exists()


# MaxText's own tiny llama2, scanned (layers on axis 1: query/kernel (16, 3, 4, 8)), trained by
# Tunix (tests/data/maxtext/README.md).
LLAMA = pathlib.Path(__file__).parent / 'data/maxtext/tunix_llama2_scan'


def _stored(step_dir):
  """The converted weights read by plain Orbax: {'a/b': array} under params/params."""
  raw = builders.raw_leaves(step_dir / 'items')
  return {k[len('params/params/'):]: v for k, v in raw.items() if k.startswith('params/params/')}


def test_param_scan_axis_names_the_scanned_side_and_must_fit_it(tmp_path, capsys):
  """Unscanning: the stored layers' axis (1 here), checked; scanning: the written one."""
  src = builders.raw_leaves(LLAMA / '2' / 'model_params')
  weights = {k[len('base/'):-len('/value')]: v for k, v in src.items() if 'rngs' not in k}
  stacked = {k: v for k, v in weights.items() if k.startswith('decoder/layers/')}
  out = tmp_path / 'out'
  # The run is stacked on axis 1: axis 0 (or -1) names nothing that holds the layers.
  status, _, err = run(capsys, 'convert', LLAMA, out / 'a' / '0', '--layout', 'maxtext',
                       '--params-only', '--scan-layers', 'false', '--param-scan-axis', '0')
  assert status == 2 and 'stacked along axis 1' in err and 'not along param_scan_axis=0' in err
  assert 'decoder/layers/mlp/wo/kernel (48, 3, 16)' in err and '--param-scan-axis 1' in err
  status, _, err = run(capsys, 'convert', LLAMA, out / 'b' / '0', '--layout', 'maxtext',
                       '--params-only', '--scan-layers', 'false', '--param-scan-axis', '-1')
  assert status == 2 and '--param-scan-axis -1: expected a non-negative axis' in err
  assert not out.exists()
  # Scanning onto axis 0: every stacked weight's layer axis moved to the front.
  status, _, err = run(capsys, 'convert', LLAMA, out / 'c' / '0', '--layout', 'maxtext',
                       '--params-only', '--scan-layers', 'true', '--param-scan-axis', '0')
  assert status == 0, err
  got = _stored(out / 'c' / '0')
  assert got.keys() == weights.keys()
  for k, v in weights.items():
    want = np.moveaxis(v, 1, 0) if k in stacked else v
    np.testing.assert_array_equal(got[k], want, err_msg=k)
  meta = json.loads((out / 'c' / '0' / '_CHECKPOINT_METADATA').read_text())['custom_metadata']
  assert meta['scan_layers'] is True and meta['param_scan_axis'] == 0
  status, report, _ = run(capsys, 'inspect', out / 'c' / '0', '--json')
  assert status == 0 and json.loads(report)['layers'] == {'form': 'scanned', 'count': 3, 'axis': 0}
  # Back to unscanned: the step's recorded axis is used; another one is refused.
  status, _, err = run(capsys, 'convert', out / 'c' / '0', out / 'd' / '0', '--layout', 'maxtext',
                       '--params-only', '--scan-layers', 'false', '--param-scan-axis', '1')
  assert status == 2 and 'records its layers stacked along axis 0' in err
  status, _, err = run(capsys, 'convert', out / 'c' / '0', out / 'd' / '0', '--layout', 'maxtext',
                       '--params-only', '--scan-layers', 'false')
  assert status == 0, err
  got = _stored(out / 'd' / '0')
  for k, v in stacked.items():
    rest = k[len('decoder/layers/'):]
    for i in range(3):
      np.testing.assert_array_equal(got[f'decoder/layers_{i}/{rest}'], v[:, i], err_msg=k)
  # The full state: adam's mu and nu, which mirror the weights, moved onto axis 0 with them.
  status, _, err = run(capsys, 'convert', LLAMA, out / 'e' / '0', '--layout', 'maxtext',
                       '--scan-layers', 'true', '--param-scan-axis', '0')
  assert status == 0, err
  opt = builders.raw_leaves(LLAMA / '2' / 'optimizer_state')
  got = builders.raw_leaves(out / 'e' / '0' / 'items')
  checked = 0
  for field in ('mu', 'nu'):
    for k in weights:
      want = opt[f'opt_state/0/{field}/base/{k}/value']
      np.testing.assert_array_equal(got[f'opt_state/0/{field}/params/{k}'],
                                    np.moveaxis(want, 1, 0) if k in stacked else want, err_msg=k)
      checked += 1
  assert checked == 2 * len(weights) and got['step'] == opt['step/value']
  # An axis with nothing scanned on either side.
  status, _, err = run(capsys, 'convert', LLAMA, out / 'f' / '0', '--layout', 'maxtext',
                       '--params-only', '--scan-layers', 'false', '--param-scan-axis', '1')
  assert status == 0, err  # The stored layers are scanned on 1: it names them, and fits.
  status, _, err = run(capsys, 'convert', out / 'f' / '0', out / 'g' / '0', '--layout', 'maxtext',
                       '--params-only', '--param-scan-axis', '1')
  assert status == 2 and 'no layer axis is used' in err


# --- scanned blocks that are not whole, records that contradict the arrays -----------------


# (model, the weights taken away or reshaped: a path prefix, what the refusal names)
_DAMAGED = {
    'gemma3 position': ('gemma3', 'decoder/layers/layers_5/', 'decoder/layers/layers_5/...: missing'),
    'gemma3 weight': ('gemma3', 'decoder/layers/layers_5/pre_ffw_norm/scale',
                      'decoder/layers/layers_5: lacks pre_ffw_norm/scale'),
    'gemma3 shape': ('gemma3', 'decoder/layers/layers_2/mlp/wo/kernel',
                     'decoder/layers/layers_2/mlp/wo/kernel: (47, 1, 16), the other positions'
                     ' (48, 1, 16)'),
    'gemma3 remainder': ('gemma3', 'decoder/layers_remainder/layers_1/post_ffw_norm/scale',
                         'decoder/layers_remainder/layers_1: lacks post_ffw_norm/scale'),
    'gemma4 global': ('gemma4', 'decoder/scanned_blocks/global_layer/',
                      'decoder/scanned_blocks/global_layer/...: missing'),
}


@pytest.mark.parametrize('case', list(_DAMAGED))
def test_scanned_blocks_that_are_not_whole_are_refused_naming_the_position(
    case, tmp_path, capsys, mesh, monkeypatch):
  """MaxText's own scanned gemma step (plain Orbax) lacking a position of its blocks, a
  position lacking a weight (or holding one of another shape), or gemma4's global stack: refused
  before any read by export, convert re-laying it, and a restore (of a Tunix run of it) into the
  unscanned model, naming it; inspect shows no layer count, and says why."""
  from tests import test_export_maxtext as mt
  model, spoiled, named = _DAMAGED[case]
  flat = mt.maxtext_tree(model, 'scanned')
  if case.endswith('shape'):
    flat[spoiled] = flat[spoiled][:-1]
  else:
    flat = {k: v for k, v in flat.items() if not k.startswith(spoiled)}
  src = mt.save_maxtext_step(tmp_path / 'run', flat)
  status, shown, _ = run(capsys, 'inspect', src)
  assert status == 0 and named in shown and 'layers  ?' in shown, shown
  run_dir = mt.save_tunix_run(tmp_path / 'tunix', flat)  # What the restore takes.
  _fail_reads(monkeypatch)
  out = tmp_path / 'out'
  status, _, err = run(capsys, 'export', src, out / 'hf', '--model', model)
  assert status == 2 and named in err and 'whole blocks' in err, err
  status, _, err = run(capsys, 'convert', src, out / 'mt' / '0', '--layout', 'maxtext',
                       '--params-only', '--scan-layers', 'false')
  assert status == 2 and named in err, err
  assert not out.exists()
  unscanned = {k: jax.ShapeDtypeStruct(v.shape, v.dtype)
               for k, v in mt.maxtext_tree(model, 'unscanned').items()}
  with pytest.raises(maxtext.LayerScanMismatchError, match='whole blocks') as e:
    maxtext.restore_train_state(run_dir, sharded({'params': {'params': mt.nest(unscanned)}}, mesh),
                                params_only=True)
  assert named in str(e.value)


def test_a_record_the_arrays_contradict_is_named_and_the_axis_they_fit_taken(tmp_path, capsys):
  """A converted step recording `param_scan_axis` 1 over layers stacked on axis 0: the
  contradiction is named (what the step records, what the arrays fit), the axis the arrays fit
  is taken when given (and recorded by a convert of the step), the recorded one refused."""
  step = tmp_path / 'ax0' / '0'
  status, _, err = run(capsys, 'convert', LLAMA, step, '--layout', 'maxtext', '--params-only',
                       '--scan-layers', 'true', '--param-scan-axis', '0')
  assert status == 0, err
  meta_file = step / '_CHECKPOINT_METADATA'
  meta = json.loads(meta_file.read_text())
  meta['custom_metadata']['param_scan_axis'] = 1  # The arrays hold their layers on axis 0.
  meta_file.write_text(json.dumps(meta))
  said = ('records its layers stacked along axis 1', 'hold them along axis 0',
          'the record contradicts the arrays', 'Pass --param-scan-axis 0')
  out = tmp_path / 'out'
  for flags in ((), ('--param-scan-axis', '1')):
    status, _, err = run(capsys, 'convert', step, out / 'a' / '0', '--layout', 'maxtext',
                         '--params-only', '--scan-layers', 'false', *flags)
    assert status == 2 and all(s in err for s in said), err
    status, _, err = run(capsys, 'export', step, out / 'hf', '--model', 'llama3', *flags)
    assert status == 2 and all(s in err for s in said), err
  assert not out.exists()
  status, report, _ = run(capsys, 'inspect', step, '--json')
  shown = json.loads(report)
  assert status == 0 and shown['layers'] == {'form': 'scanned', 'count': 3, 'axis': 0}
  # Named once: the step's layers are resolved once, and what inspect shows is that.
  assert sum('the record contradicts the arrays' in n for n in shown['notes']) == 1, shown
  layers = step_layers.of(reader.open_source(step))
  assert (layers.axis, layers.count) == (0, 3) and layers.problem in shown['notes']
  # Given the axis the arrays fit: taken apart along it, as the step was written.
  status, _, err = run(capsys, 'convert', step, out / 'b' / '0', '--layout', 'maxtext',
                       '--params-only', '--scan-layers', 'false', '--param-scan-axis', '0')
  assert status == 0, err
  src = builders.raw_leaves(LLAMA / '2' / 'model_params')
  got = _stored(out / 'b' / '0')
  stacked = [k for k in src if k.startswith('base/decoder/layers/') and 'rngs' not in k]
  for k in stacked:
    rest = k[len('base/decoder/layers/'):-len('/value')]
    for i in range(3):
      np.testing.assert_array_equal(got[f'decoder/layers_{i}/{rest}'], src[k][:, i], err_msg=k)
  status, _, err = run(capsys, 'export', step, out / 'hf', '--model', 'llama3',
                       '--param-scan-axis', '0')
  assert status == 0 and 'MaxText model (scanned, 3 layers)' in err, err
  # Re-written scanned (as stored, or scanned asked for) along it: the record is the arrays'.
  for name, flags in (('c', ()), ('d', ('--scan-layers', 'true'))):
    status, _, err = run(capsys, 'convert', step, out / name / '0', '--layout', 'maxtext',
                         '--params-only', *flags, '--param-scan-axis', '0')
    assert status == 0, err
    written = json.loads((out / name / '0' / '_CHECKPOINT_METADATA').read_text())
    assert written['custom_metadata']['param_scan_axis'] == 0
    assert _stored(out / name / '0').keys() == _stored(step).keys()


def _config(name: str) -> dict[str, str]:
  """The MaxText config a fixture of tests/data/maxtext was made with (its MANIFEST)."""
  manifest = json.loads((LLAMA.parent / 'MANIFEST.json').read_text())
  return dict(a.split('=', 1) for a in manifest['fixtures'][name]['config_argv'])


def _params_of(source: reader.Source) -> dict:
  """A params-only MaxText target holding the step's weights in their own form."""
  tree: dict = {}
  for leaf, path in reader.weights(source):
    node = tree
    for key in ('params', 'params', *path[:-1]):
      node = node.setdefault(key, {})
    node[path[-1]] = jax.ShapeDtypeStruct(leaf.shape, jnp.float32)
  return tree


def test_a_step_opened_once_carries_the_layers_inspect_export_and_restore_take(tmp_path, capsys):
  """A step's decoder layers are resolved once per opened step (`step_layers.of`: form, axis,
  count), as MaxText made the step (its config: scan_layers, base_num_decoder_layers; MaxText's
  default param_scan_axis 1): inspect reports them, an export to Hugging Face describes them,
  and MaxText's restore into the other form takes them apart along that axis (or stacks them)."""
  names = ('tunix_llama2_scan', 'tunix_llama2_unscan')
  sources = {n: reader.open_source(LLAMA.parent / n) for n in names}
  for name, source in sources.items():
    config = _config(name)
    scanned, count = config['scan_layers'] == 'True', int(config['base_num_decoder_layers'])
    layers = step_layers.of(source)
    assert step_layers.of(source) is layers  # Resolved once, then shared by every plan.
    assert layers.trainer is trainers.MAXTEXT  # decoder/..., token_embedder/...
    shown = {'form': 'scanned' if scanned else 'unscanned', 'count': count,
             'axis': 1 if scanned else None}
    assert {'form': layers.form.kind, 'count': layers.count, 'axis': layers.axis} == shown
    assert layers.problem is None
    status, report, err = run(capsys, 'inspect', source.step_dir, '--json')
    assert status == 0 and json.loads(report)['layers'] == shown, err
    status, _, err = run(capsys, 'export', source.step_dir, tmp_path / name, '--model', 'llama2')
    assert status == 0 and f'MaxText model ({shown["form"]}, {count} layers)' in err, err
    other = sources[names[1 - names.index(name)]]
    plan = maxtext.plan_restore(source.step_dir, _params_of(other), params_only=True)
    kernels = [o for o in plan.outputs if o.path[-3:] == ('mlp', 'wo', 'kernel')]
    if scanned:
      assert [str(o.transform) for o in kernels] == [
          f'take(axis={layers.axis}, index={i})' for i in range(count)]
    else:
      assert [(str(o.transform), len(o.inputs)) for o in kernels] == [('stack(axis=1)', count)]


def test_an_opened_step_carries_the_trainer_whose_naming_its_layouts_map_by(tmp_path):
  """Whose model code named a step's weights is resolved with its layers, once per opened step
  (`Layers.trainer`), and a family's naming is taken by it (`step_layers.naming`): Tunix's for
  a Tunix model's weights, MaxText's for its decoder's; a step with no weights has none, and
  asking it for a naming says so."""
  data = pathlib.Path(__file__).parent / 'data'
  qwen3, llama2 = huggingface.get('qwen3'), huggingface.get('llama2')
  # Who made each fixture (tests/data/*/MANIFEST.json): google-tunix's Qwen3 model class, and
  # a Tunix run of MaxText's Llama 2 decoder.
  cases = ((data / 'tunix/hf_qwen3', qwen3, trainers.TUNIX),
           (data / 'maxtext/tunix_llama2_unscan', llama2, trainers.MAXTEXT))
  for path, family, trainer in cases:
    source = reader.open_source(path)
    assert step_layers.of(source).trainer is trainer, path
    assert step_layers.naming(source, family) is family.naming_of(trainer), path
  # An Orbax step holding no model weights (an optimizer's state alone): no trainer, and no
  # naming to lay it out by.
  with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckptr:
    ckptr.save(tmp_path / 'plain', ocp.args.Composite(
        opt_state=ocp.args.PyTreeSave({'count': np.zeros((), np.int32)})))
  source = reader.open_source(tmp_path / 'plain')
  assert step_layers.of(source).trainer is None
  with pytest.raises(errors.UnsupportedLayoutError, match='expected model weights') as e:
    step_layers.naming(source, qwen3)
  assert str(tmp_path / 'plain') in str(e.value)

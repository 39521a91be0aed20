"""Scanned <-> unscanned MaxText layers at read time, on 8 simulated devices.

Tunix saves of a MaxText-shaped model in both forms (real nnx, optax, Orbax:
`decoder/layers_<i>/...` per layer, or `decoder/layers/...` stacked along
MaxText's `param_scan_axis`), restored into MaxText train states of the other
form. Expected values: the raw Tunix arrays read by plain Orbax, stacked or
sliced with numpy in the test.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from orbax_tunix import maxtext
from orbax_tunix.keypaths import flatten, fmt
from tests import builders
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


@pytest.fixture
def no_reads(monkeypatch):
  def fail(*args, **kwargs):
    raise AssertionError('an array was read before the error')

  monkeypatch.setattr(ocp.PyTreeCheckpointHandler, 'restore', fail)


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

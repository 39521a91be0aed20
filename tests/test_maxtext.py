"""Tunix checkpoints restored as MaxText's train state, on 8 simulated devices.

The abstract states are built as MaxText builds them (MaxText itself is not on
the package index): a Linen model with the checkpoint's parameter names,
`TrainState.create` with an optax optimizer, `jax.eval_shape`, and a sharding
per leaf on the (data=4, model=2) mesh. Expected values come from a plain
Orbax read of the raw Tunix items, at on-disk paths spelled out here.
"""

import logging
import pathlib
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx
from flax.training import train_state
from jax.sharding import NamedSharding, PartitionSpec

import orbax_tunix as ot
from orbax_tunix import maxtext
from orbax_tunix.handlers.pytree_handler import TunixPyTreeHandler
from orbax_tunix.keypaths import flatten, fmt
from orbax_tunix.mapping import optax_states
from orbax_tunix.maxtext import plan as maxtext_plan
from orbax_tunix.reading import reader
from tests import builders

ROOT = pathlib.Path(__file__).resolve().parent.parent
SCHEDULE = optax.linear_schedule(1e-3, 1e-4, 10)


def adamw():
  return optax.adamw(SCHEDULE)


def clip_adamw():
  return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(SCHEDULE))


# --- MaxText-shaped models: the checkpoints' parameter names, in Linen --------


class QProj(nn.Module):
  @nn.compact
  def __call__(self, x):
    return x @ self.param('w', nn.initializers.lecun_normal(), (8, 8))


class TinyAttn(nn.Module):
  @nn.compact
  def __call__(self, x):
    return QProj(name='q_proj')(x) + nn.Dense(8, use_bias=False, name='k_proj')(x)


class TinyMlp(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(8, name='down_proj')(nn.Dense(16, name='up_proj')(x))


class TinyLayer(nn.Module):
  @nn.compact
  def __call__(self, x):
    return TinyMlp(name='mlp')(TinyAttn(name='attn')(x))


class Numbered(nn.Module):
  """Unscanned layers keyed '0', '1', ... (Tunix's nnx.List)."""

  layer: type[nn.Module]
  n: int = 2

  @nn.compact
  def __call__(self, x):
    for i in range(self.n):
      x = self.layer(name=str(i))(x)
    return x


class TinyLM(nn.Module):
  """The committed fixtures' TinyLM."""

  scanned: bool = False

  @nn.compact
  def __call__(self, tokens):
    x = nn.Embed(16, 8, name='embedder')(tokens)
    if self.scanned:
      # MaxText's scan_layers=True: one stacked array per weight, layer axis 1.
      scan = nn.scan(
          lambda mdl, carry, _: (mdl(carry), None),
          variable_axes={'params': 1},
          split_rngs={'params': True},
          length=2,
      )
      x, _ = scan(TinyLayer(name='layers'), x, None)
    else:
      x = Numbered(TinyLayer, name='layers')(x)
    return nn.RMSNorm(name='final_norm')(x)


class Block(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.Dense(8, name='attn')(x)
    nn.Dense(16, name='mlp')(x)
    return x


class SmallModel(nn.Module):
  """tests/builders.Model: layers/<i>/{attn,mlp}, head."""

  @nn.compact
  def __call__(self, x):
    return nn.Dense(4, name='head')(Numbered(Block, name='layers')(x))


class RngModel(nn.Module):
  """The rng_vars fixture's weights: embedder, proj, head."""

  @nn.compact
  def __call__(self, tokens):
    x = nn.Dense(8, name='proj')(nn.Embed(16, 8, name='embedder')(tokens))
    return nn.Dense(16, name='head')(x)


class OwnBase(nn.Module):
  """The own_base_module fixture: a module of its own called `base`."""

  @nn.compact
  def __call__(self, tokens):
    x = nn.Dense(8, name='base')(nn.Embed(16, 8, name='embedder')(tokens))
    return nn.Dense(16, name='head')(x)


def sharded(tree, mesh, float_dtype=None):
  """Each leaf sharded over the mesh axes its dims divide (as MaxText's rules would)."""

  def one(leaf):
    axes, spec = list(mesh.axis_names), []
    for dim in leaf.shape:
      spec.append(axes.pop(0) if axes and dim % mesh.shape[axes[0]] == 0 else None)
    dtype = leaf.dtype
    if float_dtype is not None and jnp.issubdtype(dtype, jnp.floating):
      dtype = float_dtype
    sharding = NamedSharding(mesh, PartitionSpec(*spec))
    return jax.ShapeDtypeStruct(leaf.shape, dtype, sharding=sharding)

  return jax.tree.map(one, tree)


def abstract_state(model, tx, mesh, sample=None, float_dtype=None):
  """MaxText's abstract TrainState: eval_shape of TrainState.create, sharded."""
  sample = jnp.zeros((1, 4), jnp.int32) if sample is None else sample

  def init():
    params = model.init(jax.random.key(0), sample)
    return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)

  return sharded(jax.eval_shape(init), mesh, float_dtype)


def as_dict(state):
  """The same state as a plain dict (MaxText's on-disk `items` layout)."""
  return {'params': state.params, 'opt_state': state.opt_state, 'step': state.step}


# --- expected values ------------------------------------------------------------


def expected_raw_path(path, nodes, base=''):
  """The on-disk path of a target leaf, spelled out: `nodes` maps target chain
  positions to the checkpoint's state nodes; `base` is the adapter level."""
  s = fmt(path)
  if path == ('step',):
    return 'step/value'
  if path[:2] == ('params', 'params'):
    return f'{base}{fmt(path[2:])}/value'
  if path[0] == 'nnx_aux':
    return f'{fmt(path[2:])}/value'
  for target_node, disk_node in nodes.items():
    prefix = f'opt_state/{target_node}/'
    if s.startswith(prefix):
      field, *rest = s[len(prefix):].split('/')
      if field == 'count':
        return f'{disk_node}/count/value'
      assert rest[0] == 'params', s
      return f'{disk_node}/{field}/{base}{"/".join(rest[1:])}/value'
  raise AssertionError(f'no expected source for {s}')


def assert_restored(restored, abstract, step_dir, nodes, filled=(), base='', kept=()):
  """Structure, shardings and dtypes of the target; values of the raw Tunix items."""
  assert jax.tree.structure(restored) == jax.tree.structure(abstract)
  raw = {
      item: builders.raw_leaves(step_dir / item)
      for item in ('model_params', 'optimizer_state')
      if (step_dir / item).exists()
  }
  want = dict(flatten(abstract)[0])
  for path, leaf in flatten(restored)[0]:
    if path[0] in kept:
      assert leaf is want[path], fmt(path)
      continue
    assert isinstance(leaf, jax.Array), fmt(path)
    assert leaf.sharding == want[path].sharding, fmt(path)
    assert leaf.dtype == want[path].dtype, fmt(path)
    if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
      leaf = jax.random.key_data(leaf)  # stored as its key data
    if fmt(path) in filled:
      source = raw['optimizer_state']['step/value']
    else:
      item = 'optimizer_state' if path[0] in ('step', 'opt_state') else 'model_params'
      source = raw[item][expected_raw_path(path, nodes, base)]
    np.testing.assert_array_equal(
        np.asarray(leaf), np.asarray(source).astype(leaf.dtype), err_msg=fmt(path))


@pytest.fixture
def no_reads(monkeypatch):
  """Fails the test if any array is read (errors must come first)."""

  def fail(*args, **kwargs):
    raise AssertionError('an array was read before the error')

  monkeypatch.setattr(TunixPyTreeHandler, 'restore', fail)
  monkeypatch.setattr(ocp.PyTreeCheckpointHandler, 'restore', fail)


# --- checkpoints written here with builders (real nnx, optax, Orbax) ------------


@pytest.fixture(scope='module')
def written(tmp_path_factory):
  """Plain SFT, a clipping chain, and adapter + inject_hyperparams + clip."""
  root = tmp_path_factory.mktemp('tunix')
  out = {}
  model, opt = builders.make(builders.Model(nnx.Rngs(0)), optax.adamw(1e-3), steps=2)
  out['sft'] = builders.save_tunix(root / 'sft', 2, model, opt)
  model, opt = builders.make(builders.Model(nnx.Rngs(1)), clip_adamw())
  out['clip'] = builders.save_tunix(root / 'clip', 1, model, opt)
  tx = optax.chain(
      optax.clip_by_global_norm(1.0),
      optax.inject_hyperparams(optax.adamw)(learning_rate=SCHEDULE),
  )
  model, opt = builders.make(builders.Adapter(builders.Model(nnx.Rngs(2))), tx, steps=3)
  out['adapter_inject_clip'] = builders.save_tunix(root / 'aic', 3, model, opt)
  return out


@pytest.mark.parametrize(
    'name, tx, nodes, filled, base',
    [
        # Tunix adamw(1e-3) -> [adam]; MaxText adamw(schedule) -> [adam, None, {count}].
        ('sft', adamw, {'0': 'opt_state/0'}, ['opt_state/2/count'], ''),
        ('sft', clip_adamw, {'1/0': 'opt_state/0'}, ['opt_state/1/2/count'], ''),
        ('clip', clip_adamw, {'1/0': 'opt_state/1/0', '1/2': 'opt_state/1/2'}, [], ''),
        ('clip', adamw, {'0': 'opt_state/1/0', '2': 'opt_state/1/2'}, [], ''),
        ('adapter_inject_clip', clip_adamw, {'1/0': 'opt_state/1/inner_state/0'},
         ['opt_state/1/2/count'], 'base/'),
    ],
)
def test_written_checkpoints(written, mesh, name, tx, nodes, filled, base):
  abstract = abstract_state(SmallModel(), tx(), mesh, sample=jnp.zeros((1, 8)))
  restored = maxtext.restore_train_state(written[name].parent, abstract)
  assert_restored(restored, abstract, written[name], nodes, filled, base)


# --- the committed fixtures, written by the real google-tunix ------------------


FIXTURE_CASES = [
    # name, model, tx, target chain node -> on-disk node, filled leaves, adapter level
    ('sft_full', TinyLM(), adamw, {'0': 'opt_state/0'}, ['opt_state/2/count'], ''),
    ('chain_clip', TinyLM(), clip_adamw, {'1/0': 'opt_state/1/0'}, ['opt_state/1/2/count'], ''),
    ('adapter_inject', TinyLM(), adamw, {'0': 'opt_state/inner_state/0'},
     ['opt_state/2/count'], 'base/'),
    ('adapter_inject_clip', TinyLM(), clip_adamw, {'1/0': 'opt_state/1/inner_state/0'},
     ['opt_state/1/2/count'], 'base/'),
    ('grad_accum', TinyLM(), adamw, {'0': 'opt_state/inner_opt_state/inner_state/0'},
     ['opt_state/2/count'], ''),
    ('own_base_module', OwnBase(), adamw, {'0': 'opt_state/0'}, ['opt_state/2/count'], ''),
    ('v1_writer', TinyLM(), adamw, {'0': 'opt_state/0'}, ['opt_state/2/count'], ''),
    ('rl_actor', TinyLM(), clip_adamw, {'1/0': 'opt_state/0'}, ['opt_state/1/2/count'], ''),
    ('rng_vars', RngModel(), adamw, {'0': 'opt_state/0'}, ['opt_state/2/count'], ''),
]


@pytest.mark.parametrize('name, model, tx, nodes, filled, base', FIXTURE_CASES)
def test_fixture_full_state(tunix_data, mesh, caplog, name, model, tx, nodes, filled, base):
  abstract = abstract_state(model, tx(), mesh)
  caplog.set_level(logging.INFO, logger='orbax_tunix')
  restored = maxtext.restore_train_state(tunix_data / name, abstract)
  step_dir = ot.detect(tunix_data / name).step_dir
  assert_restored(restored, abstract, step_dir, nodes, filled, base)
  assert restored.step.dtype == jnp.int32  # uint32 on disk
  for leaf in filled:
    assert any(f'{leaf}: filled with' in r.getMessage() for r in caplog.records), leaf


@pytest.mark.parametrize('name, model, tx, nodes, filled, base', FIXTURE_CASES)
def test_fixture_params_only(tunix_data, mesh, monkeypatch, name, model, tx, nodes, filled, base):
  abstract = abstract_state(model, tx(), mesh, float_dtype=jnp.bfloat16)
  opened = []
  for method in ('restore', 'metadata'):  # Orbax's own reads.
    original = getattr(ocp.PyTreeCheckpointHandler, method)

    def spy(self, directory, *args, _original=original, **kwargs):
      opened.append(pathlib.Path(directory).name)
      return _original(self, directory, *args, **kwargs)

    monkeypatch.setattr(ocp.PyTreeCheckpointHandler, method, spy)
  restored = maxtext.restore_train_state(tunix_data / name, abstract, params_only=True)
  assert set(opened) == {'model_params'}
  step_dir = ot.detect(tunix_data / name).step_dir
  assert_restored(restored, abstract, step_dir, nodes, base=base, kept=('opt_state', 'step'))
  assert restored.params['params']['embedder']['embedding'].dtype == jnp.bfloat16


def test_rng_variables_go_to_nnx_aux(tunix_data, mesh):
  """MaxText's NNX layout keeps RNG state under nnx_aux/model/<path>."""
  state = as_dict(abstract_state(RngModel(), adamw(), mesh))
  replicated = NamedSharding(mesh, PartitionSpec())
  typed_key = jax.eval_shape(lambda: jax.random.key(0))  # what nnx.eval_shape gives
  key = jax.ShapeDtypeStruct(typed_key.shape, typed_key.dtype, sharding=replicated)
  key_data = jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=replicated)
  count = jax.ShapeDtypeStruct((), jnp.uint32, sharding=replicated)
  state['nnx_aux'] = {'model': {
      'rngs': {'params': {'count': count, 'key': key}, 'dropout': {'count': count, 'key': key}},
      'dropout': {'rngs': {'count': count, 'key': key_data}},
  }}
  restored = maxtext.restore_train_state(tunix_data / 'rng_vars', state)
  assert_restored(
      restored, state, tunix_data / 'rng_vars' / '1', {'0': 'opt_state/0'}, ['opt_state/2/count'])
  aux = restored['nnx_aux']['model']
  assert jax.dtypes.issubdtype(aux['rngs']['params']['key'].dtype, jax.dtypes.prng_key)
  assert aux['dropout']['rngs']['key'].dtype == jnp.uint32


def test_rng_variables_left_out_without_nnx_aux(tunix_data, mesh, caplog):
  caplog.set_level(logging.INFO, logger='orbax_tunix')
  abstract = abstract_state(RngModel(), adamw(), mesh)
  plan = maxtext.plan_restore(tunix_data / 'rng_vars', abstract)
  assert not any('rngs' in i.leaf.path for o in plan.outputs for i in o.inputs)
  maxtext.restore_train_state(tunix_data / 'rng_vars', abstract)
  assert any('6 RNG/non-weight variables' in r.getMessage() for r in caplog.records)


def test_lora_target_as_dict_with_list_opt_state(tunix_data, mesh):
  """A LoRA target in MaxText's on-disk form: opt_state a list, None for empty states."""
  rep = NamedSharding(mesh, PartitionSpec())
  shapes = {'kernel': (8, 2), 'w': (8, 2)}
  lora = {
      str(i): {'attn': {proj: {
          f'{name}_lora_a': jax.ShapeDtypeStruct(shapes[name], jnp.float32, sharding=rep),
          f'{name}_lora_b': jax.ShapeDtypeStruct(shapes[name][::-1], jnp.float32, sharding=rep),
      } for proj, name in (('k_proj', 'kernel'), ('q_proj', 'w'))}}
      for i in range(2)
  }
  count = jax.ShapeDtypeStruct((), jnp.int32, sharding=rep)
  state = {
      'params': {'params': {'layers': lora}},
      'opt_state': [
          {'count': count, 'mu': {'params': {'layers': lora}}, 'nu': {'params': {'layers': lora}}},
          None,
          {'count': count},
      ],
      'step': count,
  }
  restored = maxtext.restore_train_state(tunix_data / 'lora_qwix', state)
  assert restored['opt_state'][1] is None
  assert_restored(
      restored, state, tunix_data / 'lora_qwix' / '1', {'0': 'opt_state/0'}, ['opt_state/2/count'])


def test_plan_reads_each_array_once(tunix_data, mesh):
  abstract = abstract_state(TinyLM(), clip_adamw(), mesh)
  plan = maxtext.plan_restore(tunix_data / 'adapter_inject_clip', abstract)
  sources = plan.sources()
  assert len(sources['model_params']) == 14
  assert len(sources['optimizer_state']) == 1 + 1 + 2 * 14  # step, adam count, mu, nu
  assert list(plan.fills) == [('opt_state', '1', '2', 'count')]
  w = ('layers', '0', 'attn', 'q_proj', 'w')
  outputs = {o.path: o for o in plan.outputs}
  mu = outputs[('opt_state', '1', '0', 'mu', 'params') + w]
  assert [(i.leaf.item, i.leaf.path) for i in mu.inputs] == [
      ('optimizer_state', ('opt_state', '1', '0', 'mu') + w)]
  assert mu.transform.is_identity
  assert [(i.leaf.item, i.leaf.path) for i in outputs[('params', 'params') + w].inputs] == [
      ('model_params', w)]
  assert 'fill opt_state/1/2/count' in plan.describe()


def test_reads_each_needed_array_once_and_nothing_else(tunix_data, mesh, monkeypatch):
  """grad_accum holds acc_grads, counters and hyperparameters no MaxText state takes."""
  calls = builders.spy_restores(monkeypatch)
  abstract = abstract_state(TinyLM(), adamw(), mesh)
  maxtext.restore_train_state(tunix_data / 'grad_accum', abstract)
  assert [item for item, _ in calls] == ['model_params', 'optimizer_state']
  model, opt = calls[0][1], calls[1][1]
  assert len(model) == len(set(model)) == 14
  assert len(opt) == len(set(opt)) == 1 + 1 + 2 * 14  # step, adam count, mu, nu
  assert not [p for p in opt if 'acc_grads' in p or 'hyperparams' in p or 'mini_step' in p]
  assert 'opt_state/inner_opt_state/inner_state/0/mu/layers/0/attn/q_proj/w/value' in opt


def test_a_step_opened_once_is_restored_without_opening_it_again(tunix_data, mesh, monkeypatch):
  """The step opened once (`reader.open_source`, as the other tools take it) is what the
  restore reads: the same state as from its path, and the step not detected again. One
  opened without an item the restore needs is refused, naming it."""
  abstract = abstract_state(TinyLM(), adamw(), mesh)
  source = reader.open_source(tunix_data / 'grad_accum')
  weights_only = reader.open_source(tunix_data / 'grad_accum', weights_only=True)
  expected = maxtext.restore_train_state(tunix_data / 'grad_accum', abstract)
  opened = []
  for module, name in ((maxtext_plan, 'detect'), (reader, 'open_checkpoint'),
                       (reader, 'open_source')):
    monkeypatch.setattr(module, name, lambda *a, _name=name, **k: opened.append(_name))
  restored = maxtext.restore_train_state(source, abstract)
  assert opened == []
  for want, got in zip(jax.tree.leaves(expected), jax.tree.leaves(restored), strict=True):
    assert got.sharding == want.sharding and got.dtype == want.dtype
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  with pytest.raises(ot.MissingItemError, match=r"grad_accum/\d+: the step was opened without"
                     r" \['optimizer_state'\]"):
    maxtext.plan_restore(weights_only, abstract)
  params = maxtext.restore_train_state(weights_only, abstract, params_only=True)
  np.testing.assert_array_equal(np.asarray(params.params['params']['embedder']['embedding']),
                                np.asarray(expected.params['params']['embedder']['embedding']))
  assert opened == []


# --- as an Orbax handler, called as MaxText's restore calls it ------------------


def maxtext_restore_args(abstract):
  """As MaxText's `map_to_pspec`: shardings only, no dtypes."""
  return jax.tree.map(lambda x: ocp.ArrayRestoreArgs(sharding=x.sharding), abstract)


def test_items_handler_with_plain_pytree_restore(tunix_data, mesh):
  abstract = abstract_state(TinyLM(), clip_adamw(), mesh)
  step_dir = tunix_data / 'adapter_inject_clip' / '1'
  restored = ocp.Checkpointer(maxtext.ItemsHandler()).restore(
      step_dir,
      args=ocp.args.PyTreeRestore(
          item=abstract, restore_args=maxtext_restore_args(abstract), partial_restore=True),
  )
  assert_restored(
      restored, abstract, step_dir, {'1/0': 'opt_state/1/inner_state/0'},
      ['opt_state/1/2/count'], 'base/')


def test_items_handler_params_only(tunix_data, mesh):
  abstract = abstract_state(TinyLM(), adamw(), mesh)
  step_dir = tunix_data / 'sft_full' / '2'
  ckptr = ocp.Checkpointer(maxtext.ItemsHandler())
  # MaxText's load_parameters_path: a target holding the params alone.
  restored = ckptr.restore(step_dir, args=ocp.args.PyTreeRestore(item={'params': abstract.params}))
  assert_restored(restored, {'params': abstract.params}, step_dir, {})
  restored = ckptr.restore(step_dir, args=maxtext.ItemsRestore(item=abstract, params_only=True))
  assert_restored(restored, abstract, step_dir, {}, kept=('opt_state', 'step'))


def test_items_handler_reads_maxtext_items_as_orbax_does(tmp_path, mesh):
  """A MaxText checkpoint (not Tunix) goes to the plain PyTree handler."""
  model, tx = TinyLM(), adamw()
  params = model.init(jax.random.key(3), jnp.zeros((1, 4), jnp.int32))
  state = as_dict(train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx))
  with ocp.Checkpointer(ocp.PyTreeCheckpointHandler()) as ckptr:
    ckptr.save(tmp_path / 'items', args=ocp.args.PyTreeSave(state))
  abstract = sharded(jax.eval_shape(lambda: state), mesh)
  restored = ocp.Checkpointer(maxtext.ItemsHandler()).restore(
      tmp_path / 'items',
      args=ocp.args.PyTreeRestore(item=abstract, restore_args=maxtext_restore_args(abstract)))
  for (path, got), (_, want) in zip(flatten(restored)[0], flatten(state)[0], strict=True):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=fmt(path))


def load_params_as_maxtext_does(path, abstract_params):
  """The call MaxText's `load_params_from_path` makes (common/checkpointing.py,
  main), with `ItemsHandler` where MaxText constructs its PyTree handler: the
  item `{'params': <Linen params collection>}`, `transforms={}`, and restore
  args from `construct_restore_args`."""
  ckptr = ocp.Checkpointer(maxtext.ItemsHandler(
      restore_concurrent_gb=96, save_concurrent_gb=96, use_ocdbt=True, use_zarr3=True))
  restore_args = ocp.checkpoint_utils.construct_restore_args(abstract_params)
  restored = ckptr.restore(
      pathlib.Path(path), item={'params': abstract_params}, transforms={},
      restore_args={'params': restore_args})
  return restored['params']


def test_maxtext_load_params_from_path_on_a_tunix_step(tunix_data, mesh):
  abstract = abstract_state(TinyLM(), adamw(), mesh)
  step_dir = tunix_data / 'sft_full' / '2'
  params = load_params_as_maxtext_does(step_dir, abstract.params)
  assert_restored({'params': params}, {'params': abstract.params}, step_dir, {})


def test_maxtext_load_full_state_from_path_on_a_tunix_step(tunix_data, mesh):
  """The v0 call of MaxText's `_load_full_state_from_path` (Linen TrainState), with
  `ItemsHandler` in place of its PyTree handler: item positional, restore args
  carrying shardings only."""
  abstract = abstract_state(TinyLM(), clip_adamw(), mesh)
  step_dir = tunix_data / 'adapter_inject_clip' / '1'
  handler = maxtext.ItemsHandler(
      restore_concurrent_gb=96, save_concurrent_gb=96, use_ocdbt=True, use_zarr3=True)
  restore_args = jax.tree_util.tree_map(
      lambda x: ocp.type_handlers.ArrayRestoreArgs(sharding=x.sharding), abstract)
  restored = ocp.Checkpointer(handler).restore(step_dir, abstract, restore_args=restore_args)
  assert_restored(
      restored, abstract, step_dir, {'1/0': 'opt_state/1/inner_state/0'},
      ['opt_state/1/2/count'], 'base/')


def test_maxtext_load_params_from_path_on_maxtext_items(tmp_path, mesh):
  model = TinyLM()
  params = model.init(jax.random.key(3), jnp.zeros((1, 4), jnp.int32))
  state = as_dict(train_state.TrainState.create(apply_fn=model.apply, params=params, tx=adamw()))
  with ocp.Checkpointer(ocp.PyTreeCheckpointHandler()) as ckptr:
    ckptr.save(tmp_path / 'items', args=ocp.args.PyTreeSave(state))
  abstract = sharded(jax.eval_shape(lambda: state['params']), mesh)
  restored = load_params_as_maxtext_does(tmp_path / 'items', abstract)
  for (path, got), (_, want) in zip(flatten(restored)[0], flatten(params)[0], strict=True):
    assert got.sharding == dict(flatten(abstract)[0])[path].sharding, fmt(path)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=fmt(path))


# --- errors: raised before any array is read ------------------------------------


def test_error_weight_in_target_not_on_disk(tunix_data, mesh, no_reads):
  state = as_dict(abstract_state(TinyLM(), adamw(), mesh))
  extra = jax.ShapeDtypeStruct((8, 16), jnp.float32)
  for i in range(25):
    state['params']['params'][f'lm_head_{i}'] = {'kernel': extra}
  with pytest.raises(ot.TargetMismatchError) as e:
    maxtext.restore_train_state(tunix_data / 'sft_full', state)
  msg = str(e.value)
  assert '25 target weights are not in the checkpoint' in msg
  assert 'params/params/lm_head_0/kernel (checkpoint path lm_head_0/kernel)' in msg
  assert '... and 5 more' in msg
  assert 'sft_full/2' in msg


def test_error_weight_on_disk_not_in_target(tunix_data, mesh, no_reads):
  state = as_dict(abstract_state(TinyLM(), adamw(), mesh))
  del state['params']['params']['final_norm']
  with pytest.raises(ot.TargetMismatchError) as e:
    maxtext.restore_train_state(tunix_data / 'sft_full', state, params_only=True)
  assert '1 weights in the checkpoint are not in the target:\n  final_norm/scale' in str(e.value)


def test_error_shape_mismatch(tunix_data, mesh, no_reads):
  state = as_dict(abstract_state(TinyLM(), adamw(), mesh))
  state['params']['params']['embedder']['embedding'] = jax.ShapeDtypeStruct((32, 8), jnp.float32)
  with pytest.raises(ot.TargetMismatchError) as e:
    maxtext.restore_train_state(tunix_data / 'chain_clip', state)
  msg = str(e.value)
  assert '1 leaves differ in shape' in msg
  assert 'params/params/embedder/embedding: target (32, 8), checkpoint (16, 8)' in msg


def test_error_scanned_target_unscanned_checkpoint(tunix_data, mesh, no_reads):
  """Layers under names no layer form knows (Tunix's `layers/<i>`, not MaxText's `decoder`):
  not re-laid; both sides' weights are listed."""
  abstract = abstract_state(TinyLM(scanned=True), adamw(), mesh)
  kernel = abstract.params['params']['layers']['mlp']['up_proj']['kernel']
  assert kernel.shape == (8, 2, 16)  # MaxText's layer axis 1
  with pytest.raises(ot.TargetMismatchError) as e:
    maxtext.restore_train_state(tunix_data / 'sft_full', abstract, params_only=True)
  msg = str(e.value)
  assert '6 target weights are not in the checkpoint' in msg
  assert 'params/params/layers/mlp/up_proj/kernel (checkpoint path layers/mlp/up_proj/kernel)' in msg
  assert 'layers/0/mlp/up_proj/kernel (stored as model_params/' in msg


class StackedLayers(nnx.Module):
  """Tunix-side scanned layers: one nnx.Param per weight with a leading layer axis."""

  def __init__(self, rngs):
    self.attn = nnx.Linear(8, 8, rngs=rngs)
    self.attn.kernel = nnx.Param(jnp.stack([self.attn.kernel.value] * 2))
    self.attn.bias = nnx.Param(jnp.zeros((2, 8)))


class StackedModel(nnx.Module):
  def __init__(self, rngs):
    self.layers = StackedLayers(rngs)
    self.head = nnx.Linear(8, 4, rngs=rngs)

  def __call__(self, x):
    for i in range(2):
      x = x @ self.layers.attn.kernel[i] + self.layers.attn.bias[i]
    return self.head(x)


class AttnOnly(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(8, name='attn')(x)


class UnscannedAttn(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(4, name='head')(Numbered(AttnOnly, name='layers')(x))


def test_error_unscanned_target_scanned_checkpoint(tmp_path, mesh, no_reads):
  model, opt = builders.make(StackedModel(nnx.Rngs(0)), optax.adamw(1e-3))
  builders.save_tunix(tmp_path, 1, model, opt)
  abstract = abstract_state(UnscannedAttn(), adamw(), mesh, sample=jnp.zeros((1, 8)))
  with pytest.raises(ot.TargetMismatchError) as e:
    maxtext.restore_train_state(tmp_path, abstract)
  msg = str(e.value)
  assert 'params/params/layers/0/attn/kernel (checkpoint path layers/0/attn/kernel)' in msg
  assert 'weights in the checkpoint are not in the target:\n  layers/attn/bias' in msg


@pytest.mark.parametrize('params_only', [False, True])
def test_error_lora_only_checkpoint(tunix_data, mesh, no_reads, params_only):
  abstract = abstract_state(TinyLM(), adamw(), mesh)
  with pytest.raises(maxtext.LoraOnlyCheckpointError) as e:
    maxtext.restore_train_state(tunix_data / 'lora_qwix', abstract, params_only=params_only)
  msg = str(e.value)
  assert 'only LoRA adapter weights (8 leaves)' in msg
  assert '14 target weights are not in it' in msg
  assert 'layers/0/attn/q_proj/w_lora_a' in msg


def test_error_optimizer_without_counterpart(tunix_data, mesh, no_reads):
  abstract = abstract_state(TinyLM(), optax.sgd(SCHEDULE, momentum=0.9), mesh)
  with pytest.raises(ot.TargetMismatchError) as e:
    maxtext.restore_train_state(tunix_data / 'sft_full', abstract)
  msg = str(e.value)
  assert "1 states of the target's optimizer have no counterpart" in msg
  assert 'opt_state/0 {trace[weights]}' in msg
  assert 'opt_state/0 {count, mu[weights], nu[weights]}' in msg


def test_error_target_leaf_no_rule_makes(tunix_data, mesh, no_reads):
  """One optimizer field under two nodes in the target (with and without MaxText's
  `params` level): the rules map a field one way, so the leaves in the other are
  refused, never handed back unread."""
  pairs, _ = flatten(abstract_state(TinyLM(), adamw(), mesh))
  leaves = dict(pairs)
  moved = next(p for p in sorted(leaves) if p[:4] == ('opt_state', '0', 'nu', 'params'))
  leaves[moved[:3] + moved[4:]] = leaves.pop(moved)
  source = reader.open_source(tunix_data / 'sft_full')
  with pytest.raises(ot.TargetMismatchError) as e:
    maxtext_plan.make_plan(source, leaves)
  msg = str(e.value)
  # The first leaf (in chain order) sets where the field goes; the other form is refused.
  assert 'target leaves are not made by the MaxText rules' in msg
  assert 'opt_state/0/nu/' in msg and 'opt_state/0/mu/' not in msg


def test_error_not_maxtext_key_paths(tunix_data, mesh, no_reads):
  state = as_dict(abstract_state(TinyLM(), adamw(), mesh))
  state['params'] = state['params']['params']  # the collection level forgotten
  with pytest.raises(ot.TargetMismatchError, match='params/params/<weights>'):
    maxtext.restore_train_state(tunix_data / 'sft_full', state)


# --- the example ----------------------------------------------------------------


@pytest.mark.parametrize('args', [[], ['tests/data/tunix/rl_actor', '--params-only']])
def test_example_runs(args):
  out = subprocess.run(
      [sys.executable, str(ROOT / 'examples' / 'maxtext_restore.py'), *args],
      cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
  assert out.returncode == 0, out.stderr[-3000:]
  assert 'restored a TrainState on 8 devices' in out.stdout
  assert 'params/params/layers/1/mlp/up_proj/kernel' in out.stdout


# --- the state alignment, on its own ---------------------------------------------


def _state(node, *fields):
  return optax_states.OptState(tuple(node.split('/')), tuple(sorted(fields)))


ADAM = (('count', False), ('mu', True), ('nu', True))
COUNT = (('count', False),)


def test_align_states_skips_empty_and_extra_states():
  target = [_state('1/0', *ADAM), _state('1/2', *COUNT)]  # chain(clip, adamw(schedule))
  source = [_state('inner_opt_state/0', *ADAM)]  # MultiSteps(inject(adamw)), shell removed
  assert optax_states.align_states(target, source) == {0: 0}


def test_align_states_prefers_data_over_a_counter():
  # The orders disagree: keeping adam's mu/nu matters more than a count, which is filled.
  target = [_state('0', *ADAM), _state('2', *COUNT)]
  source = [_state('0', *COUNT), _state('1', *ADAM)]
  assert optax_states.align_states(target, source) == {0: 1}


def test_split_opt_path_finds_the_mirrored_weights():
  weights = {('layers', '0', 'w')}
  assert optax_states.split_opt_path(
      ('opt_state', '1', '0', 'mu', 'params', 'layers', '0', 'w'), weights, 'params'
  ) == (('1', '0'), 'mu', ('layers', '0', 'w'))
  assert optax_states.split_opt_path(('opt_state', '0', 'count'), weights) == (
      ('0',), 'count', None)


@pytest.mark.parametrize('target', [None, {}, {'params': {'params': {}}}], ids=['none', 'empty', 'hollow'])
@pytest.mark.parametrize('params_only', [False, True], ids=['full', 'params'])
def test_error_no_abstract_state(tunix_data, no_reads, target, params_only):
  """Nothing says what to restore: refused (it returned the target itself), not a no-op."""
  for call in (lambda: maxtext.restore_train_state(tunix_data / 'sft_full', target,
                                                   params_only=params_only),
               lambda: maxtext.plan_restore(tunix_data / 'sft_full', target),
               lambda: ocp.Checkpointer(maxtext.ItemsHandler()).restore(
                   tunix_data / 'sft_full' / '2', args=ocp.args.PyTreeRestore(item=target))):
    with pytest.raises(ot.TargetMismatchError) as e:
      call()
    msg = str(e.value)
    assert f'`abstract_state` {target!r}: expected MaxText\'s abstract train state' in msg
    assert 'train_state_nnx.to_checkpoint_dict' in msg and 'sft_full' in msg


def test_error_a_target_leaf_that_is_not_an_array(tunix_data, no_reads):
  """A float or an int among MaxText's abstract state: each named with what it is, before the
  step is opened, with how to build the state (the same refusal as a merge's target)."""
  target = {'params': {'params': {'decoder': {'w': 1.0, 'b': 3}}},
            'step': jax.ShapeDtypeStruct((), jnp.int32)}
  with pytest.raises(ot.TargetMismatchError) as e:
    maxtext.restore_train_state(tunix_data / 'sft_full', target)
  msg = str(e.value)
  assert 'The abstract state has 2 leaves that are not arrays' in msg, msg
  assert 'params/params/decoder/w: float' in msg and 'params/params/decoder/b: int' in msg, msg
  assert 'jax.eval_shape' in msg, msg

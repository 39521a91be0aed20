"""TunixPyTreeHandler and TunixAwareHandler on real and synthetic checkpoints."""

import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import orbax_tunix as ot
from orbax_tunix.keypaths import key_str
from tests import builders


def _leaves(tree):
  flat, _ = jax.tree_util.tree_flatten_with_path(tree)
  return {'/'.join(key_str(k) for k in kp): v for kp, v in flat}


# What each committed fixture wraps, stated here: an adapter `base` level over
# the weights (and in mu/nu), and where an inject_hyperparams shell sits.
SPECS = {
    'adapter_inject': {'adapter': True, 'shell': 'opt_state'},
    'grad_accum': {'shell': 'opt_state/inner_opt_state'},
    'adapter_inject_clip': {'adapter': True, 'shell': 'opt_state/1'},
}


def canonical_by_hand(path, item, adapter=False, shell=None):
  """The canonical path of a raw on-disk path, by plain string edits (or None)."""
  assert path.endswith('/value'), path
  path = path[: -len('/value')]
  if shell and path.startswith(shell + '/'):
    rest = path[len(shell) + 1:]
    if rest == 'count' or rest.startswith(('hyperparams/', 'hyperparams_states/')):
      return None  # The shell's own leaves leave the canonical view.
    assert rest.startswith('inner_state/'), path
    path = f'{shell}/{rest[len("inner_state/"):]}'
  if adapter:
    if item == 'model_params':
      assert path.startswith('base/'), path
      path = path[len('base/'):]
    for field in ('mu', 'nu', 'acc_grads'):
      path = path.replace(f'/{field}/base/', f'/{field}/')
  return path


def expected_leaves(step_dir, item, spec):
  """The raw leaves read by plain Orbax, under their hand-derived canonical paths."""
  out = {}
  for path, value in builders.raw_leaves(step_dir / item).items():
    canon = canonical_by_hand(path, item, **spec)
    if canon is not None:
      out[canon] = value
  return out


def _assert_values(result, expected):
  got = _leaves(result)
  assert set(got) == set(expected)
  for path, value in expected.items():
    g = got[path]
    if jax.dtypes.issubdtype(getattr(g, 'dtype', np.float32), jax.dtypes.prng_key):
      g = jax.random.key_data(g)
    np.testing.assert_array_equal(np.asarray(g), np.asarray(value), err_msg=path)


FIXTURES = ['sft_full', 'lora_qwix', 'adapter_inject', 'chain_clip', 'grad_accum',
            'adapter_inject_clip', 'own_base_module', 'v1_writer', 'rl_actor', 'rng_vars']


@pytest.mark.parametrize('name', FIXTURES)
def test_no_arg_restore_is_canonical(tunix_data, name):
  step_dir = ot.detect(tunix_data / name).step_dir
  restored = ocp.Checkpointer(ot.TunixAwareHandler()).restore(step_dir)
  assert set(restored.keys()) == {'model_params', 'optimizer_state'}
  for item in ('model_params', 'optimizer_state'):
    paths = set(_leaves(restored[item]))
    assert not any(p.endswith('/value') for p in paths)
    _assert_values(restored[item], expected_leaves(step_dir, item, SPECS.get(name, {})))
  assert set(restored['optimizer_state']) == {'opt_state', 'step'}


def test_explicit_canonical_paths(tunix_data):
  """Where specific on-disk leaves land, spelled out by hand."""
  step_dir = tunix_data / 'adapter_inject_clip' / '1'
  raw_opt = builders.raw_leaves(step_dir / 'optimizer_state')
  raw_model = builders.raw_leaves(step_dir / 'model_params')
  r = ocp.Checkpointer(ot.TunixAwareHandler()).restore(step_dir)
  mu = r['optimizer_state']['opt_state']['1']['0']['mu']
  np.testing.assert_array_equal(
      mu['layers']['0']['attn']['q_proj']['w'],
      raw_opt['opt_state/1/inner_state/0/mu/base/layers/0/attn/q_proj/w/value'])
  np.testing.assert_array_equal(
      r['model_params']['layers']['1']['mlp']['up_proj']['kernel'],
      raw_model['base/layers/1/mlp/up_proj/kernel/value'])
  assert 'hyperparams' not in r['optimizer_state']['opt_state']['1']
  assert r['optimizer_state']['step'].dtype == np.uint32


def test_own_base_module_survives(tunix_data):
  r = ocp.Checkpointer(ot.TunixAwareHandler()).restore(tunix_data / 'own_base_module' / '1')
  assert {'base', 'head'} <= set(r['model_params'])
  assert 'base' in r['optimizer_state']['opt_state']['0']['mu']


def _abstract(meta_tree, mesh, dtype=None):
  """A canonical target: every leaf sharded over the mesh where it divides."""

  def sds(m):
    spec = [None] * len(m.shape)
    if m.shape and m.shape[0] % 4 == 0:
      spec[0] = 'data'
    if len(m.shape) > 1 and m.shape[1] % 2 == 0:
      spec[1] = 'model'
    return jax.ShapeDtypeStruct(
        m.shape, dtype if dtype and jnp.issubdtype(m.dtype, jnp.floating) else m.dtype,
        sharding=NamedSharding(mesh, P(*spec)))

  return jax.tree.map(sds, meta_tree)


@pytest.mark.parametrize('name', ['adapter_inject', 'grad_accum', 'chain_clip', 'lora_qwix'])
def test_sharded_restore_into_target(tunix_data, mesh, name):
  step_dir = ot.detect(tunix_data / name).step_dir
  ckptr = ocp.Checkpointer(ot.TunixAwareHandler())
  meta = ckptr.metadata(step_dir).item_metadata
  targets = {item: _abstract(meta[item].tree, mesh, jnp.bfloat16) for item in meta.keys()}
  restored = ckptr.restore(step_dir, args=ocp.args.Composite(
      **{item: ocp.args.PyTreeRestore(item=t) for item, t in targets.items()}))
  for item, target in targets.items():
    got, want = _leaves(restored[item]), _leaves(target)
    assert set(got) == set(want)
    for path, sds in want.items():
      assert isinstance(got[path], jax.Array), path
      assert got[path].sharding == sds.sharding, path
      assert got[path].dtype == sds.dtype, path
    expected = expected_leaves(step_dir, item, SPECS.get(name, {}))
    for path, value in expected.items():
      np.testing.assert_array_equal(
          np.asarray(got[path]), np.asarray(value).astype(got[path].dtype), err_msg=path)


def test_partial_target_reads_only_what_it_names(tunix_data, mesh):
  step_dir = tunix_data / 'sft_full' / '2'
  spec = NamedSharding(mesh, P('data', 'model'))
  target = {'layers': {'0': {'attn': {'q_proj': {'w': jax.ShapeDtypeStruct((8, 8), jnp.float32, sharding=spec)}}}}}
  r = ocp.Checkpointer(ot.TunixAwareHandler()).restore(
      step_dir, args=ocp.args.Composite(model_params=ocp.args.PyTreeRestore(item=target)))
  assert list(r.keys()) == ['model_params']
  w = r['model_params']['layers']['0']['attn']['q_proj']['w']
  assert w.sharding == spec
  raw = builders.raw_leaves(step_dir / 'model_params')
  np.testing.assert_array_equal(w, raw['layers/0/attn/q_proj/w/value'])


def test_item_handler_with_standard_and_pytree_args(tunix_data, mesh):
  item_dir = tunix_data / 'adapter_inject' / '1' / 'model_params'
  ckptr = ocp.Checkpointer(ot.TunixPyTreeHandler())
  meta = ckptr.metadata(item_dir).item_metadata.tree
  assert 'base' not in meta and 'layers' in meta
  target = _abstract(meta, mesh)
  a = ckptr.restore(item_dir, args=ocp.args.StandardRestore(target))
  b = ckptr.restore(item_dir, args=ocp.args.PyTreeRestore(item=target))
  c = ckptr.restore(item_dir)
  raw = builders.raw_leaves(item_dir)
  for tree in (a, b, c):
    np.testing.assert_array_equal(
        tree['embedder']['embedding'], raw['base/embedder/embedding/value'])
  assert a['embedder']['embedding'].sharding == target['embedder']['embedding'].sharding


def test_result_keeps_callers_structure(tunix_data, mesh):
  """A target made of a NamedTuple and a list comes back as such."""
  from typing import NamedTuple

  class Adam(NamedTuple):
    count: jax.ShapeDtypeStruct
    mu: dict

  step_dir = tunix_data / 'chain_clip' / '1'
  rep = NamedSharding(mesh, P())
  target = {'opt_state': [None, [Adam(
      count=jax.ShapeDtypeStruct((), jnp.int32, sharding=rep),
      mu={'final_norm': {'scale': jax.ShapeDtypeStruct((8,), jnp.float32, sharding=rep)}})]],
      'step': jax.ShapeDtypeStruct((), jnp.int32, sharding=rep)}
  r = ocp.Checkpointer(ot.TunixPyTreeHandler()).restore(
      step_dir / 'optimizer_state', args=ocp.args.PyTreeRestore(item=target))
  assert isinstance(r['opt_state'][1][0], Adam) and r['opt_state'][0] is None
  raw = builders.raw_leaves(step_dir / 'optimizer_state')
  assert int(r['opt_state'][1][0].count) == int(raw['opt_state/1/0/count/value'])
  assert r['step'].dtype == jnp.int32 and int(r['step']) == int(raw['step/value'])


def test_strict_missing_and_shape_errors_list_paths(tunix_data, mesh):
  item_dir = tunix_data / 'sft_full' / '2' / 'model_params'
  rep = NamedSharding(mesh, P())
  target = {
      'embedder': {'embedding': jax.ShapeDtypeStruct((3, 3), jnp.float32, sharding=rep)},
      'nope': {'a': jax.ShapeDtypeStruct((1,), jnp.float32, sharding=rep),
               'b': jax.ShapeDtypeStruct((1,), jnp.float32, sharding=rep)},
  }
  with pytest.raises(ot.TargetMismatchError) as e:
    ocp.Checkpointer(ot.TunixPyTreeHandler()).restore(
        item_dir, args=ocp.args.PyTreeRestore(item=target))
  msg = str(e.value)
  assert str(item_dir) in msg
  assert '2 target leaves are not in the checkpoint' in msg and 'nope/a' in msg and 'nope/b' in msg
  assert 'embedder/embedding: target (3, 3), on disk (16, 8)' in msg
  assert isinstance(e.value, ValueError) and isinstance(e.value, ot.TunixCheckpointError)


def test_unrequested_arrays_are_never_read(tmp_path, mesh):
  """Delete the optimizer's array data: a params restore does not notice."""
  model, opt = builders.make(builders.Adapter(builders.Model(nnx.Rngs(0))), optax.adamw(1e-2))
  step_dir = tmp_path / '1'
  items = {
      'model_params': ocp.args.PyTreeSave(nnx.state(model)),
      'optimizer_state': ocp.args.PyTreeSave(nnx.state(opt, nnx.optimizer.OptState)),
  }
  handler = ocp.CompositeCheckpointHandler(
      model_params=ocp.PyTreeCheckpointHandler(use_ocdbt=False),
      optimizer_state=ocp.PyTreeCheckpointHandler(use_ocdbt=False))
  ocp.Checkpointer(handler).save(step_dir, args=ocp.args.Composite(**items))
  # Without OCDBT each array has its own directory: remove all but two weights.
  keep = {'base.head.kernel.value', 'base.layers.0.attn.kernel.value'}
  for d in list((step_dir / 'model_params').iterdir()):
    if d.is_dir() and d.name not in keep and d.name != 'array_metadatas':
      shutil.rmtree(d)
  shutil.rmtree(step_dir / 'optimizer_state')
  rep = NamedSharding(mesh, P())
  target = {'head': {'kernel': jax.ShapeDtypeStruct((8, 4), jnp.float32, sharding=rep)},
            'layers': {'0': {'attn': {'kernel': jax.ShapeDtypeStruct((8, 8), jnp.float32, sharding=rep)}}}}
  r = ocp.Checkpointer(ot.TunixAwareHandler()).restore(
      step_dir, args=ocp.args.Composite(model_params=ocp.args.PyTreeRestore(item=target)))
  np.testing.assert_array_equal(r['model_params']['head']['kernel'], model.base.head.kernel[...])
  # And a target naming a deleted array does fail: the deletion was real.
  with pytest.raises(ot.CorruptMetadataError, match='base.head.bias'):
    target['head']['bias'] = jax.ShapeDtypeStruct((4,), jnp.float32, sharding=rep)
    ocp.Checkpointer(ot.TunixAwareHandler()).restore(
        step_dir, args=ocp.args.Composite(model_params=ocp.args.PyTreeRestore(item=target)))


@pytest.mark.parametrize('wrap', ['plain', 'named_tuple_chain', 'list_state'])
def test_synthetic_optimizer_states(tmp_path, wrap):
  """NamedTuple, tuple (chain) and list optimizer states written with optax."""
  tx, spec = {
      'plain': (optax.sgd(1e-2, momentum=0.9), {}),
      'named_tuple_chain': (
          optax.chain(optax.clip_by_global_norm(1.0), optax.inject_hyperparams(optax.adam)(1e-3)),
          {'shell': 'opt_state/1'},
      ),
      'list_state': (optax.MultiSteps(optax.adamw(1e-3), every_k_schedule=2), {}),
  }[wrap]
  model, opt = builders.make(builders.Model(nnx.Rngs(1)), tx)
  step_dir = builders.save_tunix(tmp_path, 3, model, opt)
  r = ocp.Checkpointer(ot.TunixAwareHandler()).restore(step_dir)
  _assert_values(r['optimizer_state'], expected_leaves(step_dir, 'optimizer_state', spec))
  _assert_values(r['model_params'], expected_leaves(step_dir, 'model_params', spec))


def test_non_tunix_checkpoint_is_untouched(tmp_path):
  tree = {'params': {'w': np.arange(6, dtype=np.float32).reshape(2, 3)}, 'value': np.float32(1)}
  ocp.Checkpointer(ocp.CompositeCheckpointHandler()).save(
      tmp_path / '1', args=ocp.args.Composite(state=ocp.args.PyTreeSave(tree)))
  plain = ocp.Checkpointer(ocp.CompositeCheckpointHandler()).restore(
      tmp_path / '1', args=ocp.args.Composite(state=ocp.args.PyTreeRestore()))
  ours = ocp.Checkpointer(ot.TunixAwareHandler()).restore(tmp_path / '1')
  assert jax.tree.structure(plain['state']) == jax.tree.structure(ours['state'])
  np.testing.assert_array_equal(ours['state']['params']['w'], tree['params']['w'])


def test_save_through_handler_writes_ordinary_checkpoint(tmp_path):
  tree = {'w': np.ones((4,), np.float32)}
  ocp.Checkpointer(ot.TunixAwareHandler()).save(
      tmp_path / '1', args=ocp.args.Composite(state=ocp.args.PyTreeSave(tree)))
  restored = ocp.Checkpointer(ocp.CompositeCheckpointHandler()).restore(tmp_path / '1')
  np.testing.assert_array_equal(restored['state']['w'], tree['w'])


def test_our_item_handler_takes_orbax_pytree_args(tunix_data, tmp_path):
  """`TunixPyTreeHandler` given as an item's handler takes `PyTreeSave`/`PyTreeRestore`, as a
  `PyTreeCheckpointHandler` given the same way does (Orbax registers an item handler under
  its class's own args types: ours are TunixPyTreeSave/TunixPyTreeRestore)."""
  tree = {'w': np.arange(6, dtype=np.float32).reshape(2, 3)}
  ckptr = ocp.Checkpointer(ot.TunixAwareHandler(pytree=ot.TunixPyTreeHandler()))
  ckptr.save(tmp_path / '1', args=ocp.args.Composite(pytree=ocp.args.PyTreeSave(tree)))
  plain = ocp.Checkpointer(ocp.CompositeCheckpointHandler()).restore(
      tmp_path / '1', args=ocp.args.Composite(pytree=ocp.args.PyTreeRestore()))
  np.testing.assert_array_equal(plain['pytree']['w'], tree['w'])
  again = ocp.Checkpointer(ot.TunixAwareHandler(pytree=ot.TunixPyTreeHandler())).restore(
      tmp_path / '1', args=ocp.args.Composite(pytree=ocp.args.PyTreeRestore()))
  np.testing.assert_array_equal(again['pytree']['w'], tree['w'])
  # A Tunix item through the same handler: canonical, as through the default one.
  step = tunix_data / 'sft_full' / '1'
  given = ocp.Checkpointer(ot.TunixAwareHandler(model_params=ot.TunixPyTreeHandler())).restore(
      step, args=ocp.args.Composite(model_params=ocp.args.PyTreeRestore()))
  default = ocp.Checkpointer(ot.TunixAwareHandler()).restore(
      step, args=ocp.args.Composite(model_params=ocp.args.PyTreeRestore()))
  assert jax.tree.structure(given) == jax.tree.structure(default)
  _assert_values(given['model_params'], _leaves(default['model_params']))


def test_a_standard_reader_restores_a_standard_item_asked_for_nothing(tmp_path):
  """As Orbax's StandardCheckpointHandler restores with no args: its StandardRestore()."""
  from etils import epath  # pylint: disable=g-import-not-at-top

  item = epath.Path(tmp_path / 'item')
  saver = ocp.StandardCheckpointHandler()
  saver.save(item, args=ocp.args.StandardSave({'a': np.arange(4)}))
  saver.finalize(item)
  want = ocp.StandardCheckpointHandler().restore(item)
  got = ot.TunixPyTreeHandler(reader=ocp.StandardCheckpointHandler()).restore(item)
  assert jax.tree.structure(got) == jax.tree.structure(want)
  np.testing.assert_array_equal(got['a'], want['a'])


def test_hyperparameters(tunix_data):
  hp = ot.hyperparameters(tunix_data / 'adapter_inject_clip')
  assert set(hp) == {'opt_state/1'}
  assert hp['opt_state/1']['learning_rate'] == pytest.approx(1e-3)
  assert hp['opt_state/1']['b1'] == pytest.approx(0.9)
  assert set(ot.hyperparameters(tunix_data / 'grad_accum')) == {'opt_state/inner_opt_state'}
  assert ot.hyperparameters(tunix_data / 'sft_full') == {}


def test_same_handler_restores_then_saves_ordinary(tunix_data, tmp_path):
  handler = ot.TunixAwareHandler()
  ckptr = ocp.Checkpointer(handler)
  ckptr.metadata(tunix_data / 'sft_full' / '1')
  restored = ckptr.restore(tunix_data / 'sft_full' / '1')
  ckptr.save(tmp_path / '1', args=ocp.args.Composite(
      model_params=ocp.args.PyTreeSave(restored['model_params'])))
  plain = ocp.Checkpointer(ocp.CompositeCheckpointHandler()).restore(tmp_path / '1')
  _assert_values(plain['model_params'], _leaves(restored['model_params']))


def test_relative_paths_and_typed_key_targets(tunix_data, mesh, monkeypatch):
  monkeypatch.chdir(tunix_data)
  item = 'rng_vars/1/model_params'
  rep = NamedSharding(mesh, P())
  target = {'rngs': {'params': {'key': jax.ShapeDtypeStruct(
      (), jax.random.key(0).dtype, sharding=rep)}}}
  r = ot.TunixPyTreeHandler().restore(item, args=ocp.args.PyTreeRestore(item=target))
  key = r['rngs']['params']['key']
  assert jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key)
  raw = builders.raw_leaves(tunix_data / item)
  np.testing.assert_array_equal(jax.random.key_data(key), raw['rngs/params/key/value'])


@pytest.mark.parametrize('zarr3', [False, True])
def test_shape_check_from_one_listing_at_scale(tmp_path, mesh, zarr3, monkeypatch):
  """Past a few hundred leaves shapes are checked against the store's chunk grid."""
  from orbax_tunix.store import item_store

  specs = [P('data', 'model'), P(), P('data'), P(None, 'model')]
  tree = {'layers': {str(i): {'w': {'value': jax.device_put(
      jnp.full((8, 4), i, jnp.float32), NamedSharding(mesh, specs[i % 4]))}} for i in range(300)}}
  item_dir = tmp_path / '1' / 'model_params'
  handler = ocp.PyTreeCheckpointHandler(use_zarr3=zarr3)
  with ocp.Checkpointer(ocp.CompositeCheckpointHandler(model_params=handler)) as ckptr:
    ckptr.save(tmp_path / '1', args=ocp.args.Composite(model_params=ocp.args.PyTreeSave(tree)))
  assert len(item_store.open_item(item_dir).leaves) > item_store.HEADER_READS_UP_TO
  rep = NamedSharding(mesh, P())
  target = {'layers': {
      str(i): {'w': jax.ShapeDtypeStruct((8, 4), jnp.float32, sharding=rep)} for i in range(300)}}
  target['layers']['7']['w'] = jax.ShapeDtypeStruct((4, 8), jnp.float32, sharding=rep)
  target['layers']['9']['w'] = jax.ShapeDtypeStruct((8, 8), jnp.float32, sharding=rep)
  headers_read = []
  read_headers = item_store.Item._read_headers

  def spy(self, paths):
    headers_read.extend(paths)
    return read_headers(self, paths)

  monkeypatch.setattr(item_store.Item, '_read_headers', spy)
  with pytest.raises(ot.TargetMismatchError) as e:
    ot.TunixPyTreeHandler().restore(item_dir, args=ocp.args.PyTreeRestore(item=target))
  # Only the two that do not fit the chunk grid were looked up, for the message.
  assert sorted(headers_read) == [('layers', '7', 'w', 'value'), ('layers', '9', 'w', 'value')]
  assert '2 leaves differ in shape' in str(e.value)
  assert 'layers/7/w: target (4, 8), on disk (8, 4)' in str(e.value)
  assert 'layers/9/w: target (8, 8), on disk (8, 4)' in str(e.value)
  for i in (7, 9):
    target['layers'][str(i)]['w'] = jax.ShapeDtypeStruct((8, 4), jnp.float32, sharding=rep)
  r = ot.TunixPyTreeHandler().restore(item_dir, args=ocp.args.PyTreeRestore(item=target))
  np.testing.assert_array_equal(r['layers']['299']['w'], np.full((8, 4), 299, np.float32))

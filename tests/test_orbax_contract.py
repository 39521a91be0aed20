"""Our handlers where they stand in for Orbax's: the same behaviour, Tunix items aside.

Each test runs one call twice, with Orbax's class and with ours, on the same
checkpoint written by plain Orbax, and compares (or checks the error both
raise). The Tunix cases check the canonical view against a plain Orbax read
of the raw item.
"""

import shutil

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from etils import epath
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import orbax_tunix as ot
from tests import builders


def _leaves(tree):
  flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: x is ocp.PLACEHOLDER)
  return {jax.tree_util.keystr(kp): v for kp, v in flat}


def _same(a, b):
  """Same structure, leaf types, shardings, dtypes and values."""
  la, lb = _leaves(a), _leaves(b)
  assert la.keys() == lb.keys()
  for key, x in la.items():
    y = lb[key]
    assert type(x) is type(y), key
    if isinstance(x, jax.Array):
      assert x.sharding == y.sharding and x.dtype == y.dtype, key
    if x is not ocp.PLACEHOLDER:
      np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=key)


@pytest.fixture
def plain(tmp_path, mesh):
  """A step written by plain Orbax: a sharded PyTree item and a JSON item."""
  sharding = NamedSharding(mesh, P('data', 'model'))
  tree = {
      'w': jax.device_put(jnp.arange(64.0).reshape(8, 8), sharding),
      'b': np.arange(8, dtype=np.int32),
      'nested': {'x': jax.device_put(jnp.ones((4, 2)), NamedSharding(mesh, P('data')))},
  }
  step = tmp_path / '1'
  with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckptr:
    ckptr.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(tree), meta=ocp.args.JsonSave({'lr': 0.1})))
  return step, tree


# --- the composite: constructed and bound as Orbax's ---------------------------


@pytest.mark.parametrize('make', [
    lambda cls: cls('state', 'meta'),
    lambda cls: cls(state=ocp.StandardCheckpointHandler(), meta=ocp.JsonCheckpointHandler()),
    lambda cls: cls(handler_registry=ocp.handlers.DefaultCheckpointHandlerRegistry()),
    lambda cls: cls(),
])
def test_composite_constructors_as_orbax(plain, make):
  step, tree = plain
  args = ocp.args.Composite(state=ocp.args.StandardRestore(), meta=ocp.args.JsonRestore())
  ours = ocp.Checkpointer(make(ot.TunixAwareHandler)).restore(step, args=args)
  theirs = ocp.Checkpointer(make(ocp.CompositeCheckpointHandler)).restore(step, args=args)
  _same(ours['state'], theirs['state'])
  assert ours['meta'] == theirs['meta'] == {'lr': 0.1}


def test_composite_refuses_registry_with_item_names_as_orbax():
  registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
  for cls in (ocp.CompositeCheckpointHandler, ot.TunixAwareHandler):
    with pytest.raises(ValueError, match='Both `handler_registry` and `item_names`'):
      cls('state', handler_registry=registry)


def test_item_stays_bound_to_its_first_handler(tmp_path):
  for cls in (ocp.CompositeCheckpointHandler, ot.TunixAwareHandler):
    ckptr = ocp.Checkpointer(cls())
    ckptr.save(tmp_path / cls.__name__ / 'a', args=ocp.args.Composite(
        state=ocp.args.StandardSave({'a': np.arange(3)})))
    with pytest.raises(ValueError, match='does not match with any registered handler'):
      ckptr.save(tmp_path / cls.__name__ / 'b', args=ocp.args.Composite(
          state=ocp.args.JsonSave({'a': 1})))


def test_directory_without_step_metadata(tmp_path):
  """No _CHECKPOINT_METADATA (a save by the handler alone): restored as Orbax does."""
  tree = {'a': np.arange(4), 'b': {'c': np.ones(2)}}
  path = tmp_path / 'step'
  with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckptr:
    ckptr.save(path, args=ocp.args.Composite(state=ocp.args.StandardSave(tree)))
  (path / '_CHECKPOINT_METADATA').unlink()
  results = {}
  for cls in (ocp.CompositeCheckpointHandler, ot.TunixAwareHandler):
    handler = cls()
    results[cls] = handler.restore(path, args=ocp.args.Composite(state=ocp.args.StandardRestore()))
    assert handler.metadata(path).item_handlers['state'].endswith('StandardCheckpointHandler')
    assert cls().metadata(path).item_handlers == {'state': None}
    # With no args and no recorded handler, both say the item cannot be restored.
    with pytest.raises(ValueError, match='could not be restored'):
      cls().restore(path)
  _same(results[ot.TunixAwareHandler]['state'], results[ocp.CompositeCheckpointHandler]['state'])


def test_empty_step_restores_empty_as_orbax(tmp_path):
  (tmp_path / 'empty').mkdir()
  assert dict(ot.TunixAwareHandler().restore(tmp_path / 'empty')) == {}
  assert dict(ocp.CompositeCheckpointHandler().restore(tmp_path / 'empty')) == {}


def test_missing_item_is_a_key_error_naming_the_step(plain):
  step, _ = plain
  with pytest.raises(KeyError):
    ocp.CompositeCheckpointHandler().restore(step, args=ocp.args.Composite(
        other=ocp.args.PyTreeRestore()))
  with pytest.raises(ot.MissingItemError, match=r"\['other'\] not found") as e:
    ot.TunixAwareHandler().restore(step, args=ocp.args.Composite(other=ocp.args.PyTreeRestore()))
  assert isinstance(e.value, KeyError) and str(step) in str(e.value)


# --- the item handler on plain checkpoints: exactly Orbax's -------------------


def test_standard_restore_without_sharding_takes_the_saved_one(plain):
  """StandardRestore of a target without shardings: jax.Arrays in the saved sharding."""
  step, tree = plain
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)
  ours = ot.TunixPyTreeHandler().restore(step / 'state', args=ocp.args.StandardRestore(abstract))
  theirs = ocp.StandardCheckpointHandler().restore(
      step / 'state', args=ocp.args.StandardRestore(abstract))
  _same(ours, theirs)
  assert isinstance(ours['w'], jax.Array) and ours['w'].sharding == tree['w'].sharding


def test_standard_restore_fallback_sharding_on_topology_mismatch(plain, mesh, monkeypatch):
  step, _ = plain
  fallback = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  one_device = jax.devices()[:1]
  monkeypatch.setattr(jax, 'devices', lambda *a: one_device)
  for handler in (ocp.StandardCheckpointHandler(), ot.TunixPyTreeHandler()):
    with pytest.raises(ValueError, match='Topology mismatch detected'):
      handler.restore(step / 'state', args=ocp.args.StandardRestore())
    restored = handler.restore(step / 'state', args=ocp.args.StandardRestore(
        fallback_sharding=fallback))
    assert restored['w'].sharding == fallback


def test_standard_restore_rejects_unsupported_target_types(plain):
  step, tree = plain
  target = dict(tree, w='not an array')
  for handler in (ocp.StandardCheckpointHandler(), ot.TunixPyTreeHandler()):
    with pytest.raises(ValueError, match='Unsupported type'):
      handler.restore(step / 'state', args=ocp.args.StandardRestore(target))


def test_placeholder_target_without_restore_args_as_orbax(plain):
  step, tree = plain
  target = {'w': 0, 'b': ocp.PLACEHOLDER, 'nested': {'x': ocp.PLACEHOLDER}}
  ours = ot.TunixPyTreeHandler().restore(step / 'state', args=ocp.args.PyTreeRestore(target))
  theirs = ocp.PyTreeCheckpointHandler().restore(step / 'state', args=ocp.args.PyTreeRestore(target))
  _same(ours, theirs)
  assert ours['b'] is ocp.PLACEHOLDER


def test_legacy_transform_options_reach_orbax(plain):
  """transforms and transforms_default_to_original are passed on, not rebuilt."""
  step, tree = plain
  target = {'w': np.zeros((8, 8)), 'renamed': np.zeros(8, np.int32), 'nested': {'x': np.zeros((4, 2))}}
  transforms = {'renamed': ocp.Transform(original_key='b')}
  args = ocp.args.PyTreeRestore(
      item=target, transforms=transforms, transforms_default_to_original=True,
      restore_args=jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), target))
  ours = ot.TunixPyTreeHandler().restore(step / 'state', args=args)
  theirs = ocp.PyTreeCheckpointHandler().restore(step / 'state', args=args)
  _same(ours, theirs)
  np.testing.assert_array_equal(ours['renamed'], tree['b'])


def test_missing_directory_is_file_not_found(tmp_path):
  for handler in (ot.TunixPyTreeHandler(), ot.TunixAwareHandler()):
    with pytest.raises(FileNotFoundError) as e:
      handler.restore(tmp_path / 'nothing')
    assert isinstance(e.value, ot.NotACheckpointError) and 'nothing' in str(e.value)


# --- the same requests on a Tunix item: canonical ------------------------------


def _raw_canonical(item_dir):
  """The raw Tunix leaves read by plain Orbax, keyed by hand-stripped canonical path."""
  return {k[: -len('/value')]: v for k, v in builders.raw_leaves(item_dir).items()}


def test_tunix_standard_restore_without_sharding(tunix_data):
  item_dir = tunix_data / 'sft_full' / '2' / 'model_params'
  raw = _raw_canonical(item_dir)
  abstract = {}
  for path, value in raw.items():
    node = abstract
    *parents, last = path.split('/')
    for key in parents:
      node = node.setdefault(key, {})
    node[last] = jax.ShapeDtypeStruct(value.shape, value.dtype)
  restored = ot.TunixPyTreeHandler().restore(item_dir, args=ocp.args.StandardRestore(abstract))
  flat = {'/'.join(str(k.key) for k in kp): v
          for kp, v in jax.tree_util.tree_flatten_with_path(restored)[0]}
  assert flat.keys() == raw.keys()
  for path, value in flat.items():
    assert isinstance(value, jax.Array), path  # sharding from the checkpoint's metadata
    np.testing.assert_array_equal(np.asarray(value), raw[path], err_msg=path)


def test_tunix_placeholders_are_not_read(tunix_data, tmp_path, mesh):
  item_dir = tmp_path / 'model_params'
  shutil.copytree(tunix_data / 'sft_full' / '2' / 'model_params', item_dir)
  raw = _raw_canonical(item_dir)
  s = NamedSharding(mesh, P())
  target = {'embedder': {'embedding': jax.ShapeDtypeStruct(
      raw['embedder/embedding'].shape, jnp.float32, sharding=s)},
            'final_norm': {'scale': ocp.PLACEHOLDER}}
  restored = ot.TunixPyTreeHandler().restore(item_dir, args=ocp.args.PyTreeRestore(target))
  assert restored['final_norm']['scale'] is ocp.PLACEHOLDER
  assert restored['embedder']['embedding'].sharding == s
  np.testing.assert_array_equal(restored['embedder']['embedding'],
                                raw['embedder/embedding'])


def test_empty_transforms_mean_none(tunix_data, mesh):
  """MaxText passes transforms={} (asking for a partial restore): nothing to transform."""
  item_dir = tunix_data / 'sft_full' / '2' / 'model_params'
  raw = _raw_canonical(item_dir)
  s = NamedSharding(mesh, P())
  target = {'final_norm': {'scale': jax.ShapeDtypeStruct(raw['final_norm/scale'].shape,
                                                         jnp.float32, sharding=s)}}
  restored = ot.TunixPyTreeHandler().restore(
      item_dir, item=target, transforms={},
      restore_args=ocp.checkpoint_utils.construct_restore_args(target))
  np.testing.assert_array_equal(restored['final_norm']['scale'], raw['final_norm/scale'])
  with pytest.raises(ot.UnsupportedLayoutError, match='legacy `transforms`'):
    ot.TunixPyTreeHandler().restore(item_dir, item=target, transforms={
        'final_norm': {'scale': ocp.Transform(original_key='x')}})


def test_composite_reads_tunix_items_through_the_registered_handler(tunix_data):
  """A user's handler (and its options) does the reading; the view is canonical."""
  calls = []

  class Counting(ocp.PyTreeCheckpointHandler):
    def restore(self, directory, *args, **kwargs):
      calls.append(epath.Path(directory).name)
      return super().restore(directory, *args, **kwargs)

  registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
  handler = Counting(restore_concurrent_gb=1)
  registry.add('model_params', ocp.args.PyTreeRestore, handler)
  step = tunix_data / 'sft_full' / '2'
  restored = ocp.Checkpointer(ot.TunixAwareHandler(handler_registry=registry)).restore(
      step, args=ocp.args.Composite(model_params=ocp.args.PyTreeRestore()))
  assert calls == ['model_params']
  raw = _raw_canonical(step / 'model_params')
  got = {'/'.join(str(k.key) for k in kp): v
         for kp, v in jax.tree_util.tree_flatten_with_path(restored['model_params'])[0]}
  assert got.keys() == raw.keys()


def test_caller_errors_reach_the_caller_as_orbax_raised_them(tunix_data, mesh):
  """A sharding that does not divide the array is the caller's error, not damage."""
  item_dir = tunix_data / 'sft_full' / '2' / 'model_params'
  shape = _raw_canonical(item_dir)['embedder/embedding'].shape  # (16, 8)
  three = jax.sharding.Mesh(np.array(jax.devices()[:3]), ('x',))
  bad = NamedSharding(three, P(None, 'x'))  # 3 does not divide 8
  target = {'embedder': {'embedding': jax.ShapeDtypeStruct(shape, jnp.float32,
                                                                 sharding=bad)}}
  with pytest.raises(ValueError) as e:
    ot.TunixPyTreeHandler().restore(item_dir, args=ocp.args.PyTreeRestore(target))
  assert not isinstance(e.value, ot.TunixCheckpointError), e.value


def test_damaged_data_is_reported_as_such(tunix_data, tmp_path, mesh):
  step = tmp_path / '2'
  shutil.copytree(tunix_data / 'sft_full' / '2', step)
  for data in (step / 'model_params' / 'd').iterdir():
    data.write_bytes(data.read_bytes()[:100])
  with pytest.raises(ot.CorruptMetadataError, match='stored data is missing or damaged') as e:
    ocp.Checkpointer(ot.TunixAwareHandler()).restore(step)
  assert str(step / 'model_params') in str(e.value)


def _unrestorable_warnings(caplog):
  return [r.getMessage() for r in caplog.records if 'could not be restored' in r.getMessage()]


def test_no_warning_that_restorable_items_cannot_be_restored(tunix_data, plain, caplog):
  """Orbax's composite warns "could not be restored" for every item without a bound
  handler, also those it then restores by their recorded handler; ours only for
  items that no handler can restore."""
  step, _ = plain
  caplog.set_level('WARNING')
  for path in (tunix_data / 'adapter_inject_clip' / '1', step):
    ocp.Checkpointer(ot.TunixAwareHandler()).restore(path)
    ot.TunixAwareHandler().metadata(path)
  assert _unrestorable_warnings(caplog) == []
  # The same calls with Orbax's own class do log it: the check can fail.
  ocp.Checkpointer(ocp.CompositeCheckpointHandler()).restore(step)
  assert _unrestorable_warnings(caplog)
  caplog.clear()
  # An item no handler can restore keeps Orbax's warning (and Orbax's error).
  meta_file = step / '_CHECKPOINT_METADATA'
  meta = meta_file.read_text().replace(
      ocp.JsonCheckpointHandler.typestr(), 'some.unknown.Handler')
  meta_file.write_text(meta)
  with pytest.raises(ValueError, match='could not be restored'):
    ocp.CompositeCheckpointHandler().restore(step)
  caplog.clear()
  with pytest.raises(ValueError, match='could not be restored'):
    ot.TunixAwareHandler().restore(step)
  ot.TunixAwareHandler().metadata(step)
  found = _unrestorable_warnings(caplog)
  assert found and all('"meta"' in m for m in found), found


def test_tunix_standard_restore_on_another_topology_is_orbaxs_error(tmp_path, mesh, monkeypatch):
  """A Tunix item saved sharded over 8 devices, restored without a target where
  fewer devices exist: Orbax's 'Topology mismatch' (pass a target with
  shardings), for the canonical tree as for a plain one; with a fallback
  sharding it restores."""
  sharding = NamedSharding(mesh, P('data', 'model'))
  state = {'layers': {'0': {'w': {'value': jax.device_put(jnp.arange(64.0).reshape(8, 8), sharding)}}}}
  step = tmp_path / '1'
  with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckptr:
    ckptr.save(step, args=ocp.args.Composite(model_params=ocp.args.PyTreeSave(state)))
  one_device = jax.devices()[:1]
  monkeypatch.setattr(jax, 'devices', lambda *a: one_device)
  item = step / 'model_params'
  with pytest.raises(ValueError, match='Topology mismatch detected'):
    ocp.StandardCheckpointHandler().restore(item, args=ocp.args.StandardRestore())
  for restore in (
      lambda **kw: ot.TunixPyTreeHandler().restore(item, args=ocp.args.StandardRestore(**kw)),
      lambda **kw: ocp.Checkpointer(ot.TunixAwareHandler()).restore(step, args=ocp.args.Composite(
          model_params=ocp.args.StandardRestore(**kw)))['model_params'],
  ):
    with pytest.raises(ValueError, match='Topology mismatch detected'):
      restore()
    fallback = jax.sharding.SingleDeviceSharding(one_device[0])
    got = restore(fallback_sharding=fallback)
    assert got['layers']['0']['w'].sharding == fallback  # canonical: no `value` level
    np.testing.assert_array_equal(got['layers']['0']['w'], np.arange(64.0).reshape(8, 8))


def test_no_args_restores_as_the_saving_handler_does(plain, mesh, monkeypatch):
  """Nothing asked for: an item saved by StandardCheckpointHandler restores as that
  handler restores it (Orbax's topology check on another topology, not a sharding
  error from the PyTree path)."""
  step, tree = plain
  with ocp.Checkpointer(ocp.StandardCheckpointHandler()) as ckptr:
    ckptr.save(step.parent / 'alone', args=ocp.args.StandardSave(tree))
  for directory in (step / 'state', step.parent / 'alone'):
    _same(ot.TunixPyTreeHandler().restore(directory),
          ocp.StandardCheckpointHandler().restore(directory))
  one_device = jax.devices()[:1]
  monkeypatch.setattr(jax, 'devices', lambda *a: one_device)
  for directory in (step / 'state', step.parent / 'alone'):
    for handler in (ocp.StandardCheckpointHandler(), ot.TunixPyTreeHandler()):
      with pytest.raises(ValueError, match='Topology mismatch detected'):
        handler.restore(directory)
  # No step metadata says which handler saved it: the same message.
  (step.parent / 'alone' / '_CHECKPOINT_METADATA').unlink()
  with pytest.raises(ValueError, match='Topology mismatch detected'):
    ot.TunixPyTreeHandler().restore(step.parent / 'alone')

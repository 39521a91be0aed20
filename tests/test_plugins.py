"""Plugging in: CheckpointManager registry, Orbax v1, entry points, examples."""

import importlib.metadata
import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import orbax_tunix as ot
from tests import builders

ROOT = builders.pathlib.Path(__file__).resolve().parents[1]


def _manager(root):
  return ocp.CheckpointManager(
      root, options=ocp.CheckpointManagerOptions(read_only=True),
      handler_registry=ot.handler_registry())


@pytest.mark.parametrize('name', ['sft_full', 'v1_writer'])
def test_checkpoint_manager_lists_and_restores(tunix_data, name):
  mngr = _manager(tunix_data / name)
  assert mngr.all_steps() == [1, 2]
  restored = mngr.restore(2)
  assert set(restored.keys()) == {'model_params', 'optimizer_state'}
  raw = builders.raw_leaves(tunix_data / name / '2' / 'model_params')
  np.testing.assert_array_equal(
      restored['model_params']['layers']['1']['attn']['q_proj']['w'],
      raw['layers/1/attn/q_proj/w/value'])
  assert restored['optimizer_state']['step'].dtype == np.uint32  # no 'value' level
  mngr.close()


def test_checkpoint_manager_with_args(tunix_data, mesh):
  mngr = _manager(tunix_data / 'sft_full')
  s = NamedSharding(mesh, P('data'))
  target = {'embedder': {'embedding': jax.ShapeDtypeStruct((16, 8), jnp.bfloat16, sharding=s)}}
  for args in (ocp.args.PyTreeRestore(item=target), ocp.args.StandardRestore(target)):
    r = mngr.restore(1, args=ocp.args.Composite(model_params=args))
    e = r['model_params']['embedder']['embedding']
    assert e.dtype == jnp.bfloat16 and e.sharding == s
  mngr.close()


def _ours_in_v1_registry():
  entries = ocp.v1.handlers.global_registry().get_all_entries()
  return [e for e in entries if e[0] is ot.handlers.plugins.TunixV1PyTreeHandler]


def test_register_is_idempotent_and_v1_loads_canonical(tunix_data, mesh):
  ot.register()
  once = _ours_in_v1_registry()
  ot.register()
  ot.load_plugins()  # Runs register() again, through the entry point.
  assert len(once) == 1 and _ours_in_v1_registry() == once
  for name in ('v1_writer', 'adapter_inject'):
    step_dir = ot.detect(tunix_data / name).step_dir
    state = ocp.v1.load_checkpointables(step_dir)
    assert set(state) == {'model_params', 'optimizer_state'}
    paths = [jax.tree_util.keystr(kp) for kp, _ in jax.tree_util.tree_leaves_with_path(state)]
    assert not any("'value'" in p or "'base'" in p or 'inner_state' in p for p in paths)
  s = NamedSharding(mesh, P('data', 'model'))
  abstract = {'layers': {'0': {'attn': {'q_proj': {'w': jax.ShapeDtypeStruct((8, 8), jnp.float32, sharding=s)}}}}}
  params = ocp.v1.load_checkpointables(
      tunix_data / 'adapter_inject' / '1', {'model_params': abstract})['model_params']
  w = params['layers']['0']['attn']['q_proj']['w']
  assert w.sharding == s
  raw = builders.raw_leaves(tunix_data / 'adapter_inject' / '1' / 'model_params')
  np.testing.assert_array_equal(w, raw['base/layers/0/attn/q_proj/w/value'])


def test_v1_leaves_other_checkpoints_alone(tmp_path):
  ot.register()
  tree = {'a': {'value': np.arange(3, dtype=np.float32)}}
  ocp.v1.save_checkpointables(tmp_path / 'ckpt', {'state': tree})
  loaded = ocp.v1.load_checkpointables(tmp_path / 'ckpt')
  np.testing.assert_array_equal(loaded['state']['a']['value'], tree['a']['value'])


def test_entry_point_declared_and_loaded():
  eps = importlib.metadata.entry_points(group=ot.handlers.plugins.ENTRY_POINT_GROUP)
  assert 'tunix' in [e.name for e in eps]
  assert next(e for e in eps if e.name == 'tunix').value == 'orbax_tunix:register'
  assert 'tunix' in ot.load_plugins()


def _run_example(example, tmp_path, stderr=None):
  out = subprocess.run(
      [sys.executable, str(ROOT / 'examples' / example)],
      cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False)
  assert out.returncode == 0, out.stderr[-3000:]
  if stderr is not None:
    stderr.append(out.stderr)
  return out.stdout


def test_quickstart_example(tunix_data, tmp_path):
  stderr = []
  out = _run_example('quickstart.py', tmp_path, stderr)
  # The main job succeeds and says nothing that reads as a failure.
  assert stderr == [''], stderr[0][-3000:]
  step = tunix_data / 'adapter_inject_clip' / '1'
  model = builders.raw_leaves(step / 'model_params')
  opt = builders.raw_leaves(step / 'optimizer_state')
  # The canonical optimizer state: the raw leaves but the inject shell's own.
  shell = [k for k in opt if k.startswith(('opt_state/1/hyperparams/', 'opt_state/1/count/'))]
  assert 'adapter_inject_clip/1' in out and 'tunix checkpoint, step 1' in out
  assert f'restored model_params: {len(model)} arrays, {sum(v.nbytes for v in model.values())} bytes' in out
  assert f'restored optimizer_state: {len(opt) - len(shell)} arrays' in out
  assert 'learning_rate=0.001' in out and 'b1=0.9' in out


def test_checkpoint_manager_example(tmp_path):
  out = _run_example('checkpoint_manager.py', tmp_path)
  assert 'steps [1, 2], restoring 2' in out
  lines = [line for line in out.splitlines() if line.startswith("  [")]
  assert len(lines) == 5 and all("bfloat16" in line for line in lines)
  assert "['model_params', 'optimizer_state']" in out


def test_v1_example(tunix_data, tmp_path):
  out = _run_example('v1_load.py', tmp_path)
  assert "'tunix'" in out.splitlines()[0]
  for item in ('model_params', 'optimizer_state'):
    raw = builders.raw_leaves(tunix_data / 'v1_writer' / '2' / item)
    assert f'{item}: {len(raw)} leaves' in out


def test_lora_merge_example(tunix_data, tmp_path):
  out = _run_example('lora_merge.py', tmp_path)
  base = builders.raw_leaves(tunix_data / 'lora_base' / '1' / 'model_params')
  assert f': {len(base)} weights' in out.splitlines()[0]
  q = next(line for line in out.splitlines() if 'layers/1/attn/q_proj/w ' in line)
  assert "bfloat16 (8, 8) P(None, 'model')" in q


def test_qlora_example_reads_a_qlora_run_dequantized_and_merged(tmp_path):
  out = _run_example('qlora.py', tmp_path)
  assert 'dequantized layers/0/mlp/up_proj/kernel: bfloat16 (40, 56)' in out
  assert '74 weights of the plain model' in out


def test_saves_are_ordinary_checkpoints(tmp_path):
  """Saved through our registry or composite, a step restores without orbax_tunix."""

  tree = {'w': np.arange(4, dtype=np.float32)}
  mngr = ocp.CheckpointManager(tmp_path / 'mngr', handler_registry=ot.handler_registry())
  mngr.save(1, args=ocp.args.Composite(model_params=ocp.args.PyTreeSave(tree)))
  mngr.wait_until_finished()
  mngr.close()
  ocp.Checkpointer(ot.TunixAwareHandler()).save(
      tmp_path / 'ckptr' / '1', args=ocp.args.Composite(model_params=ocp.args.PyTreeSave(tree)))
  for root in ('mngr', 'ckptr'):
    meta = json.loads((tmp_path / root / '1' / '_CHECKPOINT_METADATA').read_text())
    assert meta['item_handlers'] == {'model_params': ocp.PyTreeCheckpointHandler.typestr()}
    code = (
        'import sys, orbax.checkpoint as ocp\n'
        f'r = ocp.CheckpointManager({str(tmp_path / root)!r}).restore(1)\n'
        "assert 'orbax_tunix' not in sys.modules\n"
        "print(r['model_params']['w'].tolist())\n")
    out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True,
                         timeout=120, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().endswith('[0.0, 1.0, 2.0, 3.0]')


def test_manager_that_saved_restores_as_saved_then_canonical_once_reopened(tmp_path, mesh):
  """Orbax's composite serves an item with the handler that saved it for the
  rest of the manager's life (the tree as saved); a manager opened on the
  step restores it canonically, with args or without."""
  from flax import nnx  # pylint: disable=g-import-not-at-top

  model = builders.Model(nnx.Rngs(3))
  canonical = {'/'.join(map(str, path)): np.asarray(variable[...])
               for path, variable in nnx.to_flat_state(nnx.state(model))}
  raw = {f'{path}/value': value for path, value in canonical.items()}  # nnx's value level
  replicated = NamedSharding(mesh, P())
  abstract = ot.keypaths.nest(
      (tuple(path.split('/')), jax.ShapeDtypeStruct(v.shape, jnp.bfloat16, sharding=replicated))
      for path, v in canonical.items())
  with ocp.CheckpointManager(tmp_path, handler_registry=ot.handler_registry()) as mngr:
    mngr.save(1, args=ocp.args.Composite(model_params=ocp.args.PyTreeSave(nnx.state(model))))
    mngr.wait_until_finished()
    as_saved = mngr.restore(1)['model_params']
  with _manager(tmp_path) as mngr:
    without_args = mngr.restore(1)['model_params']
  with _manager(tmp_path) as mngr:
    with_args = mngr.restore(1, args=ocp.args.Composite(
        model_params=ocp.args.PyTreeRestore(item=abstract)))['model_params']
  for restored, expected, dtype in ((as_saved, raw, np.float32),
                                    (without_args, canonical, np.float32),
                                    (with_args, canonical, jnp.bfloat16)):
    got = {ot.keypaths.fmt(p): v for p, v in ot.keypaths.flat_dict(restored).items()}
    assert set(got) == set(expected)
    for path, value in got.items():
      assert value.dtype == dtype, path
      np.testing.assert_array_equal(np.asarray(value), expected[path].astype(dtype))
  assert with_args['head']['kernel'].sharding == replicated


def test_v1_written_step_through_v0_apis(tunix_data):
  """Orbax's v0 composite has no handler for v1's typestr; ours fills the gap."""
  mngr = ocp.CheckpointManager(
      tunix_data / 'v1_writer', options=ocp.CheckpointManagerOptions(read_only=True),
      handler_registry=ot.handler_registry())
  r = mngr.restore(1)
  assert 'layers' in r['model_params'] and 'opt_state' in r['optimizer_state']
  mngr.close()


def test_public_api_is_one_list():
  """__all__, the package docstring and docs/api.md's table name the same things."""
  import pkgutil
  import re

  exported = set(ot.__all__)
  # Every public name but the package's own modules (`maxtext` is exported).
  submodules = {m.name for m in pkgutil.iter_modules(ot.__path__)} - {'maxtext'}
  assert exported == {n for n in dir(ot) if not n.startswith('_')} - submodules
  doc = {m for m in re.findall(r'\b([A-Za-z_]+)\b', ot.__doc__.split('::')[1]) if m in dir(ot)}
  assert doc | {'Detection'} == exported | {'detect'}  # Detection: what detect returns.
  table = (ROOT / 'docs' / 'api.md').read_text().split('# Public API')[1].split('\n## ')[0]
  rows = [line.split('|')[1] for line in table.splitlines() if line.startswith('| `')]
  named = set(re.findall(r'`([A-Za-z_]+)', ''.join(rows)))
  assert named == exported, named ^ exported
  maxtext_row = next(line for line in table.splitlines() if line.startswith('| `maxtext`'))
  assert set(re.findall(r'`([A-Za-z_]+)`', maxtext_row.split('|')[2])) == set(ot.maxtext.__all__)



# --- targets that already have the on-disk shape: Orbax's, unchanged ------------------------


class _MLP(nnx.Module):
  """A model as flax's checkpointing guide saves one: Linear layers and a BatchNorm."""

  def __init__(self, rngs):
    self.l1 = nnx.Linear(4, 16, rngs=rngs)
    self.l2 = nnx.Linear(16, 8, rngs=rngs)
    self.bn = nnx.BatchNorm(8, rngs=rngs)


def _flax_target(mesh):
  """flax's documented restore target: `nnx.split` of `nnx.eval_shape`, shardings attached."""
  _, abstract = nnx.split(nnx.eval_shape(lambda: _MLP(nnx.Rngs(0))))
  def sharded(x):
    spec = P('data', 'model') if len(x.shape) == 2 else P('model')
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, spec))
  return jax.tree.map(sharded, abstract)


def _assert_same(got, want, what):
  """Tree structure, values, dtypes and shardings as plain Orbax restored them."""
  assert jax.tree.structure(got) == jax.tree.structure(want), what
  for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(want),
                          strict=True):
    where = f'{what}: {jax.tree_util.keystr(path)}'
    assert isinstance(a, jax.Array) and a.dtype == b.dtype, where
    assert a.sharding == b.sharding, where
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=where)


@pytest.fixture(scope='module')
def flax_state(tmp_path_factory):
  """A plain flax nnx checkpoint (not Tunix's): the guide's StandardCheckpointer save, and
  a CheckpointManager step of the same state."""
  root = tmp_path_factory.mktemp('flax')
  _, state = nnx.split(_MLP(nnx.Rngs(0)))
  with ocp.StandardCheckpointer() as ckptr:
    ckptr.save(root / 'state', state)
  with ocp.CheckpointManager(root / 'run') as mngr:
    mngr.save(1, args=ocp.args.StandardSave(state))
  return root


def test_a_flax_nnx_checkpoint_restores_as_with_plain_orbax(flax_state, mesh):
  target = _flax_target(mesh)
  plain = ocp.StandardCheckpointer().restore(flax_state / 'state', target)
  assert isinstance(plain, nnx.State)
  item = flax_state / 'run' / '1' / 'default'

  def single(handler, path, args):
    return ocp.Checkpointer(handler).restore(path, args=args)

  def composite(handler, args):
    return ocp.Checkpointer(handler).restore(item.parent, args=ocp.args.Composite(
        default=args))['default']

  def manager(**kwargs):
    return ocp.CheckpointManager(flax_state / 'run', **kwargs).restore(
        1, args=ocp.args.StandardRestore(target))

  standard, pytree = ocp.args.StandardRestore(target), ocp.args.PyTreeRestore(target)
  # (ours, plain Orbax's same call)
  cases = {
      'TunixPyTreeHandler StandardRestore': (
          lambda: single(ot.TunixPyTreeHandler(), flax_state / 'state', standard),
          lambda: single(ocp.StandardCheckpointHandler(), flax_state / 'state', standard)),
      'TunixPyTreeHandler PyTreeRestore': (
          lambda: single(ot.TunixPyTreeHandler(), item, pytree),
          lambda: single(ocp.PyTreeCheckpointHandler(), item, pytree)),
      'TunixAwareHandler StandardRestore': (
          lambda: composite(ot.TunixAwareHandler(), standard),
          lambda: composite(ocp.CompositeCheckpointHandler(), standard)),
      'TunixAwareHandler PyTreeRestore': (
          lambda: composite(ot.TunixAwareHandler(), pytree),
          lambda: composite(ocp.CompositeCheckpointHandler(), pytree)),
      'CheckpointManager(handler_registry)': (
          lambda: manager(handler_registry=ot.handler_registry()), manager),
  }
  for what, (ours, orbax) in cases.items():
    _assert_same(ours(), orbax(), what)
  ot.register()  # As load_plugins() does for any trainer.
  _assert_same(ocp.v1.load_pytree(flax_state / 'state', target), plain, 'v1 load_pytree')
  _assert_same(ocp.v1.load_checkpointables(item.parent, {'default': target})['default'], plain,
               'v1 load_checkpointables')


def test_a_tunix_item_with_an_on_disk_target_restores_as_with_plain_orbax(tunix_data, mesh):
  """The on-disk tree (with its nnx `value` levels) as the target: no rewrite."""
  step = tunix_data / 'sft_full' / '2'
  stored = ocp.PyTreeCheckpointHandler().metadata(step / 'model_params').tree
  cpu = NamedSharding(mesh, P())
  target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=cpu), stored)
  assert 'value' in jax.tree_util.keystr(jax.tree_util.tree_flatten_with_path(target)[0][0][0])
  plain = ocp.Checkpointer(ocp.PyTreeCheckpointHandler()).restore(
      step / 'model_params', args=ocp.args.PyTreeRestore(target))
  _assert_same(ocp.Checkpointer(ot.TunixPyTreeHandler()).restore(
      step / 'model_params', args=ocp.args.PyTreeRestore(target)), plain, 'TunixPyTreeHandler')
  _assert_same(ocp.Checkpointer(ot.TunixAwareHandler()).restore(step, args=ocp.args.Composite(
      model_params=ocp.args.PyTreeRestore(target)))['model_params'], plain, 'TunixAwareHandler')
  ot.register()  # v1 reads into the target's shardings, as StandardRestore does.
  _assert_same(ocp.v1.load_checkpointables(step, {'model_params': target})['model_params'],
               ocp.Checkpointer(ocp.StandardCheckpointHandler()).restore(
                   step / 'model_params', args=ocp.args.StandardRestore(target)), 'v1')
  # The canonical target (no `value` level) still reads the same arrays.
  canonical = ocp.Checkpointer(ot.TunixPyTreeHandler()).restore(step / 'model_params')
  flat = {jax.tree_util.keystr(p): v for p, v in jax.tree_util.tree_flatten_with_path(plain)[0]}
  for p, v in jax.tree_util.tree_flatten_with_path(canonical)[0]:
    name = jax.tree_util.keystr(p)
    np.testing.assert_array_equal(np.asarray(v), np.asarray(flat[name + "['value']"]))

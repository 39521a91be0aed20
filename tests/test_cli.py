"""The `orbax-tunix` command line: inspect, convert and diff, as a user runs them."""

from __future__ import annotations

import importlib.metadata
import io
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

import orbax_tunix
from orbax_tunix import cli
from orbax_tunix.cli import display, progress
from orbax_tunix.cli import flags as cli_flags
from orbax_tunix.keypaths import flat_dict, fmt
from orbax_tunix.reading import memory, reader
from orbax_tunix.store import step_store
from orbax_tunix.tools import convert, inspection
from tests import builders, test_handlers

FIXTURES = tuple(test_handlers.FIXTURES)
REPO = pathlib.Path(__file__).resolve().parent.parent
# The subprocesses run on one CPU device, away from the test's 8 fake ones.
SUBPROCESS_ENV = {
    **{k: v for k, v in os.environ.items() if k != 'XLA_FLAGS'},
    'JAX_PLATFORMS': 'cpu',
}


def run(capsys, *argv: str) -> tuple[int, str, str]:
  """Runs the CLI in-process; returns (exit status, stdout, stderr)."""
  status = cli.main([str(a) for a in argv])
  captured = capsys.readouterr()
  return status, captured.out, captured.err


def plain(value):
  """A restored leaf as a numpy array (PRNG keys as their key data)."""
  if isinstance(value, jax.Array) and jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key):
    value = jax.random.key_data(value)
  return np.asarray(value)


def canonical_source(step_dir: pathlib.Path, name: str) -> dict[str, dict[str, np.ndarray]]:
  """Every item of fixture `name`'s step in canonical form, independently of the package:
  raw leaves read by plain Orbax, under paths derived by hand (`test_handlers`)."""
  spec = test_handlers.SPECS.get(name, {})
  return {
      item: test_handlers.expected_leaves(step_dir, item, spec)
      for item in ('model_params', 'optimizer_state')
  }


def plain_orbax_restore(step_dir: pathlib.Path) -> dict[str, dict[str, np.ndarray]]:
  """Every item of a step, read by plain Orbax with no arguments."""
  with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckptr:
    restored = ckptr.restore(step_dir)
  return {item: {fmt(p): plain(v) for p, v in flat_dict(tree).items()} for item, tree in restored.items()}


def write_big_checkpoint(root: pathlib.Path, n_leaves: int, leaf_mib: int) -> pathlib.Path:
  """A Tunix-layout step of incompressible float32 arrays; returns the step dir."""
  rng = np.random.default_rng(0)
  side = int((leaf_mib * 2**20 // 4) ** 0.5)

  def noise():
    # Random bytes, not random normals: fast, and zstd cannot shrink them.
    return np.frombuffer(rng.bytes(side * side * 4), np.float32).reshape(side, side).copy()

  params = {'layers': {str(i): {'w': {'value': jax.numpy.asarray(noise())}} for i in range(n_leaves)}}
  params['rngs'] = {'default': {'count': {'value': jax.numpy.uint32(1)}}}
  step_dir = root / '1'
  with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckptr:
    ckptr.save(step_dir, args=ocp.args.Composite(model_params=ocp.args.PyTreeSave(params)))
  return step_dir


@pytest.fixture(scope='module')
def big_checkpoint(tmp_path_factory) -> pathlib.Path:
  """About 200 MiB of array data in 50 leaves (written once per module)."""
  return write_big_checkpoint(tmp_path_factory.mktemp('big'), n_leaves=50, leaf_mib=4)


# --- inspect ----------------------------------------------------------------


@pytest.mark.parametrize('name', FIXTURES)
def test_inspect_every_fixture(capsys, tunix_data, name):
  status, out, err = run(capsys, 'inspect', tunix_data / name)
  assert status == 0, err
  assert 'kind        Tunix' in out
  assert 'model_params: ' in out and 'Totals' in out
  assert 'nnx_value' in out


@pytest.mark.parametrize('name', FIXTURES)
def test_inspect_json_leaves_are_the_canonical_metadata(capsys, tunix_data, name):
  status, out, _ = run(capsys, 'inspect', tunix_data / name, '--json')
  assert status == 0
  doc = json.loads(out)
  step_dir = pathlib.Path(doc['step_dir'])
  for item, body in doc['items'].items():
    meta = flat_dict(orbax_tunix.TunixPyTreeHandler().metadata(step_dir / item).tree)
    expected = {
        fmt(p): {
            'shape': list(m.shape),
            'dtype': str(np.dtype(m.dtype)),
            'bytes': int(np.prod(m.shape)) * np.dtype(m.dtype).itemsize,
        }
        for p, m in meta.items()
    }
    assert body['leaves'] == expected
    assert body['bytes'] == sum(leaf['bytes'] for leaf in expected.values())
  assert doc['bytes'] == sum(body['bytes'] for body in doc['items'].values())


def test_inspect_shows_steps_rewrites_hyperparameters(capsys, tunix_data):
  _, out, _ = run(capsys, 'inspect', tunix_data / 'adapter_inject', '--json')
  doc = json.loads(out)
  rewrites = doc['items']['optimizer_state']['rewrites']
  assert [r['rule'] for r in rewrites] == ['nnx_value', 'inject_hyperparams', 'adapter_base']
  # Each says what it undoes, in words of its own.
  assert "'value'" in rewrites[0]['description']
  assert 'inject_hyperparams' in rewrites[1]['description']
  assert "'base'" in rewrites[2]['description']
  hp = doc['hyperparameters']['opt_state']
  assert hp['b1'] == pytest.approx(0.9) and hp['learning_rate'] == pytest.approx(1e-3)
  outline = {row['path']: row['description'] for row in doc['optimizer']['outline']}
  assert outline['opt_state/0/mu'].startswith('mirrors the weights (14 of 14')
  assert 'inject_hyperparams' in outline['opt_state']
  _, out, _ = run(capsys, 'inspect', tunix_data / 'sft_full', '--json')
  doc = json.loads(out)
  assert [(s['step'], s['committed']) for s in doc['steps']] == [(1, True), (2, True)]
  assert doc['step'] == 2


def test_inspect_lora(capsys, tunix_data):
  _, out, _ = run(capsys, 'inspect', tunix_data / 'lora_qwix', '--json')
  lora = json.loads(out)['lora']
  assert lora['style'] == 'qwix' and lora['ranks'] == [2]
  assert lora['base_weights'] is False
  assert lora['targets'] == [
      'layers/0/attn/k_proj/kernel',
      'layers/0/attn/q_proj/w',
      'layers/1/attn/k_proj/kernel',
      'layers/1/attn/q_proj/w',
  ]
  _, out, _ = run(capsys, 'inspect', tunix_data / 'lora_qwix')
  assert 'rank          2' in out and 'not saved (adapters only)' in out
  assert 'export --peft --lora-alpha A' in out and '--merge-lora --lora-alpha A --base BASE' in out
  _, out, _ = run(capsys, 'inspect', tunix_data / 'lora_qwix_full')
  assert 'export --peft --lora-alpha A' in out and '--base-only' in out


def test_inspect_of_flax_adapters_suggests_no_alpha(capsys, tunix_data, tmp_path):
  """flax's nnx.LoRA has no alpha: the merge and --peft refuse --lora-alpha for it, so
  inspect suggests the merge without it, and that suggestion runs."""
  _, out, _ = run(capsys, 'inspect', tunix_data / 'lora_flax')
  assert 'style         flax' in out, out
  assert '--merge-lora (the merged model)' in out and '--lora-alpha' not in out, out
  status, _, err = run(capsys, 'convert', tunix_data / 'lora_flax', tmp_path / 'm' / '1',
                       '--merge-lora')
  assert status == 0, err


def test_inspect_collapses_layers_on_request(capsys, tunix_data):
  _, full, _ = run(capsys, 'inspect', tunix_data / 'sft_full')
  assert 'layers/1/attn/q_proj/w' in full  # Piped: every leaf.
  _, folded, _ = run(capsys, 'inspect', tunix_data / 'sft_full', '--collapse')
  assert 'layers/[0-1]/attn/q_proj/w' in folded and 'layers/1/' not in folded


def test_collapse_groups_identical_layers_only():
  def leaf(path, shape):
    return reader.LeafInfo('m', tuple(path.split('/')), (), shape, np.dtype('float32'))

  leaves = [leaf(f'layers/{i}/w', (4, 4)) for i in (0, 1, 2, 3, 5)]
  leaves += [leaf('layers/4/w', (8, 4)), leaf('opt/0/count', ())]
  rows = {r.path: (r.count, r.nbytes) for r in display.collapse_rows(leaves)}
  assert rows == {
      'layers/[0-3,5]/w': (5, 5 * 64),
      'layers/4/w': (1, 128),
      'opt/0/count': (1, 4),
  }


def test_inspect_lists_unfinished_steps(capsys, tunix_data, tmp_path):
  root = tmp_path / 'run'
  shutil.copytree(tunix_data / 'sft_full', root)
  shutil.copytree(root / '2', root / '3.orbax-checkpoint-tmp-123')
  status, out, _ = run(capsys, 'inspect', root, '--json')
  assert status == 0
  steps = [(s['step'], s['committed']) for s in json.loads(out)['steps']]
  assert steps == [(1, True), (2, True), (3, False)]
  _, out, _ = run(capsys, 'inspect', root)
  assert '(unfinished: 3)' in out
  status, _, err = run(capsys, 'inspect', root, '--step', '3')
  assert status == 2 and 'step 3 is unfinished' in err
  status, out, _ = run(capsys, 'inspect', root, '--step', '1', '--json')
  assert status == 0 and json.loads(out)['step'] == 1


def test_inspect_reads_metadata_only(big_checkpoint, tunix_data):
  """On ~200 MiB of arrays, inspect reads a tiny fraction of them (rchar)."""
  array_bytes = 50 * 4 * 2**20
  on_disk = sum(f.stat().st_size for f in big_checkpoint.rglob('*') if f.is_file())
  assert on_disk > 0.8 * array_bytes  # The data did not compress away.
  script = (
      'import io, sys\n'
      'from orbax_tunix import cli\n'
      'def rchar():\n'
      '  return int(next(l for l in open("/proc/self/io") if l.startswith("rchar")).split()[1])\n'
      'sys.stdout = io.StringIO()\n'
      # Warm-up on a tiny checkpoint: lazy imports and backend start-up.
      f'cli.main(["inspect", {str(tunix_data / "sft_full")!r}, "--json"])\n'
      'before = rchar()\n'
      f'status = cli.main(["inspect", {str(big_checkpoint)!r}, "--json"])\n'
      'after = rchar()\n'
      'sys.stdout = sys.__stdout__\n'
      'print(status, after - before)\n'
  )
  done = subprocess.run(
      [sys.executable, '-c', script], capture_output=True, text=True, env=SUBPROCESS_ENV,
      cwd=REPO, timeout=120, check=True,
  )
  status, read = map(int, done.stdout.split())
  assert status == 0
  assert read < 0.01 * array_bytes, f'inspect read {read} bytes of {array_bytes}'


# --- convert ----------------------------------------------------------------


# An adapters-only save is not converted as it is (it is merged; test_lora_merge.py).
@pytest.mark.parametrize('name', [n for n in FIXTURES if n != 'lora_qwix'])
def test_convert_then_plain_orbax_then_diff(capsys, tunix_data, tmp_path, name):
  dst = tmp_path / 'out' / '7'
  # A tiny budget forces one batch per few leaves: the streaming path.
  status, out, err = run(capsys, 'convert', tunix_data / name, dst, '--memory-budget', '2K')
  assert status == 0, err
  assert out.startswith('converted ') and out.count('\n') == 1
  source = canonical_source(orbax_tunix.detect(tunix_data / name).step_dir, name)
  restored = plain_orbax_restore(dst)
  assert restored.keys() == source.keys()
  for item in source:
    assert restored[item].keys() == source[item].keys()
    for path, value in source[item].items():
      np.testing.assert_array_equal(restored[item][path], value, err_msg=f'{item}/{path}')
  meta = json.loads((dst / '_CHECKPOINT_METADATA').read_text())
  assert set(meta['item_handlers'].values()) == {ocp.PyTreeCheckpointHandler.typestr()}
  for item in source:
    tree = flat_dict(ocp.PyTreeCheckpointHandler().metadata(dst / item).tree)
    assert {fmt(p) for p in tree} == set(source[item])
  status, out, _ = run(capsys, 'diff', tunix_data / name, dst)
  assert status == 0 and out.strip().splitlines()[-1].startswith('match:')


def test_convert_output_is_a_checkpoint_manager_step(capsys, tunix_data, tmp_path):
  root = tmp_path / 'ckpts'
  assert run(capsys, 'convert', tunix_data / 'rl_actor', root / '5')[0] == 0
  with ocp.CheckpointManager(root) as mngr:
    assert mngr.all_steps() == [5]
    restored = mngr.restore(5)
  assert set(restored.keys()) == {'model_params', 'optimizer_state'}
  custom = json.loads((root / '5' / '_CHECKPOINT_METADATA').read_text())['custom_metadata']
  assert custom['global_step'] == 2 and custom['role'] == 'actor'  # Kept from the source.
  assert custom['orbax_tunix']['source_step'] == 1


def test_convert_keeps_hyperparameters_in_custom_metadata(capsys, tunix_data, tmp_path):
  assert run(capsys, 'convert', tunix_data / 'grad_accum', tmp_path / '1')[0] == 0
  custom = json.loads((tmp_path / '1' / '_CHECKPOINT_METADATA').read_text())['custom_metadata']
  hp = custom['orbax_tunix']['hyperparameters']['opt_state/inner_opt_state']
  assert hp['learning_rate'] == pytest.approx(1e-3)


def test_convert_relative_paths(capsys, tunix_data, tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  src = os.path.relpath(tunix_data / 'sft_full', tmp_path)
  status, _, err = run(capsys, 'convert', src, 'out/2')
  assert status == 0, err
  assert run(capsys, 'diff', src, 'out/2')[0] == 0
  assert run(capsys, 'inspect', 'out')[0] == 0


def test_convert_step(capsys, tunix_data, tmp_path):
  assert run(capsys, 'convert', tunix_data / 'sft_full', tmp_path / '1', '--step', '1')[0] == 0
  assert run(capsys, 'diff', tunix_data / 'sft_full' / '1', tmp_path / '1')[0] == 0
  assert run(capsys, 'diff', tunix_data / 'sft_full', tmp_path / '1')[0] == 1  # Latest is 2.
  status, _, err = run(capsys, 'convert', tunix_data / 'sft_full', tmp_path / '9', '--step', '9')
  assert status == 2
  assert 'expected a step 9, found none. Steps present: 1, 2' in err
  assert not (tmp_path / '9').exists()


@pytest.mark.parametrize('name', ['rng_vars', 'adapter_inject', 'sft_full'])
def test_convert_maxtext_params_as_maxtext_reads_them(capsys, tunix_data, tmp_path, name):
  dst = tmp_path / '3'
  status, _, err = run(capsys, 'convert', tunix_data / name, dst, '--layout', 'maxtext', '--params-only')
  assert status == 0, err
  assert sorted(p.name for p in dst.iterdir() if p.is_dir()) == ['items']
  weights = {
      path: value
      for path, value in canonical_source(
          orbax_tunix.detect(tunix_data / name).step_dir, name)['model_params'].items()
      if 'rngs' not in path.split('/')
  }
  # MaxText's load_parameters_path read (checkpointing.load_params_from_path).
  items = dst / 'items'
  meta = ocp.PyTreeCheckpointHandler().metadata(items).tree
  cpu = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  abstract = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=cpu), meta['params'])
  ckptr = ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_ocdbt=True, use_zarr3=True))
  legacy = ckptr.restore(
      items,
      item={'params': abstract},
      transforms={},
      restore_args={'params': ocp.checkpoint_utils.construct_restore_args(abstract)},
  )
  partial = ckptr.restore(
      items,
      args=ocp.args.PyTreeRestore(
          item={'params': abstract},
          restore_args=ocp.checkpoint_utils.construct_restore_args({'params': abstract}),
          partial_restore=True,
      ),
  )
  for restored in (legacy, partial):
    got = {fmt(p): np.asarray(v) for p, v in flat_dict(restored['params']['params']).items()}
    assert got.keys() == weights.keys()
    for path, value in weights.items():
      np.testing.assert_array_equal(got[path], value)
  assert run(capsys, 'diff', tunix_data / name, dst, '--params-only')[0] == 0
  status, out, _ = run(capsys, 'diff', tunix_data / name, dst)
  assert status == 1 and 'add --params-only' in out


def test_convert_maxtext_full_state_needs_the_optimizer(capsys, tunix_data, tmp_path):
  """A weights-only save has no optimizer state for MaxText to continue: --params-only."""
  status, _, err = run(capsys, 'convert', tunix_data / 'lora_base', tmp_path / '1', '--layout', 'maxtext')
  assert status == 2 and '--params-only' in err and 'optimizer_state' in err
  assert not (tmp_path / '1').exists()


def test_convert_maxtext_full_state(capsys, tunix_data, tmp_path):
  """MaxText's own train state: params/params, opt_state as adamw's list, step int32."""
  dst = tmp_path / '2'
  status, _, err = run(capsys, 'convert', tunix_data / 'sft_full', dst, '--layout', 'maxtext')
  assert status == 0, err
  restored = ocp.PyTreeCheckpointHandler().restore(dst / 'items')
  raw = {item: builders.raw_leaves(tunix_data / 'sft_full' / '2' / item)
         for item in ('model_params', 'optimizer_state')}
  opt = restored['opt_state']
  assert isinstance(opt, list) and len(opt) == 3 and opt[1] is None
  assert set(opt[0]) == {'count', 'mu', 'nu'} and set(opt[2]) == {'count'}
  assert np.asarray(restored['step']).dtype == np.int32
  assert int(restored['step']) == int(raw['optimizer_state']['step/value'])
  # Tunix's adamw(1e-3) has no schedule state: MaxText's schedule count is the step.
  assert int(opt[2]['count']) == int(raw['optimizer_state']['step/value'])
  assert int(opt[0]['count']) == int(raw['optimizer_state']['opt_state/0/count/value'])
  for path, value in raw['model_params'].items():
    w = tuple(path.split('/')[:-1])
    for tree, prefix in ((restored['params']['params'], 'model_params'),
                         (opt[0]['mu']['params'], 'opt_state/0/mu'),
                         (opt[0]['nu']['params'], 'opt_state/0/nu')):
      got = tree
      for k in w:
        got = got[k]
      want = value if prefix == 'model_params' else raw['optimizer_state'][f'{prefix}/{path}']
      np.testing.assert_array_equal(np.asarray(got), want, err_msg=f'{prefix}/{path}')


def test_convert_params_only_of_a_lora_only_save_fails_as_the_api_does(tunix_data, tmp_path):
  """Adapters alone are not parameters: the CLI refuses, as restore_train_state does."""
  dst = tmp_path / 'out' / '1'
  done = subprocess.run(
      [sys.executable, '-m', 'orbax_tunix.cli', 'convert', str(tunix_data / 'lora_qwix'),
       str(dst), '--params-only', '--layout', 'maxtext'],
      capture_output=True, text=True, env=SUBPROCESS_ENV, cwd=REPO, timeout=120,
  )
  assert done.returncode == 2, done.stderr
  assert 'LoRA adapters only' in done.stderr and '_lora_a' in done.stderr
  assert 'Traceback' not in done.stderr
  assert not (tmp_path / 'out').exists()
  with pytest.raises(orbax_tunix.LoraOnlyCheckpointError):
    convert.plan_convert(tunix_data / 'lora_qwix', dst, params_only=True, layout='maxtext')


@pytest.mark.parametrize('params_only', [False, True])
def test_canonical_convert_of_a_lora_only_save_keeps_the_adapters(tunix_data, tmp_path,
                                                                   params_only):
  """A canonical step re-lays what was saved and claims no model: adapters alone convert."""
  dst = tmp_path / 'out' / '1'
  done = subprocess.run(
      [sys.executable, '-m', 'orbax_tunix.cli', 'convert', str(tunix_data / 'lora_qwix'),
       str(dst), *(['--params-only'] if params_only else [])],
      capture_output=True, text=True, env=SUBPROCESS_ENV, cwd=REPO, timeout=120,
  )
  assert done.returncode == 0, done.stderr
  raw = builders.raw_leaves(tunix_data / 'lora_qwix' / '1' / 'model_params')
  got = builders.raw_leaves(dst / 'model_params')
  assert sorted(got) == sorted(p.removesuffix('/value') for p in raw)
  for path, value in raw.items():
    np.testing.assert_array_equal(got[path.removesuffix('/value')], value, err_msg=path)
  assert (dst / 'optimizer_state').exists() != params_only


def test_convert_params_only_canonical_drops_rng_and_optimizer(capsys, tunix_data, tmp_path):
  dst = tmp_path / '1'
  status, _, err = run(capsys, 'convert', tunix_data / 'rng_vars', dst, '--params-only')
  assert status == 0 and 'RNG state' in err
  restored = plain_orbax_restore(dst)
  assert list(restored) == ['model_params']
  assert not any('rngs' in p.split('/') for p in restored['model_params'])
  assert run(capsys, 'diff', tunix_data / 'rng_vars', dst, '--params-only')[0] == 0


def test_convert_dtype(capsys, tunix_data, tmp_path):
  dst = tmp_path / '1'
  assert run(capsys, 'convert', tunix_data / 'rng_vars', dst, '--dtype', 'bfloat16')[0] == 0
  meta = {
      fmt(p): np.dtype(m.dtype)
      for p, m in flat_dict(ocp.PyTreeCheckpointHandler().metadata(dst / 'model_params').tree).items()
  }
  assert meta['embedder/embedding'] == jax.numpy.bfloat16
  assert meta['rngs/params/key'] == np.uint32 and meta['rngs/params/count'] == np.uint32
  status, out, _ = run(capsys, 'diff', tunix_data / 'rng_vars', dst)
  assert status == 1 and 'Dtypes differ' in out
  assert run(capsys, 'diff', tunix_data / 'rng_vars', dst, '--ignore-dtype', '--atol', '0.01')[0] == 0
  status, _, err = run(capsys, 'convert', tunix_data / 'rng_vars', tmp_path / '2', '--dtype', 'int8')
  assert status == 2 and 'floating dtype' in err


def test_convert_refuses_existing_destination(capsys, tunix_data, tmp_path):
  dst = tmp_path / '1'
  dst.mkdir()
  (dst / 'keep.txt').write_text('mine')
  # A folder of something else is never written over, --force or not; the message
  # names what it holds and does not suggest --force (which would refuse too).
  for flags in ((), ('--force',)):
    status, out, err = run(capsys, 'convert', tunix_data / 'sft_full', dst, *flags)
    assert status == 2 and out == ''
    assert 'never written over' in err and 'keep.txt' in err, err
    assert '--force' not in err and 'Traceback' not in err, err
    assert sorted(p.name for p in dst.iterdir()) == ['keep.txt']
  shutil.rmtree(dst)
  assert run(capsys, 'convert', tunix_data / 'chain_clip', dst)[0] == 0
  status, _, err = run(capsys, 'convert', tunix_data / 'sft_full', dst)  # A step: --force.
  assert status == 2 and 'already exists (a checkpoint step). Pass --force' in err, err
  assert run(capsys, 'convert', tunix_data / 'sft_full', dst, '--force')[0] == 0
  assert run(capsys, 'diff', tunix_data / 'sft_full', dst)[0] == 0
  assert sorted(p.name for p in tmp_path.iterdir()) == ['1']  # No temporaries left.


@pytest.mark.parametrize('dst', ['2/converted', '3', '1/model_params/sub', '.', 'actor/9'])
def test_convert_refuses_destination_inside_source_run(capsys, tunix_data, tmp_path, dst):
  """The source run, every step and item in it, is never written to."""
  root = tmp_path / 'run'
  shutil.copytree(tunix_data / 'sft_full', root)
  before = sorted(str(p) for p in root.rglob('*'))
  status, _, err = run(capsys, 'convert', root / '1', root / dst, '--force')
  assert status == 2 and 'overlaps the source checkpoint' in err, err
  assert sorted(str(p) for p in root.rglob('*')) == before
  status, _, err = run(capsys, 'convert', root / '2', tmp_path, '--force')
  assert status == 2 and 'holding the source step' in err


def test_convert_failure_leaves_nothing(capsys, tunix_data, tmp_path, monkeypatch):
  real_save = ocp.PyTreeCheckpointHandler.save
  calls = []

  def failing_save(self, *args, **kwargs):
    calls.append(1)
    if len(calls) == 3:
      raise OSError(28, 'No space left on device')
    return real_save(self, *args, **kwargs)

  monkeypatch.setattr(ocp.PyTreeCheckpointHandler, 'save', failing_save)
  out_dir = tmp_path / 'out'
  status, _, err = run(capsys, 'convert', tunix_data / 'sft_full', out_dir / '1', '--memory-budget', '2K')
  assert status == 2 and 'No space left on device' in err and 'Traceback' not in err
  assert not out_dir.exists()  # The parent it created goes too.


def test_convert_interrupt_leaves_nothing(capsys, tunix_data, tmp_path, monkeypatch):
  real_save = ocp.PyTreeCheckpointHandler.save

  def interrupted_save(self, *args, **kwargs):
    real_save(self, *args, **kwargs)
    raise KeyboardInterrupt  # Ctrl-C after the first batch.

  monkeypatch.setattr(ocp.PyTreeCheckpointHandler, 'save', interrupted_save)
  status, _, err = run(capsys, 'convert', tunix_data / 'sft_full', tmp_path / 'out' / '1')
  assert status == 130 and 'interrupted' in err
  assert list(tmp_path.iterdir()) == []


def _start(*argv: str, text: bool = True) -> subprocess.Popen:
  """`python ARGV` in the suite's environment, its output piped (a convert to signal or kill)."""
  return subprocess.Popen([sys.executable, *argv], env=SUBPROCESS_ENV, cwd=REPO,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=text)


def _wait_for_first_batch(proc: subprocess.Popen, parent: pathlib.Path) -> None:
  """Waits until a conversion has written its first batch into its temporary dir."""
  deadline = time.monotonic() + 120
  while time.monotonic() < deadline:
    assert proc.poll() is None, proc.communicate()
    if any((tmp / 'model_params' / '_METADATA').exists() for tmp in parent.glob('*.orbax-checkpoint-tmp-*')):
      return
    time.sleep(0.005)
  raise AssertionError('the conversion never wrote a batch')


def test_convert_killed_midway_leaves_no_destination(big_checkpoint, tmp_path):
  dst = tmp_path / 'out' / '1'
  proc = _start('-m', 'orbax_tunix.cli', 'convert', str(big_checkpoint), str(dst),
                '--memory-budget', '12M', text=False)
  _wait_for_first_batch(proc, dst.parent)
  proc.kill()
  proc.wait(timeout=60)
  assert proc.returncode == -signal.SIGKILL
  assert not dst.exists()
  # What a kill leaves is a temporary directory Orbax and this tool call unfinished.
  leftovers = list(dst.parent.iterdir())
  assert [p.name.startswith('1.orbax-checkpoint-tmp-') for p in leftovers] == [True]
  assert step_store.list_steps(dst.parent)[0].committed is False


@pytest.mark.parametrize('sig', [signal.SIGTERM, signal.SIGHUP])
def test_convert_sigterm_removes_its_temporary(big_checkpoint, tmp_path, sig):
  dst = tmp_path / 'out' / '1'
  proc = _start('-m', 'orbax_tunix.cli', 'convert', str(big_checkpoint), str(dst),
                '--memory-budget', '12M')
  _wait_for_first_batch(proc, dst.parent)
  proc.send_signal(sig)
  _, err = proc.communicate(timeout=60)
  assert proc.returncode == 130, err
  assert 'interrupted' in err and 'Traceback' not in err
  assert list(tmp_path.iterdir()) == []


def _no_temporary_left(proc: subprocess.Popen, dst: pathlib.Path, tmp_path: pathlib.Path) -> None:
  """A conversion stopped by a signal: exit 130, its message, and nothing left (also a
  moment later: no write of it lands after the clean-up); or it had finished: DST whole."""
  _, err = proc.communicate(timeout=300)
  time.sleep(0.5)
  left = sorted(p.name for p in dst.parent.iterdir()) if dst.parent.exists() else []
  assert 'Traceback' not in err and 'Error' not in err, err
  if (dst / '_CHECKPOINT_METADATA').exists():
    # The signal came after the commit (or during the interpreter's own shutdown, after the
    # command returned, ending the process by that signal): the step is whole, nothing beside.
    assert left == [dst.name], (left, err)
    return
  assert proc.returncode == 130, err
  assert err.strip().endswith('interrupted; nothing was written at the destination.'), err
  assert list(tmp_path.iterdir()) == [], left


@pytest.mark.parametrize('sig', [signal.SIGTERM, signal.SIGINT])
@pytest.mark.parametrize('save', [1, 2])
def test_convert_signal_mid_write_leaves_no_temporary(big_checkpoint, tmp_path, sig, save):
  """The signal lands while Orbax's threads write a batch (its save started, not waited
  for): they are let finish before the temporary step is removed."""
  dst = tmp_path / 'out' / '1'
  proc = _start(str(REPO / 'tests' / 'signal_mid_write.py'), str(int(sig)), str(save), 'convert',
                str(big_checkpoint), str(dst), '--memory-budget', '300M')
  _no_temporary_left(proc, dst, tmp_path)
  assert proc.returncode == 130


@pytest.mark.parametrize('delay', [0.0, 0.7, 1.4, 2.1])
def test_convert_signal_at_any_moment_leaves_no_temporary(big_checkpoint, tmp_path, delay):
  """Signals at several moments after the temporary step appears (reads, writes, commit)."""
  dst = tmp_path / 'out' / '1'
  proc = _start('-m', 'orbax_tunix.cli', 'convert', str(big_checkpoint), str(dst),
                '--memory-budget', '300M')
  deadline = time.monotonic() + 120
  while not list(dst.parent.glob('*.orbax-checkpoint-tmp-*')) and time.monotonic() < deadline:
    assert proc.poll() is None, proc.communicate()
    time.sleep(0.002)
  time.sleep(delay)
  proc.send_signal(signal.SIGTERM if delay * 10 % 2 else signal.SIGINT)
  _no_temporary_left(proc, dst, tmp_path)


# --- diff -------------------------------------------------------------------


def test_diff_reports_value_differences(capsys, tunix_data):
  a, b = tunix_data / 'sft_full' / '1', tunix_data / 'sft_full' / '2'
  status, out, _ = run(capsys, 'diff', a, b)
  assert status == 1
  assert 'Values differ (atol 0): 44' in out and out.strip().splitlines()[-1].startswith('differ:')
  status, out, _ = run(capsys, 'diff', a, b, '--json')
  doc = json.loads(out)
  assert status == 1 and doc['match'] is False
  by_path = {v['path']: v for v in doc['values']}
  expected = np.abs(
      canonical_source(a, 'sft_full')['model_params']['embedder/embedding']
      - canonical_source(b, 'sft_full')['model_params']['embedder/embedding']
  ).max()
  assert by_path['model_params/embedder/embedding']['max_abs_diff'] == pytest.approx(float(expected))
  assert run(capsys, 'diff', a, b, '--atol', '1')[0] == 0
  assert run(capsys, 'diff', a, a)[0] == 0


def test_diff_reports_missing_and_mismatched_leaves(capsys, tmp_path):
  """Plain Orbax checkpoints (not Tunix) compare as they are."""

  def save(step_dir, tree):
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckptr:
      ckptr.save(step_dir, args=ocp.args.Composite(state=ocp.args.PyTreeSave(tree)))

  ones = np.ones((2, 3), np.float32)
  save(tmp_path / 'a' / '1', {'w': ones, 'b': np.zeros(3, np.float32), 'x': np.arange(2), 'same': ones})
  save(tmp_path / 'b' / '1', {'w': ones.T.copy(), 'b': np.zeros(3, np.float16), 'y': np.arange(2), 'same': ones})
  status, out, _ = run(capsys, 'diff', tmp_path / 'a', tmp_path / 'b', '--json')
  doc = json.loads(out)
  assert status == 1
  assert doc['only_a'] == ['state/x'] and doc['only_b'] == ['state/y']
  assert doc['shape'] == [{'path': 'state/w', 'a': '(2, 3) float32', 'b': '(3, 2) float32'}]
  assert doc['dtype'] == [{'path': 'state/b', 'a': '(3,) float32', 'b': '(3,) float16'}]
  assert doc['values'] == [] and doc['compared'] == 2
  status, out, _ = run(capsys, 'diff', tmp_path / 'a', tmp_path / 'b')
  for title in ('Only in A', 'Only in B', 'Shapes differ: 1', 'Dtypes differ: 1'):
    assert title in out


def test_diff_tunix_against_its_v1_twin(capsys, tunix_data):
  """Same run written through Orbax v0 and v1: equal in canonical form."""
  assert run(capsys, 'diff', tunix_data / 'sft_full', tunix_data / 'v1_writer')[0] == 0


def test_diff_error_status(capsys, tunix_data, tmp_path):
  status, out, err = run(capsys, 'diff', tunix_data / 'sft_full', tmp_path / 'nothing')
  assert status == 2 and out == ''
  assert 'no such file or directory' in err and 'Traceback' not in err


def test_compare_values_handles_nan_and_chunks():
  from orbax_tunix.tools import diff

  a = np.arange(300_000, dtype=np.float32)
  b = a.copy()
  b[-1] += 2
  assert diff.compare_values(a, b) == (2.0, 1)
  x = np.array([np.nan, 1.0])
  assert diff.compare_values(x, x.copy()) == (0.0, 0)
  assert diff.compare_values(x, np.array([0.0, 1.0]))[0] == float('inf')
  assert diff.compare_values(np.uint32(5), np.uint32(3)) == (2.0, 1)


# --- messages, output and packaging -----------------------------------------


def test_not_a_checkpoint_message(capsys, tmp_path):
  status, out, err = run(capsys, 'inspect', tmp_path)
  assert status == 2 and out == ''
  assert err.startswith(f'orbax-tunix: error: {tmp_path}: expected an Orbax checkpoint')
  assert 'Traceback' not in err


def test_debug_shows_the_traceback(capsys, tmp_path):
  status, _, err = run(capsys, 'inspect', tmp_path, '--debug')
  assert status == 2 and 'Traceback' in err and 'NotACheckpointError' in err


def test_usage_errors_exit_2(capsys):
  assert cli.main(['convert', 'a', 'b', '--memory-budget', 'lots']) == 2
  assert 'expected a positive size' in capsys.readouterr().err


@pytest.mark.parametrize('argv, status', [
    (['inspect', '{data}/sft_full', '--json'], 0), (['inspect', '{data}/nowhere'], 2)])
def test_the_command_exits_with_mains_status_its_objects_frozen(tunix_data, argv, status):
  """`python -m orbax_tunix.cli` exits with `main`'s status, after freezing what it made out
  of the cyclic GC (the interpreter's shutdown then skips walking it): the freeze is seen by
  the exit hooks, which run after it."""
  script = ('import atexit, gc, runpy, sys\n'
            'atexit.register(lambda: print("frozen", gc.get_freeze_count(), file=sys.stderr))\n'
            f'sys.argv = ["orbax-tunix", *{[a.format(data=tunix_data) for a in argv]!r}]\n'
            'runpy.run_module("orbax_tunix.cli", run_name="__main__")\n')
  done = subprocess.run([sys.executable, '-c', script], capture_output=True, text=True,
                        env=SUBPROCESS_ENV, cwd=REPO, timeout=120)
  assert done.returncode == status, done.stderr
  frozen = int(done.stderr.rsplit('frozen', 1)[1].split()[0])
  assert frozen > 10_000, done.stderr[-500:]


def test_parse_size():
  # One rule for every size option: XB decimal (as transformers' max_shard_size), XiB and a
  # bare X binary (as `ls -h`), no unit bytes.
  assert cli_flags.parse_size('1000') == 1000
  assert cli_flags.parse_size('2K') == 2048
  assert cli_flags.parse_size('512M') == 512 * 2**20
  assert cli_flags.parse_size('1.5GiB') == 3 * 2**29
  assert cli_flags.parse_size('1gb') == 10**9
  assert cli_flags.parse_size('5GB') == 5 * 10**9
  assert cli_flags.parse_size('1e3KB') == 10**6


def test_rich_tables_and_plain_fallback(monkeypatch, tunix_data):
  report = inspection.inspect_checkpoint(tunix_data / 'lora_qwix')
  stream = io.StringIO()
  display.show_inspect(display.Printer(stream, fancy=True), report, collapse=True)
  drawn = stream.getvalue()
  # Brackets in folded paths are text, not rich markup.
  assert 'layers/[0-1]/attn/q_proj/w_lora_a' in drawn
  monkeypatch.setattr(display, 'rich', None)  # As if rich were not installed.
  stream = io.StringIO()
  output = display.Printer(stream, fancy=True)
  assert not output.fancy
  display.show_inspect(output, report, collapse=True)
  assert 'layers/[0-1]/attn/q_proj/w_lora_a' in stream.getvalue()


def test_progress_lines(monkeypatch):
  monkeypatch.setattr(progress, 'LOG_INTERVAL', 0.0)
  stream = io.StringIO()
  line = progress.make_progress(stream, fancy=True)  # Not a terminal: log lines.
  line.start(2 * 2**20, 'converting')
  line.advance(2**20)
  line.advance(2**20)
  line.finish()
  assert stream.getvalue().splitlines()[-1].startswith('converting: 2.0 MiB / 2.0 MiB (100%)')


def test_console_script_is_declared():
  # The installed metadata, not pyproject.toml: what `pip install` made must start the command.
  scripts = [s for s in importlib.metadata.entry_points(group='console_scripts') if s.name == 'orbax-tunix']
  assert [s.value for s in scripts] == ['orbax_tunix.cli:console']
  from orbax_tunix import cli
  assert scripts[0].load() is cli.console


def test_batches_fit_the_budget():
  leaves = [reader.LeafInfo('m', (str(i),), (str(i),), (n,), np.dtype('uint8')) for i, n in enumerate([3, 3, 3, 10, 1])]
  sizes = [[leaf.nbytes for leaf in b] for b in memory.batches(leaves, 6)]
  assert sizes == [[3, 3], [3], [10], [1]]


_FREED = """
import importlib.util, sys, numpy as np, psutil
spec = importlib.util.spec_from_file_location('memory', sys.argv[2])  # (Not the package: quick.)
memory = importlib.util.module_from_spec(spec)
spec.loader.exec_module(memory)
if sys.argv[1] == 'set':
  assert memory.return_freed_memory()
big = np.ones(16 << 20, np.uint8)
del big  # glibc's own rule: buffers up to 16 MiB now come from its heap
rss = psutil.Process().memory_info().rss
batches = [np.ones(4 << 20, np.uint8) for _ in range(8)]
del batches[:-1]  # 28 MiB freed below one still held
print((psutil.Process().memory_info().rss - rss) >> 20)
"""


@pytest.mark.skipif(not sys.platform.startswith('linux'), reason="glibc's allocator")
def test_the_command_line_gives_back_freed_batches():
  """With `memory.return_freed_memory` (the command line sets it), freed batches leave the
  process's memory; by glibc's own rule they stay in its heap below a batch still held."""
  held = {how: int(subprocess.run([sys.executable, '-c', _FREED, how, memory.__file__],
                                  check=True, capture_output=True, text=True).stdout)
          for how in ('set', 'unset')}
  assert held['set'] <= 8 and held['unset'] >= 24, held


def test_plan_is_metadata_only(tunix_data, tmp_path, monkeypatch):
  def no_reads(*args, **kwargs):
    raise AssertionError('planning read an array')

  monkeypatch.setattr(ocp.PyTreeCheckpointHandler, 'restore', no_reads)
  plan = convert.plan_convert(tunix_data / 'adapter_inject', tmp_path / '1', memory_budget=2**30)
  assert [item.name for item in plan.items] == ['model_params', 'optimizer_state']
  # 1 GiB less 64 MiB of fixed overhead, over 5 copies in flight, halved: the writer reads
  # the next batch while it writes one.
  assert plan.batch_bytes == (2**30 - 64 * 2**20) // 5 // 2
  assert not (tmp_path / '1').exists()


def test_optax_state_names_come_from_optax():
  from orbax_tunix.tools.inspection import optax_state_names

  assert 'ScaleByAdamState' in optax_state_names(frozenset({'count', 'mu', 'nu'}))
  # nnx drops MultiSteps' empty skip_state: a subset of the fields still fits.
  assert optax_state_names(
      frozenset({'mini_step', 'gradient_step', 'inner_opt_state', 'acc_grads'})) == ('MultiStepsState',)
  assert optax_state_names(frozenset({'not_an_optax_field'})) == ()


def test_inspect_reads_the_optimizers_scalars_in_one_restore(tunix_data, monkeypatch):
  """Hyperparameters and the state's step counter share one Orbax restore."""
  calls = []
  restore = ocp.PyTreeCheckpointHandler.restore

  def spy(self, directory, *args, **kwargs):
    calls.append(pathlib.Path(directory).name)
    return restore(self, directory, *args, **kwargs)

  monkeypatch.setattr(ocp.PyTreeCheckpointHandler, 'restore', spy)
  report = inspection.inspect_checkpoint(tunix_data / 'adapter_inject')
  assert calls == ['optimizer_state']
  assert report.state_step is not None and 'learning_rate' in report.hyperparameters['opt_state']


@pytest.mark.parametrize('name', ['tunix_llama2_scan', 'tunix_llama2_unscan'])
def test_inspect_says_which_maxtext_layer_form_and_how_many(capsys, name):
  """The form and count MaxText's config had when the fixture was made (its manifest)."""
  manifest = json.loads((REPO / 'tests/data/maxtext/MANIFEST.json').read_text())['fixtures'][name]
  argv = dict(a.split('=', 1) for a in manifest['config_argv'] if '=' in a)
  status, out, _ = run(capsys, 'inspect', REPO / 'tests/data/maxtext' / name, '--json')
  assert status == 0
  layers = json.loads(out)['layers']
  assert layers == {'form': 'scanned' if manifest['scan_layers'] else 'unscanned',
                    'count': int(argv['base_num_decoder_layers']),
                    # MaxText's base.yml default, unless the config set it.
                    'axis': int(argv.get('param_scan_axis', 1)) if manifest['scan_layers'] else None}


def test_convert_maxtext_says_when_the_weights_are_not_a_maxtext_model(capsys, tunix_data, tmp_path):
  """A Tunix qwen3 (its own names) laid out for MaxText: its loaders read it, a model does not."""
  status, _, err = run(capsys, 'convert', tunix_data / 'hf_qwen3', tmp_path / '1', '--layout',
                       'maxtext', '--params-only')
  assert status == 0
  assert "note: the weights are not a MaxText model's (expected top-level decoder and" in err
  assert 'found embedder, final_norm, layers, lm_head' in err
  status, _, err = run(capsys, 'convert', REPO / 'tests/data/maxtext/tunix_llama2_scan',
                       tmp_path / '2', '--layout', 'maxtext', '--params-only')
  assert status == 0 and "not a MaxText model's" not in err


def test_inspect_calls_plain_arrays_no_known_model(capsys, tunix_data, tmp_path):
  """`weights` says what the arrays are: a Tunix model only when they are one of the families'
  (issue 36.13); arrays Orbax wrote of no model, and a LoRA save without its base, say so."""
  step = tmp_path / 'plain' / '1'
  with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckptr:
    ckptr.save(step, args=ocp.args.Composite(model_params=ocp.args.PyTreeSave(
        {'encoder': {'w': np.ones((4, 3), np.float32)}, 'head': np.zeros(3, np.float32)})))
  for path, want in ((step, 'Orbax arrays (no known model)'),
                     (tunix_data / 'lora_qwix', 'LoRA adapters only (no base weights)'),
                     (tunix_data / 'hf_gemma4', 'Tunix model (tunix.models)')):
    status, out, err = run(capsys, 'inspect', path, '--json')
    assert status == 0, err
    assert json.loads(out)['weights'] == want, path


def test_commands_keep_jax_compilation_cache_for_the_next(tmp_path, tunix_data):
  """A command's programs are written to JAX's persistent compilation cache under the user's
  cache directory (whole: no temporary file left), and the next command loads them;
  `--no-compilation-cache` keeps it off."""
  env = {k: v for k, v in SUBPROCESS_ENV.items()
         if not k.startswith(('JAX_COMPILATION_CACHE', 'JAX_PERSISTENT_CACHE',
                              'JAX_ENABLE_COMPILATION_CACHE'))}
  env.update(XDG_CACHE_HOME=str(tmp_path / 'xdg'), JAX_LOG_COMPILES='1')
  cache = tmp_path / 'xdg' / 'orbax-tunix' / 'jax'
  merge = ['convert', str(tunix_data / 'lora_qwix_full'), '--merge-lora',
           '--lora-alpha', '4', '--debug']

  def convert_to(out: str, *flags: str) -> str:
    done = subprocess.run([sys.executable, '-m', 'orbax_tunix.cli', *merge[:2], str(tmp_path / out),
                           *merge[2:], *flags], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stderr

  said = convert_to('off', '--no-compilation-cache')
  assert not (tmp_path / 'xdg').exists() and 'Persistent compilation cache' not in said
  convert_to('cold')
  written = sorted(p.name for p in cache.iterdir())
  assert written and all(n.endswith('-cache') for n in written), written
  assert cache.stat().st_mode & 0o777 == 0o700
  said = convert_to('warm')
  # Every program loaded (JAX logs each load as a compilation).
  hits = said.count('Persistent compilation cache hit')
  assert hits and hits == said.count('Finished XLA compilation'), said
  assert sorted(p.name for p in cache.iterdir()) == written
  read = [ocp.PyTreeCheckpointHandler().restore(tmp_path / name / 'model_params')
          for name in ('warm', 'off')]
  for got, want in zip(*(jax.tree.leaves(r) for r in read), strict=True):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want), strict=True)

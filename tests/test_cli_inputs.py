"""Unusual but valid inputs through the real command line, in a subprocess.

Each test writes its checkpoint with plain Orbax, flax nnx and optax (or takes
a committed Tunix fixture), runs `python -m orbax_tunix.cli`, and checks the
exit status, the message, and what was (and was not) written. Expected values
come from plain Orbax reads, never from this package.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys

import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from etils import epath
from flax import nnx

from tests import builders
from tests.test_faults import snapshot

REPO = pathlib.Path(__file__).resolve().parent.parent
ENV = {**{k: v for k, v in os.environ.items() if k != 'XLA_FLAGS'}, 'JAX_PLATFORMS': 'cpu'}


def cli(*argv: object) -> subprocess.CompletedProcess:
  done = subprocess.run(
      [sys.executable, '-m', 'orbax_tunix.cli', *map(str, argv)],
      capture_output=True, text=True, env=ENV, cwd=REPO, timeout=300,
  )
  assert 'Traceback' not in done.stderr, done.stderr
  return done


def save_step(step_dir: pathlib.Path, **items) -> pathlib.Path:
  with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckptr:
    ckptr.save(epath.Path(step_dir), args=ocp.args.Composite(
        **{name: ocp.args.PyTreeSave(tree) for name, tree in items.items()}))
  return step_dir


def plain_restore(step_dir: pathlib.Path) -> dict:
  with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckptr:
    return ckptr.restore(epath.Path(step_dir))


def test_keys_holding_a_slash_are_not_merged_with_nested_paths(tmp_path):
  a = save_step(tmp_path / 'a' / '1', state={'a/b': np.ones(3), 'a': {'b': np.zeros(3)}})
  b = save_step(tmp_path / 'b' / '1', state={'a/b': np.ones(3), 'a': {'b': np.full(3, 2.0)}})
  done = cli('diff', a, b)
  assert done.returncode == 1, done.stdout
  assert '2 leaves compared' in done.stdout
  differ = done.stdout.split('Values differ')[1]
  assert 'state/a/b' in differ and '"a/b"' not in differ  # The nested leaf, not the key.
  inspected = json.loads(cli('inspect', a, '--json').stdout)
  assert inspected['num_leaves'] == 2
  assert set(inspected['items']['state']['leaves']) == {'"a/b"', 'a/b'}


def test_nan_against_a_number_differs_at_any_tolerance(tmp_path):
  a = save_step(tmp_path / 'a' / '1', state={'x': np.array([np.nan, 1.0])})
  b = save_step(tmp_path / 'b' / '1', state={'x': np.array([2.0, 1.0])})
  c = save_step(tmp_path / 'c' / '1', state={'x': np.array([np.nan, 1.0])})
  assert cli('diff', a, b, '--atol', 'inf').returncode == 1
  assert cli('diff', a, c).returncode == 0  # NaN at the same place matches.


def test_float64_and_int64_keep_their_width(tmp_path):
  src = save_step(tmp_path / 'src' / '1', state={
      'f': np.linspace(0, 1, 7, dtype=np.float64) + 1e-12, 'i': np.arange(5, dtype=np.int64) << 40})
  dst = tmp_path / 'out' / '1'
  done = cli('convert', src, dst, '--dtype', 'float64')
  assert done.returncode == 0, done.stderr
  restored = plain_restore(dst)['state']
  assert restored['f'].dtype == np.float64 and restored['i'].dtype == np.int64
  np.testing.assert_array_equal(restored['f'], np.linspace(0, 1, 7, dtype=np.float64) + 1e-12)
  np.testing.assert_array_equal(restored['i'], np.arange(5, dtype=np.int64) << 40)
  record = json.loads((dst / '_CHECKPOINT_METADATA').read_text())['custom_metadata']['orbax_tunix']
  assert record['dtype'] == 'float64'
  assert cli('diff', src, dst).returncode == 0


def test_one_item_saved_on_its_own(tmp_path):
  """`ocp.PyTreeCheckpointer().save(dir, tree)`: one directory, one item."""
  tx = optax.inject_hyperparams(optax.adamw)(learning_rate=3e-4)
  model, opt = builders.make(builders.Model(nnx.Rngs(0)), tx)
  item = tmp_path / 'opt'
  ocp.PyTreeCheckpointer().save(epath.Path(item), nnx.state(opt, nnx.optimizer.OptState))
  raw = builders.raw_leaves(item)
  inspected = json.loads(cli('inspect', item, '--json').stdout)
  leaves = inspected['items']['opt']['leaves']
  # Raw paths with the nnx level and the inject shell removed, by hand.
  want = {k[:-len('/value')].replace('opt_state/inner_state/', 'opt_state/') for k in raw
          if not k.startswith(('opt_state/hyperparams/', 'opt_state/count/'))}
  assert set(leaves) == want
  assert inspected['hyperparameters']['opt_state']['learning_rate'] == pytest.approx(3e-4)
  assert 'skipped' not in json.dumps(inspected) and 'ocdbt' not in json.dumps(inspected['items'])
  dst = tmp_path / 'out' / '1'
  assert cli('convert', item, dst).returncode == 0
  restored = plain_restore(dst)['opt']
  np.testing.assert_array_equal(
      restored['opt_state']['0']['mu']['head']['kernel'],
      raw['opt_state/inner_state/0/mu/head/kernel/value'])
  assert cli('diff', item, dst).returncode == 0


def test_maxtext_items_converts_canonically(tmp_path):
  """A plain MaxText `items` TrainState (lists and None in opt_state) converts as it is."""
  state = {
      'params': {'params': {'w': np.arange(6, dtype=np.float32).reshape(2, 3)}},
      'opt_state': [{'count': np.int32(3), 'mu': {'params': {'w': np.ones((2, 3), np.float32)}}},
                    None, {'count': np.int32(3)}],
      'step': np.int32(3),
  }
  src = save_step(tmp_path / 'mt' / '3', items=state)
  dst = tmp_path / 'out' / '3'
  done = cli('convert', src, dst)
  assert done.returncode == 0, done.stderr
  restored = plain_restore(dst)['items']
  original = plain_restore(src)['items']
  np.testing.assert_array_equal(restored['params']['params']['w'], original['params']['params']['w'])
  np.testing.assert_array_equal(restored['opt_state'][0]['mu']['params']['w'],
                                original['opt_state'][0]['mu']['params']['w'])
  assert cli('diff', src, dst).returncode == 0


def test_checksums_catch_flipped_data_bytes(tmp_path):
  rng = np.random.default_rng(0)
  src = save_step(tmp_path / 'src' / '1', state={'w': rng.standard_normal((256, 256)).astype(np.float32)})
  dst = tmp_path / 'out' / '1'
  assert cli('convert', src, dst).returncode == 0
  done = cli('inspect', dst, '--verify')
  assert done.returncode == 0 and '1 arrays checked' in done.stdout, done.stdout
  data = max((dst / 'state' / 'ocdbt.process_0' / 'd').iterdir(), key=lambda p: p.stat().st_size)
  raw = bytearray(data.read_bytes())
  raw[len(raw) // 2] ^= 0x01  # Inside the array's compressed chunk.
  data.write_bytes(bytes(raw))
  done = cli('inspect', dst, '--verify')
  assert done.returncode == 1 and 'state/w' in done.stdout and 'FAILED' in done.stdout
  done = cli('diff', src, dst)
  assert done.returncode == 1 and 'Damaged in B' in done.stdout
  # A source this package did not write records no checksums: verify says so.
  done = cli('inspect', src, '--verify')
  assert done.returncode == 2 and 'records no checksums' in done.stderr


def test_damaged_array_data_names_the_item_and_the_way_out(tunix_data, tmp_path):
  root = tmp_path / 'run'
  shutil.copytree(tunix_data / 'sft_full', root)
  for data in (root / '2' / 'model_params').rglob('*'):
    if data.is_file() and data.parent.name == 'd':
      data.write_bytes(data.read_bytes()[:50])
  before = snapshot(root)
  done = cli('convert', root, tmp_path / 'out' / '2')
  assert done.returncode == 2
  first = done.stderr.splitlines()[0]
  assert first.startswith(f'orbax-tunix: error: {root / "2" / "model_params"}: ')
  assert '--step' in done.stderr and 'tensorstore_spec' not in done.stderr
  assert len(done.stderr.splitlines()) <= 3
  assert not (tmp_path / 'out').exists() and snapshot(root) == before
  assert cli('convert', root, tmp_path / 'out' / '1', '--step', '1').returncode == 0


def test_restore_train_state_names_the_missing_metadata(tunix_data, tmp_path):
  import jax  # pylint: disable=g-import-not-at-top

  import orbax_tunix as ot  # pylint: disable=g-import-not-at-top
  from orbax_tunix import maxtext

  root = tmp_path / 'run'
  shutil.copytree(tunix_data / 'sft_full', root)
  (root / '2' / 'model_params' / '_METADATA').unlink()
  with pytest.raises(ot.CorruptMetadataError, match=r'model_params/_METADATA'):
    maxtext.restore_train_state(root, {'params': {'params': {'w': jax.ShapeDtypeStruct((1,), 'f4')}}})


# --- diff: what it compares ---------------------------------------------------------


def save_items(step_dir: pathlib.Path, **items) -> pathlib.Path:
  """A step of PyTree items and JSON items (names starting with 'json')."""
  args = {name: ocp.args.JsonSave(v) if name.startswith('json') else ocp.args.PyTreeSave(v)
          for name, v in items.items()}
  with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckptr:
    ckptr.save(epath.Path(step_dir), args=ocp.args.Composite(**args))
  return step_dir


INT64_MIN = np.iinfo(np.int64).min


@pytest.mark.parametrize('a, b', [
    (np.array([2**62], np.int64), np.array([-2**62], np.int64)),  # int64 overflow
    (np.array([INT64_MIN], np.int64), np.array([0], np.int64)),  # |INT64_MIN| overflows too
    (np.array([2**63 + 1], np.uint64), np.array([2**63 + 3], np.uint64)),  # float64 rounds these
    (np.array([2**64 - 1], np.uint64), np.array([INT64_MIN], np.int64)),  # 2**64 + 2**63 - 1 apart
])
def test_diff_compares_integers_exactly(tmp_path, a, b):
  from orbax_tunix.tools import diff

  want = abs(int(a[0]) - int(b[0]))  # Python ints: exact.
  assert diff.compare_values(a, b, atol=1) == (float(want), 1)
  assert diff.compare_values(a, b, atol=float(want)) == (float(want), 0)
  assert diff.compare_values(a, a.copy(), atol=0) == (0.0, 0)
  x = save_step(tmp_path / 'a' / '1', state={'x': a})
  y = save_step(tmp_path / 'b' / '1', state={'x': b})
  done = cli('diff', x, y, '--atol', '1', '--ignore-dtype', '--json')
  assert done.returncode == 1, done.stdout
  assert json.loads(done.stdout)['values'][0]['path'] == 'state/x'


@pytest.mark.parametrize('ints, floats', [
    (np.array([2**62 + 1], np.int64), np.array([2.0**62])),  # float64(2**62 + 1) == 2**62
    (np.array([2**64 - 1], np.uint64), np.array([2.0**64])),  # float64(2**64 - 1) == 2**64
    (np.array([INT64_MIN + 1], np.int64), np.array([-(2.0**63) - 2048])),  # below int64
    (np.array([0], np.int64), np.array([-1e-300])),  # a fraction below zero
    (np.array([2**53 + 1, 7, -3], np.int64), np.array([2.0**53, 7.5, -3.0], np.float32)),
    (np.array([True, False]), np.array([1.0, 0.5], np.float16)),
    (np.array([-5], np.int64), np.array([1e300])),  # far outside the integers
])
def test_diff_compares_integers_against_floats_exactly(tmp_path, ints, floats):
  from fractions import Fraction  # pylint: disable=g-import-not-at-top

  from orbax_tunix.tools import diff

  apart = [abs(Fraction(int(i)) - Fraction(float(f))) for i, f in zip(ints, floats, strict=True)]
  for atol in (0.0, 0.5, 1.0, 4096.0):
    want = (float(max(apart)), sum(d > Fraction(atol) for d in apart))
    assert diff.compare_values(ints, floats, atol=atol) == want, atol
    assert diff.compare_values(floats, ints, atol=atol) == want, atol
  x = save_step(tmp_path / 'a' / '1', state={'x': ints})
  y = save_step(tmp_path / 'b' / '1', state={'x': floats})
  done = cli('diff', x, y, '--ignore-dtype', '--json')
  assert done.returncode == 1, done.stdout
  assert json.loads(done.stdout)['values'][0]['path'] == 'state/x'


@pytest.mark.parametrize('options', [{'atol': float('nan')}, {'atol': -1.0}, {'memory_budget': 0}])
def test_library_diff_refuses_options_that_would_make_everything_match(tmp_path, options):
  from orbax_tunix import errors
  from orbax_tunix.tools import diff

  x = save_step(tmp_path / 'a' / '1', state={'x': np.zeros(2)})
  y = save_step(tmp_path / 'b' / '1', state={'x': np.ones(2)})
  with pytest.raises(errors.InvalidOptionError, match=next(iter(options))):
    diff.diff_checkpoints(x, y, **options)
  assert not diff.diff_checkpoints(x, y).match  # Without them, they differ.


def test_diff_compares_json_items(tmp_path):
  a = save_items(tmp_path / 'a' / '1', state={'w': np.ones(2)}, json_cfg={'lr': 1e-3, 'steps': [1, 2]})
  same = save_items(tmp_path / 's' / '1', state={'w': np.ones(2)}, json_cfg={'lr': 1e-3, 'steps': [1, 2]})
  other = save_items(tmp_path / 'o' / '1', state={'w': np.ones(2)},
                     json_cfg={'lr': 1e-1, 'steps': [1, 2, 3], 'flag': True})
  without = save_items(tmp_path / 'n' / '1', state={'w': np.ones(2)})
  assert cli('diff', a, same).returncode == 0
  doc = json.loads(cli('diff', a, other, '--json').stdout)
  assert doc['match'] is False
  assert doc['json'] == [{'path': 'json_cfg/lr', 'a': '0.001', 'b': '0.1'}]
  assert doc['only_b'] == ['json_cfg/flag', 'json_cfg/steps/2']
  done = cli('diff', a, without)
  assert done.returncode == 1 and 'Only in A' in done.stdout and 'json_cfg' in done.stdout
  done = cli('diff', a, other, '--item', 'json_cfg')
  assert done.returncode == 1 and 'JSON values differ: 1' in done.stdout
  done = cli('diff', a, without, '--item', 'json_cfg')  # Asked for, absent from B: an error.
  assert done.returncode == 2 and 'json_cfg' in done.stderr
  # From Python, `items` may be any iterable: B narrowed as A is (one pass would leave B whole).
  from orbax_tunix.tools import diff

  result = diff.diff_checkpoints(a, without, items=iter(['state']))
  assert result.match and not result.only_a and not result.only_b


def _scaled_learning_rate(src_step: pathlib.Path, dst_step: pathlib.Path, factor: float) -> None:
  """A copy of a Tunix step whose inject_hyperparams learning rate is scaled,
  rewritten with plain Orbax (the model item is copied as it is)."""
  shutil.copytree(src_step, dst_step)
  tree = ocp.PyTreeCheckpointHandler().restore(epath.Path(src_step / 'optimizer_state'))
  hp = tree['opt_state']['hyperparams']['learning_rate']
  hp['value'] = np.asarray(hp['value']) * np.float32(factor)
  shutil.rmtree(dst_step / 'optimizer_state')
  handler = ocp.PyTreeCheckpointHandler()
  handler.save(epath.Path(dst_step / 'optimizer_state'), args=ocp.args.PyTreeSave(tree))
  handler.finalize(epath.Path(dst_step / 'optimizer_state'))


def test_diff_compares_the_inject_hyperparams(tunix_data, tmp_path):
  src = tunix_data / 'adapter_inject' / '1'
  scaled = tmp_path / 'scaled' / '1'
  _scaled_learning_rate(src, scaled, 100)
  done = cli('diff', src, scaled)
  assert done.returncode == 1, done.stdout
  assert 'Hyperparameters differ' in done.stdout
  assert 'optimizer_state/opt_state/hyperparams/learning_rate' in done.stdout
  # Its conversion records them (counts too): it matches its source, not the other.
  converted = tmp_path / 'converted' / '1'
  assert cli('convert', src, converted).returncode == 0
  record = json.loads((converted / '_CHECKPOINT_METADATA').read_text())['custom_metadata']
  side = record['orbax_tunix']['inject_hyperparams']
  assert side['optimizer_state/opt_state/count'] == 1
  assert side['optimizer_state/opt_state/hyperparams/learning_rate'] == pytest.approx(1e-3)
  assert cli('diff', src, converted).returncode == 0
  doc = json.loads(cli('diff', scaled, converted, '--json').stdout)
  assert [m['path'] for m in doc['hyperparameters']] == [
      'optimizer_state/opt_state/hyperparams/learning_rate']
  # Weights only, or the model item alone: the optimizer's shell is not compared.
  assert cli('diff', src, scaled, '--params-only').returncode == 0
  assert cli('diff', src, scaled, '--item', 'model_params').returncode == 0


def test_diff_json_is_strict(tmp_path):
  a = save_step(tmp_path / 'a' / '1', state={'x': np.array([np.nan, 1.0]), 's': 'one'})
  b = save_step(tmp_path / 'b' / '1', state={'x': np.array([2.0, 1.0]), 's': 'two'})

  def refuse(constant):
    raise ValueError(f'not strict JSON: {constant}')

  done = cli('diff', a, b, '--json', '--atol', 'inf')
  assert done.returncode == 1
  doc = json.loads(done.stdout, parse_constant=refuse)
  assert doc['max_abs_diff'] == 'inf' and doc['atol'] == 'inf'
  assert {v['path']: v['max_abs_diff'] for v in doc['values']} == {'state/s': 'inf', 'state/x': 'inf'}


def test_items_holding_empty_containers_are_structure(tmp_path):
  """A plain optax inject_hyperparams state holds `hyperparams_states: {}`."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  tx = optax.inject_hyperparams(optax.adam)(learning_rate=1e-3)
  state = tx.init({'w': jnp.ones(3)})
  src = save_step(tmp_path / 'src' / '1', opt=state, other={'a': {}, 'b': [], 'c': np.ones(2)})
  before = snapshot(tmp_path / 'src')
  done = cli('inspect', src, '--json')
  assert done.returncode == 0, done.stderr
  assert set(json.loads(done.stdout)['items']['other']['leaves']) == {'c'}
  dst = tmp_path / 'out' / '1'
  done = cli('convert', src, dst)
  assert done.returncode == 0, done.stderr
  assert cli('diff', src, dst).returncode == 0
  restored = plain_restore(dst)
  assert restored['other']['a'] == {} and restored['other']['b'] == []
  assert restored['opt']['hyperparams_states'] == {}
  assert snapshot(tmp_path / 'src') == before


# --- a closed output never turns a result into another ------------------------------


def _differing_pair(tmp_path: pathlib.Path, n: int = 3000) -> tuple[pathlib.Path, pathlib.Path]:
  """Two steps whose every leaf differs: the diff prints well over a pipe's 64 KiB."""
  names = {f'leaf_with_a_long_name_to_fill_the_pipe_{i:05d}': i for i in range(n)}
  a = save_step(tmp_path / 'a' / '1', state={k: np.float32(v) for k, v in names.items()})
  b = save_step(tmp_path / 'b' / '1', state={k: np.float32(v + 1) for k, v in names.items()})
  return a, b


def _with_closed_stdout(*argv: object, read: int = 0) -> subprocess.Popen:
  """Runs the CLI with stdout a pipe whose reader reads `read` lines, then closes it."""
  process = subprocess.Popen(
      [sys.executable, '-m', 'orbax_tunix.cli', *map(str, argv)], stdout=subprocess.PIPE,
      stderr=subprocess.PIPE, env=ENV, cwd=REPO)
  for _ in range(read):
    process.stdout.readline()
  process.stdout.close()  # The reader goes away (`| head -1`).
  process.wait(timeout=300)
  return process


def test_closed_stdout_keeps_the_exit_status(tmp_path):
  a, b = _differing_pair(tmp_path)
  # Closed before the first write, after the first line, and through a shell's `| head -1`.
  assert _with_closed_stdout('diff', a, b).returncode == 1
  assert _with_closed_stdout('diff', a, b, read=1).returncode == 1
  assert _with_closed_stdout('diff', a, b, '--json').returncode == 1
  assert _with_closed_stdout('diff', a, a).returncode == 0
  missing = _with_closed_stdout('diff', a, tmp_path / 'nothing')
  assert missing.returncode == 2 and b'no such file' in missing.stderr.read()
  shell = subprocess.run(
      ['bash', '-c', f'"{sys.executable}" -m orbax_tunix.cli diff "{a}" "{b}" | head -1;'
       ' echo "status=${PIPESTATUS[0]}"'], capture_output=True, text=True, env=ENV, cwd=REPO,
      timeout=300)
  assert shell.stdout.strip().endswith('status=1'), shell.stdout + shell.stderr
  assert 'Traceback' not in shell.stderr and 'Broken pipe' not in shell.stderr, shell.stderr
  # inspect --verify: damaged arrays stay 1, a sound step 0.
  rng = np.random.default_rng(0)
  src = save_step(tmp_path / 'src' / '1', state={'w': rng.standard_normal((256, 256)).astype(np.float32)})
  dst = tmp_path / 'converted' / '1'
  assert cli('convert', src, dst).returncode == 0
  assert _with_closed_stdout('inspect', dst, '--verify').returncode == 0
  data = max((dst / 'state' / 'ocdbt.process_0' / 'd').iterdir(), key=lambda p: p.stat().st_size)
  raw = bytearray(data.read_bytes())
  raw[len(raw) // 2] ^= 0x01  # Inside the array's compressed chunk: its checksum fails.
  data.write_bytes(bytes(raw))
  assert cli('inspect', dst, '--verify').returncode == 1
  for read in (0, 1):
    done = _with_closed_stdout('inspect', dst, '--verify', read=read)
    assert done.returncode == 1
    assert b'Traceback' not in done.stderr.read()


def test_verify_names_every_unreadable_array_and_exits_1(tmp_path):
  """Truncated data files: every array they held is reported damaged (exit 1), the others
  checked. Which arrays are unreadable is asked of plain Orbax, one array at a time."""
  rng = np.random.default_rng(0)
  state = {f'w{i}': rng.standard_normal((128, 128)).astype(np.float32) for i in range(6)}
  src = save_step(tmp_path / 'src' / '1', state=state)
  dst = tmp_path / 'out' / '1'
  assert cli('convert', src, dst, '--memory-budget', '2G').returncode == 0
  files = sorted((dst / 'state' / 'ocdbt.process_0' / 'd').iterdir(), key=lambda p: p.stat().st_size)
  for data in files[-2:]:
    data.write_bytes(data.read_bytes()[:data.stat().st_size // 3])
  item = dst / 'state'
  meta = ocp.PyTreeCheckpointHandler().metadata(item).tree
  unreadable = []
  for name in state:
    try:
      ocp.PyTreeCheckpointHandler().restore(item, args=ocp.args.PyTreeRestore(
          {name: meta[name]}, partial_restore=True))
    except Exception:  # noqa: BLE001  (any failure: plain Orbax cannot read it)
      unreadable.append(f'state/{name}')
  assert 0 < len(unreadable) < len(state)
  done = cli('inspect', dst, '--verify', '--json')
  assert done.returncode == 1, done.stderr
  found = json.loads(done.stdout)['verify']
  assert sorted(found['unreadable']) == unreadable and not found['ok']
  assert found['checked'] == len(state) - len(unreadable) and not found['damaged']
  done = cli('inspect', dst, '--verify')
  assert done.returncode == 1 and 'FAILED' in done.stdout
  assert f'damaged: stored data missing or unreadable: {len(unreadable)}' in done.stdout
  # diff reads the same way: each unreadable array is damaged in B (exit 1), the rest compared.
  done = cli('diff', src, dst, '--json')
  assert done.returncode == 1, done.stderr
  found = json.loads(done.stdout)
  assert sorted(found['damaged_b']) == unreadable and not found['damaged_a']
  assert not found['values'] and found['compared'] == len(state)


def test_verify_checks_the_items_asked_for(tunix_data, tmp_path):
  dst = tmp_path / 'converted' / '1'
  assert cli('convert', tunix_data / 'adapter_inject', dst).returncode == 0
  for argv in (('inspect', dst, '--verify', '--item', 'model_params'),
               ('inspect', dst / 'model_params', '--verify')):
    done = cli(*argv)
    assert done.returncode == 0, done.stdout
    assert 'missing' not in done.stdout and 'ok: 14 arrays checked' in done.stdout
  shutil.rmtree(dst / 'optimizer_state')  # Recorded, gone: missing when the step is checked.
  assert cli('inspect', dst, '--verify', '--item', 'model_params').returncode == 0
  done = cli('inspect', dst, '--verify')
  assert done.returncode == 1 and 'recorded but missing from the step: 30' in done.stdout


# --- a failed read leaves nothing behind ------------------------------------------------


def _truncated_at_read_time(root: pathlib.Path) -> pathlib.Path:
  """A step whose OCDBT index is sound and whose largest data file is cut in half:
  the listing and the headers read, the array reads fail (some, while others run)."""
  rng = np.random.default_rng(0)
  tree = {'layers': {str(i): {'w': {'value': rng.standard_normal((256, 256)).astype(np.float32)}}
                     for i in range(20)}}
  step = save_step(root / '1', model_params=tree)
  data = max((step / 'model_params').rglob('d/*'), key=lambda p: p.stat().st_size)
  data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
  return step


def test_failed_reads_leave_no_task_or_coroutine_behind(tmp_path):
  """Orbax abandons its other reads when one fails; they are drained, not collected later."""
  import gc  # pylint: disable=g-import-not-at-top
  import logging  # pylint: disable=g-import-not-at-top

  import orbax_tunix as ot  # pylint: disable=g-import-not-at-top
  from orbax_tunix.reading import reader

  step = _truncated_at_read_time(tmp_path / 'run')
  reports = []

  class Collect(logging.Handler):
    def emit(self, record):
      reports.append(record.getMessage())

  handler, hook = Collect(), sys.unraisablehook
  logging.getLogger('asyncio').addHandler(handler)
  # TensorStore's own callbacks into a closed loop ('Event loop is closed') are
  # not ours to drain; the CLI drops those (commands._LOOP_NOISE).
  sys.unraisablehook = lambda r: reports.append(r) if 'Event loop is closed' not in str(
      r.exc_value) else None
  try:
    for _ in range(5):
      ckpt = reader.open_source(step, whole=False)
      with pytest.raises(ot.CorruptMetadataError, match='reading the arrays failed'):
        reader.read(ckpt, 'model_params', ckpt.items['model_params'])
      del ckpt
      gc.collect()
  finally:
    sys.unraisablehook = hook
    logging.getLogger('asyncio').removeHandler(handler)
  assert reports == []


def test_convert_of_truncated_data_prints_one_message(tmp_path):
  step = _truncated_at_read_time(tmp_path / 'run')
  before = snapshot(tmp_path / 'run')
  for attempt in range(6):  # It was one run in two (or three) before.
    done = cli('convert', step, tmp_path / 'out' / '1')
    assert done.returncode == 2
    assert len(done.stderr.splitlines()) == 1, (attempt, done.stderr)
    assert done.stderr.startswith(f'orbax-tunix: error: {step / "model_params"}: ')
  assert not (tmp_path / 'out').exists() and snapshot(tmp_path / 'run') == before


def test_force_interrupted_after_the_commit_says_it_is_committed(tunix_data, tmp_path):
  """SIGINT while --force removes the old step it moved aside, the new one already renamed
  into place: the message says DST holds the new step (it said 'nothing was written'), and
  nothing is left beside it."""
  import signal  # noqa: PLC0415

  dst = tmp_path / 'out' / '1'
  assert cli('convert', tunix_data / 'sft_full', dst, '--step', '1').returncode == 0
  done = subprocess.run(
      [sys.executable, str(REPO / 'tests' / 'signal_in_commit.py'), str(int(signal.SIGINT)),
       'cleanup', 'convert', str(tunix_data / 'sft_full'), str(dst), '--force'],
      capture_output=True, text=True, env=ENV, cwd=REPO, timeout=300)
  assert done.returncode == 130, done.stderr
  assert (f'orbax-tunix: interrupted; {dst} holds the new checkpoint step, complete (committed'
          ' before the interruption).') in done.stderr, done.stderr
  assert sorted(p.name for p in dst.parent.iterdir()) == ['1']
  assert cli('diff', tunix_data / 'sft_full' / '2', dst).returncode == 0  # The new one, whole.


@pytest.mark.parametrize('marker', ['', '{"run": "r", "host": "h", "pid": 1}'])
def test_a_local_folder_holding_the_writing_marker_is_refused_as_without_it(
    tunix_data, tmp_path, capsys, marker):
  """`.orbax-tunix-writing` (empty, or text copied from a bucket) in a local folder of one's
  own: no command takes it for an interrupted run's (none claims a local destination: it is
  written beside and renamed onto it), so each refuses the folder as it would without the
  marker, `--force` or not, and nothing in it is touched."""
  from orbax_tunix.cli import commands  # noqa: PLC0415
  from orbax_tunix.writing import commit  # noqa: PLC0415

  mine = tmp_path / 'mine'
  (mine / 'eval').mkdir(parents=True)
  (mine / 'NOTES.md').write_text('my notes')
  (mine / 'eval' / 'score.json').write_text('{"score": 1}')
  (mine / commit.MARKER).write_text(marker)
  before = snapshot(mine)
  for argv in (['convert', tunix_data / 'hf_qwen3', mine],
               ['export', tunix_data / 'hf_qwen3', mine, '--model', 'qwen3'],
               ['export', tunix_data / 'hf_qwen3_lora', mine, '--model', 'qwen3', '--peft',
                '--lora-alpha', '3']):
    for flags in ([], ['--force']):
      status = commands.main([str(a) for a in [*argv, *flags]])
      err = capsys.readouterr().err
      assert status == 2 and f'{mine}: expected a new (or empty) directory' in err, err
      assert 'NOTES.md' in err and 'never claims a local destination' in err, err
      assert snapshot(mine) == before
  assert sorted(p.name for p in tmp_path.iterdir()) == ['mine']  # Nothing beside it either.

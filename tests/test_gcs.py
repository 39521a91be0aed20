"""Every public entry point on gs://, against a real GCS emulator (fake-gcs-server).

Checkpoints in the bucket are written there by Orbax (its CheckpointManager,
straight to gs://) or are the committed google-tunix fixtures uploaded file by
file. Expected values come from plain Orbax reads of the local fixtures.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from etils import epath

import orbax_tunix as ot
from orbax_tunix import maxtext
from orbax_tunix.reading import planned_item
from orbax_tunix.writing import commit
from tests import builders, test_lora_merge, tunix_models
from tests import gcs as gcs_lib
from tests.test_cli import REPO, SUBPROCESS_ENV, run
from tests.test_handlers import SPECS, _abstract, _assert_values, _leaves, expected_leaves
from tests.test_maxtext import TinyLM, abstract_state, adamw, assert_restored


@pytest.fixture(scope='module')
def uploaded(gcs, tunix_data):
  """The committed fixtures, uploaded to one bucket: {name: gs:// root}."""
  remote = epath.Path(gcs.bucket())
  roots = {}
  for name in ('sft_full', 'v1_writer', 'adapter_inject'):
    gcs_lib.upload(tunix_data / name, remote / name)
    roots[name] = remote / name
  return roots


def orbax_steps(root) -> list[int]:
  """The steps Orbax itself takes as committed under `root`."""
  with ocp.CheckpointManager(root, options=ocp.CheckpointManagerOptions(read_only=True)) as m:
    return list(m.all_steps())


# --- detection: committed exactly as Orbax decides it on a bucket ----------------


def test_detect_root_step_and_item(uploaded):
  root = uploaded['sft_full']
  found = ot.detect(root)
  assert (found.step, found.step_dir) == (2, root / '2')
  assert ot.detect(root / '1').step == 1
  item = ot.detect(root / '2' / 'model_params')
  assert item.kind == found.kind and item.rewrites == {'model_params': ('nnx_value',)}
  assert [s.step for s in found.steps if s.committed] == orbax_steps(root) == [1, 2]


def test_step_without_commit_file_is_unfinished(uploaded, bucket, capsys, tunix_data, tmp_path):
  """Step 2 lacking its commit_success.txt files: Orbax's latest is 1, so is ours."""
  root = bucket / 'run'
  gcs_lib.upload(tunix_data / 'sft_full', root)
  for marker in (tunix_data / 'sft_full' / '2').rglob(commit.COMMIT_SUCCESS):
    (root / marker.relative_to(tunix_data / 'sft_full').as_posix()).unlink()
  assert orbax_steps(root) == [1]
  found = ot.detect(root)
  assert found.step == 1
  restored = ocp.Checkpointer(ot.TunixAwareHandler()).restore(found.step_dir)
  _assert_values(restored['model_params'],
                 expected_leaves(tunix_data / 'sft_full' / '1', 'model_params', {}))
  with pytest.raises(ot.UncommittedStepError, match='commit_success.txt'):
    ot.detect(root / '2')
  status, out, _ = run(capsys, 'inspect', root, '--json')
  assert status == 0 and json.loads(out)['step'] == 1
  status, _, _ = run(capsys, 'convert', root, tmp_path / 'out' / '1')
  assert status == 0
  record = ocp.metadata.metadata_store(enable_write=False).read(
      tmp_path / 'out' / '1' / '_CHECKPOINT_METADATA')['custom_metadata']['orbax_tunix']
  assert (record['source_step'], record['source']) == (1, os.fspath(root / '1'))


def test_save_failed_before_commit_is_skipped(bucket, monkeypatch):
  """An Orbax save to gs:// that fails before its commit file: no step, for both."""
  root = bucket / 'run'
  model, optimizer = builders.make(builders.Model(nnx_rngs()), builders.optax.adam(1e-3))
  builders.save_tunix(root, 1, model, optimizer)

  def fail(self, *args, **kwargs):
    raise RuntimeError('simulated preemption before the commit')

  monkeypatch.setattr(ocp.path.atomicity.CommitFileTemporaryPath, 'finalize', fail)
  with pytest.raises(RuntimeError, match='simulated preemption'):
    builders.save_tunix(root, 5, model, optimizer)
  monkeypatch.undo()
  assert (root / '5' / '_CHECKPOINT_METADATA').exists()  # Orbax wrote it first.
  assert orbax_steps(root) == [1]
  assert ot.detect(root).step == 1


def nnx_rngs():
  from flax import nnx  # pylint: disable=g-import-not-at-top

  return nnx.Rngs(0)


# --- restores ------------------------------------------------------------------


def test_composite_restore_without_target(uploaded, tunix_data):
  step_dir = ot.detect(uploaded['adapter_inject']).step_dir
  restored = ocp.Checkpointer(ot.TunixAwareHandler()).restore(step_dir)
  local = tunix_data / 'adapter_inject' / '1'
  for item in ('model_params', 'optimizer_state'):
    _assert_values(restored[item], expected_leaves(local, item, SPECS['adapter_inject']))


def test_composite_and_item_restores_into_sharded_target(uploaded, tunix_data, mesh):
  step_dir = ot.detect(uploaded['adapter_inject']).step_dir
  local = tunix_data / 'adapter_inject' / '1'
  ckptr = ocp.Checkpointer(ot.TunixAwareHandler())
  meta = ckptr.metadata(step_dir).item_metadata
  target = _abstract(meta['model_params'].tree, mesh, jnp.bfloat16)
  expected = expected_leaves(local, 'model_params', SPECS['adapter_inject'])
  composite = ckptr.restore(step_dir, args=ocp.args.Composite(
      model_params=ocp.args.PyTreeRestore(item=target)))['model_params']
  item = ocp.Checkpointer(ot.TunixPyTreeHandler()).restore(
      step_dir / 'model_params', args=ocp.args.StandardRestore(target))
  for restored in (composite, item):
    got, want = _leaves(restored), _leaves(target)
    assert set(got) == set(want) == set(expected)
    for path, sds in want.items():
      assert (got[path].sharding, got[path].dtype) == (sds.sharding, sds.dtype), path
      np.testing.assert_array_equal(
          np.asarray(got[path]), expected[path].astype(sds.dtype), err_msg=path)


def test_checkpoint_manager_writes_and_restores_on_bucket(bucket, tmp_path):
  """Orbax's CheckpointManager with our registry, writing Tunix steps to gs://."""
  from flax import nnx  # pylint: disable=g-import-not-at-top

  model, optimizer = builders.make(builders.Model(nnx.Rngs(1)), builders.optax.adam(1e-3))
  root = bucket / 'managed'
  options = ocp.CheckpointManagerOptions(max_to_keep=2)
  with ocp.CheckpointManager(root, options=options, handler_registry=ot.handler_registry()) as m:
    for step in (10, 20, 30):
      m.save(step, args=ocp.args.Composite(
          model_params=ocp.args.PyTreeSave(nnx.state(model)),
          optimizer_state=ocp.args.PyTreeSave(nnx.state(optimizer, nnx.optimizer.OptState))))
    m.wait_until_finished()
    assert m.all_steps() == [20, 30]
  with ocp.CheckpointManager(root, handler_registry=ot.handler_registry()) as m:
    assert m.all_steps() == [20, 30]
    restored = m.restore(m.latest_step())
  assert ot.detect(root).step == 30
  local = builders.save_tunix(tmp_path, 30, model, optimizer)  # same state, on disk
  for item in ('model_params', 'optimizer_state'):
    _assert_values(restored[item], expected_leaves(local, item, {}))


def test_v1_load_checkpointables(uploaded, tunix_data):
  ot.register()
  step_dir = ot.detect(uploaded['v1_writer']).step_dir
  state = ocp.v1.load_checkpointables(step_dir)
  _assert_values(state['model_params'],
                 expected_leaves(tunix_data / 'v1_writer' / '2', 'model_params', {}))


@pytest.mark.parametrize('params_only', [False, True])
def test_maxtext_restore_train_state(uploaded, tunix_data, mesh, params_only):
  abstract = abstract_state(TinyLM(), adamw(), mesh)
  restored = maxtext.restore_train_state(uploaded['sft_full'], abstract, params_only=params_only)
  kept = ('opt_state', 'step') if params_only else ()
  filled = () if params_only else ['opt_state/2/count']
  assert_restored(restored, abstract, tunix_data / 'sft_full' / '2', {'0': 'opt_state/0'},
                  filled=filled, kept=kept)


def test_hyperparameters(uploaded, tunix_data):
  raw = builders.raw_leaves(tunix_data / 'adapter_inject' / '1' / 'optimizer_state')
  found = ot.hyperparameters(uploaded['adapter_inject'])
  assert set(found) == {'opt_state'}
  for name, value in found['opt_state'].items():
    np.testing.assert_array_equal(value, raw[f'opt_state/hyperparams/{name}/value'], err_msg=name)


# --- the command line ----------------------------------------------------------


def test_inspect_and_json(uploaded, tunix_data, capsys):
  status, out, _ = run(capsys, 'inspect', uploaded['sft_full'])
  assert status == 0 and 'gs://' in out and 'layers' in out
  status, out, _ = run(capsys, 'inspect', uploaded['sft_full'], '--json')
  assert status == 0
  doc = json.loads(out)
  manifest = json.loads((tunix_data / 'MANIFEST.json').read_text())
  on_disk = manifest['fixtures']['sft_full']['step_items']['2']['items']['model_params']
  assert doc['step'] == 2
  # The weights' shapes as google-tunix recorded them when it wrote the fixture.
  want = {entry['path'][: -len('/value')]: entry['shape'] for entry in on_disk}
  got = {path: leaf['shape'] for path, leaf in doc['items']['model_params']['leaves'].items()}
  assert got == want


def restore_plain(step_dir):
  """A converted step read by plain Orbax, without this package."""
  with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckptr:
    return ckptr.restore(step_dir)


@pytest.mark.parametrize('src_on_bucket, dst_on_bucket', [(False, True), (True, False), (True, True)])
def test_convert_both_layouts_and_diff(uploaded, tunix_data, bucket, tmp_path, capsys,
                                       src_on_bucket, dst_on_bucket):
  src = uploaded['sft_full'] if src_on_bucket else tunix_data / 'sft_full'
  base = bucket if dst_on_bucket else tmp_path
  local_step = tunix_data / 'sft_full' / '2'
  canonical, maxtext_dst = base / 'canonical' / '2', base / 'maxtext' / '2'

  assert run(capsys, 'convert', src, canonical)[0] == 0
  assert run(capsys, 'convert', src, maxtext_dst, '--layout', 'maxtext', '--params-only')[0] == 0
  assert orbax_steps(base / 'canonical') == [2]
  restored = restore_plain(canonical)
  for item in ('model_params', 'optimizer_state'):
    _assert_values(restored[item], expected_leaves(local_step, item, {}))
  items = restore_plain(maxtext_dst)['items']
  _assert_values(items['params']['params'], expected_leaves(local_step, 'model_params', {}))
  # A bucket against a disk, both ways round.
  assert run(capsys, 'diff', canonical, tunix_data / 'sft_full')[0] == 0
  assert run(capsys, 'diff', uploaded['sft_full'], tunix_data / 'sft_full' / '1')[0] == 1
  status, out, _ = run(capsys, 'inspect', canonical, '--verify')
  assert status == 0, out


def test_force_replaces_a_bucket_step_once_complete(uploaded, bucket, capsys, tunix_data):
  dst = bucket / 'out' / '7'
  assert run(capsys, 'convert', uploaded['sft_full'], dst, '--step', '1')[0] == 0
  status, _, err = run(capsys, 'convert', uploaded['sft_full'], dst)
  assert status == 2 and 'force' in err
  assert run(capsys, 'convert', uploaded['sft_full'], dst, '--force')[0] == 0
  assert orbax_steps(bucket / 'out') == [7]
  assert commit.leftovers(dst) == []
  restored = restore_plain(dst)
  _assert_values(restored['model_params'],
                 expected_leaves(tunix_data / 'sft_full' / '2', 'model_params', {}))


def test_killed_convert_into_bucket_leaves_no_finished_step(bucket, tmp_path):
  """SIGKILL mid-write: Orbax, detect and inspect see no step; a rerun succeeds."""
  src = tmp_path / 'src'
  big = {f'w{i}': np.full((256, 1024), i, np.float32) for i in range(24)}  # 24 MiB
  with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckptr:
    ckptr.save(src / '1', args=ocp.args.Composite(
        model_params=ocp.args.PyTreeSave({k: {'value': v} for k, v in big.items()})))
  root = bucket / 'converted'
  dst = root / '1'
  command = [sys.executable, '-m', 'orbax_tunix.cli', 'convert', str(src), str(dst),
             '--memory-budget', '1MiB']
  process = subprocess.Popen(command, cwd=REPO, env=SUBPROCESS_ENV,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
  deadline = time.monotonic() + 120
  while not (dst / 'model_params').exists():
    assert process.poll() is None, process.stderr.read().decode()
    assert time.monotonic() < deadline, 'convert never started writing'
    time.sleep(0.05)
  process.send_signal(signal.SIGKILL)
  process.wait()
  assert (dst / commit.MARKER).exists() and not (dst / commit.COMMIT_SUCCESS).exists()
  assert orbax_steps(root) == []
  with pytest.raises(ot.UncommittedStepError, match='unfinished'):
    ot.detect(root)
  inspected = subprocess.run([sys.executable, '-m', 'orbax_tunix.cli', 'inspect', str(root)],
                             cwd=REPO, env=SUBPROCESS_ENV, capture_output=True, text=True)
  assert inspected.returncode == 2, inspected.stdout
  rerun = subprocess.run(command, cwd=REPO, env=SUBPROCESS_ENV, capture_output=True, text=True)
  assert rerun.returncode == 0, rerun.stderr
  assert orbax_steps(root) == [1]
  restored = restore_plain(dst)['model_params']
  for name, value in big.items():
    np.testing.assert_array_equal(np.asarray(restored[name]), value, err_msg=name)


def _cli(*argv, script=None, check=None):
  """The real CLI in a subprocess (through a test script when given)."""
  command = [sys.executable, *(['-m', 'orbax_tunix.cli'] if script is None else
                               [str(REPO / 'tests' / script)]), *map(str, argv)]
  done = subprocess.run(command, cwd=REPO, env=SUBPROCESS_ENV, capture_output=True, text=True,
                        timeout=600)
  assert 'Traceback' not in done.stderr, done.stderr
  if check is not None:
    assert done.returncode == check, done.stderr
  return done


def _model_params(step_dir):
  return restore_plain(step_dir)['model_params']


@pytest.mark.parametrize('signum, where', [
    (signal.SIGTERM, 'copy:2'),   # A preemption while the new step is copied in.
    (signal.SIGINT, 'empty'),     # Ctrl-C while the old step is emptied.
])
def test_force_interrupted_while_copying_in_keeps_the_complete_new_step(
    uploaded, bucket, tunix_data, signum, where):
  """--force on a bucket (no rename): interrupted once the old step was made unfinished,
  the complete new step is kept beside it and the message says where; DST is an unfinished
  step Orbax skips (never a mixed one); a rerun writes it."""
  root = bucket / 'out'
  dst = root / '7'
  _cli('convert', uploaded['sft_full'], dst, '--step', '1', check=0)
  done = _cli(signum, where, 'convert', uploaded['sft_full'], dst, '--force',
              script='signal_in_commit.py', check=130)
  (staging,) = commit.leftovers(dst)
  assert re.search(rf'interrupted; the new checkpoint step is complete at {re.escape(str(staging))};'
                   rf' {re.escape(str(dst))} is unfinished \(it holds .*skip it\); the old one is'
                   ' gone. Run again', done.stderr), done.stderr
  assert 'nothing was written' not in done.stderr
  assert orbax_steps(root) == []  # DST: an unfinished step.
  assert not (dst / commit.COMMIT_SUCCESS).exists()
  expected = expected_leaves(tunix_data / 'sft_full' / '2', 'model_params', {})
  _assert_values(_model_params(staging), expected)  # The new step, whole, where it says.
  rerun = _cli('convert', uploaded['sft_full'], dst, check=0)
  assert f'note: {staging} is left from an interrupted conversion' in rerun.stderr, rerun.stderr
  assert orbax_steps(root) == [7]
  _assert_values(_model_params(dst), expected)


def test_force_interrupted_after_the_commit_says_it_is_committed(uploaded, bucket, tunix_data):
  """SIGINT while the staging copy is removed, the new step already committed in DST: the
  message says DST holds the new step (not 'nothing was written')."""
  root = bucket / 'out'
  dst = root / '7'
  _cli('convert', uploaded['sft_full'], dst, '--step', '1', check=0)
  done = _cli(signal.SIGINT, 'cleanup', 'convert', uploaded['sft_full'], dst, '--force',
              script='signal_in_commit.py', check=130)
  assert f'interrupted; {dst} holds the new checkpoint step, complete (committed before the' \
      ' interruption)' in done.stderr, done.stderr
  assert orbax_steps(root) == [7]
  _assert_values(_model_params(dst), expected_leaves(tunix_data / 'sft_full' / '2',
                                                     'model_params', {}))


def test_force_interrupted_before_the_copy_leaves_the_old_step(uploaded, bucket, tunix_data):
  """SIGTERM while the new step is still being written beside the old one: the old step
  is untouched and committed, nothing is left beside it."""
  root = bucket / 'out'
  dst = root / '7'
  _cli('convert', uploaded['sft_full'], dst, '--step', '1', check=0)
  done = _cli(signal.SIGTERM, 1, 'convert', uploaded['sft_full'], dst, '--force',
              script='signal_mid_write.py', check=130)
  assert 'interrupted; nothing was written at the destination' in done.stderr, done.stderr
  assert orbax_steps(root) == [7] and commit.leftovers(dst) == []
  _assert_values(_model_params(dst), expected_leaves(tunix_data / 'sft_full' / '1',
                                                     'model_params', {}))


def test_a_second_run_into_a_step_another_run_writes_is_refused(bucket, tmp_path):
  """A resubmitted job: a second convert into the step a live convert is writing in place
  refuses (deleting nothing); the first one finishes and its step is whole."""
  src = tmp_path / 'src'
  big = {f'w{i}': np.full((64, 64), i, np.float32) for i in range(6)}
  with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckptr:
    ckptr.save(src / '1', args=ocp.args.Composite(
        model_params=ocp.args.PyTreeSave({k: {'value': v} for k, v in big.items()})))
  root = bucket / 'converted'
  dst = root / '1'
  go = tmp_path / 'go'
  first = subprocess.Popen(
      [sys.executable, str(REPO / 'tests' / 'pause_mid_write.py'), str(go), '1', 'convert',
       str(src), str(dst), '--memory-budget', '64KiB'],
      cwd=REPO, env=SUBPROCESS_ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  try:
    deadline = time.monotonic() + 300
    while not pathlib.Path(f'{go}.paused').exists():
      assert first.poll() is None, first.communicate()
      assert time.monotonic() < deadline, 'the first convert never started writing'
      time.sleep(0.1)
    for flags in ((), ('--force',)):
      second = _cli('convert', src, dst, *flags, check=2)
      assert re.search(r'being written by another run \(run \S+, process '
                       rf'{first.pid} on this host\); a run never deletes', second.stderr), \
          second.stderr
      assert (dst / commit.MARKER).exists()
  finally:
    go.write_text('go')
    out, err = first.communicate(timeout=600)
  assert first.returncode == 0, err
  assert orbax_steps(root) == [1]
  restored = _model_params(dst)
  for name, value in big.items():
    np.testing.assert_array_equal(np.asarray(restored[name]), value, err_msg=name)
  assert _cli('convert', src, dst, check=2).stderr.count('already exists') == 1  # Committed.


def _small_step(tmp_path) -> tuple[pathlib.Path, dict[str, np.ndarray]]:
  """A step of six small arrays (a conversion of it makes six saves at 64 KiB a batch)."""
  big = {f'w{i}': np.full((64, 64), i, np.float32) for i in range(6)}
  with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckptr:
    ckptr.save(tmp_path / 'src' / '1', args=ocp.args.Composite(
        model_params=ocp.args.PyTreeSave({k: {'value': v} for k, v in big.items()})))
  return tmp_path / 'src' / '1', big


def _paused_convert(src, dst, go, *, elsewhere: bool) -> subprocess.Popen:
  """A convert into `dst` (on this host, or as on another host: `as_another_host.py`),
  paused once its first array save has started writing in place, until `go` exists."""
  another = [str(REPO / 'tests' / 'as_another_host.py')] if elsewhere else []
  writer = subprocess.Popen(
      [sys.executable, *another, str(REPO / 'tests' / 'pause_mid_write.py'), str(go), '1',
       'convert', str(src), str(dst), '--memory-budget', '64KiB'],
      cwd=REPO, env=SUBPROCESS_ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  deadline = time.monotonic() + 300
  while not pathlib.Path(f'{go}.paused').exists():
    assert writer.poll() is None, writer.communicate()
    assert time.monotonic() < deadline, 'the convert never started writing'
    time.sleep(0.1)
  return writer


_REAL_TIME, _REAL_TIME_NS = time.time, time.time_ns


def _clock(monkeypatch, offset: float) -> None:
  """This host's clock, `offset` seconds off (for every reader of it in this process)."""
  monkeypatch.setattr(time, 'time', lambda: _REAL_TIME() + offset)
  monkeypatch.setattr(time, 'time_ns', lambda: _REAL_TIME_NS() + int(offset * 1e9))


def test_a_claim_from_another_host_is_judged_by_the_stores_clock(bucket, tmp_path, capsys,
                                                                 monkeypatch):
  """A run on another host (its process cannot be looked up from here) writes a step in
  place, paused mid-write. With this host's clock an hour ahead, a second run still finds
  its claim live, `--force` or not, and deletes nothing: a claim's age is the store's (its
  modification time against an object written now), never two hosts' clocks compared.
  Killed, its claim lapses after `LEASE_SECONDS` of the store's time, with this host's
  clock an hour behind too; then the rerun replaces what it left."""
  src, big = _small_step(tmp_path)
  root = bucket / 'converted'
  dst = root / '1'
  go = tmp_path / 'go'
  writer = _paused_convert(src, dst, go, elsewhere=True)
  try:
    _clock(monkeypatch, +3600)
    for flags in ((), ('--force',)):
      status, _, err = run(capsys, 'convert', src, dst, *flags)
      assert status == 2 and re.search(
          r'being written by another run \(run \S+, process \d+ on host elsewhere, its claim'
          r" last renewed \d+ s ago by the store's clock\); a run never deletes", err), err
      assert (dst / commit.MARKER).exists() and (dst / 'model_params').exists()
    writer.kill()  # Its host dies: nothing removes its claim.
    writer.wait()
    status, _, err = run(capsys, 'convert', src, dst)  # Dead, but only just, by the store.
    assert status == 2 and 'being written by another run' in err, err
    _clock(monkeypatch, -3600)
    monkeypatch.setattr(commit, 'LEASE_SECONDS', 2.0)
    time.sleep(2.5)  # Of the store's time too: the emulator runs on this host's real clock.
    status, _, err = run(capsys, 'convert', src, dst)
    assert status == 0, err
  finally:
    go.write_text('go')
    if writer.poll() is None:
      writer.kill()
    writer.communicate()
  assert orbax_steps(root) == [1] and commit.leftovers(dst) == []
  restored = _model_params(dst)
  for name, value in big.items():
    np.testing.assert_array_equal(np.asarray(restored[name]), value, err_msg=name)


def test_a_folder_holding_the_writing_marker_is_refused_unless_its_claim_proves_it(
    bucket, tmp_path, tunix_data, capsys):
  """`.orbax-tunix-writing` in a folder is a leftover to replace only where it holds this
  package's claim for that very folder naming every entry there: a marker copied from a real
  leftover into a folder of one's own, an empty one, or a real leftover one has added to, is
  refused by every command as the folder would be without it (`--force` too), deleting
  nothing; the real leftover alone is replaced."""
  src, big = _small_step(tmp_path)
  leftover = bucket / 'converted' / '1'
  go = tmp_path / 'go'
  writer = _paused_convert(src, leftover, go, elsewhere=False)
  writer.kill()  # An interrupted run: its claim and a partial item are left.
  writer.communicate()
  claim = (leftover / commit.MARKER).read_text()
  mine = bucket / 'mine'
  notes = {'NOTES.md': 'my notes', 'eval/score.json': '{"score": 1}'}
  for name, text in notes.items():
    (mine / name).parent.mkdir(parents=True, exist_ok=True)
    (mine / name).write_text(text)
  commands = [('convert', src, mine), ('export', tunix_data / 'hf_qwen3', mine, '--model', 'qwen3'),
              ('export', tunix_data / 'hf_qwen3_lora', mine, '--model', 'qwen3', '--peft',
               '--lora-alpha', '3')]
  for marker, why in ((claim, 'its claim is for another location (gs://'),
                      ('', 'it holds no claim of this package')):
    (mine / commit.MARKER).write_text(marker)
    for argv in commands:
      for flags in ((), ('--force',)):
        status, _, err = run(capsys, *argv, *flags)
        assert status == 2, err
        assert f'{commit.MARKER} is no sign of an interrupted run of this package ({why}' in err
        assert 'NOTES.md' in err and 'Traceback' not in err, err
        assert {name: (mine / name).read_text() for name in notes} == notes
  (leftover / 'NOTES.md').write_text('added to a leftover')
  status, _, err = run(capsys, 'convert', src, leftover)
  assert status == 2 and 'its claim does not name NOTES.md' in err, err
  assert (leftover / 'NOTES.md').read_text() == 'added to a leftover'
  (leftover / 'NOTES.md').unlink()
  assert run(capsys, 'convert', src, leftover)[0] == 0  # What the run left, and only that.
  restored = _model_params(leftover)
  for name, value in big.items():
    np.testing.assert_array_equal(np.asarray(restored[name]), value, err_msg=name)


# --- storage requests ----------------------------------------------------------


def _settled(gcs) -> int:
  """The emulator's request count once it stops moving: it logs a request after its
  response, late on a loaded machine (a fixed wait let one call's requests fall into the
  next one's count)."""
  count, deadline = gcs.requests(), time.monotonic() + 10
  while time.monotonic() < deadline:
    time.sleep(0.3)
    now = gcs.requests()
    if now == count:
      return now
    count = now
  return count


def _requests(gcs, call) -> int:
  before = _settled(gcs)
  call()
  return _settled(gcs) - before


class _BeforeTheRead(Exception):
  pass


def test_planning_requests_do_not_grow_per_leaf(gcs, bucket, mesh, capsys, monkeypatch):
  """detect, inspect and a full restore's planning (all of it before Orbax's
  read of the arrays): requests per item, not per leaf."""

  def stop(*args, **kwargs):
    raise _BeforeTheRead

  monkeypatch.setattr(planned_item.PlannedItem, '_orbax_read', stop)
  counts = {}
  for leaves in (16, 1024):
    state = {f'layer{i}': {'w': {'value': np.full((8,), i, np.float32)}} for i in range(leaves)}
    root = bucket / f'run{leaves}'
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckptr:
      ckptr.save(root / '1', args=ocp.args.Composite(model_params=ocp.args.PyTreeSave(state)))
    target = {f'layer{i}': {'w': jax.ShapeDtypeStruct((8,), jnp.float32)} for i in range(leaves)}

    def plan(root=root, target=target):
      with pytest.raises(_BeforeTheRead):
        ocp.Checkpointer(ot.TunixAwareHandler()).restore(root / '1', args=ocp.args.Composite(
            model_params=ocp.args.PyTreeRestore(item=target)))

    counts[leaves] = {
        'detect': _requests(gcs, lambda root=root: ot.detect(root)),
        'inspect': _requests(gcs, lambda root=root: run(capsys, 'inspect', root)),
        'plan': _requests(gcs, plan),
    }
  added = 1024 - 16
  for what in ('detect', 'inspect', 'plan'):
    # 64 times the leaves: a request per leaf would add `added`. The item's own requests
    # vary by a few to a dozen (tensorstore re-checks the OCDBT manifest a varying number
    # of times, more on a loaded machine: 7 against 20 for `plan` in one CI run, 7-10
    # against 15-17 on a quiet one), so the bound is one request per 20 added leaves.
    assert counts[1024][what] - counts[16][what] < added // 20, (what, counts)


def test_lora_merge_with_adapters_and_base_in_a_bucket(bucket, tunix_data, mesh):
  """The merge from gs:// computes the LoRA model's logits (recorded by the
  fixture script), and is the merge from disk, bit for bit."""
  for name in ('lora_qwix', 'lora_base'):
    gcs_lib.upload(tunix_data / name, bucket / name)
  meta = ot.TunixPyTreeHandler().metadata(tunix_data / 'lora_base' / '1' / 'model_params')
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  target = jax.tree.map(
      lambda m: jax.ShapeDtypeStruct(m.shape, jnp.bfloat16, sharding=replicated), meta.tree)
  local = ot.restore_merged_lora(tunix_data / 'lora_qwix', target, lora_alpha=4.0,
                                 base=tunix_data / 'lora_base')
  remote = ot.restore_merged_lora(bucket / 'lora_qwix', target, lora_alpha=4.0,
                                  base=bucket / 'lora_base')
  for (path, a), (_, b) in zip(_leaves(local).items(), _leaves(remote).items(), strict=True):
    assert a.sharding == b.sharding and a.dtype == b.dtype == jnp.bfloat16, path
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=path)
  ref = json.loads((tunix_data / 'lora_reference.json').read_text())['lora_qwix_full']
  np.testing.assert_allclose(
      test_lora_merge.plain_logits(tunix_models.TinyLM, remote, ref['tokens']),
      np.asarray(ref['logits'], np.float32), atol=test_lora_merge.FIXTURE_BF16_ATOL, rtol=0)


def test_unreachable_bucket_fails_fast_with_one_line(tunix_data, tmp_path):
  """No network (an endpoint nobody listens on) and no credentials: each command
  fails in seconds with one line, before any client's retries (~50 s) begin."""
  closed = f'http://127.0.0.1:{gcs_lib.free_port()}'
  env = {k: v for k, v in SUBPROCESS_ENV.items()
         if k not in ('FSSPEC_GCS_TOKEN', 'GOOGLE_AUTH_TOKEN_FOR_TESTING')}
  env.update(STORAGE_EMULATOR_HOST=closed, TENSORSTORE_GCS_HTTP_URL=closed)
  local = tmp_path / 'run'
  shutil.copytree(tunix_data / 'sft_full', local)
  for argv in (('inspect', 'gs://nowhere/run'), ('diff', 'gs://nowhere/run', local),
               ('convert', local, 'gs://nowhere/out/2'),
               ('convert', 'gs://nowhere/run', tmp_path / 'out' / '2')):
    start = time.monotonic()
    done = subprocess.run([sys.executable, '-m', 'orbax_tunix.cli', *map(str, argv)],
                          capture_output=True, text=True, env=env, cwd=REPO, timeout=120)
    took = time.monotonic() - start
    where = f'{argv}: {took:.1f} s, exit {done.returncode}\n{done.stderr}'
    assert done.returncode == 2 and took < 20, where
    assert done.stderr.count('\n') == 1 and 'gs://nowhere/' in done.stderr, where
    assert 'cannot reach' in done.stderr and '127.0.0.1' in done.stderr, where
  assert not (tmp_path / 'out').exists()


# --- export: Hugging Face safetensors to and from a bucket ----------------------


def _files(folder) -> dict[str, bytes]:
  return {p.name: p.read_bytes() for p in epath.Path(folder).iterdir()}


def _tensor(files: dict[str, bytes], name: str) -> np.ndarray:
  """One tensor of an export, found through its index and parsed by hand
  (safetensors: an 8-byte little-endian header length, a JSON header, the bytes)."""
  index = json.loads(files['model.safetensors.index.json'])
  data = files[index['weight_map'][name]]
  size = int.from_bytes(data[:8], 'little')
  entry = json.loads(data[8:8 + size])[name]
  start, end = entry['data_offsets']
  assert entry['dtype'] == 'F32', entry
  return np.frombuffer(data[8 + size + start:8 + size + end], np.float32).reshape(entry['shape'])


def test_export_to_and_from_a_bucket(gcs, bucket, tunix_data, tmp_path, capsys):
  """A bucket as OUT_DIR and as SRC: the same files as a local export (which
  google-tunix's loader is proven to load in test_export_hf), nothing beside."""
  local_src = tunix_data / 'hf_qwen3'
  remote_src = bucket / 'runs' / 'hf_qwen3'
  gcs_lib.upload(local_src, remote_src)
  shard = ('--max-shard-size', '64KB')  # Several files and an index.
  local_out, remote_out, round_trip = tmp_path / 'hf', bucket / 'hf' / 'qwen3', tmp_path / 'rt'
  for src, out in ((local_src, local_out), (local_src, remote_out), (remote_src, round_trip)):
    status, _, err = run(capsys, 'export', src, out, '--model', 'qwen3', *shard)
    assert status == 0, err
  want = _files(local_out)
  assert len(want) > 2 and 'model.safetensors.index.json' in want
  assert _files(remote_out) == want
  assert _files(round_trip) == want
  assert sorted(p.name for p in remote_out.parent.iterdir()) == ['qwen3']  # Nothing beside.
  # One tensor against plain Orbax's read of the source (the embedding is copied as it is).
  raw = builders.raw_leaves(local_src / '1' / 'model_params')
  np.testing.assert_array_equal(_tensor(want, 'model.embed_tokens.weight'),
                                raw['embedder/input_embedding/value'])


def test_failed_export_into_a_bucket_leaves_nothing(gcs, bucket, tunix_data, tmp_path, capsys):
  """A read that fails midway (truncated array data): exit 2, one message, and
  neither the folder nor its staging copy in the bucket."""
  src = tmp_path / 'src'
  shutil.copytree(tunix_data / 'hf_qwen3', src)
  for data in (src / '1' / 'model_params').rglob('*'):
    if data.is_file() and data.parent.name == 'd':
      data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
  out = bucket / 'hf' / 'qwen3'
  status, _, err = run(capsys, 'export', src, out, '--model', 'qwen3')
  assert status == 2, err
  assert 'Traceback' not in err and str(src / '1' / 'model_params') in err
  assert not out.exists()
  assert not (bucket / 'hf').exists() or list((bucket / 'hf').iterdir()) == []

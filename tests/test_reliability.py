"""Broken checkpoints get clear errors; the source is never written to."""

import hashlib
import os
import shutil
import threading

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import orbax_tunix as ot


def snapshot(root):
  """Every file's bytes and timestamps, and every directory's entries."""
  out = {}
  for dirpath, dirnames, filenames in os.walk(root):
    st = os.stat(dirpath)
    out[dirpath] = ('dir', tuple(sorted(dirnames + filenames)), st.st_mtime_ns)
    for name in filenames:
      p = os.path.join(dirpath, name)
      st = os.stat(p)
      with open(p, 'rb') as f:
        out[p] = (hashlib.sha256(f.read()).hexdigest(), st.st_mtime_ns, st.st_size)
  return out


@pytest.fixture
def run(tunix_data, tmp_path):
  root = tmp_path / 'run'
  shutil.copytree(tunix_data / 'adapter_inject', root)
  return root


def _truncate(path):
  data = path.read_bytes()
  path.write_bytes(data[: len(data) // 2])


def _delete_array_data(item):
  for d in list(item.rglob('d')):
    shutil.rmtree(d)


BREAKS = {
    'truncated _METADATA': (lambda r: _truncate(r / '1/model_params/_METADATA'), ot.CorruptMetadataError, '_METADATA'),
    'non-tree _METADATA': (lambda r: (r / '1/optimizer_state/_METADATA').write_text('[1, 2]'), ot.CorruptMetadataError, '_METADATA'),
    'invalid _CHECKPOINT_METADATA': (lambda r: (r / '1/_CHECKPOINT_METADATA').write_text('{"item_h'), ot.CorruptMetadataError, '_CHECKPOINT_METADATA'),
    'list _CHECKPOINT_METADATA': (lambda r: (r / '1/_CHECKPOINT_METADATA').write_text('[]'), ot.CorruptMetadataError, '_CHECKPOINT_METADATA'),
    'deleted array data': (lambda r: _delete_array_data(r / '1/model_params'), ot.CorruptMetadataError, 'model_params'),
    'file instead of item directory': (
        lambda r: (shutil.rmtree(r / '1/model_params'), (r / '1/model_params').write_text('x')),
        ot.CorruptMetadataError, 'model_params'),
}


# Damage to array data only, which detection (metadata only) does not see.
DATA_BREAKS = {'deleted array data'}


def _restore_all(root):
  return ocp.Checkpointer(ot.TunixAwareHandler()).restore(root / '1')


@pytest.mark.parametrize('case', sorted(BREAKS))
def test_broken_checkpoint_errors(run, case):
  breaker, error, names = BREAKS[case]
  breaker(run)
  before = snapshot(run)
  # Each entry point on its own: detection (JSON only: array data it does not
  # read), and a whole-step restore.
  calls = (_restore_all,) if case in DATA_BREAKS else (ot.detect, _restore_all)
  if case in DATA_BREAKS:
    assert ot.detect(run).is_tunix
  for call in calls:
    with pytest.raises(error) as e:
      call(run)
    assert isinstance(e.value, ot.TunixCheckpointError)
    assert str(run) in str(e.value) and names in str(e.value), (call, str(e.value))
  assert snapshot(run) == before


def test_missing_item_asked_for_explicitly(run):
  """An absent item is an error only when asked for (tests/test_partial_steps.py has more)."""
  shutil.rmtree(run / '1/optimizer_state')
  before = snapshot(run)
  assert ot.detect(run).absent == ('optimizer_state',)
  # No args: the items on disk, as Orbax's own composite restores them.
  assert set(_restore_all(run).keys()) == {'model_params'}
  with pytest.raises(ot.TargetMismatchError, match='optimizer_state'):
    ocp.Checkpointer(ot.TunixAwareHandler()).restore(
        run / '1', args=ocp.args.Composite(optimizer_state=ocp.args.PyTreeRestore()))
  # What is there still restores.
  r = ocp.Checkpointer(ot.TunixAwareHandler()).restore(
      run / '1', args=ocp.args.Composite(model_params=ocp.args.PyTreeRestore()))
  assert 'layers' in r['model_params']
  assert snapshot(run) == before


@pytest.mark.parametrize('where', ['empty', 'file', 'missing', 'only unfinished'])
def test_not_a_checkpoint(tmp_path, where):
  path = tmp_path / 'x'
  error = ot.NotACheckpointError
  if where == 'empty':
    path.mkdir()
  elif where == 'file':
    path.write_text('not a checkpoint')
  elif where == 'only unfinished':
    (path / '3.orbax-checkpoint-tmp-77' / 'model_params').mkdir(parents=True)
    error = ot.UncommittedStepError
  # The handlers are called directly: ocp.Checkpointer checks existence and
  # tmp names itself before it reaches them.
  calls = {
      ot.detect: error,
      # An empty directory is an empty step to Orbax's composite (and ours).
      lambda p: ot.TunixAwareHandler().restore(p): None if where == 'empty' else error,
      # The item handler takes item directories only; anything else is not one.
      lambda p: ot.TunixPyTreeHandler().restore(p): ot.NotACheckpointError,
  }
  for call, expected in calls.items():
    if expected is None:
      assert dict(call(path)) == dict(ocp.CompositeCheckpointHandler().restore(path)) == {}
      continue
    with pytest.raises(expected) as e:
      call(path)
    assert str(path) in str(e.value)


def test_root_given_where_a_step_is_needed(tunix_data):
  with pytest.raises(ot.NotACheckpointError, match=r'sft_full/2'):
    ocp.Checkpointer(ot.TunixAwareHandler()).restore(tunix_data / 'sft_full')


def test_wrong_shapes_in_target(run, mesh):
  before = snapshot(run)
  s = NamedSharding(mesh, P())
  with pytest.raises(ot.TargetMismatchError) as e:
    ocp.Checkpointer(ot.TunixAwareHandler()).restore(run / '1', args=ocp.args.Composite(
        model_params=ocp.args.PyTreeRestore(item={'final_norm': {'scale': jax.ShapeDtypeStruct((9,), jnp.float32, sharding=s)}})))
  assert 'final_norm/scale: target (9,), on disk (8,)' in str(e.value)
  assert str(run / '1' / 'model_params') in str(e.value)
  assert snapshot(run) == before


def test_every_read_operation_leaves_source_untouched(run, mesh):
  before = snapshot(run)
  ot.detect(run)
  ot.hyperparameters(run)
  ckptr = ocp.Checkpointer(ot.TunixAwareHandler())
  ckptr.metadata(run / '1')
  ckptr.restore(run / '1')
  ocp.Checkpointer(ot.TunixPyTreeHandler()).restore(run / '1' / 'model_params')
  mngr = ocp.CheckpointManager(
      run, options=ocp.CheckpointManagerOptions(read_only=True), handler_registry=ot.handler_registry())
  mngr.restore(1)
  mngr.close()
  ot.register()
  ocp.v1.load_checkpointables(run / '1')
  assert snapshot(run) == before


def test_read_only_file_system(run):
  """Restores work from a read-only mount when the sandbox allows one."""
  ro = run.parent / 'ro'
  ro.mkdir()
  if os.system(f'mount --bind {run} {ro} 2>/dev/null && mount -o remount,ro,bind {ro} 2>/dev/null') != 0:
    os.system(f'umount {ro} 2>/dev/null')
    pytest.skip('no bind mounts here; the snapshot tests cover writes')
  try:
    with pytest.raises(OSError):
      (ro / 'probe').write_text('x')
    r = ocp.Checkpointer(ot.TunixAwareHandler()).restore(ro / '1')
    assert 'layers' in r['model_params']
    assert ot.detect(ro).step == 1
  finally:
    os.system(f'umount {ro}')


def test_step_being_written_while_root_is_read(run, monkeypatch):
  """A save in flight is a tmp step: readers keep using step 1 until it is renamed."""
  # A half-written step, as a writer that died leaves it...
  half = run / '5.orbax-checkpoint-tmp-1700000000'
  shutil.copytree(run / '1' / 'model_params', half / 'model_params')
  _truncate(half / 'model_params' / '_METADATA')
  # ...and a real async save, held in flight before its commit.
  release, reached = threading.Event(), threading.Event()
  finalize = ocp.CompositeCheckpointHandler.finalize

  def held_finalize(self, directory):
    reached.set()
    assert release.wait(60)
    return finalize(self, directory)

  monkeypatch.setattr(ocp.CompositeCheckpointHandler, 'finalize', held_finalize)
  tree = {'w': {'value': np.ones((256, 256), np.float32)}}
  ckptr = ocp.AsyncCheckpointer(ocp.CompositeCheckpointHandler())
  ckptr.save(run / '2', args=ocp.args.Composite(model_params=ocp.args.PyTreeSave(tree)))
  try:
    assert reached.wait(60)
    in_flight = [p.name for p in run.iterdir() if p.name.startswith('2.orbax-checkpoint-tmp')]
    assert in_flight and not (run / '2').exists()
    d = ot.detect(run)
    assert d.step == 1
    assert 'layers' in ocp.Checkpointer(ot.TunixAwareHandler()).restore(d.step_dir)['model_params']
  finally:
    release.set()
    ckptr.wait_until_finished()
    ckptr.close()
  d = ot.detect(run)
  assert d.step == 2 and any('unfinished step 5' in n for n in d.notes)


def test_convert_to_read_only_destination(run, tmp_path):
  """A destination that cannot be written: a clear error, nothing left, source intact."""
  from orbax_tunix import cli

  parent = tmp_path / 'ro_parent'
  parent.mkdir()
  if os.system(f'mount --bind {parent} {parent} 2>/dev/null && mount -o remount,ro,bind {parent} 2>/dev/null') != 0:
    os.system(f'umount {parent} 2>/dev/null')
    pytest.skip('no bind mounts here')
  before = snapshot(run)
  try:
    from orbax_tunix.tools import convert

    with pytest.raises(ot.InvalidDestinationError) as e:
      convert.run_convert(convert.plan_convert(run, parent / 'out'))
    assert str(parent / 'out') in str(e.value) and 'writable' in str(e.value)
    assert isinstance(e.value, ot.TunixCheckpointError)
    assert cli.main(['convert', str(run), str(parent / 'out')]) == 2
    assert list(parent.iterdir()) == []
  finally:
    os.system(f'umount {parent}')
  assert snapshot(run) == before


def test_overlap_compares_what_paths_are(tunix_data, tmp_path):
  """places.overlap: the one decision of whether a new step may go at a path."""
  from etils import epath  # pylint: disable=g-import-not-at-top

  from orbax_tunix.writing import places

  run = tmp_path / 'run'
  shutil.copytree(tunix_data / 'sft_full', run)
  (tmp_path / 'link').symlink_to(run)
  (tmp_path / 'out').mkdir()
  (tmp_path / 'dangling').symlink_to(run / '7')
  step = epath.Path(run / '2')
  cases = {
      run / '3': 'inside', tmp_path / 'link' / '3': 'inside', tmp_path / 'link': 'the source run',
      tmp_path / 'out' / '..' / 'link' / '2' / 'model_params': 'inside',
      tmp_path / 'dangling': 'inside', tmp_path / 'missing' / '..' / 'run' / '9': 'inside',
      tmp_path: 'holding', tmp_path / 'out' / '2': None, tmp_path / 'runs' / '2': None,
  }
  for dst, want in cases.items():
    how = places.overlap(step, epath.Path(dst))
    assert (how is None) if want is None else (want in how), (dst, how)
    how = places.overlap(epath.Path(tmp_path / 'link' / '2'), epath.Path(dst))
    assert (how is None) if want is None else (want in how), ('via link', dst, how)
  buckets = {'gs://b/run/3': 'inside', 'gs://B//run/./x/../3/': 'inside', 'gs://b/run/': 'the',
             'gs://b/': 'holding', 'gs://b/runs/3': None, 'gs://c/run/3': None}
  for dst, want in buckets.items():
    how = places.overlap(epath.Path('gs://b/run/2'), epath.Path(dst))
    assert (how is None) if want is None else (want in how), (dst, how)
  assert places.overlap(step, epath.Path('gs://b/run/3')) is None  # Another kind of path.
  bind = tmp_path / 'bind'
  bind.mkdir()
  if os.system(f'mount --bind {run} {bind} 2>/dev/null') == 0:
    try:  # The same directory under another name, which no path text shows.
      assert 'another name' in places.overlap(step, epath.Path(bind / '5'))
    finally:
      os.system(f'umount {bind}')


@pytest.fixture
def full_disk(tmp_path):
  """A 2 MiB tmpfs (the suite runs as root); skipped where nothing can be mounted."""
  disk = tmp_path / 'disk'
  disk.mkdir()
  if os.system(f'mount -t tmpfs -o size=2m tmpfs {disk} 2>/dev/null') != 0:
    pytest.skip('no tmpfs mounts here')
  try:
    yield disk
  finally:
    os.system(f'umount {disk}')


def test_convert_onto_a_full_disk_says_so_and_leaves_nothing(tmp_path, full_disk):
  """TensorStore's RESOURCE_EXHAUSTED on a full disk is the destination's fault, not a bug:
  the same message as any write that runs out of space, and nothing left on the disk."""
  from tests.test_cli_inputs import cli, save_step  # noqa: PLC0415  (the real CLI, a subprocess)
  rng = np.random.default_rng(0)
  src = save_step(tmp_path / 'src' / '1', state={
      f'w{i}': rng.standard_normal((256, 256)).astype(np.float32) for i in range(12)})  # 3 MiB
  done = cli('convert', src, full_disk / 'out' / '1')
  assert done.returncode == 2, done.stderr
  err = done.stderr
  assert err.startswith(f'orbax-tunix: error: {full_disk}/out/1: writing failed: no space left on'
                        ' the device') and 'Traceback' not in err, err
  assert 'nothing was left behind' in err and 'Free space or choose another destination' in err
  assert 'report it' not in err
  assert list(full_disk.iterdir()) == []


# Every command that writes, on tiny real runs (a few hundred KB of arrays): argv after DST.
WRITERS = {
    'convert': ('hf_qwen3', 'convert', ()),
    'convert --merge-lora': ('lora_qwix_full', 'convert', ('--merge-lora', '--lora-alpha', '4')),
    'export': ('hf_qwen3', 'export', ('--model', 'qwen3')),
    'export --peft': ('hf_qwen3_lora', 'export', ('--model', 'qwen3', '--peft',
                                                  '--lora-alpha', '3')),
}


# The CLI in a process whose files may not grow past argv[1] bytes (`ulimit -f`: RLIMIT_FSIZE,
# set by the child itself: a `preexec_fn` would fork this multithreaded process).
_LIMITED_CLI = ('import resource, runpy, sys; n = int(sys.argv[1]);'
                ' resource.setrlimit(resource.RLIMIT_FSIZE, (n, n));'
                " sys.argv = ['orbax-tunix', *sys.argv[2:]];"
                " runpy.run_module('orbax_tunix.cli', run_name='__main__')")


def _write_limited(tunix_data, dst, writer: str, limit: int):
  """A command of `WRITERS` run as the real CLI in a subprocess whose files may not grow past
  `limit` bytes."""
  import subprocess  # noqa: PLC0415
  import sys  # noqa: PLC0415

  from tests.test_cli_inputs import ENV, REPO  # noqa: PLC0415

  fixture, command, flags = WRITERS[writer]
  return subprocess.run(
      [sys.executable, '-c', _LIMITED_CLI, str(limit), command, str(tunix_data / fixture),
       str(dst), *flags], capture_output=True, text=True, env=ENV, cwd=REPO, timeout=300)


@pytest.mark.parametrize('writer', list(WRITERS))
def test_a_file_size_limit_says_so_in_every_command_and_leaves_nothing(tunix_data, tmp_path,
                                                                      writer):
  """`ulimit -f`: TensorStore's OUT_OF_RANGE (convert's arrays) and Python's EFBIG (export's
  files, a step's metadata) are the destination's limit, told as one message by every command,
  not a bug to report; nothing is left half-written."""
  out = tmp_path / 'out'
  dst = out / ('1' if WRITERS[writer][1] == 'convert' else 'folder')
  limit = 4096  # Below every run's largest file, above its smallest.
  done = _write_limited(tunix_data, dst, writer, limit)
  err = done.stderr
  assert done.returncode == 2, err
  errors = [line for line in err.splitlines() if line.startswith('orbax-tunix: error:')]
  assert len(errors) == 1 and errors[0].startswith(
      f'orbax-tunix: error: {dst}: writing failed: a file grew past the largest file size'
      f' allowed (File too large: this process may write files of at most {limit} bytes,'
      ' `ulimit -f`); nothing was left behind. Expected to write about'), err
  assert 'Raise the limit (`ulimit -f unlimited`' in errors[0], err
  assert not [t for t in ('Traceback', 'OUT_OF_RANGE', 'report it', 'Free space') if t in err], err
  assert not out.exists(), list(out.iterdir())  # Nothing, not even the parent it created.


@pytest.mark.parametrize('writer', list(WRITERS))
def test_a_full_disk_says_so_in_every_command_and_leaves_nothing(tunix_data, tmp_path, writer):
  """A disk with room for one page (4 KiB): every command says the same, in the OS's words
  (not TensorStore's RESOURCE_EXHAUSTED naming a staging path that is gone), and leaves the
  disk empty."""
  disk = tmp_path / 'disk'
  disk.mkdir()
  if os.system(f'mount -t tmpfs -o size=4k tmpfs {disk} 2>/dev/null') != 0:
    pytest.skip('no tmpfs mounts here')
  try:
    dst = disk / ('1' if WRITERS[writer][1] == 'convert' else 'folder')
    done = _write_limited(tunix_data, dst, writer, limit=1 << 40)  # No size limit: the disk's.
    err = done.stderr
    assert done.returncode == 2, err
    errors = [line for line in err.splitlines() if line.startswith('orbax-tunix: error:')]
    assert len(errors) == 1 and errors[0].startswith(
        f'orbax-tunix: error: {dst}: writing failed: no space left on the device (No space left'
        ' on device); nothing was left behind. Expected room for about'), err
    assert 'Free space or choose another destination' in errors[0], err
    assert not [t for t in ('Traceback', 'RESOURCE_EXHAUSTED', 'report it') if t in err], err
    assert list(disk.iterdir()) == []
  finally:
    os.system(f'umount {disk}')


def test_a_failed_save_leaves_no_unretrieved_write_in_its_commit_thread(
    tmp_path, full_disk, caplog, monkeypatch):
  """Orbax's save writes its arrays in a commit thread, on an event loop of its own: inside
  `tidy_failures` that loop is drained too when the writes fail, so Python has nothing to
  report later, after the message ("Task exception was never retrieved", "Exception ignored
  in: ... Event loop is closed", with tracebacks)."""
  import gc  # noqa: PLC0415
  import sys  # noqa: PLC0415

  from orbax_tunix.store import _orbax  # noqa: PLC0415

  reported = []
  monkeypatch.setattr(sys, 'unraisablehook', lambda u: reported.append(repr(u.exc_value)))
  rng = np.random.default_rng(0)
  tree = {f'w{i}': rng.standard_normal((256, 256)).astype(np.float32) for i in range(16)}
  with caplog.at_level('ERROR', logger='asyncio'):
    with pytest.raises(Exception, match='No space left on device'), _orbax.tidy_failures():  # noqa: B017
      ocp.PyTreeCheckpointHandler().save(full_disk / 'item', args=ocp.args.PyTreeSave(tree))
    gc.collect()
  reported += [r.getMessage() for r in caplog.records if r.name == 'asyncio']
  assert reported == []


@pytest.mark.parametrize('mount', ['-t tmpfs -o size=8m tmpfs', '--bind {other}'])
@pytest.mark.parametrize('command', ['convert', 'export'])
def test_an_empty_mount_point_as_destination_is_refused_at_once(tunix_data, tmp_path, mount,
                                                               command):
  """A container volume as DST (a tmpfs, or a bind mount within one file system, which
  `os.path.ismount` does not see): refused before anything is written, saying why; nothing
  on the parent's file system, nothing on the volume."""
  from tests.test_cli_inputs import cli  # noqa: PLC0415  (the real CLI, a subprocess)
  volume, other = tmp_path / 'out' / 'volume', tmp_path / 'other'
  volume.mkdir(parents=True)
  other.mkdir()
  if os.system(f'mount {mount.format(other=other)} {volume} 2>/dev/null') != 0:
    pytest.skip('nothing can be mounted here')
  try:
    flags = ('--model', 'qwen3') if command == 'export' else ()
    done = cli(command, tunix_data / 'hf_qwen3', volume, *flags)
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith(f'orbax-tunix: error: {volume}: the destination is a mount'
                                  ' point') and 'inside it' in done.stderr, done.stderr
    assert sorted(p.name for p in volume.parent.iterdir()) == ['volume']
    assert list(volume.iterdir()) == [] and list(other.iterdir()) == []
    inside = cli(command, tunix_data / 'hf_qwen3', volume / '1', *flags)  # What it suggests.
    assert inside.returncode == 0, inside.stderr
  finally:
    os.system(f'umount {volume}')

"""Hostile inputs: checkpoints edited as an attacker would, against every tool and the API.

A checkpoint is a stranger's download. Each test takes real steps (the committed
google-tunix fixtures, or steps Orbax and flax nnx write as `builders` does), edits their
metadata by hand (item names, keys, sizes) and checks that the tool refuses with one
message naming the entry (exit 2 from the command line), before anything outside the
checkpoint is read and before anything is written: the source, the folders beside it and
the destination's parent are byte-identical afterwards (`snapshot`). The command line runs
in-process (`tests.test_cli.run`), so the corpus stays fast.
"""

from __future__ import annotations

import builtins
import json
import os
import pathlib
import shutil

import fsspec
import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
import tensorstore as ts
from etils import epath

import orbax_tunix as ot
from orbax_tunix import cli, maxtext
from orbax_tunix.mapping import patterns, transforms
from orbax_tunix.store import _orbax
from orbax_tunix.writing import commit
from tests import gcs as gcs_lib
from tests.test_cli import run
from tests.test_faults import snapshot

DATA = pathlib.Path(__file__).parent / 'data' / 'tunix'
PYTREE = ocp.PyTreeCheckpointHandler.typestr()


# --- item 1: names that become paths --------------------------------------------------


def _rename_item(step_dir: pathlib.Path, old: str, new: str) -> None:
  """`_CHECKPOINT_METADATA` edited to record item `old` under the name `new`."""
  meta_file = step_dir / '_CHECKPOINT_METADATA'
  meta = json.loads(meta_file.read_text())
  meta['item_handlers'] = {new if k == old else k: v for k, v in meta['item_handlers'].items()}
  meta_file.write_text(json.dumps(meta))


def _victim(tmp_path: pathlib.Path) -> tuple[pathlib.Path, pathlib.Path]:
  """A real google-tunix qwen3 step at tmp/run/1, and beside it a user's own folder holding
  an item (tmp/shared/1/model_params): what a hostile name points at."""
  step = tmp_path / 'run' / '1'
  shutil.copytree(DATA / 'hf_qwen3' / '1', step)
  shared = tmp_path / 'shared' / '1' / 'model_params'
  shutil.copytree(DATA / 'hf_qwen3' / '1' / 'model_params', shared)
  return step, shared


def _hostile_names(shared: pathlib.Path) -> list[str]:
  return ['../../shared/1/model_params', os.fspath(shared), 'a/b', '..', 'C:model_params']


def spy_outside(monkeypatch, outside: pathlib.Path) -> list[str]:
  """Records every file-system access (Python's opens, stats and listings, TensorStore's
  opens) of a path under `outside` from now on."""
  seen: list[str] = []
  where = os.fspath(outside)

  def watch(name, original):
    def spy(first, *args, **kwargs):
      if where in str(first):
        seen.append(f'{name}({first})')
      return original(first, *args, **kwargs)
    return spy

  for module, name in ((builtins, 'open'), (os, 'stat'), (os, 'lstat'), (os, 'scandir'),
                       (os, 'listdir'), (ts, 'open')):
    monkeypatch.setattr(module, name, watch(name, getattr(module, name)))
  monkeypatch.setattr(ts.KvStore, 'open', staticmethod(watch('KvStore.open', ts.KvStore.open)))
  return seen


@pytest.mark.parametrize('index', range(5))
def test_item_names_leading_outside_the_step_are_refused_by_every_command(
    tmp_path, capsys, monkeypatch, index):
  step, shared = _victim(tmp_path)
  name = _hostile_names(shared)[index]
  _rename_item(step, 'model_params', name)
  (tmp_path / 'out').mkdir()
  before = snapshot(tmp_path)
  seen = spy_outside(monkeypatch, shared.parent.parent)
  for argv in (('convert', step, tmp_path / 'out' / '1'),
               ('convert', step, tmp_path / 'out' / '1', '--item', 'optimizer_state'),
               ('export', step, tmp_path / 'out' / 'hf', '--model', 'qwen3'),
               ('inspect', step), ('inspect', step, '--json'),
               ('diff', step, DATA / 'hf_qwen3'), ('diff', DATA / 'hf_qwen3', step)):
    status, out, err = run(capsys, *argv)
    assert status == 2, (argv, out, err)
    assert err.startswith(f'orbax-tunix: error: {step / "_CHECKPOINT_METADATA"}: item_handlers'
                          f' names the item {name!r}, which is not a plain name'), err
    assert len(err.splitlines()) == 1 and not out
  assert not seen  # Nothing outside the step was looked at, let alone read.
  monkeypatch.undo()
  assert snapshot(tmp_path) == before  # Source, the folder beside it, DST's parent.


def test_the_api_refuses_hostile_item_names_before_reading(tmp_path, monkeypatch, mesh):
  step, shared = _victim(tmp_path)
  _rename_item(step, 'model_params', '../../shared/1/model_params')
  before = snapshot(tmp_path)
  seen = spy_outside(monkeypatch, shared.parent.parent)
  match = r"item_handlers names the item '\.\./\.\./shared/1/model_params'"
  with pytest.raises(ot.UnsafeNameError, match=match):
    ot.detect(step)
  with pytest.raises(ot.UnsafeNameError, match=match):
    ot.detect(step.parent)
  with pytest.raises(ot.UnsafeNameError, match=match):
    ocp.Checkpointer(ot.TunixAwareHandler()).restore(step)
  abstract = {'optimizer_state': jax.ShapeDtypeStruct((), np.float32)}
  with pytest.raises(ot.UnsafeNameError, match=match):  # Named items too: the others are named.
    ocp.Checkpointer(ot.TunixAwareHandler()).restore(step, args=ocp.args.Composite(
        optimizer_state=ocp.args.PyTreeRestore(abstract)))
  with pytest.raises(ot.UnsafeNameError, match=match):
    ocp.Checkpointer(ot.TunixAwareHandler()).metadata(step)
  target = {'params': {'params': {'w': jax.ShapeDtypeStruct((1,), 'f4')}}}
  with pytest.raises(ot.CorruptMetadataError, match=match):  # Its base class.
    maxtext.restore_train_state(step.parent, target)
  with pytest.raises(ot.UnsafeNameError, match=match):
    ot.hyperparameters(step)
  assert not seen
  monkeypatch.undo()
  assert snapshot(tmp_path) == before


def test_array_directories_named_after_hostile_keys_are_refused(tmp_path, capsys, monkeypatch):
  """Without OCDBT, each array is a directory named after its keys: a key `..` (or one
  holding `../`) would be read from outside the item."""
  item = tmp_path / 'run' / '1' / 'state'
  plain = ocp.PyTreeCheckpointHandler(use_ocdbt=False)
  with ocp.Checkpointer(ocp.CompositeCheckpointHandler(state=plain)) as ckptr:
    ckptr.save(epath.Path(item.parent), args=ocp.args.Composite(state=ocp.args.PyTreeSave(
        {'w': np.arange(6.0).reshape(2, 3), 'b': np.ones(3)})))
  assert (item / 'b' / '.zarray').exists()  # An array is a directory named after its key.
  outside = tmp_path / 'run' / 'outside'
  with ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_ocdbt=False)) as ckptr:
    ckptr.save(epath.Path(outside), args=ocp.args.PyTreeSave({'w': np.full(3, 7.0)}))
  meta_file = item / '_METADATA'
  meta = json.loads(meta_file.read_text())
  entry = meta['tree_metadata'].pop("('b',)")
  entry['key_metadata'][0]['key'] = '../../outside/w'
  meta['tree_metadata']["('../../outside/w',)"] = entry
  meta_file.write_text(json.dumps(meta))
  (tmp_path / 'out').mkdir()
  before = snapshot(tmp_path)
  seen = spy_outside(monkeypatch, outside)
  for argv in (('inspect', item.parent), ('convert', item.parent, tmp_path / 'out' / '1'),
               ('diff', item.parent, item.parent)):
    status, _, err = run(capsys, *argv)
    assert status == 2, err
    assert ("""the leaf "../../outside/w" is stored without OCDBT in the directory"""
            """ '../../outside/w', which is not a plain name""") in err, err
  with pytest.raises(ot.UnsafeNameError, match='stored without OCDBT'):
    ocp.Checkpointer(ot.TunixPyTreeHandler()).restore(item)
  assert not seen
  monkeypatch.undo()
  assert snapshot(tmp_path) == before


def _bucket_objects(root: epath.Path) -> dict[str, tuple]:
  """Every object under a gs:// path: its size and checksum."""
  fs, where = fsspec.core.url_to_fs(os.fspath(root))
  fs.invalidate_cache()
  return {name: (info['size'], info.get('md5Hash') or info.get('crc32c'))
          for name, info in fs.find(where, detail=True).items()}


def test_hostile_item_names_in_a_bucket_are_refused(bucket, tmp_path, capsys):
  step, shared = _victim(tmp_path)
  _rename_item(step, 'model_params', '../../shared/1/model_params')
  gcs_lib.upload(tmp_path / 'run', bucket / 'run')
  gcs_lib.upload(tmp_path / 'shared', bucket / 'shared')
  before = _bucket_objects(bucket)
  remote = bucket / 'run' / '1'
  for argv in (('inspect', remote), ('convert', remote, tmp_path / 'out' / '1'),
               ('convert', step, bucket / 'out' / '1'), ('convert', remote, bucket / 'out' / '1')):
    status, _, err = run(capsys, *argv)
    assert status == 2, err
    assert "names the item '../../shared/1/model_params', which is not a plain name" in err
  with pytest.raises(ot.UnsafeNameError):
    ocp.Checkpointer(ot.TunixAwareHandler()).restore(remote)
  assert _bucket_objects(bucket) == before
  assert not (tmp_path / 'out').exists()


def test_an_index_naming_a_file_outside_the_export_proves_nothing(tmp_path, capsys):
  """`--force` trusts only the export's own record; an index pointing its first file
  elsewhere (`../x.safetensors`) is no record of this folder, and nothing outside is read."""
  out = tmp_path / 'hf'
  status, _, err = run(capsys, 'export', DATA / 'hf_qwen3', out, '--model', 'qwen3',
                       '--max-shard-size', '20KB')
  assert status == 0, err
  index = json.loads((out / 'model.safetensors.index.json').read_text())
  first = min(index['weight_map'].values())
  shutil.copy(out / first, tmp_path / 'elsewhere.safetensors')
  index['weight_map'] = {k: '../elsewhere.safetensors' if v == first else v
                         for k, v in index['weight_map'].items()}
  (out / 'model.safetensors.index.json').write_text(json.dumps(index))
  before = snapshot(tmp_path)
  status, _, err = run(capsys, 'export', DATA / 'hf_qwen3', out, '--model', 'qwen3', '--force')
  assert status == 2 and 'did not write' in err, err
  assert snapshot(tmp_path) == before


# --- item 2: sizes a checkpoint claims ------------------------------------------------

EMBEDDING = 'embedder.input_embedding.value'  # Its array's name in hf_qwen3's model_params.


def _edit_header(item: pathlib.Path, array: str, **changes) -> dict:
  """An array's zarr header rewritten inside the item's OCDBT store, as an attacker would;
  returns the header as it was."""
  store = _orbax.open_kvstore(epath.Path(item), use_ocdbt=True)
  header = json.loads(store.read(f'{array}/.zarray').result().value)
  store.write(f'{array}/.zarray', json.dumps({**header, **changes}).encode()).result()
  return header


def _every_chunk_stored(item: pathlib.Path, stored: bool) -> None:
  """`_METADATA`'s record of whether Orbax stored every chunk (an attacker may flip it)."""
  meta = json.loads((item / '_METADATA').read_text())
  meta['store_array_data_equal_to_fill_value'] = stored
  (item / '_METADATA').write_text(json.dumps(meta))


def _sized_victim(tmp_path: pathlib.Path, shape: list[int], every_chunk: bool = True
                  ) -> pathlib.Path:
  step = tmp_path / 'run' / '1'
  shutil.copytree(DATA / 'hf_qwen3' / '1', step)
  original = _edit_header(step / 'model_params', EMBEDDING, shape=shape)
  assert original['shape'] == [96, 40] and original['chunks'] == [96, 40]
  _every_chunk_stored(step / 'model_params', every_chunk)
  (tmp_path / 'out').mkdir()
  return step


COMMANDS = (('convert', 'out/1'), ('export', 'out/hf', '--model', 'qwen3'), ('diff', None),
            ('inspect',))


def _run_all(capsys, tmp_path: pathlib.Path, step: pathlib.Path, commands=COMMANDS):
  for command, *rest in commands:
    argv = [command, step]
    if rest and rest[0] is None:
      argv.append(step)
    elif rest:
      argv += [tmp_path / rest[0], *rest[1:]]
    yield argv, run(capsys, *argv)


def test_headers_claiming_more_than_the_files_hold_are_refused(tmp_path, capsys):
  """(200000, 200000) float32, 160 GB, over an item of ~0.2 MB: Orbax stores every chunk,
  zstd-compressed, so the files cannot hold it (today: std::bad_alloc, SIGABRT)."""
  step = _sized_victim(tmp_path, [200000, 200000])
  before = snapshot(tmp_path)
  for argv, (status, out, err) in _run_all(capsys, tmp_path, step):
    assert status == 2, (argv, out, err)
    assert err.startswith(f'orbax-tunix: error: {step / "model_params"}: the arrays\' headers'
                          ' claim'), err
    assert 'embedder/input_embedding/value: shape (200000, 200000) float32' in err
  assert snapshot(tmp_path) == before  # No tmp folder, nothing at DST, the source as it was.
  with pytest.raises(ot.CorruptMetadataError, match='headers claim'):
    ot.export_to_hf(step, tmp_path / 'out' / 'hf', model='qwen3')


def test_sizes_beyond_the_machine_are_refused_before_any_write(tmp_path, capsys):
  """An item that says some chunks may be missing (older Orbax left out chunks equal to the
  fill value, so its files bound nothing): the claim is then checked against what must be
  held at once (the machine's memory) and, for files written as they are, the disk."""
  rows = 96 * 10**12  # 15 PB of float32 rows: beyond any machine and any disk.
  step = _sized_victim(tmp_path, [rows, 40], every_chunk=False)
  before = snapshot(tmp_path)
  expected = {
      'convert': 'model_params/embedder/input_embedding (shape (96000000000000, 40) float32),'
                 ' written as',
      'diff': 'read whole on each side to be compared, must be held at once',
      'export': 'writing failed: no space left on the device (No space left on device); nothing'
  }
  for argv, (status, out, err) in _run_all(capsys, tmp_path, step, COMMANDS[:3]):
    assert status == 2, (argv, out, err)
    assert expected[argv[0]] in err, err
    assert 'nothing was' in err and len(err.splitlines()) == 1
  status, out, _ = run(capsys, 'inspect', step, '--json')  # Metadata only: it says what is claimed.
  assert status == 0
  assert json.loads(out)['items']['model_params']['leaves']['embedder/input_embedding'][
      'shape'] == [rows, 40]
  assert snapshot(tmp_path) == before


def test_arrays_of_zero_size_are_refused_by_convert_alone(tmp_path, capsys):
  """Orbax refuses to save an array of zero size (today: a raw ValueError asking to report
  it); `inspect` and `diff` read such an array as the empty array it is."""
  step = _sized_victim(tmp_path, [0, 40])
  before = snapshot(tmp_path)
  status, _, err = run(capsys, 'convert', step, tmp_path / 'out' / '1')
  assert status == 2
  assert err.startswith(f'orbax-tunix: error: {step}: expected arrays Orbax can save, found'
                        ' arrays of zero size:\n  model_params/embedder/input_embedding: shape'
                        ' (0, 40)\n'), err
  assert snapshot(tmp_path) == before
  assert run(capsys, 'inspect', step)[0] == 0
  status, out, _ = run(capsys, 'diff', step, step)
  assert status == 0 and 'match' in out


@pytest.mark.parametrize('changes, says', [
    ({'shape': 'big'}, "its shape 'big' is not a list of whole numbers >= 0"),
    ({'shape': [-96, 40]}, 'its shape [-96, 40] is not a list of whole numbers >= 0'),
    ({'shape': [96.5, 40]}, 'its shape [96.5, 40] is not'),
    ({'chunks': [0, 40]}, 'its chunk shape [0, 40] is not a list of whole numbers >= 1'),
    ({'chunks': [96]}, "its chunk shape [96] is not one of the shape's rank 2"),
    ({'dtype': '<q9'}, 'not a zarr header (TypeError'),
])
def test_headers_that_describe_no_array_are_damage(tmp_path, capsys, changes, says):
  step = tmp_path / 'run' / '1'
  shutil.copytree(DATA / 'hf_qwen3' / '1', step)
  _edit_header(step / 'model_params', EMBEDDING, **changes)
  before = snapshot(tmp_path)
  for argv in (('inspect', step), ('convert', step, tmp_path / 'out' / '1')):
    status, _, err = run(capsys, *argv)
    assert status == 2
    assert err.startswith(f'orbax-tunix: error: {step / "model_params"}: the zarr headers of 1'
                          ' arrays do not describe an array:\n  embedder/input_embedding/value: '
                          ), err
    assert says in err.splitlines()[1], err
  assert snapshot(tmp_path) == before


# --- item 10: a destination that is a link to nothing ---------------------------------


@pytest.mark.parametrize('dst', ['latest', 'up/run/1'])
def test_a_link_to_nothing_as_dst_is_refused_naming_it(tmp_path, capsys, dst):
  """`latest -> exports/run-7`, the target absent: refused up front (today everything was
  written, then "Not a directory"), the link left as it is."""
  (tmp_path / 'latest').symlink_to('exports/run-7')
  (tmp_path / 'up').symlink_to('nowhere')
  before = snapshot(tmp_path)
  link = tmp_path / dst.split('/')[0]
  for argv in (('convert', DATA / 'hf_qwen3', tmp_path / dst),
               ('export', DATA / 'hf_qwen3', tmp_path / dst, '--model', 'qwen3')):
    status, _, err = run(capsys, *argv)
    assert status == 2
    assert err.startswith(f'orbax-tunix: error: {link}: ') and 'is a symbolic link to' in err
    assert f'{os.readlink(link)}, which does not exist' in err and 'nothing was written' in err
  assert snapshot(tmp_path) == before


# --- item 11: stdout that cannot be written once the work is done ---------------------


def test_a_summary_that_cannot_be_printed_leaves_the_status_the_works(tmp_path, capsys,
                                                                     monkeypatch):
  """stdout on a full disk (`> /dev/full`): convert commits DST complete and exits 0 with a
  note on stderr (today: exit 2, "No space left on device"); inspect, whose result is its
  output, exits 2."""
  with open('/dev/full', 'w') as full:
    monkeypatch.setattr('sys.stdout', full)
    status = cli.main(['convert', os.fspath(DATA / 'hf_qwen3'), os.fspath(tmp_path / 'out')])
    err = capsys.readouterr().err
    assert status == 0, err
    assert err.splitlines()[-1] == ('orbax-tunix: note: the summary could not be written to'
                                    ' stdout (No space left on device); the work itself is'
                                    ' done: DST is complete.')
  with open('/dev/full', 'w') as full:  # Anew: a failed stream is pointed at /dev/null.
    monkeypatch.setattr('sys.stdout', full)
    status = cli.main(['inspect', os.fspath(DATA / 'hf_qwen3'), '--json'])
    assert status == 2
    assert 'could not be written to stdout (No space left on device)' in capsys.readouterr().err
  monkeypatch.undo()
  restored = ocp.PyTreeCheckpointHandler().restore(epath.Path(tmp_path / 'out' / 'model_params'))
  expected = ocp.PyTreeCheckpointHandler().restore(epath.Path(DATA / 'hf_qwen3' / '1' /
                                                              'model_params'))
  np.testing.assert_array_equal(restored['lm_head']['w'], expected['lm_head']['w']['value'])


# --- item 12: layer numbers as no writer spells them; two `--force` runs at once ------


def test_layer_numbers_no_writer_spells_match_no_rule(tmp_path, capsys):
  """`layers/01` (or a digit of another script) is not layer 1: a rule would name it
  `model.layers.01.*`, or stack it as layer 1 beside a `layers/1`. Such a key matches no
  rule, and a model holding it is refused naming it."""
  rule = patterns.LayoutRule.of(('layers', '{i}', 'w'), ('model.layers.{i}.weight',))
  shapes = {('layers', key, 'w'): (2,) for key in ('0', '01', '\u0663', '1')}
  mapped = patterns.map_paths(shapes, [rule])
  assert set(mapped.outputs) == {('model.layers.0.weight',), ('model.layers.1.weight',)}
  assert mapped.unmatched == (('layers', '01', 'w'), ('layers', '\u0663', 'w'))
  stack = patterns.LayoutRule.of(('layers', '{i}', 'w'), ('w',), transforms.stack(0))
  assert patterns.map_paths({('layers', k, 'w'): (2,) for k in ('0', '01')}, [stack]
                            ).outputs[('w',)].sources == (('layers', '0', 'w'),)
  # A real Tunix qwen3 tree (plain Orbax wrote it) whose layer 1 is keyed '01'.
  tree = ocp.PyTreeCheckpointHandler().restore(epath.Path(DATA / 'hf_qwen3' / '1' /
                                                          'model_params'))
  tree['layers'] = {'0': tree['layers']['0'], '01': tree['layers']['1']}
  with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckptr:
    ckptr.save(epath.Path(tmp_path / 'run' / '1'),
               args=ocp.args.Composite(model_params=ocp.args.PyTreeSave(tree)))
  status, _, err = run(capsys, 'export', tmp_path / 'run', tmp_path / 'hf', '--model', 'qwen3')
  assert status == 2 and 'weights have no qwen3 tensor:\n  layers/01/attn/k_norm/w' in err, err
  assert not (tmp_path / 'hf').exists()


def test_two_force_runs_committing_at_once_leave_one_step_and_nothing_beside(tmp_path,
                                                                            monkeypatch):
  """Run B commits in the instant between run A moving the old step aside and renaming its
  own in (today: A fails saying nothing was left, and the old step stays beside DST as
  `*.orbax-tunix-old-*`). A replaces B's step as a later run would: both succeed, DST holds
  A's step, and nothing is left beside it."""
  dst = tmp_path / 'out' / '1'
  assert run_convert(dst) == 0  # The old step, this package's: `force` may replace it.
  stagings = {}
  for name in 'AB':
    staging = stagings[name] = commit.Staging(epath.Path(dst), force=True)
    shutil.copytree(dst, staging.open(), dirs_exist_ok=True)
    (staging.work / commit.COMMIT_SUCCESS).unlink()
  made_by_a = os.stat(stagings['A'].work).st_ino
  rename = type(stagings['A'].dst).rename

  def rename_then_b_commits(self, target):
    moved = rename(self, target)
    if commit.OLD_MARKER in os.fspath(target) and not b_done:
      b_done.append(stagings['B'].commit())  # DST was not there: B replaced nothing.
    return moved

  b_done = []

  monkeypatch.setattr(type(stagings['A'].dst), 'rename', rename_then_b_commits)
  assert stagings['A'].commit() is True
  monkeypatch.undo()
  assert b_done == [False]
  assert os.stat(dst).st_ino == made_by_a
  assert sorted(p.name for p in dst.parent.iterdir()) == ['1']
  assert commit.leftovers(epath.Path(dst)) == []
  for staging in stagings.values():
    assert staging.abort() is not None  # Each says DST holds its new step, complete.
  assert sorted(p.name for p in dst.parent.iterdir()) == ['1']
  assert builders_restore(dst)['model_params']['lm_head']['w'].shape == (40, 96)


def run_convert(dst: pathlib.Path) -> int:
  return cli.main(['convert', os.fspath(DATA / 'hf_qwen3'), os.fspath(dst)])


def builders_restore(step: pathlib.Path) -> dict:
  with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckptr:
    return ckptr.restore(epath.Path(step))

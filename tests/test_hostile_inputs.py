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
from orbax_tunix import maxtext
from orbax_tunix.store import _orbax
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
      'export': 'expected room for a Hugging Face',
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

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

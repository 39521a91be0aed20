"""detect(): roots, steps, items, v0/v1 writers, RL roots, non-Tunix checkpoints."""

import json
import shutil

import numpy as np
import orbax.checkpoint as ocp
import pytest

import orbax_tunix as ot

EXPECTED_REWRITES = {
    'sft_full': (('nnx_value',), ('nnx_value',)),
    'lora_qwix': (('nnx_value',), ('nnx_value',)),
    'adapter_inject': (('nnx_value', 'adapter_base'), ('nnx_value', 'inject_hyperparams', 'adapter_base')),
    'chain_clip': (('nnx_value',), ('nnx_value',)),
    'grad_accum': (('nnx_value',), ('nnx_value', 'inject_hyperparams')),
    'adapter_inject_clip': (
        ('nnx_value', 'adapter_base'),
        ('nnx_value', 'inject_hyperparams', 'adapter_base'),
    ),
    'own_base_module': (('nnx_value',), ('nnx_value',)),
    'v1_writer': (('nnx_value',), ('nnx_value',)),
    'rl_actor': (('nnx_value',), ('nnx_value',)),
    'rng_vars': (('nnx_value',), ('nnx_value',)),
}


@pytest.mark.parametrize('name', sorted(EXPECTED_REWRITES))
def test_fixture_rewrites(tunix_data, name):
  d = ot.detect(tunix_data / name)
  assert d.is_tunix and d.kind == 'tunix'
  assert d.items == ('model_params', 'optimizer_state')
  model, opt = EXPECTED_REWRITES[name]
  assert d.rewrites == {'model_params': model, 'optimizer_state': opt}


def test_root_resolves_to_latest_committed_step(tunix_data):
  d = ot.detect(tunix_data / 'sft_full')
  assert d.step == 2 and d.step_dir == tunix_data / 'sft_full' / '2'
  assert d.writer == 'v0' and d.item is None


def test_step_and_item_directories(tunix_data):
  step = ot.detect(tunix_data / 'sft_full' / '1')
  assert step.step == 1 and step.step_dir.name == '1'
  item = ot.detect(tunix_data / 'sft_full' / '1' / 'optimizer_state')
  assert item.step_dir == step.step_dir and item.item == 'optimizer_state'
  # An item directory is that item alone (planned with its step's weights).
  assert item.rewrites == {'optimizer_state': step.rewrites['optimizer_state']}


def test_rl_root_uses_actor(tunix_data):
  d = ot.detect(tunix_data / 'rl_actor')
  assert d.step_dir == tunix_data / 'rl_actor' / 'actor' / '1'
  assert any('actor' in n for n in d.notes)


def test_v1_writer(tunix_data):
  d = ot.detect(tunix_data / 'v1_writer')
  assert d.writer == 'v1' and d.is_tunix and d.step == 2


def test_old_standard_save_layout(tmp_path):
  """Tunix 0.1.0 saved model_params with StandardSave: still Tunix."""
  tree = {'w1': {'kernel': {'value': np.ones((2, 3), np.float32)}}}
  ocp.Checkpointer(ocp.CompositeCheckpointHandler()).save(
      tmp_path / '5', args=ocp.args.Composite(model_params=ocp.args.StandardSave(tree))
  )
  d = ot.detect(tmp_path)
  assert d.is_tunix and d.step == 5
  assert 'StandardCheckpointHandler' in d.item_handlers['model_params']
  assert d.rewrites == {'model_params': ('nnx_value',)}


def test_plain_orbax_and_maxtext_are_not_tunix(tmp_path):
  plain = {'params': {'w': np.ones((2,), np.float32)}}
  ckptr = ocp.Checkpointer(ocp.CompositeCheckpointHandler())
  ckptr.save(tmp_path / 'plain' / '1', args=ocp.args.Composite(state=ocp.args.PyTreeSave(plain)))
  mt = {'params': {'params': {'w': np.ones((2,), np.float32)}}, 'step': np.int32(3)}
  ckptr.save(tmp_path / 'mt' / '7', args=ocp.args.Composite(items=ocp.args.PyTreeSave(mt)))
  p = ot.detect(tmp_path / 'plain')
  assert p.kind == 'orbax' and not p.is_tunix and p.rewrites == {}
  m = ot.detect(tmp_path / 'mt')
  assert m.kind == 'maxtext' and not m.is_tunix and m.step == 7


def test_unfinished_steps_are_skipped(tunix_data, tmp_path):
  root = tmp_path / 'run'
  shutil.copytree(tunix_data / 'sft_full', root)
  (root / '2').rename(root / '3.orbax-checkpoint-tmp-1234')
  d = ot.detect(root)
  assert d.step == 1
  assert any('unfinished step 3' in n for n in d.notes)
  with pytest.raises(ot.UncommittedStepError, match='orbax-checkpoint-tmp'):
    ot.detect(root / '3.orbax-checkpoint-tmp-1234')


def test_step_argument(tunix_data):
  root = tunix_data / 'sft_full'
  assert ot.detect(root, step='1').step == ot.detect(root, step=np.int64(1)).step == 1
  for bad in (1.5, True, -1, 'one', [1]):
    with pytest.raises(ot.TunixCheckpointError, match=r'`step=.*`: expected a step number'):
      ot.detect(root, step=bad)


def test_empty_and_duplicate_step_directories(tunix_data, tmp_path):
  """The rule of step_store.holds_step: a step holds _CHECKPOINT_METADATA or an item."""
  root = tmp_path / 'run'
  shutil.copytree(tunix_data / 'sft_full', root)
  (root / '9').mkdir()  # Empty, newer: skipped with a note, as an unfinished step is.
  d = ot.detect(root)
  assert d.step == 2 and any('skipped step directory 9: it is empty' in n for n in d.notes)
  assert [(s.step, s.usable) for s in d.steps] == [(1, True), (2, True), (9, False)]
  with pytest.raises(ot.NotACheckpointError, match='step 9 is an empty directory'):
    ot.detect(root, step=9)
  shutil.copytree(root / '1', root / 'ckpt_1')
  assert ot.detect(root).step == 2  # Another step's twin: not the one chosen.
  with pytest.raises(ot.UnsupportedLayoutError, match="ckpt_1 with step_prefix='ckpt'"):
    ot.detect(root, step=1)
  assert ot.detect(root / 'ckpt_1').step == 1  # Named directly: no doubt.
  only_empty = tmp_path / 'empty_steps'
  for step in ('1', '5'):
    (only_empty / step).mkdir(parents=True)
  with pytest.raises(ot.NotACheckpointError, match=r'only empty step directories \(1, 5\)'):
    ot.detect(only_empty)


def test_missing_and_empty_paths_raise(tmp_path):
  with pytest.raises(ot.NotACheckpointError, match=str(tmp_path / 'nope')):
    ot.detect(tmp_path / 'nope')
  (tmp_path / 'empty').mkdir()
  with pytest.raises(ot.NotACheckpointError, match='empty'):
    ot.detect(tmp_path / 'empty')
  (tmp_path / 'only_tmp' / '4.orbax-checkpoint-tmp-9').mkdir(parents=True)
  with pytest.raises(ot.UncommittedStepError, match='only_tmp'):
    ot.detect(tmp_path / 'only_tmp')


def test_detect_reads_json_only(tunix_data, tmp_path):
  """Detection still works with every array data file removed."""
  root = tmp_path / 'run'
  shutil.copytree(tunix_data / 'adapter_inject', root)
  for data in list(root.rglob('d')):
    shutil.rmtree(data)
  assert not [p for p in root.rglob('*') if p.is_file() and p.parent.name == 'd']
  d = ot.detect(root)
  assert d.rewrites['optimizer_state'] == ('nnx_value', 'inject_hyperparams', 'adapter_base')


def test_manifest_round_trip(tunix_data):
  """Every on-disk path of every fixture maps to canonical and back exactly."""
  manifest = json.loads((tunix_data / 'MANIFEST.json').read_text())
  for name, fixture in manifest['fixtures'].items():
    d = ot.detect(tunix_data / name)
    for item, leaves in fixture['step_items'][str(d.step)]['items'].items():
      layout = d.maps[item]
      disk = {tuple(leaf['path'].split('/')) for leaf in leaves}
      assert set(layout.disk_to_canonical) == disk, (name, item)
      parts = set(layout.parts.values())
      for path in disk:
        canon = layout.to_canonical_path(path)
        if canon is None:
          # A quantized weight's scale or zero point (part of its weight), or a side leaf.
          assert (path in parts and path[-2] in ('scale', 'zero_point')
                  or 'hyperparams' in path or path[-2:] == ('count', 'value')), path
          continue
        assert 'value' not in canon and layout.to_disk_path(canon) == path, (name, path)
      quantized = {p[:-3] for p in disk if p[-3:-1] == ('array', 'qvalue')}
      assert {layout.to_disk_path(c)[:-3] for c in layout.composed} == quantized, (name, item)
      for canon, stored in layout.composed.items():  # QLoRA saves: each weight is its parts.
        assert stored['qvalue'] == layout.to_disk_path(canon)
        assert set(stored) <= {'qvalue', 'scale', 'zero_point'} and 'scale' in stored


def test_old_aggregate_only_checkpoint(tmp_path):
  """Checkpoints from before _METADATA: paths come from the msgpack tree file."""
  import msgpack

  item = tmp_path / '1' / 'model_params'
  item.mkdir(parents=True)
  tree = {'w1': {'kernel': {'value': 'PLACEHOLDER://w1.kernel.value'}}, 'w2': {'bias': {'value': 1.0}}}
  (item / 'checkpoint').write_bytes(msgpack.packb(tree))
  from orbax_tunix.store import item_store

  assert item_store.open_item(item).paths == {('w1', 'kernel', 'value'), ('w2', 'bias', 'value')}
  (item / 'checkpoint').write_bytes(b'\xc1\xc1garbage')
  with pytest.raises(ot.CorruptMetadataError, match='checkpoint'):
    item_store.open_item(item)


def test_a_step_directory_that_cannot_be_read_is_said_so(tunix_data, tmp_path, monkeypatch, capsys):
  """What a step directory without permissions gives a user (as root, the suite cannot
  make one: the system's PermissionError is raised where it would come from)."""
  root = tmp_path / 'run'
  shutil.copytree(tunix_data / 'sft_full', root)
  locked = root / '2'
  path_type = type(ot.store.fileio.as_path(locked))
  real_exists, real_iterdir = path_type.exists, path_type.iterdir

  def denied(path):
    if str(path).startswith(f'{locked}/') or str(path) == str(locked):
      raise PermissionError(13, 'Permission denied', str(path))

  def exists(self):
    if str(self).startswith(f'{locked}/'):
      denied(self)
    return real_exists(self)

  def iterdir(self):
    denied(self)
    return real_iterdir(self)

  monkeypatch.setattr(path_type, 'exists', exists)
  monkeypatch.setattr(path_type, 'iterdir', iterdir)
  d = ot.detect(root)  # Step 1 is readable: used, and the skip said.
  assert d.step == 1
  assert 'skipped step directory 2: it cannot be read (Permission denied)' in d.notes
  with pytest.raises(ot.NotACheckpointError) as e:
    ot.detect(root, step=2)
  assert 'cannot be read: 2 (Permission denied)' in str(e.value)
  assert 'Check their permissions' in str(e.value) and 'empty' not in str(e.value)
  shutil.rmtree(root / '1')
  from orbax_tunix import cli  # noqa: PLC0415
  assert cli.main(['inspect', str(root)]) == 2
  err = capsys.readouterr().err
  assert 'found step directories that cannot be read: 2 (Permission denied)' in err
  assert 'only empty step directories' not in err


def test_roles_look_at_only_the_tunix_items_the_step_has(tunix_data):
  """`roles`: the Tunix items a caller needs, those of them the step has (nothing else is
  opened); none of them in the step: every item (its own items decide); not with `items`."""
  step = tunix_data / 'sft_full'
  assert list(ot.detect(step).items) == ['model_params', 'optimizer_state']
  assert list(ot.detect(step, roles=('model_params',)).items) == ['model_params']
  assert list(ot.detect(step, roles=('optimizer_state', 'actor_params')).items) == [
      'optimizer_state']
  assert list(ot.detect(step, roles=('actor_params',)).items) == [
      'model_params', 'optimizer_state']
  with pytest.raises(TypeError, match='items or roles'):
    ot.detect(step, items=['model_params'], roles=('model_params',))

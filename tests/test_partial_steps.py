"""A step that lost an item it is not asked for: every entry point asks for less.

Users copy only `model_params` of a step to a laptop or a bucket, or delete
`optimizer_state` to save space. The rule, in one place (`detection.detect`):
an item the caller does not ask for may be absent (a note, no error); an item
the caller asks for that is absent raises `MissingItemError` naming it; this
package's whole-step operations (a full MaxText state, `convert` and `diff`
without `--item`) name the missing item. Expected values are raw arrays read
by plain Orbax.
"""

from __future__ import annotations

import shutil

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

import orbax_tunix as ot
from orbax_tunix import maxtext
from orbax_tunix.keypaths import flatten, fmt
from tests import builders
from tests.test_cli import run
from tests.test_faults import snapshot
from tests.test_maxtext import TinyLM, abstract_state, adamw, assert_restored


@pytest.fixture
def copied(tunix_data, tmp_path):
  """`sft_full` step 2 copied twice: without its optimizer, and without its weights."""

  def copy(drop):
    root = tmp_path / f'without_{drop}'
    shutil.copytree(tunix_data / 'sft_full', root)
    shutil.rmtree(root / '2' / drop)
    return root

  return copy('optimizer_state'), copy('model_params')


def _damage_optimizer(root):
  (root / '2' / 'optimizer_state' / '_METADATA').write_text('{"tree_metad')


def test_detect_notes_an_absent_item_and_names_it_when_asked_for(copied):
  no_opt, _ = copied
  found = ot.detect(no_opt)
  assert found.is_tunix and found.absent == ('optimizer_state',)
  assert set(found.maps) == {'model_params'}
  assert any('optimizer_state' in n and 'not on disk' in n for n in found.notes)
  with pytest.raises(ot.MissingItemError, match="'optimizer_state'") as e:
    ot.detect(no_opt, items=['optimizer_state'])
  assert str(no_opt / '2') in str(e.value) and 'model_params' in str(e.value)
  with pytest.raises(ot.MissingItemError, match='optimizer_state'):
    found.require()
  found.require(['model_params'])


def test_handlers_restore_what_is_asked_for(copied, mesh):
  no_opt, _ = copied
  step = no_opt / '2'
  before = snapshot(no_opt)
  raw = builders.raw_leaves(step / 'model_params')
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  target = {'embedder': {'embedding': jax.ShapeDtypeStruct((16, 8), np.float32, sharding=sharding)}}
  got = ocp.Checkpointer(ot.TunixAwareHandler()).restore(
      step, args=ocp.args.Composite(model_params=ocp.args.PyTreeRestore(item=target)))
  leaf = got['model_params']['embedder']['embedding']
  assert leaf.sharding == sharding
  np.testing.assert_array_equal(leaf, raw['embedder/embedding/value'])
  item = ocp.Checkpointer(ot.TunixPyTreeHandler()).restore(
      step / 'model_params', args=ocp.args.PyTreeRestore(item=target))
  np.testing.assert_array_equal(item['embedder']['embedding'], raw['embedder/embedding/value'])
  # No args: what Orbax's own composite restores (the items on disk), canonical.
  whole = ocp.Checkpointer(ot.TunixAwareHandler()).restore(step)
  orbax = ocp.Checkpointer(ocp.CompositeCheckpointHandler()).restore(step)
  assert set(whole.keys()) == set(orbax.keys()) == {'model_params'}
  assert fmt(('embedder', 'embedding')) in {fmt(p) for p, _ in flatten(whole['model_params'])[0]}
  with pytest.raises(ot.MissingItemError, match='optimizer_state'):
    ocp.Checkpointer(ot.TunixAwareHandler()).restore(
        step, args=ocp.args.Composite(optimizer_state=ocp.args.PyTreeRestore()))
  assert snapshot(no_opt) == before


@pytest.mark.parametrize('damaged', [False, True], ids=['absent', 'damaged'])
def test_maxtext_params_only_opens_the_weights_only(copied, tunix_data, tmp_path, mesh, damaged):
  if damaged:  # The optimizer is there but unreadable: params-only never opens it.
    root = tmp_path / 'damaged'
    shutil.copytree(tunix_data / 'sft_full', root)
    _damage_optimizer(root)
  else:
    root = copied[0]
  abstract = abstract_state(TinyLM(), adamw(), mesh)
  got = maxtext.restore_train_state(root, abstract, params_only=True)
  assert_restored(got, abstract, tunix_data / 'sft_full' / '2', {}, kept=('opt_state', 'step'))
  handler_got = ocp.Checkpointer(maxtext.ItemsHandler()).restore(
      root / '2', args=maxtext.ItemsRestore(item=abstract, params_only=True))
  assert_restored(handler_got, abstract, tunix_data / 'sft_full' / '2', {},
                  kept=('opt_state', 'step'))
  error = ot.CorruptMetadataError if damaged else ot.MissingItemError
  with pytest.raises(error, match='optimizer_state'):
    maxtext.restore_train_state(root, abstract)


def test_merged_lora_without_the_optimizer(tunix_data, tmp_path, mesh):
  root = tmp_path / 'lora'
  shutil.copytree(tunix_data / 'lora_qwix_full', root)
  whole = ot.restore_merged_lora(tunix_data / 'lora_qwix_full', _plain_target(tunix_data),
                                 lora_alpha=4.0)
  shutil.rmtree(root / '1' / 'optimizer_state')
  got = ot.restore_merged_lora(root, _plain_target(tunix_data), lora_alpha=4.0)
  for (path, a), (_, b) in zip(flatten(got)[0], flatten(whole)[0], strict=True):
    np.testing.assert_array_equal(a, b, err_msg=fmt(path))


def _plain_target(tunix_data):
  """The plain TinyLM's weights as the base fixture stores them (no LoRA leaves)."""
  raw = builders.raw_leaves(tunix_data / 'lora_base' / '1' / 'model_params')
  tree = {}
  for path, value in raw.items():
    keys = path.split('/')[:-1]  # Without nnx's `value` level.
    node = tree
    for k in keys[:-1]:
      node = node.setdefault(k, {})
    node[keys[-1]] = jax.ShapeDtypeStruct(value.shape, value.dtype)
  return tree


def test_hyperparameters_need_only_the_optimizer(tunix_data, tmp_path):
  root = tmp_path / 'hp'
  shutil.copytree(tunix_data / 'adapter_inject', root)
  want = ot.hyperparameters(tunix_data / 'adapter_inject')
  shutil.rmtree(root / '1' / 'model_params')
  assert ot.hyperparameters(root) == want and want
  shutil.rmtree(root / '1' / 'optimizer_state')
  (root / '1' / 'model_params').mkdir()  # Something, so that the step is not empty.
  with pytest.raises(ot.MissingItemError, match='optimizer_state'):
    ot.hyperparameters(root)


def test_cli_asks_for_less(capsys, copied, tunix_data, tmp_path):
  no_opt, no_model = copied
  before = snapshot(no_opt)
  status, out, err = run(capsys, 'inspect', no_opt)
  assert status == 0, err
  assert 'optimizer_state' in out + err and 'not on disk' in out + err
  for argv in (('--params-only',), ('--item', 'model_params')):
    dst = tmp_path / f'out{len(argv)}' / '2'
    status, _, err = run(capsys, 'convert', no_opt, dst, *argv)
    assert status == 0, err
    status, _, err = run(capsys, 'diff', tunix_data / 'sft_full', dst, '--item', 'model_params')
    assert status == 0, err
  status, _, err = run(capsys, 'convert', no_opt, tmp_path / 'whole' / '2')
  assert status == 2 and 'optimizer_state' in err and 'no directory' in err
  assert not (tmp_path / 'whole').exists()
  status, _, err = run(capsys, 'diff', no_opt, tunix_data / 'sft_full')
  assert status == 2 and 'optimizer_state' in err
  status, _, err = run(capsys, 'diff', no_opt, tunix_data / 'sft_full', '--item', 'model_params')
  assert status == 0, err
  # The optimizer alone: its item converts; the weights cannot be had.
  status, _, err = run(capsys, 'convert', no_model, tmp_path / 'opt' / '2', '--item', 'optimizer_state')
  assert status == 0, err
  status, _, err = run(capsys, 'convert', no_model, tmp_path / 'w' / '2', '--params-only')
  assert status == 2 and 'model_params' in err
  assert snapshot(no_opt) == before

"""Each metadata file is opened once per call: this package's parse serves Orbax's.

Counted with a Python audit hook (`tests/opens.py`) on the committed google-tunix
fixtures, for every entry point that restores; the second part checks the
values read against plain Orbax reads.
"""

from __future__ import annotations

import os

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

import orbax_tunix as ot
from orbax_tunix import maxtext
from orbax_tunix.tools import convert
from tests import builders, opens
from tests.test_maxtext import TinyLM, abstract_state, adamw
from tests.test_partial_steps import _plain_target


def _target(mesh):
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  return {'embedder': {'embedding': jax.ShapeDtypeStruct((16, 8), np.float32, sharding=sharding)}}


def _calls(tunix_data, mesh, tmp_path):
  step = tunix_data / 'sft_full' / '2'
  abstract = abstract_state(TinyLM(), adamw(), mesh)
  target = _target(mesh)
  composite = ocp.Checkpointer(ot.TunixAwareHandler())
  item = ocp.Checkpointer(ot.TunixPyTreeHandler())
  standard = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), target)
  return {
      'composite, args': lambda: composite.restore(step, args=ocp.args.Composite(
          model_params=ocp.args.PyTreeRestore(item=target))),
      'composite, no args': lambda: composite.restore(step),
      'item, PyTreeRestore': lambda: item.restore(
          step / 'model_params', args=ocp.args.PyTreeRestore(item=target)),
      'item, StandardRestore': lambda: item.restore(
          step / 'model_params', args=ocp.args.StandardRestore(standard)),
      'maxtext, full': lambda: maxtext.restore_train_state(step, abstract),
      'maxtext, params only': lambda: maxtext.restore_train_state(step, abstract, params_only=True),
      'ItemsHandler': lambda: ocp.Checkpointer(maxtext.ItemsHandler()).restore(
          step, args=ocp.args.PyTreeRestore(item=abstract, partial_restore=True)),
      'merged LoRA': lambda: ot.restore_merged_lora(
          tunix_data / 'lora_qwix_full', _plain_target(tunix_data), alpha=4.0),
      'hyperparameters': lambda: ot.hyperparameters(tunix_data / 'adapter_inject'),
      'convert': lambda: convert.run_convert(convert.plan_convert(
          step, tmp_path / f'out{len(os.listdir(tmp_path))}' / '2')),
  }


@pytest.mark.parametrize('name', [
    'composite, args', 'composite, no args', 'item, PyTreeRestore', 'item, StandardRestore',
    'maxtext, full', 'maxtext, params only', 'ItemsHandler', 'merged LoRA', 'hyperparameters',
    'convert',
])
def test_each_metadata_file_is_opened_once(tunix_data, mesh, tmp_path, name):
  call = _calls(tunix_data, mesh, tmp_path)[name]
  call()  # Imports and compilations out of the way.
  with opens.counting() as counts:
    call()
  source = {p: n for p, n in counts.items() if p.startswith(str(tunix_data))}
  assert source, 'nothing was counted: the hook does not see the reads'
  assert max(source.values()) == 1, source


def test_served_metadata_reads_the_same_values(tunix_data, mesh):
  """A partial read handed a cut-down `_METADATA` gets what plain Orbax reads."""
  step = tunix_data / 'sft_full' / '2'
  got = ocp.Checkpointer(ot.TunixPyTreeHandler()).restore(
      step / 'model_params', args=ocp.args.PyTreeRestore(item=_target(mesh)))
  raw = builders.raw_leaves(step / 'model_params')
  np.testing.assert_array_equal(got['embedder']['embedding'], raw['embedder/embedding/value'])

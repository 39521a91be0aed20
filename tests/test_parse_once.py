"""Each metadata file is opened once per call: this package's parse serves Orbax's.

Counted with a Python audit hook (`tests/opens.py`) on the committed google-tunix
fixtures, for every entry point that restores and every command that reads a step; the
second part checks the values read against plain Orbax reads; the last that a command
resolves, detects and lists each of its sources once and hands what it opened down.
"""

from __future__ import annotations

import collections
import contextlib
import io
import os
import pathlib
import sys

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
          tunix_data / 'lora_qwix_full', _plain_target(tunix_data), lora_alpha=4.0),
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


# --- a command opens its source once (issue 47, item 6) ------------------------------------


def _cli(tunix_data, maxtext_data, tmp_path):
  """Each command that reads a step, as the command line runs it: argv, and the number of
  checkpoints it reads (a merge's base and a diff's second side are the second)."""
  d = tunix_data
  out = lambda: str(tmp_path / f'out{len(os.listdir(tmp_path))}')  # noqa: E731
  return {
      'export': (lambda: ['export', str(d / 'hf_qwen3'), out(), '--model', 'qwen3'], 1),
      'export --merge-lora --base': (lambda: [
          'export', str(d / 'hf_qwen3_lora_only'), out(), '--model', 'qwen3', '--merge-lora',
          '--lora-alpha', '3', '--base', str(d / 'hf_qwen3')], 2),
      'export --peft': (lambda: ['export', str(d / 'hf_qwen3_lora'), out(), '--model', 'qwen3',
                                 '--peft', '--lora-alpha', '3'], 1),
      'convert': (lambda: ['convert', str(d / 'adapter_inject'), out() + '/1'], 1),
      'convert --layout maxtext': (lambda: [
          'convert', str(maxtext_data / 'tunix_llama2_scan'), out() + '/1', '--layout', 'maxtext',
          '--params-only', '--scan-layers', 'false'], 1),
      'inspect': (lambda: ['inspect', str(d / 'adapter_inject')], 1),
      'diff': (lambda: ['diff', str(d / 'sft_full' / '1'), str(d / 'sft_full' / '2')], 2),
  }


COMMANDS = ['export', 'export --merge-lora --base', 'export --peft', 'convert',
            'convert --layout maxtext', 'inspect', 'diff']


@pytest.fixture
def maxtext_data():
  return pathlib.Path(__file__).parent / 'data' / 'maxtext'


def _run(argv):
  from orbax_tunix.cli import commands  # pylint: disable=g-import-not-at-top
  with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
    return commands.main(argv)


@pytest.mark.parametrize('name', COMMANDS)
def test_each_command_opens_each_metadata_file_once(tunix_data, maxtext_data, tmp_path, name):
  argv, _ = _cli(tunix_data, maxtext_data, tmp_path)[name]
  assert _run(argv()) in (0, 1)  # Imports and compilations out of the way (diff: 1, differ).
  with opens.counting() as counts:
    assert _run(argv()) in (0, 1)
  source = {p: n for p, n in counts.items()
            if p.startswith((str(tunix_data), str(maxtext_data)))}
  assert source, 'nothing was counted: the hook does not see the reads'
  assert max(source.values()) == 1, source


@pytest.mark.parametrize('name', COMMANDS)
def test_each_command_resolves_detects_and_lists_each_source_once(tunix_data, maxtext_data,
                                                                   tmp_path, name):
  """The source is opened once (`reader.open_source`: resolved, detected, listed) and handed
  down: the layouts, the merge and the checks read what was opened, its weights found once."""
  from orbax_tunix.reading import reader  # pylint: disable=g-import-not-at-top
  from orbax_tunix.store import step_store  # pylint: disable=g-import-not-at-top
  from orbax_tunix.view import detection  # pylint: disable=g-import-not-at-top

  watched = {step_store.resolve.__code__: 'resolve', detection.detect.__code__: 'detect',
             reader.open_checkpoint.__code__: 'list',
             reader._find_weights.__code__: 'find weights'}  # pylint: disable=protected-access
  argv, sources = _cli(tunix_data, maxtext_data, tmp_path)[name]
  calls = collections.Counter()

  def count(frame, event, arg):
    del arg
    if event == 'call' and frame.f_code in watched:
      calls[watched[frame.f_code]] += 1

  assert _run(argv()) in (0, 1)
  sys.setprofile(count)
  try:
    code = _run(argv())
  finally:
    sys.setprofile(None)
  assert code in (0, 1)
  assert {k: calls[k] for k in ('resolve', 'detect', 'list')} == dict.fromkeys(
      ('resolve', 'detect', 'list'), sources), calls
  assert calls['find weights'] <= sources, calls  # inspect finds them once, diff per side.

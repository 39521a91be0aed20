"""The layout catalog: a layout's destination is a `layouts.Destination` value (its kind, its
writing, its command and flag in one place), and the families are named only by their own
values."""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

import orbax_tunix as ot
from orbax_tunix import layouts
from orbax_tunix.cli import flags
from orbax_tunix.mapping import huggingface


def test_every_layout_names_a_destination_value():
  found = {layouts.get(n).destination.name for n in layouts.names()}
  assert found == {'step', 'folder', 'adapter'}
  assert all(isinstance(layouts.get(n).destination, layouts.Destination) for n in layouts.names())
  # Each command's destinations: exactly one chosen without a switch (its default).
  for command in ('convert', 'export'):
    assert [d.name for d in layouts.destinations(command) if d.switch is None] == [
        {'convert': 'step', 'export': 'folder'}[command]]


@pytest.mark.parametrize('call', [layouts.named, layouts.options])
def test_a_bare_string_is_refused_as_a_destination(call):
  # 'step' was the kind's spelling before it was a value: it would match no layout, silently.
  with pytest.raises(TypeError, match=r"destination 'step': expected a layouts.Destination"):
    call('step')


def test_a_layout_of_a_bare_string_destination_is_refused():
  with pytest.raises(TypeError, match="destination 'folder'"):
    layouts.Layout('x', 'x', lambda request: None, destination='folder')


def test_the_step_layouts_are_canonical_and_maxtext():
  # Independent of the catalog's code: the two Orbax step outputs README documents.
  (step,) = layouts.destinations('convert')
  assert set(layouts.named(step)) == {'canonical', 'maxtext'}


def test_a_familys_layout_of_each_export_destination():
  # README: `export --model F` writes F's folder, `--peft` F's PEFT adapter.
  folder, adapter = layouts.destinations('export')
  assert flags.flag_of(adapter.switch.option) == '--peft'
  for family in huggingface.names():
    assert layouts.find(folder, family).name == family
    assert layouts.find(adapter, family).name == f'{family}.peft'
  with pytest.raises(ot.UnsupportedLayoutError, match='`model` .nope.'):
    layouts.find(folder, 'nope')


PACKAGE = pathlib.Path(layouts.__file__).resolve().parents[1]
# The families' data: the families, and each trainer's namings of them.
FAMILY_MODULES = {PACKAGE / 'mapping' / f'{name}.py' for name in ('hf_families', 'hf_tunix', 'hf_maxtext')}


def _enumerations(path: pathlib.Path, families: tuple[str, ...]) -> list[str]:
  """The string literals of `path` (not its docstrings) that name two families or more."""
  tree = ast.parse(path.read_text())
  docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef,
                                     ast.AsyncFunctionDef))
                and node.body and isinstance(node.body[0], ast.Expr)
                and isinstance(node.body[0].value, ast.Constant)}
  found = []
  for node in ast.walk(tree):
    if (isinstance(node, ast.Constant) and isinstance(node.value, str)
        and id(node) not in docstrings):
      named = {f for f in families if re.search(rf'(?<![\w.]){re.escape(f)}(?![\w.])', node.value)}
      if len(named) > 1:
        found.append(f'{path.relative_to(PACKAGE.parent)}:{node.lineno}: {sorted(named)}')
  return found


def test_no_module_but_the_families_enumerates_them():
  # Issue 35: a family is one value; text listing families is generated from the catalog
  # (as `--model`'s choices and `--config-as-trained`'s help are), never kept by hand.
  families = huggingface.choices()
  found = [e for path in sorted(PACKAGE.rglob('*.py')) if path not in FAMILY_MODULES
           for e in _enumerations(path, families)]
  assert found == []


def test_aliases_are_the_family_values_own():
  # MaxText's names of the Llama model (README: `--model llama3`, or llama3.1 and llama2).
  assert huggingface.get('llama3.1') is huggingface.get('llama2') is huggingface.get('llama3')
  assert {'llama3.1', 'llama2'} <= set(huggingface.choices()[len(huggingface.names()):])
  assert huggingface.get('qwen2').aliases == ()  # Built from llama3's value, not its names.


def test_a_new_output_format_is_one_module(tmp_path):
  """README: a new output format is one module (tests/npz_output.py: its destination, its
  sink and its layouts) and its registration (here its import): `export --npz` is in the
  command's help, refuses what it does not take (and another switch beside it), and writes
  the tensors the family's folder holds, read back by numpy."""
  import json
  import subprocess
  import sys

  import numpy as np

  from tests.test_export_hf import DATA, ROOT, read_safetensors

  def cli(*argv):
    code = ('import sys, tests.npz_output; from orbax_tunix.cli import commands;'
            f' sys.exit(commands.main({[str(a) for a in argv]!r}))')
    return subprocess.run([sys.executable, '-c', code], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)

  help_text = cli('export', '--help').stdout
  assert '--npz' in help_text and 'write one model.npz of the tensors' in help_text
  refused = cli('export', DATA / 'hf_qwen3', tmp_path / 'x', '--model', 'qwen3', '--npz',
                '--hf-config', tmp_path)
  assert refused.returncode == 2 and '--npz with --hf-config: an npz holds no config.json.' \
      ' Leave --hf-config out, or export a folder.' in refused.stderr, refused.stderr
  # A flag of the other destinations' layouts that its data does not name: refused plainly.
  plain = cli('export', DATA / 'hf_qwen3', tmp_path / 'x', '--model', 'qwen3', '--npz',
              '--max-shard-size', '1GB')
  assert plain.returncode == 2 and '--npz with --max-shard-size: the npz layouts do not take' \
      ' it. Leave --max-shard-size out, or export a folder.' in plain.stderr, plain.stderr
  both = cli('export', DATA / 'hf_qwen3', tmp_path / 'x', '--model', 'qwen3', '--npz', '--peft')
  assert both.returncode == 2 and '--peft and --npz: each writes another kind of output; pass' \
      ' one.' in both.stderr, both.stderr
  done = cli('export', DATA / 'hf_qwen3', tmp_path / 'npz', '--model', 'qwen3', '--npz',
             '--json')
  assert done.returncode == 0, done.stderr
  assert json.loads(done.stdout)['model'] == 'qwen3'
  folder = cli('export', DATA / 'hf_qwen3', tmp_path / 'folder', '--model', 'qwen3')
  assert folder.returncode == 0, folder.stderr
  _, _, want = read_safetensors(tmp_path / 'folder' / 'model.safetensors')
  with np.load(tmp_path / 'npz' / 'model.npz') as got:
    assert sorted(got.files) == sorted(want)
    for name, array in want.items():
      np.testing.assert_array_equal(got[name], array, err_msg=name)


def test_a_family_names_each_trainer_once():
  # One shape for any trainer: a family's namings are keyed by their trainer.
  from orbax_tunix.mapping import trainers
  from orbax_tunix.mapping.hf_naming import Family

  qwen3 = huggingface.get('qwen3')
  assert [n.trainer for n in qwen3.namings] == [trainers.TUNIX, trainers.MAXTEXT]
  assert huggingface.get('gemma').naming_of(trainers.MAXTEXT) is None  # Gemma 1: Tunix's only
  with pytest.raises(ValueError, match='two namings of one trainer'):
    Family('x', 'X', 'x', (qwen3.namings[0], qwen3.namings[0]))
  # Which trainer's names weights carry: their top-level keys (MaxText's decoder), else Tunix's.
  assert trainers.of([('decoder', 'layers', 'w')]) is trainers.MAXTEXT
  assert trainers.of([('layers', '0', 'attn', 'q_proj', 'w')]) is trainers.TUNIX

"""The layout catalog: sink kinds are `layouts.Destination` values, every kind a layout names is
one the pipeline writes, and the families are named only by their own values."""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

from orbax_tunix import layouts
from orbax_tunix.mapping import huggingface
from orbax_tunix.tools import pipeline


def test_every_layout_names_a_sink_the_pipeline_writes():
  kinds = {layouts.get(n).sink for n in layouts.names()}
  assert kinds == set(layouts.Destination)
  assert set(pipeline.SINKS) == set(layouts.Destination)


@pytest.mark.parametrize('call', [layouts.named, layouts.options])
def test_a_bare_string_is_refused_as_a_sink_kind(call):
  # 'step' was the kind's spelling before it was a value: it would match no layout, silently.
  with pytest.raises(TypeError, match=r"sink 'step': expected a layouts.Destination"):
    call('step')


def test_a_layout_of_a_bare_string_sink_is_refused():
  with pytest.raises(TypeError, match="sink 'folder'"):
    layouts.Layout('x', 'x', lambda request: None, sink='folder')


def test_the_step_layouts_are_canonical_and_maxtext():
  # Independent of the catalog's code: the two Orbax step outputs README documents.
  assert set(layouts.named(layouts.Destination.STEP)) == {'canonical', 'maxtext'}


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
  assert huggingface.choices()[-2:] == ('llama3.1', 'llama2')
  assert huggingface.get('qwen2').aliases == ()  # Built from llama3's value, not its names.

"""The package's layers (README, "How the package is laid out"): each sub-package imports only
the ones before it in `LAYERS`, and no module imports itself back through others."""

from __future__ import annotations

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / 'orbax_tunix'
# In order: each may import those before it (and itself).
LAYERS = ['', 'store', 'view', 'reading', 'handlers', 'mapping', 'maxtext', 'layouts', 'writing',
          'tools', 'cli']
TOP_LEVEL = {'errors', 'sizes', 'keypaths', 'conventions', 'catalog', 'version'}


def _module(path: pathlib.Path) -> str:
  parts = list(path.relative_to(PACKAGE.parent).with_suffix('').parts)
  return '.'.join(parts[:-1] if parts[-1] == '__init__' else parts)


MODULES = {_module(p): p for p in PACKAGE.rglob('*.py')}


def _imports(path: pathlib.Path) -> set[str]:
  """Every package module `path` imports, at any depth of its code."""
  found = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      names = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
      names = [f'{node.module}.{a.name}' if f'{node.module}.{a.name}' in MODULES else node.module
               for a in node.names]
    else:
      continue
    found.update(n for n in names if n in MODULES)
  return found


def _layer(module: str) -> int:
  parts = module.split('.')
  if len(parts) == 2 and parts[1] in TOP_LEVEL:
    return 0
  return LAYERS.index(parts[1]) if len(parts) > 2 or parts[1] in LAYERS else -1


def test_every_module_has_a_layer():
  assert [m for m in MODULES if m != 'orbax_tunix' and _layer(m) < 0] == []


@pytest.mark.parametrize('module', sorted(m for m in MODULES if m != 'orbax_tunix'))
def test_a_module_imports_only_earlier_layers(module):
  later = sorted(i for i in _imports(MODULES[module])
                 if i != 'orbax_tunix' and _layer(i) > _layer(module))
  assert later == [], f'{module} (layer {LAYERS[_layer(module)]!r}) imports {later}'
  assert 'orbax_tunix' not in _imports(MODULES[module]) or module.endswith('__main__'), (
      f'{module} imports the package itself (its __init__ imports everything)')


def test_no_import_cycles():
  graph = {m: _imports(p) - {m, 'orbax_tunix'} for m, p in MODULES.items() if m != 'orbax_tunix'}
  seen: dict[str, int] = {}  # 1: on the path, 2: done

  def visit(m: str, path: list[str]) -> None:
    seen[m] = 1
    for n in sorted(graph.get(m, ())):
      if seen.get(n) == 1:
        raise AssertionError(' -> '.join([*path[path.index(n):], n]))
      if n not in seen:
        visit(n, [*path, n])
    seen[m] = 2

  for m in sorted(graph):
    if m not in seen:
      visit(m, [m])

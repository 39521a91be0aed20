"""The package's layers (docs/layout.md): each sub-package imports only
the ones before it in `LAYERS`, and no module imports itself back through others; and every
other package it imports is declared in pyproject.toml."""

from __future__ import annotations

import ast
import importlib.metadata
import pathlib
import re
import sys
import tomllib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / 'orbax_tunix'
# In order: each may import those before it (and itself).
LAYERS = ['', 'store', 'view', 'reading', 'mapping', 'handlers', 'maxtext', 'writing', 'layouts',
          'tools', 'cli']
TOP_LEVEL = {'errors', 'sizes', 'keypaths', 'conventions', 'catalog', 'options', 'version'}


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


# --- what the package imports from others is declared -----------------------------------


def _normal(name: str) -> str:
  """A distribution name as PEP 503 compares them."""
  return re.sub(r'[-_.]+', '-', name).lower()


def _third_party_imports() -> dict[str, bool]:
  """Every top-level module of another package the package imports, at any depth of its
  code -> whether every such import is optional (inside a `try` that catches ImportError)."""
  found: dict[str, bool] = {}

  def visit(node: ast.AST, optional: bool) -> None:
    if isinstance(node, ast.Try):
      catches = any(h.type is None or 'ImportError' in ast.unparse(h.type) for h in node.handlers)
      for child in node.body:
        visit(child, optional or catches)
      for child in [*node.handlers, *node.orelse, *node.finalbody]:
        visit(child, optional)
      return
    names = []
    if isinstance(node, ast.Import):
      names = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
      names = [node.module]
    for name in names:
      top = name.split('.')[0]
      if top not in sys.stdlib_module_names and top not in ('orbax_tunix', '__future__'):
        found[top] = found.get(top, True) and optional
    for child in ast.iter_child_nodes(node):
      visit(child, optional)

  for path in MODULES.values():
    visit(ast.parse(path.read_text()), False)
  return found


def test_every_package_imported_is_declared():
  """Each other package the code imports is a declared dependency (an optional import, one
  inside `try: ... except ImportError`, may be an extra's instead): none may arrive only
  because another package happens to depend on it today."""
  project = tomllib.loads((PACKAGE.parent / 'pyproject.toml').read_text())['project']

  def names(requirements: list[str]) -> set[str]:
    return {_normal(re.match(r'[A-Za-z0-9._-]+', r).group(0)) for r in requirements}

  core = names(project['dependencies'])
  extras = names([r for e in project['optional-dependencies'].values() for r in e])
  provided = importlib.metadata.packages_distributions()
  imported = _third_party_imports()
  assert {'jax', 'orbax', 'rich'} <= set(imported)  # The scan sees imports (rich: optional).
  missing = []
  for module, optional in sorted(imported.items()):
    dists = {_normal(d) for d in provided.get(module, [module])}
    if not dists & (core | (extras if optional else set())):
      missing.append(f'{module} (from {", ".join(sorted(dists))}'
                     f'{", optional" if optional else ""})')
  assert missing == [], f'imported but not declared in pyproject.toml: {missing}'


# --- small modules with one job, behind their public names (issue 47) --------------------

# A function is at most this many lines (its `def` to its last line), a module at most
# `MODULE_LINES`: past them a reader loses the one job.
FUNCTION_LINES = 90
MODULE_LINES = 1000
# The one module that may use other libraries' private API (`jax._src`, `orbax.checkpoint._src`).
SEAM = 'orbax_tunix.store._orbax'


def _trees() -> dict[str, ast.Module]:
  return {m: ast.parse(p.read_text()) for m, p in MODULES.items()}


def test_no_function_is_longer_than_the_limit():
  long = [f'{m}.{n.name}: {n.end_lineno - n.lineno + 1} lines'
          for m, tree in _trees().items() for n in ast.walk(tree)
          if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)
          and n.end_lineno - n.lineno + 1 > FUNCTION_LINES]
  assert long == [], f'functions over {FUNCTION_LINES} lines: {long}'


def test_no_module_is_longer_than_the_limit():
  long = {m: n for m, p in MODULES.items() if (n := len(p.read_text().splitlines())) > MODULE_LINES}
  assert long == {}, f'modules over {MODULE_LINES} lines: {long}'


def _private(name: str) -> bool:
  return name.startswith('_') and not (name.startswith('__') and name.endswith('__'))


def test_no_module_uses_another_modules_private_names():
  """`from m import _x` or `m._x` for another package module `m` (a private module, as the
  seam `_orbax`, may be imported: its own names are its public API)."""
  found = []
  for module, tree in _trees().items():
    aliases: dict[str, str] = {}  # Local name -> the package module it names.
    for node in ast.walk(tree):
      if isinstance(node, ast.Import):
        aliases.update({a.asname or a.name: a.name for a in node.names if a.name in MODULES})
      elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in MODULES:
        for a in node.names:
          target = f'{node.module}.{a.name}'
          if target in MODULES:
            aliases[a.asname or a.name] = target
          elif _private(a.name) and node.module != module:
            found.append(f'{module}: from {node.module} import {a.name}')
    for node in ast.walk(tree):
      if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
          and node.value.id in aliases and aliases[node.value.id] != module
          and _private(node.attr)):
        found.append(f'{module}: {node.value.id}.{node.attr}')
  assert found == [], found


def test_private_apis_of_other_libraries_only_in_the_seam():
  """Only `store/_orbax.py` imports another library's private modules (`jax._src`,
  `orbax.checkpoint._src`): one pinned function each (tests/test_orbax_assumptions.py)."""
  found = []
  for module, tree in _trees().items():
    for node in ast.walk(tree):
      names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
               [node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
      found += [f'{module}: {n}' for n in names
                if not n.startswith('orbax_tunix') and any(_private(p) for p in n.split('.'))
                and module != SEAM]
  assert found == [], found

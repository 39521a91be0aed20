"""The documentation runs: every code block of README.md and docs/*.md, and every link resolves.

A ```python block is run as written, a document's blocks in order in one namespace (as a reader
runs them one after another in one session); a ```sh block is a list of `orbax-tunix` commands,
each run in this process (`cli.commands.main`) and expected to exit 0. They run from a fresh
folder holding `tests` (this repository's: the committed checkpoints under tests/data), so
what they write (`out/...`) goes there. A block that cannot run here (it installs, needs a
bucket, several hosts, a Hugging Face model folder, MaxText's or transformers' venv) says so
on the line before it, `<!-- not run: why -->`: only such a marked block is skipped, and every
marker names its reason and precedes a block. ```text and ```json blocks show output.
"""

from __future__ import annotations

import dataclasses
import pathlib
import re
import shlex

import pytest

from orbax_tunix.cli import commands

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = (ROOT / 'README.md', *sorted((ROOT / 'docs').glob('*.md')))
NOT_RUN = re.compile(r'^<!-- not run: (?P<why>.*\S.*) -->$')
FENCE = re.compile(r'^(?P<indent> *)```(?P<lang>[\w-]*)\s*$')
RUN = ('python', 'sh')
SHOWN = ('text', 'json')  # output shown, nothing to run


@dataclasses.dataclass(frozen=True)
class Block:
  """One fenced code block: where it starts (1-based line of its fence), its language, its
  code (the fence's indentation removed) and its `not run` reason, if marked."""

  doc: pathlib.Path
  line: int
  lang: str
  code: str
  not_run: str | None

  @property
  def where(self) -> str:
    return f'{self.doc.relative_to(ROOT)}:{self.line}'


def blocks(doc: pathlib.Path) -> list[Block]:
  """The fenced blocks of a Markdown file, in order.

  Raises:
    AssertionError: a fence left open, or a `not run` marker that precedes no block.
  """
  lines = doc.read_text().splitlines()
  found, i, marker = [], 0, None
  while i < len(lines):
    line = lines[i]
    fence = FENCE.match(line)
    if fence is None:
      if line.strip().startswith('<!-- not run'):
        assert NOT_RUN.match(line.strip()), f'{doc}:{i + 1}: a marker is `<!-- not run: why -->`'
        marker = (i + 1, NOT_RUN.match(line.strip())['why'])
      elif line.strip() and marker is not None:
        raise AssertionError(f'{doc}:{marker[0]}: a `not run` marker must precede a block')
      i += 1
      continue
    indent, start, body = fence['indent'], i, []
    i += 1
    while i < len(lines) and lines[i].strip() != '```':
      body.append(lines[i][len(indent):] if lines[i].startswith(indent) else lines[i])
      i += 1
    assert i < len(lines), f'{doc}:{start + 1}: a code block is not closed'
    found.append(Block(doc, start + 1, fence['lang'], '\n'.join(body) + '\n',
                       marker[1] if marker else None))
    marker = None
    i += 1
  assert marker is None, f'{doc}:{marker[0]}: a `not run` marker must precede a block'
  return found


def shell_commands(code: str) -> list[list[str]]:
  """A sh block's commands: lines joined at a trailing backslash, comments left out."""
  joined = code.replace('\\\n', ' ')
  return [argv for argv in (shlex.split(line, comments=True) for line in joined.splitlines())
          if argv]


def run_block(block: Block, namespace: dict) -> None:
  if block.lang == 'python':
    exec(compile(block.code, block.where, 'exec'), namespace)  # pylint: disable=exec-used
    return
  for argv in shell_commands(block.code):
    assert argv[0] == 'orbax-tunix', (
        f'{block.where}: {shlex.join(argv)}: a sh block runs orbax-tunix commands; mark one'
        ' that cannot run here `<!-- not run: why -->`')
    code = commands.main(argv[1:])
    assert code == 0, f'{block.where}: {shlex.join(argv)} exited {code}'


@pytest.mark.parametrize('doc', DOCS, ids=[str(d.relative_to(ROOT)) for d in DOCS])
def test_every_code_block_runs(doc, tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  (tmp_path / 'tests').symlink_to(ROOT / 'tests')
  namespace = {'__name__': '__docs__'}
  for block in blocks(doc):
    assert block.lang in RUN + SHOWN, (
        f'{block.where}: a code block says its language ({", ".join(RUN + SHOWN)})')
    if block.lang in RUN and block.not_run is None:
      run_block(block, namespace)


def test_readme_opens_with_the_two_commands():
  """The main job on the shipped checkpoint, then the test command `.ci/run` runs."""
  first, second = blocks(ROOT / 'README.md')[:2]
  assert first.line < 10 and 'examples/quickstart.py' in first.code
  assert first.code.startswith('python3 -m venv .venv && .venv/bin/pip install -q . ')
  ci = (ROOT / '.ci' / 'run').read_text()
  test_command = second.code.strip().split(' && .venv/bin/python -m pytest -q')[0]
  assert second.code.strip().endswith('.venv/bin/python -m pytest -q')
  assert test_command + '\n' in ci, 'README\'s test command is not the one .ci/run runs'


def _anchors(doc: pathlib.Path) -> set[str]:
  """GitHub's anchors of a Markdown file's headings."""
  names = set()
  for line in re.sub(r'```.*?```', '', doc.read_text(), flags=re.S).splitlines():
    if line.startswith('#'):
      title = line.lstrip('#').strip().lower()
      names.add(re.sub(r'[^\w\- ]', '', title).replace(' ', '-'))
  return names


def test_links_resolve():
  """Every relative link names a file here (and a heading of it, after `#`)."""
  broken = []
  for doc in DOCS:
    text = re.sub(r'```.*?```', '', doc.read_text(), flags=re.S)
    for target in re.findall(r'\]\(([^)\s]+)\)', text):
      if re.match(r'[a-z]+:', target):
        continue
      path, _, anchor = target.partition('#')
      linked = (doc.parent / path).resolve() if path else doc
      if not linked.exists():
        broken.append(f'{doc.relative_to(ROOT)}: {target}: no such file')
      elif anchor and linked.suffix == '.md' and anchor not in _anchors(linked):
        broken.append(f'{doc.relative_to(ROOT)}: {target}: no such heading')
  assert not broken, '\n'.join(broken)


def test_readme_links_every_guide():
  readme = (ROOT / 'README.md').read_text()
  missing = [d.name for d in DOCS[1:] if f'(docs/{d.name}' not in readme]
  assert not missing, missing

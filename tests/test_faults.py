"""Damaged and unusual checkpoints, through the real command line: one table.

Each row damages a copy of a real Tunix run (written by google-tunix, see
tests/data/tunix) and says what every tool must then do: the exit status, a
message naming what broke, no traceback, the source untouched and nothing
written where convert was pointed. The next damaged-checkpoint case is one
more row.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
from collections.abc import Callable

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
ENV = {**{k: v for k, v in os.environ.items() if k != 'XLA_FLAGS'}, 'JAX_PLATFORMS': 'cpu'}
COMMANDS = ('inspect', 'convert', 'diff')


def snapshot(root: pathlib.Path) -> dict[str, tuple]:
  """Every entry under `root`: file bytes and times, directory listings, links."""
  out = {}
  for dirpath, dirnames, filenames in os.walk(root):
    out[dirpath] = ('dir', tuple(sorted(dirnames + filenames)), os.stat(dirpath).st_mtime_ns)
    for name in filenames + dirnames:
      path = os.path.join(dirpath, name)
      if os.path.islink(path):
        out[path] = ('link', os.readlink(path))
      elif os.path.isfile(path) and os.stat(path).st_size < (1 << 20):
        st = os.stat(path)
        with open(path, 'rb') as f:
          out[path] = (hashlib.sha256(f.read()).hexdigest(), st.st_mtime_ns)
  return out


def _truncate(path: pathlib.Path, keep: float = 0.5) -> None:
  data = path.read_bytes()
  path.write_bytes(data[: int(len(data) * keep)])


def _data_files(item: pathlib.Path) -> list[pathlib.Path]:
  return [p for p in item.rglob('*') if p.is_file() and p.parent.name == 'd']


def _nest_deeply(path: pathlib.Path) -> None:
  path.write_text('{"tree_metadata": ' + '[' * 10_000 + ']' * 10_000 + '}')


def _add_phantom_leaves(path: pathlib.Path, n: int = 20_000) -> None:
  """Leaves in _METADATA that have no array data (e.g. a bad merge)."""
  meta = json.loads(path.read_text())
  entry = next(iter(meta['tree_metadata'].values()))
  for i in range(n):
    keys = ('phantom', str(i), 'value')
    meta['tree_metadata'][repr(keys)] = {
        'key_metadata': [{'key': k, 'key_type': 2} for k in keys],
        'value_metadata': entry['value_metadata'],
    }
  path.write_text(json.dumps(meta))


def _record_handler(typestr: str) -> Callable[[pathlib.Path], None]:
  def make(step: pathlib.Path) -> None:
    meta_file = step / '_CHECKPOINT_METADATA'
    meta = json.loads(meta_file.read_text())
    meta['item_handlers']['model_params'] = typestr
    meta_file.write_text(json.dumps(meta))

  return make


def _replace_with_dangling_link(item: pathlib.Path) -> None:
  shutil.rmtree(item)
  item.symlink_to(item.parent / 'nowhere')


def _replace_with_file(item: pathlib.Path) -> None:
  shutil.rmtree(item)
  item.write_text('x')


def _sparse(path: pathlib.Path, size: int) -> None:
  with open(path, 'r+b') as f:
    f.truncate(size)  # A hole: no disk used, but stat says `size`.


def _link_to_dev_zero(path: pathlib.Path) -> None:
  path.unlink()
  path.symlink_to('/dev/zero')


@dataclasses.dataclass(frozen=True)
class Fault:
  """One damaged checkpoint and what each tool must do with it.

  Attributes:
    name: the case.
    make: damages the step directory of a fresh copy.
    message: a regex the error must match (it must name the step too).
    exits: per command (inspect, convert, diff), the exit status; None
      where the outcome depends on where the damage falls (still no
      traceback, nothing written).
  """

  name: str
  make: Callable[[pathlib.Path], None]
  message: str
  exits: tuple[int | None, int | None, int | None] = (2, 2, 2)


FAULTS = [
    # An absent item: inspect shows the rest (with a note); the whole-step
    # tools name it (tests/test_partial_steps.py covers asking for less).
    Fault('model_params missing', lambda s: shutil.rmtree(s / 'model_params'), r'model_params',
          (0, 2, 2)),
    Fault('model_params without _METADATA', lambda s: (s / 'model_params' / '_METADATA').unlink(),
          r'model_params'),
    Fault('model_params a dangling symlink', lambda s: _replace_with_dangling_link(s / 'model_params'),
          r'model_params'),
    Fault('model_params a file', lambda s: _replace_with_file(s / 'model_params'), r'model_params'),
    Fault('optimizer_state missing', lambda s: shutil.rmtree(s / 'optimizer_state'),
          r'optimizer_state', (0, 2, 2)),
    Fault('truncated _METADATA', lambda s: _truncate(s / 'model_params' / '_METADATA'), r'_METADATA'),
    Fault('non-tree _METADATA', lambda s: (s / 'optimizer_state' / '_METADATA').write_text('[1, 2]'),
          r'_METADATA'),
    Fault('_METADATA nested 10^4 deep', lambda s: _nest_deeply(s / 'model_params' / '_METADATA'),
          r'_METADATA.*nested'),
    Fault('_METADATA linked to /dev/zero', lambda s: _link_to_dev_zero(s / 'model_params' / '_METADATA'),
          r'_METADATA.*regular file, found a device'),
    Fault('_METADATA of 2 GiB', lambda s: _sparse(s / 'model_params' / '_METADATA', 2 << 30),
          r'_METADATA.*larger than'),
    Fault('_METADATA lists leaves with no array data',
          lambda s: _add_phantom_leaves(s / 'model_params' / '_METADATA'), r'no array data'),
    Fault('invalid _CHECKPOINT_METADATA', lambda s: (s / '_CHECKPOINT_METADATA').write_text('{"item_h'),
          r'_CHECKPOINT_METADATA'),
    Fault('list _CHECKPOINT_METADATA', lambda s: (s / '_CHECKPOINT_METADATA').write_text('[]'),
          r'_CHECKPOINT_METADATA'),
    Fault('recorded handler is JSON', _record_handler(
        'orbax.checkpoint._src.handlers.json_checkpoint_handler.JsonCheckpointHandler'),
          r'JsonCheckpointHandler'),
    Fault('deleted array data',
          lambda s: [shutil.rmtree(d) for d in list((s / 'model_params').rglob('d'))],
          r'model_params'),
    Fault('zero-byte array data',
          lambda s: [p.write_bytes(b'') for p in _data_files(s / 'model_params')],
          r'model_params', (None, 2, 2)),
    Fault('truncated array data',
          lambda s: [_truncate(p) for p in _data_files(s / 'model_params')],
          r'model_params.*(missing or damaged|another step)', (None, 2, 2)),
]


@pytest.fixture(scope='module')
def pristine(tunix_data, tmp_path_factory):
  """An undamaged copy, the other side of every diff."""
  root = tmp_path_factory.mktemp('pristine') / 'run'
  shutil.copytree(tunix_data / 'adapter_inject', root)
  return root / '1'


def run_cli(*argv: object) -> subprocess.CompletedProcess:
  return subprocess.run(
      [sys.executable, '-m', 'orbax_tunix.cli', *map(str, argv)],
      capture_output=True, text=True, env=ENV, cwd=REPO, timeout=300,
  )


@pytest.mark.parametrize('fault', FAULTS, ids=[f.name for f in FAULTS])
def test_damaged_step(fault, tunix_data, tmp_path, pristine):
  root = tmp_path / 'run'
  shutil.copytree(tunix_data / 'adapter_inject', root, symlinks=True)
  step = root / '1'
  fault.make(step)
  before = snapshot(root)
  out = tmp_path / 'out'
  argvs = {
      'inspect': ('inspect', step),
      'convert': ('convert', step, out / '1'),
      'diff': ('diff', step, pristine),
  }
  with concurrent.futures.ThreadPoolExecutor(2) as pool:
    done = dict(zip(COMMANDS, pool.map(lambda c: run_cli(*argvs[c]), COMMANDS), strict=True))
  for command, expected in zip(COMMANDS, fault.exits, strict=True):
    result = done[command]
    where = f'{command}: exit {result.returncode}\n{result.stderr}'
    assert 'Traceback' not in result.stderr, where
    if expected is not None:
      assert result.returncode == expected, where
    if result.returncode == 2:
      assert str(step) in result.stderr, where
      assert re.search(fault.message, result.stderr, re.S), where
  assert snapshot(root) == before, 'the source was written to'
  assert not out.exists(), 'convert wrote something'


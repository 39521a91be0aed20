"""An export's files written on several threads (issue 53 item 4): the same bytes as written
in order, failures of any thread raised once none writes any more, the threads the host
gives (or `ORBAX_TUNIX_THREADS`), and `--timings` saying where the time went.

Expected files are built here from numpy alone: the 8-byte header length, the header the
plan's `Shard` gives (its JSON is checked against the safetensors format in
test_export_hf.py), then every tensor's C-order bytes one after another.
"""

from __future__ import annotations

import errno
import json
import os
import re
import threading
import time

import ml_dtypes
import numpy as np
import pytest

from orbax_tunix import errors
from orbax_tunix.cli import commands
from orbax_tunix.mapping.outputs import Output
from orbax_tunix.reading import memory
from orbax_tunix.writing import writer

RNG = np.random.default_rng(0)
# Tensors as an export makes them: transposed views (float32, bfloat16), one made in two
# blocks of rows, a vector, an empty one, a contiguous one larger than a piece.
TENSORS = {
    'a.weight': RNG.standard_normal((96, 700), dtype=np.float32).T,
    'b.weight': RNG.standard_normal((300, 40)).astype(ml_dtypes.bfloat16).T,
    'c.weight': RNG.standard_normal((50, 33), dtype=np.float32),
    'd.weight': RNG.standard_normal(77, dtype=np.float32),
    'e.weight': np.zeros((0, 5), np.float32),
    'f.weight': RNG.standard_normal((600, 300), dtype=np.float32),
}
PIECE = 4096  # Bytes per piece: every tensor above but the last two is cut into several.


def _batches() -> list[list[tuple[Output, np.ndarray]]]:
  """The tensors as the executor hands them over: three batches, `c` in two blocks of rows."""
  made = []
  for name, value in TENSORS.items():
    if name == 'c.weight':
      made += [(Output((name,), (), shape=value[:20].shape, dtype=value.dtype, rows=(0, 20)),
                value[:20]),
               (Output((name,), (), shape=value[20:].shape, dtype=value.dtype, rows=(20, 50)),
                value[20:])]
    else:
      made.append((Output((name,), (), shape=value.shape, dtype=value.dtype), value))
  return [made[:2], made[2:5], made[5:]]


def _files() -> list[writer.Shard]:
  """Two files: the float32 tensors but the last, then the others (a file holds one dtype)."""
  entry = lambda n: (n, TENSORS[n].dtype.name, TENSORS[n].shape)  # noqa: E731
  return [writer.Shard('one.safetensors', tuple(map(entry, ['a.weight']))),
          writer.Shard('two.safetensors', tuple(map(entry, ['b.weight']))),
          writer.Shard('three.safetensors', tuple(map(entry, ['c.weight', 'd.weight', 'e.weight',
                                                              'f.weight'])))]


def _expected(shard: writer.Shard) -> bytes:
  header = shard.header({'k': 'v'})
  return (len(header).to_bytes(8, 'little') + header
          + b''.join(np.ascontiguousarray(TENSORS[n]).tobytes() for n, _, _ in shard.tensors))


@pytest.fixture
def pieces(monkeypatch):
  """Pieces of `PIECE` bytes, and the threads each `os.pwrite` of the sink ran on."""
  monkeypatch.setattr(memory, 'COPY_BUFFER_BYTES', PIECE)
  seen: list[str] = []
  pwrite = os.pwrite

  def recorded(fd, data, at):
    seen.append(threading.current_thread().name)
    time.sleep(0.001)  # Long enough for the other threads to take their pieces.
    return pwrite(fd, data, at)

  monkeypatch.setattr(writer.os, 'pwrite', recorded)
  return seen


@pytest.mark.parametrize('threads', [1, 4])
def test_the_files_are_the_tensors_bytes_on_any_threads(tmp_path, pieces, threads):
  sink = writer.SafetensorsSink(tmp_path, _files(), metadata={'k': 'v'}, threads=threads)
  for batch in _batches():
    sink.write(batch)
  sink.close()
  for shard in _files():
    assert (tmp_path / shard.name).read_bytes() == _expected(shard), shard.name
  workers = {name for name in pieces if name.startswith('orbax_tunix-write')}
  assert len(workers) == (threads if threads > 1 else 0), sorted(set(pieces))


def test_a_failed_piece_is_raised_once_no_thread_writes(tmp_path, pieces, monkeypatch):
  """A full disk on one thread: `write` raises the OS's error, after every piece it started
  has ended (the staging can then be removed with nothing writing into it)."""
  recorded = writer.os.pwrite
  calls = []

  def full(fd, data, at):
    calls.append(at)
    if len(calls) == 5:
      raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return recorded(fd, data, at)

  monkeypatch.setattr(writer.os, 'pwrite', full)
  sink = writer.SafetensorsSink(tmp_path, _files(), threads=4)
  with pytest.raises(OSError) as failed:
    for batch in _batches():
      sink.write(batch)
  assert failed.value.errno == errno.ENOSPC
  ended = len(calls)
  time.sleep(0.1)
  assert len(calls) == ended  # Nothing was still writing.


def test_the_blocks_written_are_cut_to_the_size_the_budget_gives(tmp_path, monkeypatch):
  """`piece_bytes` (a small budget's share, `memory.copy_buffer_bytes`) bounds every block a
  thread copies and writes, a row where one is larger; the files are the same."""
  sizes = []
  pwrite = os.pwrite
  monkeypatch.setattr(writer.os, 'pwrite',
                      lambda fd, data, at: sizes.append(len(data)) or pwrite(fd, data, at))
  sink = writer.SafetensorsSink(tmp_path, _files(), metadata={'k': 'v'}, threads=2,
                                piece_bytes=1000)
  for batch in _batches():
    sink.write(batch)
  sink.close()
  for shard in _files():
    assert (tmp_path / shard.name).read_bytes() == _expected(shard), shard.name
  widest = max(v[0].nbytes for v in TENSORS.values() if v.ndim == 2 and v.size)
  headers = {8 + len(f.header({'k': 'v'})) for f in _files()}
  assert max(n for n in sizes if n not in headers) <= max(1000, widest)
  assert sorted(n for n in sizes if n > 1000) == sorted(  # Only single rows over 1000.
      [TENSORS['f.weight'][0].nbytes] * 600)


def test_a_budget_below_a_threads_buffer_leaves_the_batches_most_of_it():
  """The threads' buffers take at most their share of any budget (an eighth): a budget
  smaller than a 4 MiB buffer still gives batches above a row of a small model."""
  for budget in (20_000, 1 << 20, 16 << 20):
    assert memory.copy_buffer_bytes(budget) <= budget // memory.THREAD_BUFFER_SHARE
    held = memory.write_threads(budget) * memory.copy_buffer_bytes(budget)
    assert held <= budget // memory.THREAD_BUFFER_SHARE
    assert writer.batch_bytes(budget, safetensors=True) >= budget // 16


def test_threads_follow_the_affinity_or_the_variable(monkeypatch):
  monkeypatch.delenv(memory.THREADS_VARIABLE, raising=False)
  monkeypatch.setattr(os, 'sched_getaffinity', lambda pid: {0, 2, 5})
  assert memory.host_threads() == 3
  # As many as an eighth of the budget holds 4 MiB buffers for, at least one.
  assert memory.write_threads(2**30) == 3
  assert memory.write_threads(64 << 20) == 2
  assert memory.write_threads(1) == 1
  monkeypatch.setenv(memory.THREADS_VARIABLE, '7')
  assert memory.host_threads() == 7
  for bad in ('0', 'many', '-2'):
    monkeypatch.setenv(memory.THREADS_VARIABLE, bad)
    with pytest.raises(errors.InvalidOptionError, match=f"ORBAX_TUNIX_THREADS='{bad}'"):
      memory.host_threads()


def test_a_bad_thread_count_is_refused_before_anything_is_written(tunix_data, tmp_path, capsys,
                                                                  monkeypatch):
  monkeypatch.setenv(memory.THREADS_VARIABLE, '0')
  out = tmp_path / 'out'
  status = commands.main(['export', str(tunix_data / 'hf_qwen3'), str(out), '--model', 'qwen3'])
  err = capsys.readouterr().err
  assert status == 2 and 'ORBAX_TUNIX_THREADS=\'0\': expected a whole number' in err, err
  assert not out.exists() and list(tmp_path.iterdir()) == []


def test_timings_say_where_the_time_went(tunix_data, tmp_path, capsys, monkeypatch):
  """`--timings`: one line on stderr after the summary, each phase's seconds, the batches
  read (as many as the budget makes) and the threads that wrote."""
  monkeypatch.setenv(memory.THREADS_VARIABLE, '3')
  out = tmp_path / 'out'
  status = commands.main(['export', str(tunix_data / 'hf_qwen3'), str(out), '--model', 'qwen3',
                          '--memory-budget', '256M', '--timings', '--json'])
  captured = capsys.readouterr()
  assert status == 0, captured.err
  json.loads(captured.out)  # The summary is still one JSON document.
  (line,) = [x for x in captured.err.splitlines() if x.startswith('timings: ')]
  found = re.fullmatch(
      r'timings: set-up ([\d.]+) s, plan ([\d.]+) s, read ([\d.]+) s in (\d+) batches'
      r' \(waited for ([\d.]+) s\), made ([\d.]+) s, written ([\d.]+) s on 3 threads,'
      r' committed ([\d.]+) s; ([\d.]+) s in all', line)
  assert found, line
  assert int(found[4]) >= 1
  # The phases the caller waits for, one after another, fit in the whole.
  sequential = [float(found[i]) for i in (1, 2, 5, 6, 7, 8)]
  assert sum(sequential) <= float(found[9]) + 0.01, line
  status = commands.main(['export', str(tunix_data / 'hf_qwen3'), str(tmp_path / 'again'),
                          '--model', 'qwen3'])
  assert status == 0 and 'timings' not in capsys.readouterr().err  # Only when asked.

"""`convert` and `export` across hosts: two JAX processes of four CPU devices each.

Each test starts the `orbax-tunix` command twice, as process 0 and 1 of one
`jax.distributed` job over localhost (`--coordinator-address`,
`--num-processes`, `--process-id`; gloo CPU collectives), and compares what
they wrote with what one process writes (the same command, run in this test
process), read back with plain Orbax (every leaf as numpy, value for value,
dtype and name) and with the `safetensors` package (in the MaxText venv,
which has it). The error cases check that every process exits non-zero with
a message and that nothing finished-looking is left.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import zlib

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from etils import epath

from orbax_tunix.cli import commands
from orbax_tunix.writing import commit, distributed
from tests import mp_worker
from tests.clients import client_env

DATA = pathlib.Path(__file__).parent / 'data'
TUNIX = DATA / 'tunix'
MAXTEXT = DATA / 'maxtext'
# A healthy two-process run takes ~20 s on 2 shared cores.
TIMEOUT_S = 150
# Short JAX timeouts: a failure must show well inside the test's own.
JAX_TIMEOUT_S = 15


def free_port() -> int:
  with socket.socket() as s:
    s.bind(('localhost', 0))
    return s.getsockname()[1]


@dataclasses.dataclass(frozen=True)
class Finished:
  codes: list[int]
  outputs: list[str]
  seconds: float

  def show(self) -> str:
    return '\n'.join(f'--- process {i} (exit {c}) ---\n{o[-4000:]}'
                     for i, (c, o) in enumerate(zip(self.codes, self.outputs, strict=True)))


def env() -> dict[str, str]:
  return dict(
      os.environ,
      XLA_FLAGS=mp_worker.xla_flags(os.environ.get('XLA_FLAGS', ''), mp_worker.LOCAL_DEVICES),
      JAX_PLATFORMS='cpu',
      PYTHONPATH=os.pathsep.join([str(pathlib.Path(__file__).parents[1]),
                                  os.environ.get('PYTHONPATH', '')]),
  )


def start(argv: list[str], logs: pathlib.Path, *, num_processes: list[int] | None = None,
          cwds: list[pathlib.Path] | None = None, prefixes: list[list[str]] | None = None,
          ) -> list[tuple[subprocess.Popen, pathlib.Path]]:
  """Starts the command as processes 0 and 1 of one job; returns (process, log) pairs."""
  port = free_port()
  started = []
  for i in range(2):
    n = (num_processes or [2, 2])[i]
    log = logs / f'process_{i}.log'
    with log.open('w') as f:
      started.append((subprocess.Popen(
          [*(prefixes or [[], []])[i], sys.executable, '-m', 'orbax_tunix.cli', *argv,
           '--coordinator-address', f'localhost:{port}', '--num-processes', str(n),
           '--process-id', str(i), '--initialization-timeout', str(JAX_TIMEOUT_S)],
          env=env(), cwd=(cwds or [logs, logs])[i], stdout=f, stderr=subprocess.STDOUT,
          start_new_session=True,  # Its own group: a timeout kills it and its children.
      ), log))
  return started


def finish(started: list[tuple[subprocess.Popen, pathlib.Path]], t0: float) -> Finished:
  """Waits for every process (killing all at the time limit), then reports."""
  deadline = t0 + TIMEOUT_S
  try:
    for p, _ in started:
      p.wait(timeout=max(0.0, deadline - time.monotonic()))
  except subprocess.TimeoutExpired:
    pass
  finally:
    for p, _ in started:
      if p.poll() is None:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
  result = Finished([p.returncode for p, _ in started], [log.read_text() for _, log in started],
                    time.monotonic() - t0)
  if time.monotonic() >= deadline:
    pytest.fail(f'processes still running after {TIMEOUT_S} s; killed.\n{result.show()}')
  return result


def run_two(argv: list[str], logs: pathlib.Path, **kwargs) -> Finished:
  t0 = time.monotonic()
  return finish(start(argv, logs, **kwargs), t0)


def run_one(argv: list[str]) -> None:
  """The same command in this process: one process, no `jax.distributed`."""
  assert commands.main(argv) == 0


def read_step(step: pathlib.Path) -> dict[tuple[str, str], np.ndarray]:
  """Every leaf of every PyTree item, read with plain Orbax as numpy."""
  out = {}
  for item in sorted(p.name for p in step.iterdir() if (p / '_METADATA').exists()):
    handler = ocp.PyTreeCheckpointHandler()
    meta = handler.metadata(epath.Path(step / item)).tree
    args = jax.tree.map(lambda m: ocp.RestoreArgs(restore_type=np.ndarray), meta)
    tree = handler.restore(epath.Path(step / item), args=ocp.args.PyTreeRestore(restore_args=args))
    for path, value in jax.tree_util.tree_flatten_with_path(tree)[0]:
      out[(item, jax.tree_util.keystr(path))] = np.asarray(value)
  return out


def custom_metadata(step: pathlib.Path) -> dict:
  return json.loads((step / '_CHECKPOINT_METADATA').read_text())['custom_metadata']


def assert_same_step(one: pathlib.Path, two: pathlib.Path) -> None:
  a, b = read_step(one), read_step(two)
  assert a.keys() == b.keys()
  assert a, 'no leaves read'
  for key in a:
    np.testing.assert_array_equal(b[key], a[key], err_msg=str(key), strict=True)
  # The record convert writes (provenance, checksums of every array) too.
  assert custom_metadata(two) == custom_metadata(one)
  assert sorted(p.name for p in one.iterdir()) == sorted(p.name for p in two.iterdir())
  assert not list(two.parent.glob('*tmp*')) and not list(two.parent.glob('*.orbax-tunix-*'))


CONVERTS = {
    'canonical': (TUNIX / 'sft_full', []),
    'maxtext_unscan': (MAXTEXT / 'tunix_llama2_scan', ['--layout', 'maxtext',
                                                       '--scan-layers', 'false']),
    'maxtext_scan': (MAXTEXT / 'tunix_llama2_unscan', ['--layout', 'maxtext',
                                                       '--scan-layers', 'true']),
    'lora_merge_bf16': (TUNIX / 'lora_qwix_full', ['--merge-lora', '--lora-alpha', '4',
                                                   '--dtype', 'bfloat16']),
    # A canonical step claims no model: adapters saved alone convert as they are.
    'canonical_adapters_only': (TUNIX / 'lora_qwix', []),
}


@pytest.mark.parametrize('case', sorted(CONVERTS))
def test_convert_two_processes_write_what_one_writes(case, tmp_path):
  src, flags = CONVERTS[case]
  run_one(['convert', str(src), str(tmp_path / 'one' / '1'), *flags])
  done = run_two(['convert', str(src), str(tmp_path / 'two' / '1'), *flags], tmp_path)
  assert done.codes == [0, 0], done.show()
  step = tmp_path / 'two' / '1'
  # Both processes wrote their own shards: Orbax's per-process databases, merged.
  for item in (p for p in step.iterdir() if (p / '_METADATA').exists()):
    assert sorted(p.name for p in item.glob('ocdbt.process_*')) == [
        'ocdbt.process_0', 'ocdbt.process_1'], item
  assert_same_step(tmp_path / 'one' / '1', step)


def safetensors_read(folder: pathlib.Path) -> dict[str, tuple[str, list[int], str]]:
  """{file/tensor: (dtype, shape, crc32 of the bytes)} as the `safetensors` package reads them."""
  script = (
      'import json, sys, zlib, pathlib\n'
      'import numpy as np\n'
      'from safetensors import safe_open\n'
      'out = {}\n'
      'for f in sorted(pathlib.Path(sys.argv[1]).glob("*.safetensors")):\n'
      '  with safe_open(str(f), "np") as st:\n'
      '    for k in st.keys():\n'
      '      t = np.ascontiguousarray(st.get_tensor(k))\n'
      '      out[f.name + "/" + k] = [str(t.dtype), list(t.shape), zlib.crc32(t.tobytes())]\n'
      'print(json.dumps(out))\n'
  )
  # The MaxText venv has the safetensors package (built by scripts/maxtext_venv.sh on first use).
  done = subprocess.run([client_env('maxtext_venv.sh'), '-c', script, str(folder)], capture_output=True,
                        text=True, timeout=120, env={**os.environ, 'PYTHONPATH': ''})
  assert done.returncode == 0, done.stderr[-3000:]
  return json.loads(done.stdout)


def test_export_several_shards_two_processes_write_what_one_writes(tmp_path):
  from tests.test_export_hf import HF_CONFIG_DIMS, _write_hf_dir  # pylint: disable=g-import-not-at-top

  # With the base model's folder: process 0 writes config.json and copies the tokenizer.
  hf = _write_hf_dir(tmp_path / 'base', HF_CONFIG_DIMS['hf_qwen3'])
  argv = ['export', str(TUNIX / 'hf_qwen3'), '--model', 'qwen3', '--max-shard-size', '20KB',
          '--hf-config', str(hf)]
  run_one([argv[0], argv[1], str(tmp_path / 'one'), *argv[2:]])
  done = run_two([argv[0], argv[1], str(tmp_path / 'two'), *argv[2:]], tmp_path)
  assert done.codes == [0, 0], done.show()
  one, two = tmp_path / 'one', tmp_path / 'two'
  names = sorted(p.name for p in one.iterdir())
  assert len([n for n in names if n.endswith('.safetensors')]) > 2, names
  assert {'config.json', 'tokenizer.json'} <= set(names), names
  assert sorted(p.name for p in two.iterdir()) == names
  for name in names:  # Name for name, byte for byte.
    assert (two / name).read_bytes() == (one / name).read_bytes(), name
  read_one, read_two = safetensors_read(one), safetensors_read(two)
  assert read_two == read_one and read_one
  assert not [p for p in tmp_path.iterdir() if 'tmp' in p.name or 'orbax-tunix' in p.name]


def test_export_peft_two_processes_write_what_one_writes(tmp_path):
  argv = ['export', str(TUNIX / 'hf_gemma2_lora'), '--model', 'gemma2', '--peft',
          '--lora-alpha', '3', '--base-model', 'google/gemma-2-2b']
  run_one([argv[0], argv[1], str(tmp_path / 'one'), *argv[2:]])
  done = run_two([argv[0], argv[1], str(tmp_path / 'two'), *argv[2:]], tmp_path)
  assert done.codes == [0, 0], done.show()
  one, two = tmp_path / 'one', tmp_path / 'two'
  names = sorted(p.name for p in one.iterdir())
  assert names == ['adapter_config.json', 'adapter_model.safetensors']
  assert sorted(p.name for p in two.iterdir()) == names
  for name in names:
    assert (two / name).read_bytes() == (one / name).read_bytes(), name
  assert not [p for p in tmp_path.iterdir() if 'tmp' in p.name or 'orbax-tunix' in p.name]


def run_script_job(script: str, args: list[str], logs: pathlib.Path) -> Finished:
  """`python -c script PORT I *args` as processes 0 and 1: the caller's own job (the script
  calls jax.distributed.initialize itself)."""
  port, t0 = free_port(), time.monotonic()
  started = []
  for i in range(2):
    log = logs / f'api_{i}.log'
    with log.open('w') as f:
      started.append((subprocess.Popen(
          [sys.executable, '-c', script, str(port), str(i), *args], env=env(), cwd=logs,
          stdout=f, stderr=subprocess.STDOUT, start_new_session=True), log))
  return finish(started, t0)


API_SCRIPT = """
import sys
import jax
jax.config.update('jax_cpu_collectives_implementation', 'gloo')
port, pid, src, out = sys.argv[1:]
jax.distributed.initialize(f'localhost:{port}', 2, int(pid), initialization_timeout=30)
import orbax_tunix
orbax_tunix.export_to_hf(src, out, model='qwen3', max_shard_size='20KB')
print('exported', jax.process_index(), jax.process_count())
"""


def test_export_api_in_a_job_the_caller_started(tmp_path):
  # The caller's own jax.distributed.initialize(); export_to_hf shares the work.
  run_one(['export', str(TUNIX / 'hf_qwen3'), str(tmp_path / 'one'), '--model', 'qwen3',
           '--max-shard-size', '20KB'])
  done = run_script_job(API_SCRIPT, [str(TUNIX / 'hf_qwen3'), str(tmp_path / 'two')], tmp_path)
  assert done.codes == [0, 0], done.show()
  assert [f'exported {i} 2' in o for i, o in enumerate(done.outputs)] == [True, True]
  names = sorted(p.name for p in (tmp_path / 'one').iterdir())
  assert sorted(p.name for p in (tmp_path / 'two').iterdir()) == names
  for name in names:
    assert (tmp_path / 'two' / name).read_bytes() == (tmp_path / 'one' / name).read_bytes()


CONVERT_API_SCRIPT = """
import sys
import jax
jax.config.update('jax_cpu_collectives_implementation', 'gloo')
port, pid, src, dst = sys.argv[1:]
jax.distributed.initialize(f'localhost:{port}', 2, int(pid), initialization_timeout=30)
from orbax_tunix.tools import convert
result = convert.run_convert(convert.plan_convert(src, dst, layout='maxtext', scan_layers=False))
print('converted', jax.process_index(), jax.process_count(), result.num_leaves)
"""


def test_convert_api_in_a_job_the_caller_started(tmp_path):
  # The caller's own jax.distributed.initialize(); plan_convert/run_convert share the work.
  src = MAXTEXT / 'tunix_llama2_scan'
  run_one(['convert', str(src), str(tmp_path / 'one' / '1'), '--layout', 'maxtext',
           '--scan-layers', 'false'])
  done = run_script_job(CONVERT_API_SCRIPT, [str(src), str(tmp_path / 'two' / '1')], tmp_path)
  assert done.codes == [0, 0], done.show()
  assert [f'converted {i} 2 ' in o for i, o in enumerate(done.outputs)] == [True, True]
  step = tmp_path / 'two' / '1'
  for item in (p for p in step.iterdir() if (p / '_METADATA').exists()):
    assert sorted(p.name for p in item.glob('ocdbt.process_*')) == [
        'ocdbt.process_0', 'ocdbt.process_1'], item
  assert_same_step(tmp_path / 'one' / '1', step)


def test_process_count_mismatch_fails_every_process(tmp_path):
  out = tmp_path / 'out'
  done = run_two(['export', str(TUNIX / 'hf_qwen3'), str(out), '--model', 'qwen3'], tmp_path,
                 num_processes=[2, 3])
  assert all(c != 0 for c in done.codes), done.show()
  for output in done.outputs:
    assert 'process 1 was given --num-processes 3' in output, done.show()
  assert done.seconds < 90, done.show()
  assert not out.exists() and [p.name for p in tmp_path.iterdir() if p.is_dir()] == []


def test_destinations_that_differ_fail_every_process(tmp_path):
  # A relative DST, the processes in different directories: two destinations.
  homes = [tmp_path / 'host0', tmp_path / 'host1']
  for home in homes:
    home.mkdir()
  done = run_two(['export', str(TUNIX / 'hf_qwen3'), 'out', '--model', 'qwen3'], tmp_path,
                 cwds=homes)
  assert all(c != 0 for c in done.codes), done.show()
  for output in done.outputs:
    assert 'the same absolute path' in output and 'orbax-tunix: error:' in output, done.show()
  assert [list(h.iterdir()) for h in homes] == [[], []], done.show()


def test_destination_some_process_cannot_see_fails_every_process(tmp_path):
  # Process 1 runs in its own mount namespace with an empty tmpfs over the
  # destination's parent: the same path, another filesystem, as a disk local
  # to each host.
  if shutil.which('unshare') is None or subprocess.run(
      ['unshare', '-m', 'true'], capture_output=True).returncode != 0:
    pytest.skip('needs unshare -m (mount namespaces) to give one process another filesystem')
  parent = tmp_path / 'shared'
  parent.mkdir()
  out = parent / 'out'
  wrapper = tmp_path / 'own_mount.sh'
  wrapper.write_text(f'#!/bin/sh\nmount -t tmpfs none {parent} && exec "$@"\n')
  wrapper.chmod(0o755)
  done = run_two(['export', str(TUNIX / 'hf_qwen3'), str(out), '--model', 'qwen3'], tmp_path,
                 prefixes=[[], ['unshare', '-m', str(wrapper)]])
  assert all(c != 0 for c in done.codes), done.show()
  for output in done.outputs:
    assert 'is not visible' in output and 'orbax-tunix: error:' in output, done.show()
  assert list(parent.iterdir()) == [], done.show()


def write_large(root: pathlib.Path, arrays: int, rows: int) -> pathlib.Path:
  """A plain Orbax step large enough that converting it takes a few seconds."""
  rng = np.random.default_rng(0)
  tree = {f'w{i:03d}': rng.standard_normal((rows, 256)).astype(np.float32) for i in range(arrays)}
  step = root / '1'
  with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckptr:
    ckptr.save(epath.Path(step), args=ocp.args.Composite(
        model_params=ocp.args.PyTreeSave(tree)))
  return step


def test_a_process_killed_mid_way_fails_the_other_and_commits_nothing(tmp_path):
  src = write_large(tmp_path / 'src', arrays=96, rows=2048)  # 192 MiB
  dst = tmp_path / 'dst' / '1'
  t0 = time.monotonic()
  started = start(['convert', str(src), str(dst), '--memory-budget', '200M'], tmp_path)
  while time.monotonic() - t0 < TIMEOUT_S and not list(dst.parent.glob('1.*')):
    time.sleep(0.05)  # Process 0 opened the staging: the work is under way.
  time.sleep(1.0)
  assert started[1][0].poll() is None, 'process 1 finished before it could be killed'
  os.killpg(started[1][0].pid, signal.SIGKILL)
  done = finish(started, t0)
  assert done.codes[0] != 0, done.show()
  assert not dst.exists(), done.show()
  # What is left is a staging directory, which every reader skips.
  assert all(commit.TMP_MARKER in p.name for p in dst.parent.iterdir()), list(dst.parent.iterdir())


@pytest.mark.parametrize('command', ['convert', 'export'])
def test_a_process_whose_writes_fail_fails_every_process_and_commits_nothing(command, tmp_path):
  """Process 1's writes fail part way (a full disk): every process exits non-zero saying
  which process failed and why, none waits for it past the failure, and nothing is left
  that looks finished."""
  src = write_large(tmp_path / 'src', arrays=24, rows=512) if command == 'convert' else (
      TUNIX / 'hf_qwen3')
  dst = tmp_path / 'dst' / ('1' if command == 'convert' else 'out')
  argv = [command, str(src), str(dst), '--memory-budget', '4M'] + (
      ['--model', 'qwen3', '--max-shard-size', '20KB'] if command == 'export' else [])
  failing = [sys.executable, str(pathlib.Path(__file__).parent / 'fail_mid_write.py')]
  done = run_two(argv, tmp_path, prefixes=[[], failing])
  assert all(c != 0 for c in done.codes), done.show()
  assert done.seconds < 90, done.show()
  for output in done.outputs:
    assert 'orbax-tunix: error:' in output and 'Traceback' not in output, done.show()
  # Process 0 names the process that failed and why; process 1 says it as one process would.
  assert re.search(r'process 1( failed)?: OSError: \[Errno 28\] No space left on device',
                   done.outputs[0]), done.show()
  assert 'writing failed' not in done.outputs[0], done.show()  # Its own disk is not full.
  assert f'{dst}: writing failed: no space left on the device' in done.outputs[1], done.show()
  assert not dst.exists(), done.show()
  left = list(dst.parent.iterdir()) if dst.parent.exists() else []
  assert all(commit.TMP_MARKER in p.name for p in left), left


# --- the pieces, in this process --------------------------------------------------------


def test_crc32_combine_and_zero_extension_match_zlib_over_the_whole():
  rng = np.random.default_rng(1)
  for a_len, b_len in ((0, 5), (5, 0), (1, 1), (1000, 3333), (4096, 65537)):
    a, b = rng.bytes(a_len), rng.bytes(b_len)
    assert distributed.crc32_combine(zlib.crc32(a), zlib.crc32(b), b_len) == zlib.crc32(a + b)
    assert distributed.extend_zeros(zlib.crc32(a), b_len) == zlib.crc32(a + bytes(b_len))


def test_shares_of_any_split_combine_into_the_crc32():
  # Each process's share: its bytes in place, zeros elsewhere (odd and even counts).
  rng = np.random.default_rng(2)
  data = rng.bytes(5000)
  for cuts in ([0, 5000], [0, 1, 5000], [0, 100, 2000, 5000], [0, 7, 8, 4096, 5000]):
    shares = [zlib.crc32(bytes(a) + data[a:b] + bytes(len(data) - b))
              for a, b in zip(cuts, cuts[1:], strict=False)]
    assert distributed.combine_shares(shares, len(data)) == zlib.crc32(data), cuts


def test_parts_of_a_sharded_array_combine_into_its_checksum(mesh):
  # Shards split on either axis (runs of rows, runs within rows): the parts'
  # checksums, combined in offset order, are the whole array's.
  from orbax_tunix.writing import checksums

  value = np.arange(8 * 6, dtype=np.float32).reshape(8, 6)
  for spec in (jax.sharding.PartitionSpec('data', 'model'),
               jax.sharding.PartitionSpec('model', 'data'), jax.sharding.PartitionSpec()):
    if spec and value.shape[1] % mesh.shape[spec[1]]:
      continue
    arr = jax.device_put(value, jax.sharding.NamedSharding(mesh, spec))
    crc, at = 0, 0
    for offset, length, part in sorted(distributed._local_parts(arr)):
      assert offset == at, spec
      crc, at = distributed.crc32_combine(crc, part, length), at + length
    assert at == value.nbytes
    assert f'crc32:{crc:08x}' == checksums.checksum(value), spec
    # One process holding every shard: its share is the whole CRC.
    assert distributed.combine_shares([distributed._share_crc(arr)], value.nbytes) == crc
    # Its shards joined into one block (the whole array here).
    index, block = distributed._process_block(arr)
    np.testing.assert_array_equal(block, value)


def test_placement_splits_where_the_stored_chunks_split(monkeypatch):
  # Eight devices as two processes of four (this process holds them all).
  monkeypatch.setattr(distributed, 'process_count', lambda: 2)
  P = jax.sharding.PartitionSpec
  spec = lambda *a: distributed.placement(*a).spec  # noqa: E731
  assert spec((64, 32)) == P('all')
  assert spec((64, 32), (64, 4)) == P(None, 'all')  # Rows unsplit on disk: split columns.
  assert spec((64, 32), (32, 32)) == P('processes')  # Two chunks of rows: one per process.
  assert spec((6, 3)) == P('processes') and spec((3, 5)) == P() and spec(()) == P()


def test_deal_balances_bytes_and_is_deterministic():
  sizes = [50, 10, 40, 30, 20, 25]
  owner = distributed.deal(sizes, 2)
  loads = [sum(s for s, o in zip(sizes, owner, strict=True) if o == p) for p in range(2)]
  assert sorted(loads) == [85, 90] and owner == distributed.deal(sizes, 2)
  assert distributed.deal([1, 1], 3) == [0, 1]


def test_one_process_is_untouched():
  assert not distributed.initialize(distributed.Options())  # No flags, no cluster here.
  assert not distributed.active() and distributed.is_primary()
  assert distributed.exchange('x', 'text') == ['text']
  assert distributed.mine([3, 2, 1]) == [0, 1, 2]

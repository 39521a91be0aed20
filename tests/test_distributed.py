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

from orbax_tunix import errors
from orbax_tunix.cli import commands
from orbax_tunix.writing import checksums, commit, consensus, dealing, global_arrays, job
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


def start(argv: list[str] | list[list[str]], logs: pathlib.Path, *,
          num_processes: list[int] | None = None, cwds: list[pathlib.Path] | None = None,
          prefixes: list[list[str]] | None = None, process_ids: list[int] | None = None,
          ports: list[int] | None = None, timeout: int = JAX_TIMEOUT_S,
          ) -> list[tuple[subprocess.Popen, pathlib.Path]]:
  """Starts the command as processes 0 and 1 of one job (or as `process_ids`, each
  given its `num_processes`, its port, its own argv when `argv` is one per process);
  returns (process, log) pairs."""
  port = free_port()
  ids = process_ids or [0, 1]
  argvs = argv if argv and isinstance(argv[0], list) else [argv] * len(ids)
  started = []
  for k, i in enumerate(ids):
    n = (num_processes or [2] * len(ids))[k]
    log = logs / f'process_{k}.log'
    with log.open('w') as f:
      started.append((subprocess.Popen(
          [*(prefixes or [[]] * len(ids))[k], sys.executable, '-m', 'orbax_tunix.cli', *argvs[k],
           '--coordinator-address', f'localhost:{(ports or [port] * len(ids))[k]}',
           '--num-processes', str(n), '--process-id', str(i), '--initialization-timeout',
           str(timeout)],
          env=env(), cwd=(cwds or [logs] * len(ids))[k], stdout=f, stderr=subprocess.STDOUT,
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


def write_large(root: pathlib.Path, arrays: int, rows: int, seed: int = 0) -> pathlib.Path:
  """A plain Orbax step large enough that converting it takes a few seconds."""
  rng = np.random.default_rng(seed)
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


# --- a job that cannot form, or processes given different work ---------------------------

# What JAX's coordination service prints when it ends a process, and Python's traceback.
CRASH = ('Traceback', 'Check failure', 'terminate called', 'client.h:', 'Aborted')


def assert_refused(done: Finished, expected: list[str], *, within: float) -> None:
  """Every process exited 2 with one message holding its `expected` text, no trace, in time."""
  assert done.codes == [2] * len(expected), done.show()
  for output, text in zip(done.outputs, expected, strict=True):
    errors = [line for line in output.splitlines() if line.startswith('orbax-tunix: error:')]
    assert len(errors) == 1 and text in output, done.show()
    assert not [c for c in CRASH if c in output], done.show()
  assert done.seconds < within, done.show()


SHORT_S = 3  # --initialization-timeout of the jobs that cannot form.
# Python and JAX start in a few seconds on 2 shared cores: the wait ends soon after the timeout.
WITHIN_S = SHORT_S + 45


def test_a_missing_peer_ends_every_process_within_the_timeout(tmp_path):
  out = tmp_path / 'out'
  argv = ['export', str(TUNIX / 'hf_qwen3'), str(out), '--model', 'qwen3']
  alone = run_two(argv, tmp_path, process_ids=[0], timeout=SHORT_S)  # Process 1 never comes.
  assert_refused(alone, ['process 1 did not join within 3 s (--initialization-timeout);'
                         ' joined: process 0 of 2'], within=WITHIN_S)
  alone = run_two(argv, tmp_path, process_ids=[1], timeout=SHORT_S)  # Nor process 0.
  assert_refused(alone, ['process 1: no process 0 answered at localhost:'], within=WITHIN_S)
  assert not out.exists() and [p.name for p in tmp_path.iterdir() if p.is_dir()] == []


def test_a_mistyped_port_ends_every_process_naming_the_flag(tmp_path):
  out = tmp_path / 'out'
  done = run_two(['export', str(TUNIX / 'hf_qwen3'), str(out), '--model', 'qwen3'], tmp_path,
                 ports=[free_port(), free_port()], timeout=SHORT_S)
  assert_refused(done, ['process 1 did not join within 3 s', 'no process 0 answered at'
                        ' localhost:'], within=WITHIN_S)
  assert '(--coordinator-address)' in done.outputs[1], done.show()
  assert not out.exists()


def test_a_duplicated_process_id_ends_every_process_naming_it(tmp_path):
  out = tmp_path / 'out'
  argv = ['export', str(TUNIX / 'hf_qwen3'), str(out), '--model', 'qwen3']
  # Three processes, two of them given id 1 (and none id 2).
  done = run_two(argv, tmp_path, process_ids=[0, 1, 1], num_processes=[3, 3, 3],
                 timeout=SHORT_S)
  assert_refused(done, ['two processes were given --process-id 1'] * 3, within=WITHIN_S)
  # Two processes given id 0: the second finds the port taken; the first waits for process 1.
  t0 = time.monotonic()
  first = start(argv, tmp_path, process_ids=[0], timeout=SHORT_S, ports=[port := free_port()])
  time.sleep(1.0)
  (tmp_path / 'second').mkdir()
  second = start(argv, tmp_path / 'second', process_ids=[0], timeout=SHORT_S, ports=[port])
  done = finish(first + second, t0)
  # Whichever took the port first (the first, unless it started slower) waits for process 1.
  said = ['process 1 did not join within 3 s', 'another process was given --process-id 0 too']
  if said[0] not in done.outputs[0]:
    said.reverse()
  assert_refused(done, said, within=WITHIN_S + 1)
  assert not out.exists()


@pytest.mark.parametrize('flags, expected', [
    (['--coordinator-address', 'localhost'], "--coordinator-address 'localhost': expected"
     ' HOST:PORT'),
    (['--coordinator-address', 'localhost:70000'], "--coordinator-address 'localhost:70000'"),
    (['--coordinator-address', '::1:1234'], "--coordinator-address '::1:1234'"),
    (['--initialization-timeout', '0'], '--initialization-timeout 0: expected a whole number'
     ' of seconds above 0'),
    (['--initialization-timeout', '-1'], '--initialization-timeout -1'),
    (['--process-id', '2'], '--process-id 2: expected'),
    (['--num-processes', '0', '--process-id', '0'], '--num-processes 0: expected'),
])
def test_job_flags_out_of_range_are_refused_naming_the_flag(flags, expected, tmp_path, capsys):
  given = {'--coordinator-address': 'localhost:1234', '--num-processes': '2',
           '--process-id': '0', '--initialization-timeout': '5'}
  given.update(zip(flags[::2], flags[1::2], strict=True))
  out = tmp_path / 'out'
  code = commands.main(['export', str(TUNIX / 'hf_qwen3'), str(out), '--model', 'qwen3',
                        *[x for kv in given.items() for x in kv]])
  err = capsys.readouterr().err
  assert code == 2 and err.count('orbax-tunix: error:') == 1 and expected in err, err
  assert 'Traceback' not in err, err
  assert not out.exists()


def differing_work(tmp_path: pathlib.Path, case: str) -> tuple[list[list[str]], pathlib.Path]:
  """(each process's argv, the destination) of two processes given different work."""
  qwen = ['export', str(TUNIX / 'hf_qwen3'), str(tmp_path / 'out'), '--model', 'qwen3']
  if case == 'step':
    base = ['convert', str(TUNIX / 'sft_full'), str(tmp_path / 'out' / '1')]
    return [[*base, '--step', '1'], [*base, '--step', '2']], tmp_path / 'out' / '1'
  if case == 'source':  # Two runs of one structure, other values.
    one, two = (write_large(tmp_path / name, arrays=2, rows=8, seed=seed)
                for name, seed in (('run_a', 0), ('run_b', 1)))
    dst = tmp_path / 'out' / '1'
    return [['convert', str(one), str(dst)], ['convert', str(two), str(dst)]], dst
  if case == 'dtype':
    return [qwen, [*qwen, '--dtype', 'bfloat16']], tmp_path / 'out'
  if case == 'peft_alpha':  # An option whose value only shapes digests (a config, tensors).
    peft = ['export', str(TUNIX / 'hf_qwen3_lora'), str(tmp_path / 'out'), '--model', 'qwen3',
            '--peft']
    return [[*peft, '--lora-alpha', '3'], [*peft, '--lora-alpha', '4']], tmp_path / 'out'
  if case == 'merge_scaling':  # One process given the alpha, the other the scale.
    merge = ['convert', str(TUNIX / 'lora_qwix_full'), str(tmp_path / 'out' / '1'),
             '--merge-lora']
    return [[*merge, '--lora-alpha', '4'], [*merge, '--lora-scale', '0.5']], \
        tmp_path / 'out' / '1'
  assert case == 'max_shard_size'
  return [[*qwen, '--max-shard-size', '20KB'], [*qwen, '--max-shard-size', '40KB']], \
      tmp_path / 'out'


@pytest.mark.parametrize('case, fields, shown', [
    ('step', ['source'], ['sft_full/1 (step 1, metadata', 'sft_full/2 (step 2, metadata']),
    ('source', ['source'], ['run_a/1 (step', 'run_b/1 (step']),
    ('dtype', ['dtype', 'items'], ['dtype: process 0: None; process 1: bfloat16']),
    # An option given differently: named with each process's value, what it makes only named.
    ('max_shard_size', ['--max-shard-size'], ['--max-shard-size: process 0: 20000; process 1:'
                                              ' 40000', 'different options (--max-shard-size,'
                                              ' and so files differ)']),
    ('peft_alpha', ['--lora-alpha'], ['--lora-alpha: process 0: 3.0; process 1: 4.0\n',
                                      'different options (--lora-alpha, and so ']),
    ('merge_scaling', ['--lora-alpha', '--lora-scale'], [
        '--lora-alpha: process 0: 4.0; process 1: (not given)\n',
        '--lora-scale: process 0: (not given); process 1: 0.5']),
])
def test_processes_given_different_work_are_refused_naming_what_differs(
    case, fields, shown, tmp_path):
  argvs, dst = differing_work(tmp_path, case)
  done = run_two(argvs, tmp_path)
  assert_refused(done, ['the processes were given different '] * 2, within=TIMEOUT_S)
  for output in done.outputs:
    said = output[output.index('orbax-tunix: error:'):]
    for field in fields:
      assert f'\n  {field}: process 0: ' in said, done.show()
    for text in shown:
      assert text in said, done.show()
    if fields[0].startswith('--'):  # Options: their values, no digest of what they make.
      assert 'digest' not in said, done.show()
  assert not dst.exists(), done.show()
  assert not [p for p in tmp_path.rglob('*') if 'tmp' in p.name or 'orbax-tunix' in p.name], \
      done.show()


def test_a_process_that_cannot_plan_ends_every_process(tmp_path):
  # Process 1 is given a step the run does not have: it says so; process 0 names it.
  base = ['convert', str(TUNIX / 'sft_full'), str(tmp_path / 'out' / '1')]
  done = run_two([[*base, '--step', '1'], [*base, '--step', '7']], tmp_path)
  assert_refused(done, ['1 of 2 processes failed (plan)', 'expected a step 7, found none'], within=TIMEOUT_S)
  assert 'process 1: ' in done.outputs[0], done.show()
  assert not (tmp_path / 'out').exists(), done.show()


def test_a_source_is_told_by_its_metadata_not_only_its_path(tmp_path):
  # Two runs at one path (each host its own disk): their plans differ in `source` alone.
  from orbax_tunix.tools import agreement, convert  # pylint: disable=g-import-not-at-top

  def planned() -> dict[str, str]:
    return agreement.fingerprint(convert.plan_convert(tmp_path / 'run' / '1',
                                                      tmp_path / 'out' / '1'))

  write_large(tmp_path / 'run', arrays=2, rows=8, seed=0)
  first = planned()
  shutil.rmtree(tmp_path / 'run')
  write_large(tmp_path / 'run', arrays=2, rows=8, seed=1)
  second = planned()
  assert [k for k in first if first[k] != second[k]] == ['source'], (first, second)
  assert planned() == second  # The same work: the same fingerprint.


def test_options_are_told_by_name_and_value_a_path_as_what_it_is(tmp_path, monkeypatch):
  """Each option the caller gave is a field of its own, by the caller's name (a merge's alpha
  as `lora_alpha`): a difference names it. A path option is told as what it is (the same
  base through a relative path from another directory agrees)."""
  from orbax_tunix.tools import agreement, convert  # pylint: disable=g-import-not-at-top

  def planned(base, alpha=4.0) -> dict[str, str]:
    return agreement.fingerprint(convert.plan_convert(
        TUNIX / 'lora_qwix', tmp_path / 'out' / '1', merge_lora=True, lora_alpha=alpha,
        base=base, items=['model_params']))

  absolute = planned(TUNIX / 'lora_base')
  assert absolute['`lora_alpha`'] == '4.0' and absolute['`items`'] == 'model_params'
  assert absolute['`base`'] == os.path.realpath(TUNIX / 'lora_base'), absolute
  monkeypatch.chdir(TUNIX / 'lora_qwix')
  assert planned(os.path.join('..', 'lora_base')) == absolute
  other = planned(TUNIX / 'lora_base', alpha=8.0)
  assert [k for k in absolute if absolute[k] != other[k]][0] == '`lora_alpha`'


def test_hf_config_files_are_told_by_their_contents(tmp_path):
  # The base model's folder at one path, another tokenizer in it: only `other_files` differs.
  from orbax_tunix.tools import agreement, export  # pylint: disable=g-import-not-at-top
  from tests.test_export_hf import HF_CONFIG_DIMS, _write_hf_dir  # pylint: disable=g-import-not-at-top

  hf = _write_hf_dir(tmp_path / 'base', HF_CONFIG_DIMS['hf_qwen3'])

  def planned() -> dict[str, str]:
    return agreement.fingerprint(export.plan_export(TUNIX / 'hf_qwen3', tmp_path / 'out',
                                                    model='qwen3', hf_config=hf))

  first = planned()
  (hf / 'tokenizer.json').write_text('{"another": "tokenizer"}')
  second = planned()
  assert [k for k in first if first[k] != second[k]] == ['other_files'], (first, second)
  assert 'tokenizer.json' in second['other_files']


def test_a_port_where_another_program_answers_is_named():
  # Process 1 given the port of something else (here: a server that answers HTTP).
  import threading  # pylint: disable=g-import-not-at-top

  from orbax_tunix import errors  # pylint: disable=g-import-not-at-top
  from orbax_tunix.writing import rendezvous  # pylint: disable=g-import-not-at-top

  server = socket.create_server(('localhost', 0))
  port = server.getsockname()[1]

  def answer() -> None:
    conn, _ = server.accept()
    with conn:
      conn.recv(4096)
      conn.sendall(b'HTTP/1.1 400 Bad Request\r\n\r\n')

  threading.Thread(target=answer, daemon=True).start()
  with server, pytest.raises(errors.DistributedError) as raised:
    rendezvous.meet(rendezvous.parse_address(f'localhost:{port}'), 1, 2, 5)
  assert f'what answers at localhost:{port} (`coordinator_address`) said something else' in str(
      raised.value)


# --- the pieces, in this process --------------------------------------------------------


def test_crc32_combine_and_zero_extension_match_zlib_over_the_whole():
  rng = np.random.default_rng(1)
  for a_len, b_len in ((0, 5), (5, 0), (1, 1), (1000, 3333), (4096, 65537)):
    a, b = rng.bytes(a_len), rng.bytes(b_len)
    assert checksums.crc32_combine(zlib.crc32(a), zlib.crc32(b), b_len) == zlib.crc32(a + b)
    assert checksums.extend_zeros(zlib.crc32(a), b_len) == zlib.crc32(a + bytes(b_len))


def test_shares_of_any_split_combine_into_the_crc32():
  # Each process's share: its bytes in place, zeros elsewhere (odd and even counts).
  rng = np.random.default_rng(2)
  data = rng.bytes(5000)
  for cuts in ([0, 5000], [0, 1, 5000], [0, 100, 2000, 5000], [0, 7, 8, 4096, 5000]):
    shares = [zlib.crc32(bytes(a) + data[a:b] + bytes(len(data) - b))
              for a, b in zip(cuts, cuts[1:], strict=False)]
    assert checksums.combine_shares(shares, len(data)) == zlib.crc32(data), cuts


def test_parts_of_a_sharded_array_combine_into_its_checksum(mesh):
  # Shards split on either axis (runs of rows, runs within rows): the parts'
  # checksums, combined in offset order, are the whole array's.
  value = np.arange(8 * 6, dtype=np.float32).reshape(8, 6)
  for spec in (jax.sharding.PartitionSpec('data', 'model'),
               jax.sharding.PartitionSpec('model', 'data'), jax.sharding.PartitionSpec()):
    if spec and value.shape[1] % mesh.shape[spec[1]]:
      continue
    arr = jax.device_put(value, jax.sharding.NamedSharding(mesh, spec))
    crc, at = 0, 0
    for offset, raw in sorted(global_arrays._local_runs(arr), key=lambda run: run[0]):
      assert offset == at, spec
      crc, at = checksums.crc32_combine(crc, zlib.crc32(raw), raw.size), at + raw.size
    assert at == value.nbytes
    assert f'crc32:{crc:08x}' == checksums.checksum(value), spec
    # One process holding every shard: its share is the whole CRC.
    assert checksums.combine_shares([global_arrays._share_crc(arr)], value.nbytes) == crc
    # Its shards joined into one block (the whole array here).
    index, block = global_arrays._process_block(arr)
    np.testing.assert_array_equal(block, value)


def test_placement_splits_where_the_stored_chunks_split(monkeypatch):
  # Eight devices as two processes of four (this process holds them all).
  monkeypatch.setattr(job, 'process_count', lambda: 2)
  P = jax.sharding.PartitionSpec
  spec = lambda *a: global_arrays.placement(*a).spec  # noqa: E731
  assert spec((64, 32)) == P('all')
  assert spec((64, 32), (64, 4)) == P(None, 'all')  # Rows unsplit on disk: split columns.
  assert spec((64, 32), (32, 32)) == P('processes')  # Two chunks of rows: one per process.
  assert spec((6, 3)) == P('processes') and spec((3, 5)) == P() and spec(()) == P()


def test_deal_balances_bytes_and_is_deterministic():
  sizes = [50, 10, 40, 30, 20, 25]
  owner = dealing.deal(sizes, 2)
  loads = [sum(s for s, o in zip(sizes, owner, strict=True) if o == p) for p in range(2)]
  assert sorted(loads) == [85, 90] and owner == dealing.deal(sizes, 2)
  assert dealing.deal([1, 1], 3) == [0, 1]


def test_one_process_is_untouched():
  assert not job.initialize(job.JobOptions())  # No flags, no cluster here.
  assert not job.active() and job.is_primary()
  assert consensus.exchange('x', 'text') == ['text']
  assert dealing.mine([3, 2, 1]) == [0, 1, 2]


# --- on a TPU VM: JAX's cluster detection finds a TPU cluster ---------------------------

# What JAX's GKE TPU cluster reads (jax/_src/clusters/cloud_tpu_cluster.py), cleared first.
TPU_VARIABLES = ('TPU_WORKER_HOSTNAMES', 'TPU_PROCESS_ADDRESSES', 'TPU_WORKER_ID',
                 'TPU_SKIP_MDS_QUERY', 'MEGASCALE_NUM_SLICES', 'MEGASCALE_SLICE_ID',
                 'MEGASCALE_COORDINATOR_ADDRESS', 'JAX_COORDINATOR_ADDRESS',
                 'JAX_COORDINATOR_PORT', 'GCE_METADATA_IP', 'KUBERNETES_SERVICE_HOST')


def tpu_vm_env(hosts: str, **more: str) -> dict[str, str]:
  """A TPU VM's variables as the lent v5e set them (issue 53): its worker hostnames, no
  metadata server (a closed local port: JAX's queries of it fail at once)."""
  return {'TPU_WORKER_HOSTNAMES': hosts, 'TPU_SKIP_MDS_QUERY': 'true',
          'GCE_METADATA_IP': f'127.0.0.1:{free_port()}', **more}


@pytest.fixture
def tpu_vm(monkeypatch):
  """This process told it runs on a Cloud TPU VM. JAX sets `running_in_cloud_tpu_vm` in
  `cloud_tpu_init` when it is imported on one, and its cluster modules copy the flag as they
  import it: each copy is patched."""
  from jax._src import cloud_tpu_init  # pylint: disable=g-import-not-at-top
  from jax._src.clusters import cloud_tpu_cluster, cluster  # pylint: disable=g-import-not-at-top

  for module in (cloud_tpu_init, cluster, cloud_tpu_cluster):
    monkeypatch.setattr(module, 'running_in_cloud_tpu_vm', True)
  for name in TPU_VARIABLES:
    monkeypatch.delenv(name, raising=False)

  def with_env(hosts: str, **more: str) -> None:
    for name, value in tpu_vm_env(hosts, **more).items():
      if value:
        monkeypatch.setenv(name, value)
      else:
        monkeypatch.delenv(name, raising=False)
  return with_env


@pytest.mark.parametrize('skip_mds', ['true', ''])
def test_a_one_host_tpu_vm_is_one_process(tpu_vm, skip_mds):
  # With TPU_SKIP_MDS_QUERY the metadata server is not asked; without it, it does not answer.
  tpu_vm('localhost', TPU_SKIP_MDS_QUERY=skip_mds)
  assert job.cluster_detected() == 'GkeTpuCluster'
  assert not job.initialize(job.JobOptions())
  assert not job.is_initialized() and not job.active()


def test_one_process_asked_for_is_one_process_in_any_cluster(tpu_vm):
  tpu_vm('host0,host1,host2,host3', TPU_WORKER_ID='2')  # A pod of four hosts.
  assert not job.initialize(job.JobOptions(num_processes=1))
  assert not job.initialize(job.JobOptions(num_processes=1, process_id=0,
                                                           initialization_timeout=5))
  assert not job.is_initialized()


def test_a_pod_whose_job_cannot_be_read_fails_at_once_saying_what_to_do(tpu_vm):
  tpu_vm('host0,host1', TPU_WORKER_ID='0')  # Its slice count is the metadata server's.
  t0 = time.monotonic()
  with pytest.raises(errors.DistributedError) as e:
    job.initialize(job.JobOptions())
  said = str(e.value)
  assert 'cluster (GkeTpuCluster) but could not read its job' in said, said
  assert 'Connection refused' in said and 'pass `num_processes=1`' in said, said
  assert '`coordinator_address`' in said and '`process_id`' in said, said
  assert time.monotonic() - t0 < job.DETECTED_TIMEOUT_S
  assert not job.is_initialized()


def test_a_pod_whose_other_hosts_do_not_come_fails_within_the_timeout(tpu_vm):
  # Every value in the environment (GKE's JobSet sets them so); process 1 never starts.
  tpu_vm('localhost,localhost', TPU_WORKER_ID='0', MEGASCALE_NUM_SLICES='1',
         MEGASCALE_SLICE_ID='0', MEGASCALE_COORDINATOR_ADDRESS='localhost',
         JAX_COORDINATOR_PORT=str(port := free_port()))
  with pytest.raises(errors.DistributedError) as e:
    job.initialize(job.JobOptions(initialization_timeout=2))
  said = str(e.value)
  assert 'process 1 did not join within 2 s' in said, said
  assert f'GkeTpuCluster: coordinator localhost:{port}, 2 processes, process id 0' in said, said
  assert 'pass `num_processes=1`' in said, said
  assert not job.is_initialized()


def test_options_that_leave_the_job_open_outside_a_cluster_are_refused():
  with pytest.raises(errors.DistributedError, match=r'`num_processes` and `process_id` not'
                     r' given, and JAX\'s cluster detection .* finds no cluster'):
    job.initialize(job.JobOptions(coordinator_address='localhost:1234'))


def test_the_command_on_a_one_host_tpu_vm_runs_as_one_process(tmp_path):
  """The lent TPU v5e's environment (issue 53), JAX itself told it is on a TPU VM
  (`JAX_FORCE_TPU_INIT`, read by `cloud_tpu_init` before the cluster modules import)."""
  out = tmp_path / 'out' / '1'
  found = subprocess.run(
      [sys.executable, '-m', 'orbax_tunix.cli', 'convert', str(TUNIX / 'sft_full'), str(out)],
      env={**{k: v for k, v in env().items() if k not in TPU_VARIABLES},
           **tpu_vm_env('localhost'), 'JAX_FORCE_TPU_INIT': '1'},
      capture_output=True, text=True, timeout=TIMEOUT_S, cwd=tmp_path)
  assert found.returncode == 0, found.stderr
  one = tmp_path / 'one' / '1'
  run_one(['convert', str(TUNIX / 'sft_full'), str(one)])
  assert_same_step(one, out)

"""Convert and export across hosts: bytes read and written per process, and wall time.

For each process count (1 and 2 by default), runs `orbax-tunix convert` (a
synthetic Tunix full state, sharded on disk as a pod writes it) and
`orbax-tunix export` (a Qwen3-shaped Tunix model, several safetensors
shards) as that many processes of one `jax.distributed` job over localhost,
`--devices` (4) CPU devices each, and reports per process the bytes it passed
through read()/write() (`/proc/self/io` rchar and wchar, page cache
included) and from/to storage (read_bytes, write_bytes), its peak memory
above start-up (VmHWM reset to the RSS once the process has joined the job,
the last of its start-up: what `--memory-budget` bounds), and the command's time (joining the job included), all
measured from just before the command starts (after imports) to its end, and
the job's wall time (start-up too). `--memory-budget` is passed to both
commands: the budget holds per process.

  python benchmarks/multihost.py                      # 256 MiB state, 1 and 2 processes
  python benchmarks/multihost.py --size-mb 1024 --processes 1 2 4 --memory-budget 256M

Each process of a job runs `python benchmarks/multihost.py child OUT -- ARGV`,
which imports the command, takes the counters, runs it, and writes OUT. A counter
the host lacks (`/proc/self/io`, VmHWM) reads n/a (`harness.py`). The job's
processes share one host: JAX_PLATFORMS defaults to cpu in them (they would
contend for one accelerator), and an explicit one passes through.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import time
from typing import Any

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
import harness  # noqa: E402  (a sibling module)

LOCAL_DEVICES = 4
COUNTERS = harness.IO_KEYS
# The Qwen3 fixture's dims (tests/data/tunix/README.md: vocab 96, embed 40,
# mlp 56, head dim 12, all distinct), scaled for the export.
QWEN3_DIMS = (96, 40, 56, 12)


def child(out: pathlib.Path, argv: list[str]) -> None:
  """One process of a job: the command, measured."""
  os.environ.setdefault('JAX_NUM_CPU_DEVICES', str(LOCAL_DEVICES))
  os.environ.setdefault('JAX_PLATFORMS', 'cpu')
  sys.path.insert(0, str(ROOT))

  from orbax_tunix.cli import commands  # pylint: disable=g-import-not-at-top

  # The streaming's memory is measured above start-up, of which joining the job is the
  # last part (JAX's distributed client, gloo): the peak is reset once the job is joined.
  joined = {}
  join = commands._join  # pylint: disable=protected-access

  def join_then_reset(args):
    join(args)
    gc.collect()
    joined['rss'] = harness.RssPeak()

  commands._join = join_then_reset  # pylint: disable=protected-access
  before, t0 = harness.io_counters(), time.monotonic()
  code = commands.main(argv)
  after = harness.io_counters()
  peak, _ = joined['rss'].stop() if 'rss' in joined else (None, False)
  out.write_text(json.dumps({
      'code': code, 'seconds': time.monotonic() - t0, 'peak_bytes': peak,
      **harness.io_delta(before, after),
  }))
  sys.stdout.flush()


def free_port() -> int:
  with socket.socket() as s:
    s.bind(('localhost', 0))
    return s.getsockname()[1]


def job(argv: list[str], n: int, work: pathlib.Path, timeout: float,
        env: dict[str, str]) -> dict[str, Any]:
  """Runs the command as `n` processes; returns the wall time and each process's counters."""
  port = free_port()
  procs = []
  t0 = time.monotonic()
  for i in range(n):
    flags = [] if n == 1 else ['--coordinator-address', f'localhost:{port}',
                               '--num-processes', str(n), '--process-id', str(i)]
    log = (work / f'p{i}.log').open('w')
    procs.append(subprocess.Popen(
        [sys.executable, __file__, 'child', str(work / f'p{i}.json'), '--', *argv, *flags],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=work, env=env))
  try:
    for p in procs:
      p.wait(timeout=max(1.0, t0 + timeout - time.monotonic()))
  finally:
    for p in procs:
      if p.poll() is None:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
  wall = time.monotonic() - t0
  per = []
  for i, p in enumerate(procs):
    if p.returncode != 0:
      raise SystemExit(f'process {i} of {n} failed ({p.returncode}):\n'
                       f'{(work / f"p{i}.log").read_text()[-3000:]}')
    per.append(json.loads((work / f'p{i}.json').read_text()))
  return {'processes': n, 'wall_s': wall, 'per_process': per}


def write_convert_source(work: pathlib.Path, size_mb: float) -> pathlib.Path:
  """The synthetic Tunix full state (weights, mu, nu), sharded over 8 devices on disk."""
  sys.path.insert(0, str(HERE))
  import synthetic  # pylint: disable=g-import-not-at-top

  shape = synthetic.shape_for(size_mb, leaves=200)
  subprocess.run([sys.executable, str(HERE / 'synthetic.py'), str(work), str(shape.layers),
                  str(shape.d_model), shape.param_dtype, 'tunix'], check=True)
  return synthetic.step_dir(work, 'tunix')


def write_export_source(work: pathlib.Path, scale: int) -> pathlib.Path:
  """The Qwen3 fixture's model with every dim scaled by `scale`, random values, sharded on disk."""
  step = work / 'qwen3' / '1'
  if (step / '_CHECKPOINT_METADATA').exists():
    return step
  script = f'''
import os, sys
os.environ['XLA_FLAGS'] = '--xla_force_host_platform_device_count=8'
os.environ['JAX_PLATFORMS'] = 'cpu'
import jax, numpy as np, orbax.checkpoint as ocp
from etils import epath
src = epath.Path({str(ROOT / 'tests/data/tunix/hf_qwen3/1/model_params')!r})
meta = ocp.PyTreeCheckpointHandler().metadata(src).tree
dims = {dict((d, d * scale) for d in QWEN3_DIMS)!r}
mesh = jax.make_mesh((8,), ('d',))
rng = np.random.default_rng(0)
def make(m):
  shape = tuple(dims.get(s, s) for s in m.shape)
  spec = jax.sharding.PartitionSpec('d') if shape and shape[0] % 8 == 0 else jax.sharding.PartitionSpec()
  value = rng.standard_normal(shape).astype(m.dtype)
  return jax.device_put(value, jax.sharding.NamedSharding(mesh, spec))
tree = jax.tree.map(make, meta)
with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckptr:
  ckptr.save(epath.Path({str(step)!r}), args=ocp.args.Composite(model_params=ocp.args.PyTreeSave(tree)))
'''
  subprocess.run([sys.executable, '-c', script], check=True)
  return step


def data_bytes(step: pathlib.Path) -> int:
  return sum(p.stat().st_size for p in step.rglob('*') if p.is_file())


def fmt(n: float | None) -> str:
  return 'n/a' if n is None else f'{n / 2**20:8.1f} MiB'


def report(name: str, source_bytes: int, runs: list[dict[str, Any]]) -> list[str]:
  lines = [f'### {name} (source on disk: {fmt(source_bytes).strip()})', '',
           '| processes | wall (job) | process | command | peak above start-up | rchar | wchar |'
           ' read_bytes | write_bytes |',
           '|---|---|---|---|---|---|---|---|---|']
  for run in runs:
    for i, p in enumerate(run['per_process']):
      wall = f'{run["wall_s"]:.1f} s' if i == 0 else ''
      n = run['processes'] if i == 0 else ''
      lines.append(f'| {n} | {wall} | {i} | {p["seconds"]:.1f} s | {fmt(p["peak_bytes"]).strip()} | '
                   + ' | '.join(fmt(p[k]).strip() for k in COUNTERS) + ' |')
  return lines + ['']


def main(argv: list[str]) -> None:
  if argv[:1] == ['child']:
    split = argv.index('--')
    child(pathlib.Path(argv[1]), argv[split + 1:])
    return
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--workdir', type=pathlib.Path, default=pathlib.Path('/tmp/orbax_tunix_multihost'))
  parser.add_argument('--size-mb', type=float, default=256, help='convert: MiB of full state')
  parser.add_argument('--export-scale', type=int, default=48,
                      help='export: the Qwen3 fixture with every dim times this')
  parser.add_argument('--processes', type=int, nargs='+', default=[1, 2])
  parser.add_argument('--timeout', type=float, default=1800)
  parser.add_argument('--memory-budget', default='1G', help='each command\'s --memory-budget')
  parser.add_argument('--devices', type=int, default=LOCAL_DEVICES, metavar='N',
                      help='CPU devices each process of a job simulates (default 4)')
  args = parser.parse_args(argv)
  env = harness.child_env(args.devices)
  work = args.workdir
  work.mkdir(parents=True, exist_ok=True)
  convert_src = write_convert_source(work / 'convert_src', args.size_mb)
  export_src = write_export_source(work / 'export_src', args.export_scale)
  out = [f'`python benchmarks/multihost.py {" ".join(argv)}`', '',
         f'{harness.commands_line(args.devices)}, per process (where unset, the job\'s'
         ' processes take cpu)', '']
  for name, src, command in (
      ('convert (canonical, full state)', convert_src, ['convert', str(convert_src)]),
      ('export (qwen3, 8 MB shards)', export_src,
       ['export', str(export_src), '--model', 'qwen3', '--max-shard-size', '8MB']),
  ):
    runs = []
    for n in args.processes:
      run_dir = work / f'run_{command[0]}_{n}'
      shutil.rmtree(run_dir, ignore_errors=True)
      run_dir.mkdir()
      dst = run_dir / ('out/1' if command[0] == 'convert' else 'out')
      runs.append(job([*command[:2], str(dst), *command[2:], '--memory-budget', args.memory_budget],
                      n, run_dir, args.timeout, env))
      shutil.rmtree(run_dir / 'out', ignore_errors=True)
    out += report(name, data_bytes(src), runs)
  print('\n'.join(out))


if __name__ == '__main__':
  main(sys.argv[1:])

"""`export` against the floor: a plain read-then-write of the same bytes, side by side.

Writes a Qwen3-shaped Tunix step (`export_memory.write_checkpoint`: float32, `--layers`
layers of width `--dim`; 8 x 1024 is 528 MiB, 36 x 1024 is 2.1 GiB), then, each round in
fresh processes with the order alternating:

  export  `orbax-tunix export STEP OUT --model qwen3` (its default memory budget)
  floor   plain Orbax restores `model_params` to the host as numpy (one restore, no target),
          then the `safetensors` package writes every array into one file: what any
          converter must at least do, with no re-layout and no memory bound.

`--before TREE` adds the export of another checkout of this package (its tree first on
PYTHONPATH), e.g. a worktree of the revision before a change.

Each child's wall time is the whole process (imports included: both import JAX and
Orbax): a command is one call per process, its first, which is what its user pays. The
floor child also reports its read and its write alone. Before each child the output is
removed and `sync` flushes what the previous one wrote, so that no contender pays for
another's writeback. Reported: the medians with their min-max spread, export / floor of the
medians, and the per-round ratios (median and range). Both work on the host; `--devices N`
sets how many CPU devices their JAX simulates, and JAX_PLATFORMS passes through (on an
accelerator host, each process opens the accelerator unless it is `cpu`, as the user's
command does).

Needs the `bench` extra (`pip install -e '.[bench]'`: the safetensors package).

  python benchmarks/export_floor.py --layers 36 --dim 1024 --rounds 5 --workdir /tmp/floor \\
      [--before /tmp/main-worktree] [--out /dev/shm/floor-out]

`--out` puts the outputs elsewhere than `--workdir` (another disk: e.g. /dev/shm for a
fast one); the source stays where it was written.

Where the export's time goes: the working tree's export runs with `--timings` and the
medians of its phases are reported beside the floor's read and write (planning, reading,
waiting for a read, writing on how many threads, committing; reads go ahead of the writes,
so the phases overlap). `--cores N` runs every child on the first N CPUs this process may
use (`taskset`: its affinity, which the export's threads follow), to see how each scales
with the cores of the host; `--memory-budget` is passed to the exports.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import harness  # pylint: disable=g-import-not-at-top  (sibling modules)
from before_after import _env  # pylint: disable=g-import-not-at-top
from export_memory import write_checkpoint  # pylint: disable=g-import-not-at-top

MIB = 1 << 20


def floor(step: pathlib.Path, out: pathlib.Path) -> dict:
  """The floor, in this process: read everything with Orbax, then write it with safetensors."""
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  from safetensors.numpy import save_file  # pylint: disable=g-import-not-at-top

  start = time.monotonic()
  handler = ocp.PyTreeCheckpointHandler()
  item = step / 'model_params'
  meta = handler.metadata(item).tree
  args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), meta)
  tree = handler.restore(item, args=ocp.args.PyTreeRestore(restore_args=args))
  read = time.monotonic()
  flat = {'.'.join(str(getattr(k, 'key', k)) for k in path): np.asarray(v)
          for path, v in jax.tree_util.tree_flatten_with_path(tree)[0]}
  out.mkdir(parents=True, exist_ok=True)
  save_file(flat, str(out / 'model.safetensors'))
  return {'read_s': read - start, 'write_s': time.monotonic() - read,
          'bytes': sum(v.nbytes for v in flat.values())}


# The phases `orbax-tunix export --timings` prints ('read 3.10 s in 22 batches', ...).
PHASES = ('set-up', 'plan', 'read', 'waited for', 'made', 'written', 'committed')


def timings(stderr: str) -> dict[str, float]:
  """The phases of an export's `--timings` line, in seconds, and its threads."""
  line = next((x for x in stderr.splitlines() if x.startswith('timings: ')), '')
  found = {name: float(m.group(1)) for name in PHASES
           if (m := re.search(rf'\b{name} ([\d.]+) s', line))}
  threads = re.search(r'on (\d+) threads', line)
  if threads:
    found['threads'] = int(threads.group(1))
  whole = re.search(r'([\d.]+) s in all', line)
  if whole:
    found['in all'] = float(whole.group(1))
  return found


def _child(argv: list[str], out: pathlib.Path, tree: str | None,
           devices: int | None, cores: list[int] | None) -> tuple[float, dict]:
  shutil.rmtree(out, ignore_errors=True)
  os.sync()  # The previous child's writes reach the disk before this one starts.
  env = harness.child_env(devices, _env(pathlib.Path(tree)) if tree else None)
  before = resource.getrusage(resource.RUSAGE_CHILDREN)
  start = time.monotonic()
  done = subprocess.run(argv, capture_output=True, text=True, check=False, env=env,
                        preexec_fn=(lambda: os.sched_setaffinity(0, cores)) if cores else None)
  seconds = time.monotonic() - start
  after = resource.getrusage(resource.RUSAGE_CHILDREN)  # This child's alone: one at a time.
  cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
  if done.returncode:
    raise SystemExit(f'{" ".join(argv)} failed:\n{done.stderr[-3000:]}')
  lines = [x for x in done.stdout.splitlines() if x.startswith('{')]
  shutil.rmtree(out, ignore_errors=True)
  return seconds, {**(json.loads(lines[-1]) if lines else timings(done.stderr)), 'cpu_s': cpu}


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--layers', type=int, default=8)
  parser.add_argument('--dim', type=int, default=1024)
  parser.add_argument('--rounds', type=int, default=5)
  parser.add_argument('--workdir')
  parser.add_argument('--before', help='another checkout of this package: its export too')
  parser.add_argument('--out', help='where the outputs go (default: WORKDIR/out)')
  parser.add_argument('--cores', type=int, metavar='N',
                      help='run every child on the first N CPUs this process may use')
  parser.add_argument('--memory-budget', metavar='SIZE', help="the exports' --memory-budget")
  parser.add_argument('--child', nargs=2, metavar=('STEP', 'OUT'), help=argparse.SUPPRESS)
  harness.add_flags(parser, cpu_default=None)
  args = parser.parse_args(argv)
  if args.child:
    print(json.dumps(floor(*map(pathlib.Path, args.child))))
    return
  harness.keep_off_devices()  # The writer's JAX: an accelerator stays free for the children.
  work = pathlib.Path(args.workdir or tempfile.mkdtemp(prefix='export-floor-'))
  step = work / f'src-{args.layers}x{args.dim}' / '1'
  if not step.exists():
    write_checkpoint(step.parent, args.layers, args.dim)
  size = sum(f.stat().st_size for f in (step / 'model_params').rglob('*') if f.is_file())
  out = pathlib.Path(args.out) if args.out else work / 'out'
  usable = sorted(os.sched_getaffinity(0))
  if args.cores is not None and not 1 <= args.cores <= len(usable):
    raise SystemExit(f'--cores {args.cores}: this process may use {len(usable)} CPUs')
  cores = usable[:args.cores] if args.cores else None
  export = [sys.executable, '-m', 'orbax_tunix.cli', 'export', str(step), str(out),
            '--model', 'qwen3'] + (['--memory-budget', args.memory_budget]
                                   if args.memory_budget else [])
  contenders = {
      'export': [*export, '--timings'],
      'floor': [sys.executable, __file__, '--child', str(step), str(out)],
  }
  trees = {'export': None, 'floor': None}
  if args.before:
    contenders['export (before)'] = export  # (Trees before --timings lack the flag.)
    trees['export (before)'] = args.before
  times: dict[str, list[float]] = {name: [] for name in contenders}
  reports: dict[str, list[dict]] = {name: [] for name in contenders}
  for i in range(args.rounds):
    for name in (list(contenders) if i % 2 == 0 else list(reversed(contenders))):
      seconds, report = _child(contenders[name], out, trees[name], args.devices, cores)
      times[name].append(seconds)
      reports[name].append(report)
      print(f'round {i + 1} {name}: {seconds:.2f} s', file=sys.stderr)
  med = {name: statistics.median(t) for name, t in times.items()}
  read = statistics.median(p['read_s'] for p in reports['floor'])
  write = statistics.median(p['write_s'] for p in reports['floor'])
  print(f'\nCommand: `python benchmarks/export_floor.py --layers {args.layers} --dim {args.dim}'
        f' --rounds {args.rounds}' + (f' --before {args.before}' if args.before else '')
        + (f' --out {args.out}' if args.out else '')
        + (f' --cores {args.cores}' if args.cores else '')
        + (f' --memory-budget {args.memory_budget}' if args.memory_budget else '')
        + (f' --devices {args.devices}`' if args.devices else '`'))
  print(harness.commands_line(args.devices)
        + f'; on {len(cores or usable)} of the {os.cpu_count()} CPUs')
  print(f'Qwen3-shaped step, {size / MIB:.0f} MiB on disk ({reports["floor"][0]["bytes"] / MIB:.0f} MiB'
        f' float32); outputs to {out.parent}\n')
  print('| contender | wall (median) | min - max | / floor | per round / floor: median (min -'
        ' max) | CPU (median, all threads) |')
  print('|---|---|---|---|---|---|')
  for name in contenders:
    ratios = sorted(t / f for t, f in zip(times[name], times['floor'], strict=True))
    cpu = statistics.median(r['cpu_s'] for r in reports[name])
    print(f'| {name} | {med[name]:.2f} s | {min(times[name]):.2f} - {max(times[name]):.2f} s |'
          f' {med[name] / med["floor"]:.2f} | {statistics.median(ratios):.2f}'
          f' ({ratios[0]:.2f} - {ratios[-1]:.2f}) | {cpu:.2f} s |')
  print(f'\nInside the floor (median): read {read:.2f} s, write {write:.2f} s;'
        f' the rest of its wall is start-up (imports).')
  phases = {name: statistics.median(r.get(name, 0.0) for r in reports['export'])
            for name in (*PHASES, 'threads', 'in all')}
  print(f'Inside the export (median of its --timings): set-up {phases["set-up"]:.2f} s, plan'
        f' {phases["plan"]:.2f} s, read {phases["read"]:.2f} s (waited for reads'
        f' {phases["waited for"]:.2f} s), made {phases["made"]:.2f} s, written'
        f' {phases["written"]:.2f} s on {phases["threads"]:.0f} threads, committed'
        f' {phases["committed"]:.2f} s; {phases["in all"]:.2f} s in all, the rest of its wall'
        f' ({med["export"] - phases["in all"]:.2f} s) start-up (imports) and exit. The phases'
        ' overlap: the reads go ahead of the writes.')


if __name__ == '__main__':
  main()

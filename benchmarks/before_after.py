"""One benchmark contender from two trees of this package, side by side in one run.

Each round runs `SCRIPT --child CONTENDER ARGS...` once with the package of
`--before` (a git revision, checked out into a temporary worktree) and once
with the working tree's, in fresh processes, the order alternating, so that
the noise of a shared machine falls on both alike. Reported: each side's
median wall time and peak RSS above start of its first call (and of its warm
calls, where the child makes them; `harness.py`), and after / before.
`--devices N` is passed to the child (or, with `--command`, sets the CPU
devices its JAX simulates).

  python benchmarks/before_after.py --before 705d2e4 --rounds 5 \\
      benchmarks/lora_merge.py merge -- --workdir /tmp/lb24 --layers 24 --dim 1024

The benchmark's own data must exist (run the benchmark once with its
`--workdir`); the script itself is run from the working tree both times.

With `--command`, any command instead (e.g. the CLI): its wall time and the
child's own peak RSS (`os.wait4`'s ru_maxrss, from zero rather than above a
start), `--fresh DIR` removed before each run (a destination):

  python benchmarks/before_after.py --before 705d2e4 --rounds 5 --fresh /tmp/out --command -- \\
      python -m orbax_tunix.cli convert /tmp/lb24/lora/1 /tmp/out/1 --merge-lora --lora-scale 0.5
"""

from __future__ import annotations

import argparse
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import harness  # sibling module; the script's directory is on sys.path

REPO = pathlib.Path(__file__).resolve().parent.parent


def _env(tree: pathlib.Path) -> dict[str, str]:
  # The tree's package first on the path (before an editable install of this one).
  return {**os.environ, 'PYTHONPATH': os.pathsep.join(
      [str(tree), *filter(None, [os.environ.get('PYTHONPATH')])])}


def _run(tree: pathlib.Path, argv: list[str]) -> dict:
  """A benchmark child: its first call's wall_s and peak_rss_bytes, and its warm calls' wall."""
  done = harness.run_child(argv, env=_env(tree))
  if 'error' in done:
    raise SystemExit(f'{tree}: {" ".join(argv)} failed:\n{done["error"]}')
  warm = [w['wall_s'] for w in done.get('warm', ())]
  return {'wall_s': done['wall_s'], 'peak_rss_bytes': done['peak_rss_bytes'],
          'warm_s': statistics.median(warm) if warm else None}


def _run_command(tree: pathlib.Path, argv: list[str], fresh: str | None,
                 devices: int | None) -> dict:
  """Any command: its wall time and its own peak RSS (this child's rusage, not all children's)."""
  if fresh:
    shutil.rmtree(fresh, ignore_errors=True)
  argv = [sys.executable if argv[0] == 'python' else argv[0], *argv[1:]]
  with tempfile.TemporaryFile('w+') as err:
    t0 = time.perf_counter()
    child = subprocess.Popen(argv, env=harness.child_env(devices, _env(tree)),
                             stdout=subprocess.DEVNULL, stderr=err)
    _, status, usage = os.wait4(child.pid, 0)  # This child's own rusage (ru_maxrss in KiB).
    wall = time.perf_counter() - t0
    child.returncode = os.waitstatus_to_exitcode(status)
    if child.returncode:
      err.seek(0)
      raise SystemExit(f'{tree}: {" ".join(argv)} failed:\n{err.read()[-3000:]}')
  return {'wall_s': wall, 'peak_rss_bytes': usage.ru_maxrss * 1024, 'warm_s': None}


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--before', required=True, help='a git revision of this repository')
  parser.add_argument('--rounds', type=int, default=5)
  parser.add_argument('--command', action='store_true',
                      help='time the command after -- rather than a benchmark child')
  parser.add_argument('--fresh', help='with --command: a directory removed before each run')
  parser.add_argument('script', nargs='?')
  parser.add_argument('contender', nargs='?')
  parser.add_argument('args', nargs=argparse.REMAINDER)
  harness.add_flags(parser, cpu_default=None)
  args = parser.parse_args(argv)
  rest = args.args[1:] if args.args[:1] == ['--'] else args.args
  if args.command:
    rest = [x for x in (args.script, args.contender) if x and x != '--'] + rest
    label, shown = 'command', f'--fresh {args.fresh} --command -- {" ".join(rest)}'

    def run(tree):
      return _run_command(tree, rest, args.fresh, args.devices)
  else:
    child = [str(pathlib.Path(args.script).resolve()), '--child', args.contender, *rest]
    if args.devices:
      child += ['--devices', str(args.devices)]
    label, shown = args.contender, f'{args.script} {args.contender} -- {" ".join(rest)}'

    def run(tree):
      return _run(tree, child)
  with tempfile.TemporaryDirectory(prefix='before-') as tmp:
    old = pathlib.Path(tmp) / 'tree'
    subprocess.run(['git', '-C', str(REPO), 'worktree', 'add', '--detach', str(old),
                    args.before], check=True, capture_output=True)
    try:
      sides = {'before': old, 'after': REPO}
      results: dict[str, list[dict]] = {k: [] for k in sides}
      for r in range(args.rounds):
        order = list(sides) if r % 2 == 0 else list(reversed(sides))
        for side in order:
          results[side].append(run(sides[side]))
          print(side, results[side][-1], flush=True)
    finally:
      subprocess.run(['git', '-C', str(REPO), 'worktree', 'remove', '--force', str(old)],
                     check=False, capture_output=True)
  wall = {k: statistics.median(x['wall_s'] for x in v) for k, v in results.items()}
  mib = {k: harness.med_of(v, 'peak_rss_bytes') for k, v in results.items()}
  warm = {k: harness.med_of(v, 'warm_s') for k, v in results.items()}
  devices = f' --devices {args.devices}' if args.devices else ''
  print(f'\nCommand: `python benchmarks/before_after.py --before {args.before} --rounds'
        f' {args.rounds}{devices} {shown}`\n')
  peak = 'peak RSS, median' if args.command else 'peak RSS above start, median'
  first = 'wall' if args.command else 'wall, first call'
  print(f'| {label} | before ({args.before}) | after | after / before |')
  print('|---|---|---|---|')
  print(f'| {first}, median of {args.rounds} | {wall["before"]:.2f} s | {wall["after"]:.2f} s |'
        f' {wall["after"] / wall["before"]:.2f} |')
  if None not in warm.values():
    print(f'| wall, warm calls, median | {warm["before"]:.2f} s | {warm["after"]:.2f} s |'
          f' {warm["after"] / warm["before"]:.2f} |')
  if None not in mib.values():
    print(f'| {peak} | {mib["before"] / harness.MIB:.0f} MiB | {mib["after"] / harness.MIB:.0f}'
          f' MiB | {mib["after"] / mib["before"]:.2f} |')


if __name__ == '__main__':
  main()

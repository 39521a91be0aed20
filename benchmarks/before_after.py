"""One benchmark contender from two trees of this package, side by side in one run.

Each round runs `SCRIPT --child CONTENDER ARGS...` once with the package of
`--before` (a git revision, checked out into a temporary worktree) and once
with the working tree's, in fresh processes, the order alternating, so that
the noise of a shared machine falls on both alike. Reported: each side's
median wall time and peak RSS above start (the `peak` module's), and
after / before.

  python benchmarks/before_after.py --before 705d2e4 --rounds 5 \\
      benchmarks/lora_merge.py merge -- --workdir /tmp/lb24 --layers 24 --dim 1024

The benchmark's own data must exist (run the benchmark once with its
`--workdir`); the script itself is run from the working tree both times.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile

REPO = pathlib.Path(__file__).resolve().parent.parent


def _run(tree: pathlib.Path, argv: list[str]) -> dict:
  # The tree's package first on the path (before an editable install of this one).
  env = {**os.environ, 'PYTHONPATH': os.pathsep.join(
      [str(tree), *filter(None, [os.environ.get('PYTHONPATH')])])}
  done = subprocess.run([sys.executable, *argv], capture_output=True, text=True, env=env,
                        check=False)
  if done.returncode:
    raise SystemExit(f'{tree}: {" ".join(argv)} failed:\n{done.stderr[-3000:]}')
  return json.loads([x for x in done.stdout.splitlines() if x.startswith('{')][-1])


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--before', required=True, help='a git revision of this repository')
  parser.add_argument('--rounds', type=int, default=5)
  parser.add_argument('script')
  parser.add_argument('contender')
  parser.add_argument('args', nargs=argparse.REMAINDER)
  args = parser.parse_args(argv)
  rest = args.args[1:] if args.args[:1] == ['--'] else args.args
  child = [str(pathlib.Path(args.script).resolve()), '--child', args.contender, *rest]
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
          results[side].append(_run(sides[side], child))
          print(side, results[side][-1], flush=True)
    finally:
      subprocess.run(['git', '-C', str(REPO), 'worktree', 'remove', '--force', str(old)],
                     check=False, capture_output=True)
  wall = {k: statistics.median(x['wall_s'] for x in v) for k, v in results.items()}
  mib = {k: statistics.median(x['peak_above_kb'] for x in v) / 1024 for k, v in results.items()}
  print(f'\nCommand: `python benchmarks/before_after.py --before {args.before} --rounds'
        f' {args.rounds} {args.script} {args.contender} -- {" ".join(rest)}`\n')
  print(f'| {args.contender} | before ({args.before}) | after | after / before |')
  print('|---|---|---|---|')
  print(f'| wall, median of {args.rounds} | {wall["before"]:.2f} s | {wall["after"]:.2f} s |'
        f' {wall["after"] / wall["before"]:.2f} |')
  print(f'| peak RSS above start, median | {mib["before"]:.0f} MiB | {mib["after"]:.0f} MiB |'
        f' {mib["after"] / mib["before"]:.2f} |')


if __name__ == '__main__':
  main()

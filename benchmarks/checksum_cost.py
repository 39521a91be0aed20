"""What the per-array checksums cost `convert`: with them, and with them stubbed out.

Writes a Tunix-layout checkpoint of incompressible float32 arrays (as
`convert_memory.py` does), then converts it in a fresh process per run,
alternating: `with` is the real `convert`; `without` replaces
`orbax_tunix.writing.checksums.checksum` by a constant (everything else the same).
Reported: median wall time of the conversion (`ConvertResult.seconds`).

  python benchmarks/checksum_cost.py [--leaves 64 --leaf-mib 8 --reps 5]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import convert_memory  # noqa: E402

CHILD = """
import json, sys
from orbax_tunix import checksums, convert
if sys.argv[3] == 'without':
  checksums.checksum = lambda value: '0'
plan = convert.plan_convert(sys.argv[1], sys.argv[2])
print(json.dumps({'seconds': convert.run_convert(plan).seconds}))
"""


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--leaves', type=int, default=64)
  parser.add_argument('--leaf-mib', type=int, default=8)
  parser.add_argument('--reps', type=int, default=5)
  args = parser.parse_args(argv)
  work = pathlib.Path(tempfile.mkdtemp(prefix='checksum-cost-'))
  try:
    src = convert_memory.write_checkpoint(work / 'src', args.leaves, args.leaf_mib, optimizer=True)
    times: dict[str, list[float]] = {'with': [], 'without': []}
    for rep in range(args.reps):
      for mode in (('with', 'without') if rep % 2 == 0 else ('without', 'with')):
        dst = work / 'out' / str(rep) / mode / '1'
        done = subprocess.run([sys.executable, '-c', CHILD, str(src), str(dst), mode],
                              capture_output=True, text=True, check=True)
        times[mode].append(json.loads(done.stdout.strip().splitlines()[-1])['seconds'])
        shutil.rmtree(dst.parent)
        print(mode, f'{times[mode][-1]:.2f} s', flush=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    total = 2 * args.leaves * args.leaf_mib
    print(f'\nCommand: `python benchmarks/checksum_cost.py --leaves {args.leaves} --leaf-mib'
          f' {args.leaf_mib} --reps {args.reps}` ({total} MiB converted per run)\n')
    print('| convert | median s | |')
    print('|---|---|---|')
    print(f'| without checksums | {med["without"]:.2f} | |')
    print(f'| with checksums | {med["with"]:.2f} | {med["with"] / med["without"] - 1:+.1%}'
          ' (target <= +5%) |')
  finally:
    shutil.rmtree(work, ignore_errors=True)


if __name__ == '__main__':
  main()

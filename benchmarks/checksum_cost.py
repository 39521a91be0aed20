"""What the per-array checksums cost `convert`: with them, and with them stubbed out.

Writes a Tunix-layout checkpoint of incompressible float32 arrays (as
`convert_memory.py` does), then converts it in a fresh process per run,
alternating: `with` is the real `convert`; `without` replaces
`orbax_tunix.writing.checksums.checksum` by a constant (everything else the same).
Each process converts once (its first call) and `--warm K` more times (a new
destination each). Reported: median wall time of the conversion
(`ConvertResult.seconds`), first and warm calls apart. `--devices N` sets how many
CPU devices the children's JAX simulates (convert works on the host); JAX_PLATFORMS
passes through (`harness.py`).

  python benchmarks/checksum_cost.py [--leaves 64 --leaf-mib 8 --reps 5]
"""

from __future__ import annotations

import argparse
import pathlib
import shutil
import statistics
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import convert_memory  # noqa: E402
import harness  # noqa: E402

MODES = ('with', 'without')


def child(mode: str, src: str, dst: str, warm: int) -> None:
  """`warm + 1` conversions of `src` in this process, to `dst`-0, `dst`-1, ...; one report."""
  from orbax_tunix.tools import convert  # pylint: disable=g-import-not-at-top
  from orbax_tunix.writing import checksums  # pylint: disable=g-import-not-at-top

  if mode == 'without':
    checksums.checksum = lambda value: '0'
  done = []

  def call():
    out = pathlib.Path(f'{dst}-{len(done)}') / '1'
    done.append(out)
    return convert.run_convert(convert.plan_convert(src, str(out)))

  def after(result):
    shutil.rmtree(done[-1].parent)
    return {'convert_s': result.seconds}

  import jax  # pylint: disable=g-import-not-at-top

  measured = harness.calls(call, warm, describe_out=after)
  harness.emit(harness.child_result(mode, measured, jax.devices()))


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--leaves', type=int, default=64)
  parser.add_argument('--leaf-mib', type=int, default=8)
  parser.add_argument('--reps', type=int, default=5)
  parser.add_argument('--child', nargs=3, metavar=('MODE', 'SRC', 'DST'), help=argparse.SUPPRESS)
  harness.add_flags(parser, cpu_default=None, warm=True)
  args = parser.parse_args(argv)
  if args.child:
    return child(*args.child, args.warm)
  harness.keep_off_devices()  # The writer's JAX: an accelerator stays free for the children.
  env = harness.child_env(args.devices)
  work = pathlib.Path(tempfile.mkdtemp(prefix='checksum-cost-'))
  try:
    src = convert_memory.write_checkpoint(work / 'src', args.leaves, args.leaf_mib, optimizer=True)

    def run(mode, rep):
      return harness.run_child([__file__, '--child', mode, str(src),
                                str(work / 'out' / f'{rep}-{mode}'), '--warm', str(args.warm)],
                               env=env)

    results = harness.rounds(MODES, args.reps, run)
    harness.exit_if_failed(results)
    total = 2 * args.leaves * args.leaf_mib
    print(f'\nCommand: `python benchmarks/checksum_cost.py --leaves {args.leaves} --leaf-mib'
          f' {args.leaf_mib} --reps {args.reps} --warm {args.warm}'
          + (f' --devices {args.devices}`' if args.devices else '`')
          + f' ({total} MiB converted per run); JAX in the children:'
          f' {harness.describe_line(harness.first_device_info(results))}\n')
    print('| convert | first call, median s | | warm calls, median s | |')
    print('|---|---|---|---|---|')
    first = {k: statistics.median(r['convert_s'] for r in v) for k, v in results.items()}
    warm = {k: [w['convert_s'] for r in v for w in r['warm']] for k, v in results.items()}
    warm = {k: statistics.median(v) if v else None for k, v in warm.items()}
    for mode in ('without', 'with'):
      cost = f'{first["with"] / first["without"] - 1:+.1%} (target <= +5%)' if mode == 'with' else ''
      wcost = (f'{warm["with"] / warm["without"] - 1:+.1%}'
               if mode == 'with' and None not in warm.values() else '')
      shown = '-' if warm[mode] is None else f'{warm[mode]:.2f}'
      print(f'| {mode} checksums | {first[mode]:.2f} | {cost} | {shown} | {wcost} |')
  finally:
    shutil.rmtree(work, ignore_errors=True)


if __name__ == '__main__':
  main()

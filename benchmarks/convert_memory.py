"""Peak memory of `orbax-tunix convert` against its `--memory-budget`.

Writes a Tunix-layout checkpoint of incompressible float32 arrays (by default
512 MiB: `model_params` with 64 leaves of 4 MiB and `optimizer_state` with
their `mu`), then runs `orbax-tunix convert` in a fresh process per budget and
samples that process's resident memory every few milliseconds.

The baseline is the peak RSS of `orbax-tunix inspect --json` on the same
checkpoint: the interpreter, JAX, Orbax and TensorStore started and every
array's metadata opened, no array read. What the budget bounds is the
conversion's peak above that baseline ("streaming"); each budget is run
`--repeat` times (the peak varies by some 10% from run to run) and every
conversion is checked with `orbax-tunix diff`. A second checkpoint with
one large array shows the other regime: an array larger than a third of the
budget is copied alone, and costs about three times its size (TensorStore
holds the compressed chunk and the decoded array while reading, the host copy
and the compressed output while writing).

The commands work on the host: `--devices N` sets how many CPU devices their JAX
simulates; JAX_PLATFORMS passes through to them (`harness.py`).

Usage (from the repository root)::

  python benchmarks/convert_memory.py
  python benchmarks/convert_memory.py --leaves 128 --leaf-mib 4 --budgets 64M,256M,1G
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shutil
import statistics
import sys
import tempfile

import harness  # sibling module; the script's directory is on sys.path

MIB = 2**20


def write_checkpoint(root: pathlib.Path, leaves: int, leaf_mib: int, optimizer: bool) -> pathlib.Path:
  """A Tunix-layout step (nnx `value` level) of random float32 arrays."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

  rng = np.random.default_rng(0)
  side = int((leaf_mib * MIB // 4) ** 0.5)

  def noise():
    return jnp.asarray(np.frombuffer(rng.bytes(side * side * 4), np.float32).reshape(side, side))

  weights = {'layers': {str(i): {'w': {'value': noise()}} for i in range(leaves)}}
  items = {'model_params': ocp.args.PyTreeSave(weights)}
  if optimizer:
    opt = {
        'opt_state': {'0': {'count': {'value': jnp.int32(1)}, 'mu': {'layers': {
            str(i): {'w': {'value': noise()}} for i in range(leaves)
        }}}},
        'step': {'value': jnp.uint32(1)},
    }
    items['optimizer_state'] = ocp.args.PyTreeSave(opt)
  with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckptr:
    ckptr.save(root / '1', args=ocp.args.Composite(**items))
  return root / '1'


def parse_budget(text: str) -> int:
  from orbax_tunix.cli.flags import parse_size  # pylint: disable=g-import-not-at-top

  return parse_size(text)


def _mib(value: float | None) -> float | str:
  return 'n/a' if value is None else round(value / MIB, 1)


def measure(
    step_dir: pathlib.Path, out_dir: pathlib.Path, budgets: list[str], label: str, repeat: int,
    env: dict[str, str],
) -> list[dict]:
  """Baseline and `repeat` conversions per budget; returns one row per budget."""
  cli = [sys.executable, '-m', 'orbax_tunix.cli']

  def peak_rss(argv):
    return harness.sampled_peak_rss(argv, env)

  baseline, _, status = peak_rss(cli + ['inspect', str(step_dir), '--json'])
  assert status == 0, 'inspect failed'
  data = sum(f.stat().st_size for f in step_dir.rglob('*') if f.is_file())
  rows = []
  for budget in budgets:
    peaks, times, matches = [], [], []
    for i in range(repeat):
      dst = out_dir / f'{label}-{budget}-{i}' / '1'
      peak, seconds, status = peak_rss(
          cli + ['convert', str(step_dir), str(dst), '--memory-budget', budget]
      )
      assert status == 0, f'convert failed with budget {budget}'
      _, _, same = peak_rss(cli + ['diff', str(step_dir), str(dst)])
      peaks.append(peak)
      times.append(seconds)
      matches.append(same == 0)
      shutil.rmtree(dst.parent)
    known = baseline is not None and None not in peaks  # RSS unreadable here: n/a
    worst = max(peaks) - baseline if known else None
    rows.append({
        'checkpoint': label,
        'on_disk_mib': round(data / MIB, 1),
        'budget_mib': round(parse_budget(budget) / MIB, 1),
        'baseline_rss_mib': _mib(baseline),
        'streaming_mib_median': _mib(statistics.median(peaks) - baseline if known else None),
        'streaming_mib_max': _mib(worst),
        'within_budget': worst <= parse_budget(budget) if known else 'n/a',
        'seconds_median': round(statistics.median(times), 1),
        'diff_match': all(matches),
    })
  return rows


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--dir', help='where to write (default: a temporary directory)')
  parser.add_argument('--leaves', type=int, default=64)
  parser.add_argument('--leaf-mib', type=int, default=4)
  parser.add_argument('--budgets', default='64M,128M,256M,1G')
  parser.add_argument('--big-leaf-mib', type=int, default=128,
                      help='size of the single array of the second checkpoint (0: skip)')
  parser.add_argument('--repeat', type=int, default=3, help='conversions per budget')
  parser.add_argument('--json', action='store_true')
  harness.add_flags(parser, cpu_default=None)
  args = parser.parse_args()
  harness.keep_off_devices()  # The writer's JAX: an accelerator stays free for the commands.
  env = harness.child_env(args.devices)
  with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
    tmp = pathlib.Path(tmp)
    many = write_checkpoint(tmp / 'many', args.leaves, args.leaf_mib, optimizer=True)
    rows = measure(
        many, tmp / 'out', args.budgets.split(','), f'{args.leaves}x{args.leaf_mib}MiB x2',
        args.repeat, env)
    if args.big_leaf_mib:
      one = write_checkpoint(tmp / 'one', 1, args.big_leaf_mib, optimizer=False)
      rows += measure(one, tmp / 'out', ['64M'], f'1x{args.big_leaf_mib}MiB', args.repeat, env)
  if args.json:
    print(json.dumps(rows, indent=1))
    return
  print(harness.commands_line(args.devices))
  columns = list(rows[0])
  widths = [max(len(c), *(len(str(r[c])) for r in rows)) for c in columns]
  print('  '.join(c.ljust(w) for c, w in zip(columns, widths, strict=True)))
  for row in rows:
    print('  '.join(str(row[c]).ljust(w) for c, w in zip(columns, widths, strict=True)))


if __name__ == '__main__':
  main()

"""Does a Tunix restore through orbax_tunix cost what a plain Orbax restore costs?

  python benchmarks/restore_cost.py                 # the full run (~1 GB, 5 rounds)
  python benchmarks/restore_cost.py --quick         # a smoke run (64 MB, 1 round; < 2 min, on a TPU too)

Writes, with Orbax directly, a synthetic transformer state twice (Tunix layout
and canonical, see `synthetic.py`), then runs the contenders of
`contenders.py` round after round, each repetition in a fresh process, the
order rotating every round:

  a  plain Orbax, canonical copy into the sharded target (the floor)
  b  orbax_tunix, Tunix checkpoint into the same target, full state
  c  orbax_tunix, params only
  d  naive: plain Orbax reads the raw Tunix tree, Python rewrites it
  e  `orbax-tunix convert` of the Tunix step (when the CLI is installed)
  f  orbax_tunix, one named weight (in the scan, against g)
  g  plain Orbax, the same weight from the canonical copy (partial restore)
  h  plain Orbax, the same weight from the Tunix step by its on-disk path

and reports medians and spread, the time ratios b/a, c/a, d/b, e/a, f/g, the bytes
each read (/proc/self/io), peak resident memory and the devices' peak memory
against the target's bytes, and, over a scan of leaf counts, the planning time
of b (everything before Orbax's first array read) against its restore time.
First calls (each a fresh process) and warm calls (`--warm K` more in the same
process) are reported apart. The target is sharded over the first
`--devices N` of JAX's devices (JAX_PLATFORMS picks the backend; 8 simulated
CPU devices by default); the checkpoints are always written on 8 CPU devices.

Only the project's own dependencies are needed. Figures go to stdout as
Markdown tables (and to `--json`); `BENCHMARKS.md` holds a full run.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import pathlib
import shlex
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

import harness
import synthetic
from harness import med, mib, spread, table

HERE = pathlib.Path(__file__).resolve().parent
CHILD = HERE / 'contenders.py'
MiB = 2**20
CONTENDER_NAMES = {
    'a': 'plain Orbax, canonical copy (floor)',
    'b': 'orbax_tunix, full state',
    'c': 'orbax_tunix, params only',
    'd': 'naive: raw restore + Python rewrite',
    'e': 'orbax-tunix convert',
    'f': 'orbax_tunix, one named weight',
    'g': 'plain Orbax, the same weight (partial restore, canonical copy)',
}
# The targets (issue 11).
TARGET_B_OVER_A = 1.02
TARGET_C_SLACK = 0.02
TARGET_PEAK = 1.2
TARGET_PLAN_SHARE = 0.01  # at 10k leaves
TARGET_PLAN_50K_S = 2.0
TARGET_F_OVER_G = 1.3


# --- running the children ----------------------------------------------------


def run_child(
    contender: str,
    workdir: pathlib.Path,
    args: argparse.Namespace,
    extra: Sequence[str] = (),
    concurrent_gb: float | None = None,
    warm: int = 0,
    platforms: str | None = None,
) -> dict[str, Any]:
  """Runs one repetition in a fresh interpreter; returns its RESULT (or the error)."""
  cmd = [str(CHILD), contender, str(workdir), *extra, '--warm', str(warm),
         '--cache', args.cache]
  if args.drop_caches:
    cmd.append('--drop-caches')
  if args.devices:
    cmd += ['--devices', str(args.devices)]
  env = dict(os.environ)
  env.pop('BENCH_RESTORE_CONCURRENT_GB', None)
  if platforms:
    env['JAX_PLATFORMS'] = platforms
  if concurrent_gb:
    env['BENCH_RESTORE_CONCURRENT_GB'] = str(concurrent_gb)
  result = harness.run_child(cmd, args.timeout, env)
  result.setdefault('contender', contender)
  return result


def write(workdir: pathlib.Path, shape: synthetic.Shape,
          layouts: tuple[str, ...] = synthetic.LAYOUTS) -> dict[str, pathlib.Path]:
  """Writes the checkpoints in a process of its own (jax with 8 devices), or reuses them."""
  cmd = [sys.executable, str(HERE / 'synthetic.py'), str(workdir), str(shape.layers),
         str(shape.d_model), shape.param_dtype, *layouts]
  proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
  if proc.returncode:
    raise RuntimeError(f'writing {workdir} failed:\n{proc.stderr[-3000:]}')
  return {k: synthetic.step_dir(workdir, k) for k in layouts}


def cli_available() -> bool:
  spec = importlib.util.find_spec('orbax_tunix')  # finds, does not import
  if spec is None or not spec.submodule_search_locations:
    return False
  return any((pathlib.Path(p) / 'cli').is_dir() for p in spec.submodule_search_locations)


# --- statistics and tables -----------------------------------------------------


def verdict(ok: bool) -> str:
  return 'MET' if ok else 'MISSED'


# --- the main comparison ------------------------------------------------------


def compare(args, policy: harness.CachePolicy) -> dict[str, Any]:
  shape = synthetic.shape_for(args.size_mb, args.leaves, args.param_dtype)
  t = time.perf_counter()
  dirs = write(args.workdir / 'main', shape)
  print(f'checkpoints ready in {time.perf_counter() - t:.0f} s: {args.workdir / "main"}', flush=True)
  disk = {
      'tunix': synthetic.disk_bytes(dirs['tunix']),
      'canonical': synthetic.disk_bytes(dirs['canonical']),
      'tunix_params': synthetic.disk_bytes(dirs['tunix'], synthetic.MODEL_ITEM),
  }
  contenders = [c for c in args.contenders if c != 'e' or cli_available()]
  notes = []
  if 'e' in args.contenders and 'e' not in contenders:
    notes.append('e skipped: orbax_tunix.cli is not installed (`orbax-tunix convert` absent).')
  out: dict[str, Any] = {
      'shape': shape.to_json(),
      'disk_leaves': shape.disk_leaves,
      'logical_bytes': shape.total_bytes,
      'params_share': shape.params_bytes / shape.total_bytes,
      'disk_bytes': disk,
      'notes': notes,
  }
  if args.verify:
    check = run_child('verify', args.workdir / 'main', args)
    out['verify'] = check
    print(f'verify: {check}', flush=True)
  results = harness.rounds(
      contenders, args.reps,
      lambda c, _: run_child(c, args.workdir / 'main', args,
                             concurrent_gb=args.restore_concurrent_gb, warm=args.warm),
      prepare=lambda: policy.prepare(list(dirs.values())))
  out['results'] = results
  out['devices'] = harness.first_device_info(results)
  out['report'] = report_compare(shape, disk, results, contenders, notes)
  if args.memory_check_gb and args.memory_reps:
    out['memory'] = memory_check(args, policy, dirs)
  return out


def memory_check(args, policy: harness.CachePolicy, dirs) -> dict[str, Any]:
  """a and b again, with Orbax's in-flight read budget (`restore_concurrent_gb`) set."""
  runs = harness.rounds(
      ['a', 'b'], args.memory_reps,
      lambda c, _: run_child(c, args.workdir / 'main', args, concurrent_gb=args.memory_check_gb),
      prepare=lambda: policy.prepare(list(dirs.values())))
  rows = []
  for c, rs in runs.items():
    rs = harness.ok(rs)
    if not rs:
      continue
    x = _per_target(rs, 'peak_rss_bytes', 'target_bytes')
    rows.append([c, len(rs), f'{med([r["wall_s"] for r in rs]):.2f}',
                 mib(harness.med_of(rs, 'peak_rss_bytes')),
                 f'{med(x):.2f}' if x else 'n/a', f'{max(x):.2f}' if x else 'n/a',
                 verdict(med(x) <= TARGET_PEAK) if c == 'b' and x else ''])
  report = table(['', 'n', 'wall s', 'peak RSS MiB', 'x target (median)', 'x target (max)',
                  f'b <= {TARGET_PEAK}'], rows)
  return {'budget_gb': args.memory_check_gb, 'runs': runs, 'report': report}


def _per_target(rs: Sequence[dict[str, Any]], key: str, per: str) -> list[float]:
  """Each run's `key` over its `per` (a peak over the target's bytes); [] when a counter is missing."""
  if any(r.get(key) is None for r in rs):
    return []
  return [r[key] / r[per] for r in rs]


def _value(r: dict[str, Any], key: str, calls: str) -> float | None:
  """A run's figure: its first call's, or the median of its warm calls'."""
  if calls == 'first':
    return r.get(key)
  warm = [w[key] for w in r.get('warm', ()) if w.get(key) is not None]
  return med(warm) if warm else None


def _runs(results, c: str, key: str, calls: str) -> dict[int, float]:
  """{round: figure} of a contender's successful runs that have it."""
  out = {}
  for r in harness.ok(results[c]):
    v = _value(r, key, calls)
    if v is not None:
      out[r['round']] = v
  return out


def report_compare(shape, disk, results, contenders, notes) -> str:
  lines = []
  expected = {
      'a': disk['canonical'], 'b': disk['tunix'], 'c': disk['tunix_params'],
      'd': disk['tunix'], 'e': disk['tunix'],
  }
  rows = []
  for c in contenders:
    rs = harness.ok(results[c])
    if not rs:
      rows.append([c, CONTENDER_NAMES[c], 'FAILED'] + [''] * 9)
      continue
    wall = [r['wall_s'] for r in rs]
    cpu = [r['cpu_s'] for r in rs]
    peak = _per_target(rs, 'peak_rss_bytes', 'target_bytes') if c != 'e' else []
    dev = _per_target(rs, 'device_peak_bytes', 'target_held_bytes') if c != 'e' else []
    rchar = harness.med_of(rs, 'rchar')
    rows.append([
        c, CONTENDER_NAMES[c], len(rs),
        f'{med(wall):.2f}', spread(wall), f'{med(cpu):.2f}',
        f'{med([r["plan_s"] for r in rs]):.3f}' if c in 'bc' else '-',
        f'{med([r["pre_read_s"] for r in rs]):.3f}' if c != 'e' else '-',
        f'{mib(rchar)} / {expected[c] / MiB:.0f}',
        mib(harness.med_of(rs, 'read_bytes')),
        mib(harness.med_of(rs, 'peak_rss_bytes')) + (f' ({med(peak):.2f}x)' if peak else ''),
        mib(harness.med_of(rs, 'device_peak_bytes')) + (f' ({med(dev):.2f}x)' if dev else ''),
    ])
  lines.append('First calls, each in a fresh process:\n')
  lines.append(table(
      ['', 'contender', 'n', 'wall s (median)', 'spread (min/max)', 'cpu s',
       'planning s', 'before 1st read s', 'read MiB (rchar) / on disk',
       'read MiB (storage)', 'peak RSS MiB (x target)', 'device peak MiB (x target held)'],
      rows,
  ))
  lines.append('')
  have = {c for c in contenders if harness.ok(results[c])}

  def ratio(num, den, calls, key='wall_s'):
    """(ratio of medians, per-round ratios) of `num` over `den`; None when either has none."""
    n, d = _runs(results, num, key, calls), _runs(results, den, key, calls)
    if not n or not d:
      return None, []
    return med(list(n.values())) / med(list(d.values())), [n[r] / d[r] for r in n if r in d]

  share = shape.params_bytes / shape.total_bytes
  targets = {
      ('b', 'a'): (f'<= {TARGET_B_OVER_A}', lambda w: w <= TARGET_B_OVER_A),
      ('c', 'a'): (f'<= {share + TARGET_C_SLACK:.2f} (params {share:.2f} of the bytes)',
                   lambda w: w <= share + TARGET_C_SLACK),
      ('d', 'b'): ('(naive vs orbax_tunix)', None),
      ('e', 'a'): ('(convert: reads and writes)', None),
  }
  rrows = []
  for (num, den), (target, met) in targets.items():
    if not {num, den} <= have:
      continue
    for calls in ('first', 'warm'):
      w, pw = ratio(num, den, calls)
      if w is None:
        continue
      cp, _ = ratio(num, den, calls, 'cpu_s')
      rrows.append([f'{num}/{den}', calls, f'{w:.3f}',
                    f'{med(pw):.3f} [{min(pw):.2f}-{max(pw):.2f}]' if pw else '-',
                    f'{cp:.3f}', target, verdict(met(w)) if met else ''])
  lines.append(table(
      ['ratio', 'calls', 'wall, of medians', 'wall, paired per round: median [min-max]',
       'cpu, of medians', 'target', ''],
      rrows,
  ))
  lines.append('')
  prow = []
  for c in [c for c in 'abcd' if c in have]:
    rs = harness.ok(results[c])
    x = _per_target(rs, 'peak_rss_bytes', 'target_bytes')
    dev = _per_target(rs, 'device_peak_bytes', 'target_held_bytes')
    target = f'<= {TARGET_PEAK}' if c == 'b' else ''
    prow.append([c, f'{rs[0]["target_bytes"] / MiB:.0f}',
                 f'{med(x):.2f}' if x else 'n/a', f'{max(x):.2f}' if x else 'n/a',
                 f'{med(dev):.2f}' if dev else 'n/a', target,
                 verdict(med(x) <= TARGET_PEAK) if c == 'b' and x else ''])
  lines.append(table(
      ['peak above baseline (first calls)', 'target MiB', 'RSS x target (median)',
       'RSS x target (max)', 'device peak x target held (median)', 'target', ''],
      prow,
  ))
  if any(r.get('warm') for c in have for r in harness.ok(results[c])):
    lines.append('\nFirst calls (fresh processes) against warm calls (the same process,'
                 ' page cache as before the first):\n')
    lines.append(harness.first_and_warm({c: results[c] for c in contenders}, CONTENDER_NAMES))
  for note in notes:
    lines.append(f'\nNote: {note}')
  return '\n'.join(lines)


# --- the planning scan ---------------------------------------------------------


def scan(args, policy: harness.CachePolicy) -> dict[str, Any]:
  out: dict[str, Any] = {'points': []}
  for n in args.scan_leaves:
    shape = synthetic.shape_for(args.scan_size_mb, n, args.param_dtype)
    # A point of the main comparison's shape reads its checkpoints (quick: no second write).
    same = shape == synthetic.shape_for(args.size_mb, args.leaves, args.param_dtype)
    workdir = args.workdir / ('main' if same else f'scan-{n}')
    platforms = 'cpu' if args.scan_backend == 'cpu' else None
    t = time.perf_counter()
    restore = n <= args.scan_restore_max
    dirs = write(workdir, shape)  # Both layouts: g reads the canonical copy at every point.
    print(f'scan {shape.disk_leaves} leaves: checkpoint ready in {time.perf_counter() - t:.0f} s',
          flush=True)
    point: dict[str, Any] = {'leaves': shape.disk_leaves, 'shape': shape.to_json(), 'runs': {}}
    plans = []
    for i in range(args.scan_reps):
      policy.prepare(list(dirs.values()))
      extra = ['--with-orbax'] if i == 0 and n <= args.orbax_metadata_max else []
      plans.append(run_child('plan', workdir, args, extra, platforms=platforms))
    point['plan'] = plans
    for c in args.scan_contenders:
      if restore or c in 'fgh':
        point['runs'][c] = []
    if point['runs']:
      for _ in range(args.scan_reps):
        for c in point['runs']:
          policy.prepare(list(dirs.values()))
          res = run_child(c, workdir, args, concurrent_gb=args.restore_concurrent_gb,
                          platforms=platforms)
          point['runs'][c].append(res)
          print(f'scan {shape.disk_leaves} {c}: {res.get("wall_s", float("nan")):.2f} s,'
                f' planning {res.get("plan_s", float("nan")):.3f} s'
                + (f' FAILED {res["error"]}' if 'error' in res else ''), flush=True)
    out['points'].append(point)
  out['report'] = report_scan(out['points'])
  return out


def report_scan(points) -> str:
  rows = []
  steps = ('open_step', 'open_items', 'plan', 'flatten', 'to_disk', 'validate',
           'restore_args', 'skeleton')
  srows = []
  for p in points:
    plans = harness.ok(p['plan'])
    direct = med([x['steps_s']['total'] for x in plans]) if plans else float('nan')
    b = harness.ok(p['runs'].get('b', []))
    a = harness.ok(p['runs'].get('a', []))
    f = harness.ok(p['runs'].get('f', []))
    g = harness.ok(p['runs'].get('g', []))
    h = harness.ok(p['runs'].get('h', []))
    fg = med([r['wall_s'] for r in f]) / med([r['wall_s'] for r in g]) if f and g else None
    fh = med([r['wall_s'] for r in f]) / med([r['wall_s'] for r in h]) if f and h else None
    plan_b = med([r['plan_s'] for r in b]) if b else float('nan')
    wall_b = med([r['wall_s'] for r in b]) if b else float('nan')
    share = plan_b / wall_b if b else float('nan')
    rows.append([
        p['leaves'],
        f'{direct:.3f}', f'{direct / p["leaves"] * 1e6:.0f}',
        f'{plan_b:.3f}' if b else '-',
        f'{med([r["pre_read_s"] for r in b]):.3f}' if b else '-',
        f'{med([r["pre_read_s"] for r in a]):.3f}' if a else '-',
        f'{wall_b:.2f}' if b else '-',
        f'{med([r["wall_s"] for r in a]):.2f}' if a else '-',
        f'{share:.2%}' if b else '-',
        (f'{verdict(share <= TARGET_PLAN_SHARE)} (<= {TARGET_PLAN_SHARE:.0%})'
         if b and 9000 <= p['leaves'] <= 11000 else
         f'{verdict(direct <= TARGET_PLAN_50K_S)} (<= {TARGET_PLAN_50K_S:.0f} s)'
         if p['leaves'] >= 45000 else ''),
        f'{med([r["wall_s"] for r in f]):.3f}' if f else '-',
        f'{med([r["wall_s"] for r in g]):.3f}' if g else '-',
        f'{fg:.2f} {verdict(fg <= TARGET_F_OVER_G)} (<= {TARGET_F_OVER_G})' if fg else '-',
        f'{med([r["wall_s"] for r in h]):.3f}' if h else '-',
        f'{fh:.2f}' if fh else '-',
    ])
    orbax = [x['steps_s']['orbax_metadata'] for x in plans if 'orbax_metadata' in x['steps_s']]
    if plans:
      srows.append([p['leaves'], f'{med(orbax):.3f}' if orbax else 'not run'] + [
          f'{med([x["steps_s"].get(s, 0.0) for x in plans]):.3f}' for s in steps
      ])
  lines = [table(
      ['leaves on disk', 'planning s (steps timed directly)', 'us / leaf',
       'planning s (in b)', 'b: before 1st read s', 'a: before 1st read s',
       'b restore s', 'a restore s', 'planning / b restore', 'target',
       'f: one weight, ours s', 'g: one weight, plain Orbax s', 'f/g',
       'h: one weight, plain Orbax from the Tunix step s', 'f/h'],
      rows,
  ), '', table(['leaves', "Orbax's own parse of the same _METADATA s"]
               + [f'{s} s' for s in steps], srows)]
  for first, last in zip(points, points[1:], strict=False):
    def total(p, skip=()):
      return med([sum(v for k, v in x['steps_s'].items()
                      if k not in ('total', 'orbax_metadata') + skip)
                  for x in harness.ok(p['plan'])])
    lines.append(
        f'\nGrowth {first["leaves"]} -> {last["leaves"]} leaves'
        f' ({last["leaves"] / first["leaves"]:.1f}x): planning {total(last) / total(first):.1f}x;'
        f' the check of paths and shapes alone {total(last) - total(last, ("validate",)):.3f} /'
        f' {total(first) - total(first, ("validate",)):.3f} s.'
    )
  return '\n'.join(lines)


# --- entry point -----------------------------------------------------------------


# Defaults of the full run and of `--quick`, for the flags they differ on.
# The quick run is a smoke run (every contender and every table once, within 2 minutes):
# each child is a fresh process, which on a TPU host also opens the chip (seconds).
# On a TPU host every child opening the chip costs about 10 s (measured on a v5e), so the
# quick run keeps its children few: one scan point, on the main comparison's checkpoints, its
# children on the host's CPU (the scan measures planning, which is host work).
FULL = {'size_mb': 1024, 'leaves': 1000, 'reps': 5, 'scan_leaves': '1000,10000,50000',
        'scan_size_mb': 256, 'scan_restore_max': 10000, 'scan_reps': 2, 'scan_backend': 'same',
        'memory_check_gb': 0.1, 'memory_reps': 3}
QUICK = {'size_mb': 64, 'leaves': 300, 'reps': 1, 'scan_leaves': '300', 'scan_size_mb': 64,
         'scan_restore_max': 600, 'scan_reps': 1, 'scan_backend': 'cpu', 'memory_check_gb': 0.0,
         'memory_reps': 1}


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
  p = argparse.ArgumentParser(
      description=__doc__.split('\n\n')[0],
      formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  p.add_argument('--size-mb', type=float, help='state size, params + mu + nu (1024; quick 64)')
  p.add_argument('--leaves', type=int, help='leaves on disk, sets the layers (1000; quick 300)')
  p.add_argument('--param-dtype', default='bfloat16', help='weights dtype (mu, nu: float32)')
  p.add_argument('--reps', type=int, help='rounds of all contenders (5; quick 1)')
  p.add_argument('--contenders', default='abcde', help='subset of abcde')
  p.add_argument('--workdir', type=pathlib.Path, default=pathlib.Path('/tmp/orbax_tunix_bench'),
                 help='checkpoints are written here once and reused')
  p.add_argument('--cache', choices=('cold', 'warm'), default='cold',
                 help='page cache state before each call, first or warm')
  p.add_argument('--drop-caches', action='store_true',
                 help='cold via /proc/sys/vm/drop_caches (root) instead of fadvise')
  p.add_argument('--no-verify', dest='verify', action='store_false',
                 help='skip checking b, c, d against a')
  p.add_argument('--scan-leaves',
                 help='leaf counts of the planning scan, "" for none (1000,10000,50000; quick 300)')
  p.add_argument('--scan-size-mb', type=float, help='state size in the scan (256; quick 64)')
  p.add_argument('--scan-backend', choices=('same', 'cpu'),
                 help="the scan's children: on the backend of the comparison, or on the host's"
                 ' CPU (same; quick cpu)')
  p.add_argument('--scan-reps', type=int, help='rounds of the scan (2; quick 1)')
  p.add_argument('--scan-restore-max', type=int,
                 help='restore (not only plan) up to this many leaves (10000; quick 600)')
  p.add_argument('--scan-contenders', default='abfgh',
                 help='restored in the scan: a, b up to --scan-restore-max; f, g at every point')
  p.add_argument('--orbax-metadata-max', type=int, default=50000,
                 help="scan: also time Orbax's own parse of _METADATA up to this many leaves")
  p.add_argument('--restore-concurrent-gb', type=float, default=None,
                 help="Orbax's in-flight read budget for every contender (default: Orbax's)")
  p.add_argument('--memory-check-gb', type=float,
                 help='after the rounds, a and b again with this in-flight budget (0: skip;'
                 ' 0.1; quick 0)')
  p.add_argument('--memory-reps', type=int, help='repetitions of the memory check (3; quick 1)')
  p.add_argument('--timeout', type=float, default=1800, help='per child, seconds')
  p.add_argument('--json', type=pathlib.Path, help='also write every figure here')
  p.add_argument('--quick', action='store_true',
                 help='smoke run: 64 MB in 300 leaves, 1 round, one scan point on those'
                 ' checkpoints, on the CPU, no memory check')
  harness.add_flags(p, cpu_default=8, warm=True)
  args = p.parse_args(argv)
  for key, value in (QUICK if args.quick else FULL).items():
    if getattr(args, key) is None:  # flags given explicitly win over the preset
      setattr(args, key, value)
  args.scan_leaves = [int(x) for x in args.scan_leaves.split(',') if x.strip()]
  args.contenders = [c for c in 'abcde' if c in args.contenders]
  args.scan_contenders = [c for c in 'abfgh' if c in args.scan_contenders]
  return args


def main(argv: Sequence[str]) -> None:
  args = parse_args(argv)
  drop_ok = harness.drop_all_caches() if args.drop_caches else False
  policy = harness.CachePolicy(args.cache, drop_ok)
  info = harness.host()
  command = 'python ' + ' '.join(shlex.quote(a) for a in [
      os.path.relpath(__file__, HERE.parent)] + list(argv))
  print(f'command: {command}\nmachine: {json.dumps(info)}\ncache: {policy.describe()}', flush=True)
  if args.drop_caches and not drop_ok:
    print('note: /proc/sys/vm/drop_caches is not writable here; evicting with fadvise.')
  t0 = time.perf_counter()
  out = {'command': command, 'machine': info, 'cache': policy.describe()}
  if args.reps > 0:
    out['compare'] = compare(args, policy)
  if args.scan_leaves:
    out['scan'] = scan(args, policy)
  info['loadavg_end'] = os.getloadavg()
  out['elapsed_s'] = time.perf_counter() - t0
  print('\n## Results\n')
  print(f'Command: `{command}`  ')
  print(f'Machine: {info["nproc"]} CPUs ({info["cpu"]}), {info["memory_gib"]} GiB,'
        f' Linux {info["kernel"]}, Python {info["python"]}  ')
  devices = out.get('compare', {}).get('devices')
  print(f'Devices: {harness.describe_line(devices)}; JAX_PLATFORMS {info["jax_platforms"]}'
        + (f'; counters switched off: {info["counters_off"]}' if info['counters_off'] else '')
        + '  ')
  print('Versions: ' + ', '.join(f'{k} {v}' for k, v in info['versions'].items())
        + f' (orbax-tunix at {info["commit"]})  ')
  print(f'Load average at start / end: {info["loadavg_start"][0]:.1f} /'
        f' {info["loadavg_end"][0]:.1f}; page cache: {policy.describe()}  ')
  print(f'Elapsed: {out["elapsed_s"] / 60:.1f} min\n')
  if 'compare' in out:
    c = out['compare']
    s = c['shape']
    print(f'### Restore: {c["disk_leaves"]} leaves on disk, {c["logical_bytes"] / MiB:.0f} MiB'
          f' of state ({s["layers"]} layers, d_model {s["d_model"]}, params {s["param_dtype"]},'
          f' mu/nu float32; on disk: Tunix {c["disk_bytes"]["tunix"] / MiB:.0f} MiB,'
          f' canonical {c["disk_bytes"]["canonical"] / MiB:.0f} MiB), {args.reps} rounds,'
          f' {args.warm} warm call(s) after each first\n')
    if 'verify' in c:
      v = c['verify']
      print(f'Correctness (b, c, d against a, every leaf, values and shardings):'
            f' b {v.get("b")}, c {v.get("c")}, d {v.get("d")}\n')
    print(c['report'])
    if 'memory' in c:
      print(f'\nPeak memory with Orbax\'s in-flight read budget set'
            f' (`restore_concurrent_gb={c["memory"]["budget_gb"]}`, a and b alike):\n')
      print(c['memory']['report'])
  if 'scan' in out:
    where = "; its children on the host's CPU" if args.scan_backend == 'cpu' else ''
    print(f'\n### Planning scan ({args.scan_size_mb:.0f} MiB of state at each leaf count{where})\n')
    print(out['scan']['report'])
  if args.json:
    args.json.write_text(json.dumps(out, indent=1, default=str))


if __name__ == '__main__':
  main(sys.argv[1:])

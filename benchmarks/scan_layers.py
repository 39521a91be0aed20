"""Scanned <-> unscanned MaxText layers at read time, against the plain restore of the same bytes.

Writes a MaxText-shaped model's weights twice in Tunix's layout (nnx `value`
and adapter `base` levels), with Orbax directly: scanned (`decoder/layers/w<k>`,
(D, L, F) stacked on axis 1, MaxText's `param_scan_axis`) and unscanned
(`decoder/layers_<i>/w<k>`, (D, F)), incompressible float32. Then, each in a
fresh process, restores the weights (`maxtext.restore_train_state(...,
params_only=True)`) into a target sharded over a (data, model) mesh of the first
`--devices N` of JAX's devices (8 simulated CPU devices by default; `harness.py`),
once (the first call) and `--warm K` more times in the same process:

  plain     scanned on disk, scanned target: the same bytes, no re-layout (the floor)
  unscan    scanned on disk, unscanned target: each layer a slice of its stacked weight
  stack     unscanned on disk, scanned target: the layers stacked

Repetitions rotate the order (page cache warm: all read the same bytes).
Reported, first and warm calls apart: wall time (median) and peak RSS above the
process's RSS before the call (VmHWM after resetting it), against the bound the
re-layout must keep: the plain restore's peak plus one stacked weight; the
devices' peak memory where the backend reports it.

  python benchmarks/scan_layers.py [--layers 16 --dim 1024 --ffn 2048 --weights 4 --reps 5]
      [--devices N] [--warm K]
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import tempfile

import harness  # sibling module; the script's directory is on sys.path

MIB = 2**20
CONTENDERS = ('plain', 'unscan', 'stack')


def write(root: pathlib.Path, layers: int, dim: int, ffn: int, weights: int) -> None:
  import numpy as np  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

  rng = np.random.default_rng(0)
  stacked = {f'w{k}': rng.standard_normal((dim, layers, ffn), dtype=np.float32)
             for k in range(weights)}
  scanned = {'layers': {name: {'value': w} for name, w in stacked.items()}}
  unscanned = {f'layers_{i}': {name: {'value': np.ascontiguousarray(w[:, i])}
                               for name, w in stacked.items()} for i in range(layers)}
  for name, decoder in (('scanned', scanned), ('unscanned', unscanned)):
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckptr:
      ckptr.save(root / name / '1', args=ocp.args.Composite(
          model_params=ocp.args.PyTreeSave({'base': {'decoder': decoder}})))


def child(args) -> None:
  """The measured restores, in this fresh process; prints a JSON line."""
  devices = harness.use_devices(args.devices, cpu_default=8)
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  from orbax_tunix import maxtext

  mesh = harness.make_mesh(devices)
  names = [f'w{k}' for k in range(args.weights)]
  if args.child == 'unscan':
    shape = (args.dim, args.ffn)
    leaf = jax.ShapeDtypeStruct(shape, jnp.float32,
                                sharding=harness.sharding(mesh, shape, ('data', 'model')))
    decoder = {f'layers_{i}': {n: leaf for n in names} for i in range(args.layers)}
  else:
    shape = (args.dim, args.layers, args.ffn)
    leaf = jax.ShapeDtypeStruct(shape, jnp.float32,
                                sharding=harness.sharding(mesh, shape, ('data', None, 'model')))
    decoder = {'layers': {n: leaf for n in names}}
  target = {'params': {'params': {'decoder': decoder}}}
  source = pathlib.Path(args.workdir) / ('unscanned' if args.child == 'stack' else 'scanned')

  measured = harness.calls(
      lambda: jax.block_until_ready(maxtext.restore_train_state(source, target, params_only=True)),
      args.warm, devices, describe_out=lambda out: {'leaves': len(jax.tree.leaves(out))})
  harness.emit(harness.child_result(args.child, measured, devices, mesh))


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--layers', type=int, default=16)
  parser.add_argument('--dim', type=int, default=1024)
  parser.add_argument('--ffn', type=int, default=2048)
  parser.add_argument('--weights', type=int, default=4)
  parser.add_argument('--reps', type=int, default=5)
  parser.add_argument('--workdir')
  parser.add_argument('--child', choices=CONTENDERS, help=argparse.SUPPRESS)
  harness.add_flags(parser, cpu_default=8, warm=True)
  args = parser.parse_args(argv)
  if args.child:
    return child(args)
  harness.keep_off_devices()  # The writer's JAX: the accelerator stays free for the children.
  workdir = pathlib.Path(args.workdir or tempfile.mkdtemp(prefix='scan-bench-'))
  if not (workdir / 'scanned').exists():
    write(workdir, args.layers, args.dim, args.ffn, args.weights)
  flags = ['--workdir', str(workdir), '--layers', str(args.layers), '--dim', str(args.dim),
           '--ffn', str(args.ffn), '--weights', str(args.weights), '--warm', str(args.warm)]
  if args.devices:
    flags += ['--devices', str(args.devices)]
  results = harness.rounds(CONTENDERS, args.reps,
                           lambda name, _: harness.run_child([__file__, '--child', name, *flags]))
  harness.exit_if_failed(results)
  stacked_mib = args.dim * args.layers * args.ffn * 4 / MIB
  shown = ' '.join(f'--{k} {getattr(args, k)}' for k in ('layers', 'dim', 'ffn', 'weights', 'reps',
                                                          'warm'))
  print(f'\nCommand: `python benchmarks/scan_layers.py {shown}'
        + (f' --devices {args.devices}`' if args.devices else '`'))
  print(f'{args.weights} stacked weights of ({args.dim}, {args.layers}, {args.ffn}) float32,'
        f' {stacked_mib:.0f} MiB each, {args.weights * stacked_mib:.0f} MiB in all, over'
        f' {harness.describe_line(harness.first_device_info(results))}')
  for kind in ('first', 'warm'):
    runs = {k: [x for r in harness.ok(v) for x in ([r] if kind == 'first' else r['warm'])]
            for k, v in results.items()}
    if not all(runs.values()):
      continue
    print('\n' + (f'First calls (fresh processes), median of {args.reps}' if kind == 'first' else
                  f'Warm calls ({args.warm} after each first), median of {len(runs["plain"])}')
          + ':\n')
    wall = {k: statistics.median(r['wall_s'] for r in v) for k, v in runs.items()}
    print('| | plain: scanned -> scanned | unscan: scanned -> unscanned |'
          ' stack: unscanned -> scanned | unscan / plain | stack / plain | bound |')
    print('|---|---|---|---|---|---|---|')
    print(f'| wall | {wall["plain"]:.2f} s | {wall["unscan"]:.2f} s |'
          f' {wall["stack"]:.2f} s | {wall["unscan"] / wall["plain"]:.2f} |'
          f' {wall["stack"] / wall["plain"]:.2f} | |')
    for key, label in (('peak_rss_bytes', 'peak RSS above start'),
                       ('device_peak_bytes', 'device peak (all devices)')):
      mid = {k: harness.med_of(v, key) for k, v in runs.items()}
      if any(x is None for x in mid.values()) or (key == 'device_peak_bytes' and kind == 'warm'):
        continue
      mid = {k: x / MIB for k, x in mid.items()}
      bound = (f'plain + one stacked weight = {mid["plain"] + stacked_mib:.0f} MiB'
               if key == 'peak_rss_bytes' else '')
      print(f'| {label}, median | {mid["plain"]:.0f} MiB | {mid["unscan"]:.0f} MiB |'
            f' {mid["stack"]:.0f} MiB | {mid["unscan"] / mid["plain"]:.2f} |'
            f' {mid["stack"] / mid["plain"]:.2f} | {bound} |')


if __name__ == '__main__':
  main()

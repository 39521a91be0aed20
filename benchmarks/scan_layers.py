"""Scanned <-> unscanned MaxText layers at read time, against the plain restore of the same bytes.

Writes a MaxText-shaped model's weights twice in Tunix's layout (nnx `value`
and adapter `base` levels), with Orbax directly: scanned (`decoder/layers/w<k>`,
(D, L, F) stacked on axis 1, MaxText's `param_scan_axis`) and unscanned
(`decoder/layers_<i>/w<k>`, (D, F)), incompressible float32. Then, each in a
fresh process on 8 simulated CPU devices, restores the weights
(`maxtext.restore_train_state(..., params_only=True)`) into a sharded target:

  plain     scanned on disk, scanned target: the same bytes, no re-layout (the floor)
  unscan    scanned on disk, unscanned target: each layer a slice of its stacked weight
  stack     unscanned on disk, scanned target: the layers stacked

Repetitions rotate the order (page cache warm: all read the same bytes).
Reported: wall time (median) and peak RSS above the process's RSS before the
call (VmHWM after resetting it), against the bound the re-layout must keep:
the plain restore's peak plus one stacked weight.

  python benchmarks/scan_layers.py [--layers 16 --dim 1024 --ffn 2048 --weights 4 --reps 5]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import tempfile

import peak  # sibling module; the script's directory is on sys.path

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
  """One measured restore, in this fresh process; prints a JSON line."""
  os.environ['XLA_FLAGS'] = '--xla_force_host_platform_device_count=8'
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from jax.sharding import NamedSharding  # pylint: disable=g-import-not-at-top
  from jax.sharding import PartitionSpec as P  # pylint: disable=g-import-not-at-top

  from orbax_tunix import maxtext

  mesh = jax.make_mesh((4, 2), ('data', 'model'))
  names = [f'w{k}' for k in range(args.weights)]
  if args.child == 'unscan':
    leaf = jax.ShapeDtypeStruct((args.dim, args.ffn), jnp.float32,
                                sharding=NamedSharding(mesh, P('data', 'model')))
    decoder = {f'layers_{i}': {n: leaf for n in names} for i in range(args.layers)}
  else:
    leaf = jax.ShapeDtypeStruct((args.dim, args.layers, args.ffn), jnp.float32,
                                sharding=NamedSharding(mesh, P('data', None, 'model')))
    decoder = {'layers': {n: leaf for n in names}}
  target = {'params': {'params': {'decoder': decoder}}}
  source = pathlib.Path(args.workdir) / ('unscanned' if args.child == 'stack' else 'scanned')

  out, result = peak.measure(
      lambda: jax.block_until_ready(maxtext.restore_train_state(source, target, params_only=True)))
  print(json.dumps({'contender': args.child, **result, 'leaves': len(jax.tree.leaves(out))}),
        flush=True)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--layers', type=int, default=16)
  parser.add_argument('--dim', type=int, default=1024)
  parser.add_argument('--ffn', type=int, default=2048)
  parser.add_argument('--weights', type=int, default=4)
  parser.add_argument('--reps', type=int, default=5)
  parser.add_argument('--workdir')
  parser.add_argument('--child', choices=CONTENDERS, help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.child:
    return child(args)
  workdir = pathlib.Path(args.workdir or tempfile.mkdtemp(prefix='scan-bench-'))
  if not (workdir / 'scanned').exists():
    write(workdir, args.layers, args.dim, args.ffn, args.weights)
  results = peak.rounds(__file__, CONTENDERS, args.reps, [
      '--workdir', str(workdir), '--layers', str(args.layers), '--dim', str(args.dim),
      '--ffn', str(args.ffn), '--weights', str(args.weights)])
  stacked_mib = args.dim * args.layers * args.ffn * 4 / MIB
  wall = {k: statistics.median(r['wall_s'] for r in v) for k, v in results.items()}
  mid = {k: statistics.median(r['peak_above_kb'] for r in v) / 1024 for k, v in results.items()}
  print(f'\nCommand: `python benchmarks/scan_layers.py --layers {args.layers} --dim {args.dim}'
        f' --ffn {args.ffn} --weights {args.weights} --reps {args.reps}`')
  print(f'{args.weights} stacked weights of ({args.dim}, {args.layers}, {args.ffn}) float32,'
        f' {stacked_mib:.0f} MiB each, {args.weights * stacked_mib:.0f} MiB in all, over 8'
        ' devices\n')
  print('| | plain: scanned -> scanned | unscan: scanned -> unscanned |'
        ' stack: unscanned -> scanned | unscan / plain | stack / plain | bound |')
  print('|---|---|---|---|---|---|---|')
  print(f'| wall, median of {args.reps} | {wall["plain"]:.2f} s | {wall["unscan"]:.2f} s |'
        f' {wall["stack"]:.2f} s | {wall["unscan"] / wall["plain"]:.2f} |'
        f' {wall["stack"] / wall["plain"]:.2f} | |')
  print(f'| peak RSS above start, median of {args.reps} | {mid["plain"]:.0f} MiB |'
        f' {mid["unscan"]:.0f} MiB | {mid["stack"]:.0f} MiB | {mid["unscan"] / mid["plain"]:.2f} |'
        f' {mid["stack"] / mid["plain"]:.2f} | plain + one stacked weight ='
        f' {mid["plain"] + stacked_mib:.0f} MiB |')


if __name__ == '__main__':
  main()

"""A LoRA merge during the restore against the plain restore of the same base.

Writes a Tunix-layout full save of a qwix-style LoRA model (incompressible
float32 weights under nnx's `value` level, `<w>_lora_a`/`<w>_lora_b` beside
each adapted one) and a canonical copy of its base weights; then, each in a
fresh process, restores the same target, sharded over a (data, model) mesh of
the first `--devices N` of JAX's devices (8 simulated CPU devices by default;
`harness.py`), once (the first call, what a fresh process pays) and `--warm K`
more times in the same process:

  plain     plain Orbax `PyTreeCheckpointHandler` restore of the canonical base
  unmerged  plain Orbax restore of what the merge reads from the LoRA save: the
            weights into the target, the adapters to the host (no merge)
  merge     `orbax_tunix.restore_merged_lora` from the LoRA save

Repetitions rotate the order; the page cache is left warm (both read the
same bytes of weights; the merge also reads the adapters). Reported, for first
and warm calls apart: wall time (median), peak RSS above the process's RSS just
before the call (VmHWM after resetting it), against the bound the merge must
keep: what the plain restore of the merged target peaks at (the target and
Orbax's in-flight reads), plus the largest single weight and its adapters in
float32; and the devices' peak memory where the backend reports it.

  python benchmarks/lora_merge.py [--layers 12 --dim 1024 --rank 16 --reps 5 --dtype float32]
      [--devices N] [--warm K] [--compile-cache off|cold|warm]

`--compile-cache` runs every child (each contender alike) without JAX's persistent compilation
cache, with a fresh empty one each (cold: it compiles and writes), or with one that earlier
children filled (warm: it loads every program), as `harness.CompileCache` says.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import tempfile

import harness  # sibling module; the script's directory is on sys.path

MIB = 2**20
ADAPTED = ('q', 'k', 'v', 'o')  # adapted per layer; 'up' and 'down' are not
PROJECTIONS = ADAPTED + ('up', 'down')
CONTENDERS = ('plain', 'unmerged', 'merge')


def write(root: pathlib.Path, layers: int, dim: int, rank: int) -> None:
  import numpy as np  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

  rng = np.random.default_rng(0)

  def noise(*shape):
    return rng.standard_normal(shape, dtype=np.float32)

  lora, base = {}, {}
  for i in range(layers):
    for p in PROJECTIONS:
      w = noise(dim, dim)
      base.setdefault(str(i), {})[p] = {'kernel': w}
      entry = {'kernel': {'value': w}}
      if p in ADAPTED:
        entry['kernel_lora_a'] = {'value': noise(dim, rank) * 0.01}
        entry['kernel_lora_b'] = {'value': noise(rank, dim) * 0.01}
      lora.setdefault(str(i), {})[p] = entry
  for name, tree in (('lora', {'layers': lora}), ('base', {'layers': base})):
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckptr:
      ckptr.save(root / name / '1', args=ocp.args.Composite(
          model_params=ocp.args.PyTreeSave(tree)))


def child(args) -> None:
  """The measured restores, in this fresh process; prints a JSON line."""
  devices = harness.use_devices(args.devices, cpu_default=8)
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

  import orbax_tunix  # pylint: disable=g-import-not-at-top

  mesh = harness.make_mesh(devices)
  dtype = jnp.dtype(args.dtype)
  sharding = harness.sharding(mesh, (args.dim, args.dim), ('data', 'model'))
  leaf = jax.ShapeDtypeStruct((args.dim, args.dim), dtype, sharding=sharding)
  target = {'layers': {str(i): {p: {'kernel': leaf} for p in PROJECTIONS}
                       for i in range(args.layers)}}
  root = pathlib.Path(args.workdir)

  if args.child == 'plain':
    handler = ocp.PyTreeCheckpointHandler()
    restore_args = jax.tree.map(
        lambda s: ocp.ArrayRestoreArgs(sharding=s.sharding, global_shape=s.shape, dtype=s.dtype),
        target)

    def call():
      return handler.restore(root / 'base' / '1' / 'model_params',
                             args=ocp.args.PyTreeRestore(target, restore_args))
  elif args.child == 'unmerged':
    # What the merge must read, by plain Orbax: the LoRA save's weights into
    # the target, its adapters to the host in float32 (paths written out by
    # hand from `write`).
    import numpy as np  # pylint: disable=g-import-not-at-top

    handler = ocp.PyTreeCheckpointHandler()
    tree, args_tree = {}, {}
    for i in range(args.layers):
      for p in PROJECTIONS:
        node, node_args = {'kernel': {'value': leaf}}, {'kernel': {'value': ocp.ArrayRestoreArgs(
            sharding=sharding, global_shape=leaf.shape, dtype=dtype)}}
        if p in ADAPTED:
          for name in ('kernel_lora_a', 'kernel_lora_b'):
            node[name] = {'value': 0}
            node_args[name] = {'value': ocp.RestoreArgs(restore_type=np.ndarray, dtype=np.float32)}
        tree.setdefault(str(i), {})[p] = node
        args_tree.setdefault(str(i), {})[p] = node_args

    def call():
      return handler.restore(root / 'lora' / '1' / 'model_params', args=ocp.args.PyTreeRestore(
          {'layers': tree}, {'layers': args_tree}))
  else:
    def call():
      return orbax_tunix.restore_merged_lora(root / 'lora', target, lora_scale=0.5)

  measured = harness.calls(lambda: jax.block_until_ready(call()), args.warm, devices,
                           describe_out=lambda out: {'leaves': len(jax.tree.leaves(out))})
  harness.emit(harness.child_result(args.child, measured, devices, mesh))


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--layers', type=int, default=12)
  parser.add_argument('--dim', type=int, default=1024)
  parser.add_argument('--rank', type=int, default=16)
  parser.add_argument('--reps', type=int, default=5)
  parser.add_argument('--dtype', default='float32')
  parser.add_argument('--workdir')
  parser.add_argument('--child', choices=CONTENDERS, help=argparse.SUPPRESS)
  harness.add_flags(parser, cpu_default=8, warm=True, compile_cache=True)
  args = parser.parse_args(argv)
  if args.child:
    return child(args)
  harness.keep_off_devices()  # The writer's JAX: the accelerator stays free for the children.
  workdir = pathlib.Path(args.workdir or tempfile.mkdtemp(prefix='lora-bench-'))
  if not (workdir / 'lora').exists():
    write(workdir, args.layers, args.dim, args.rank)
  flags = ['--workdir', str(workdir), '--layers', str(args.layers), '--dim', str(args.dim),
           '--dtype', args.dtype, '--warm', str(args.warm)]
  if args.devices:
    flags += ['--devices', str(args.devices)]
  cache = harness.CompileCache(args.compile_cache, workdir / 'jax-cache')
  cache.prime([__file__, '--child', name, *flags] for name in CONTENDERS)
  results = harness.rounds(CONTENDERS, args.reps,
                           lambda name, _: cache.run([__file__, '--child', name, *flags]))
  harness.exit_if_failed(results)
  itemsize = {'float32': 4, 'bfloat16': 2}[args.dtype]
  weight = args.dim * args.dim
  target_mib = args.layers * len(PROJECTIONS) * weight * itemsize / MIB
  extra_mib = (weight * 4 + 2 * args.dim * args.rank * 4) / MIB
  shown = ' '.join(f'--{k.replace("_", "-")} {getattr(args, k)}' for k in (
      'layers', 'dim', 'rank', 'reps', 'dtype', 'warm', 'compile_cache'))
  print(f'\nCommand: `python benchmarks/lora_merge.py {shown}'
        + (f' --devices {args.devices}`' if args.devices else '`'))
  print(f'Children: {cache.describe()}.')
  print(f'{args.layers * len(PROJECTIONS)} weights of {args.dim}x{args.dim},'
        f' {args.layers * len(ADAPTED)} adapted (rank {args.rank}); target {args.dtype},'
        f' {target_mib:.0f} MiB over {harness.describe_line(harness.first_device_info(results))}')
  calls = {'first': lambda r: [r], 'warm': lambda r: r['warm']}
  for kind, pick in calls.items():
    runs = {k: [x for r in harness.ok(v) for x in pick(r)] for k, v in results.items()}
    if not all(runs.values()):
      continue
    wall = {k: statistics.median(r['wall_s'] for r in v) for k, v in runs.items()}
    label = (f'First calls (fresh processes), median of {args.reps}' if kind == 'first' else
             f'Warm calls ({args.warm} after each first), median of {len(runs["plain"])}')
    print(f'\n{label}:\n')
    print('| | plain: the base | unmerged: the same arrays the merge reads | merge |'
          ' merge / plain | merge / unmerged | target |')
    print('|---|---|---|---|---|---|---|')
    print(f'| wall | {wall["plain"]:.2f} s | {wall["unmerged"]:.2f} s |'
          f' {wall["merge"]:.2f} s | {wall["merge"] / wall["plain"]:.2f} |'
          f' {wall["merge"] / wall["unmerged"]:.2f} | merge / plain <= 1.2 |')
    mid = {k: harness.med_of(v, 'peak_rss_bytes') for k, v in runs.items()}
    if all(x is not None for x in mid.values()):
      # Orbax's in-flight reads move the peak by up to ~100 MiB from run to run:
      # the medians are the comparison, the maxima are shown beside them.
      mid = {k: x / MIB for k, x in mid.items()}
      most = {k: max(r['peak_rss_bytes'] for r in v) / MIB for k, v in runs.items()}
      print(f'| peak RSS above start, median | {mid["plain"]:.0f} MiB |'
            f' {mid["unmerged"]:.0f} MiB | {mid["merge"]:.0f} MiB |'
            f' {mid["merge"] / mid["plain"]:.2f} | {mid["merge"] / mid["unmerged"]:.2f} |'
            f' merge <= plain + {extra_mib:.0f} MiB (the largest weight and its adapters in'
            f' float32) = {mid["plain"] + extra_mib:.0f} MiB |')
      print(f'| peak RSS above start, max | {most["plain"]:.0f} MiB | {most["unmerged"]:.0f} MiB |'
            f' {most["merge"]:.0f} MiB | {most["merge"] / most["plain"]:.2f} |'
            f' {most["merge"] / most["unmerged"]:.2f} | |')
    dev = {k: harness.med_of(v, 'device_peak_bytes') for k, v in runs.items()}
    if kind == 'first' and all(x is not None for x in dev.values()):
      print(f'| device peak (all devices), median | {dev["plain"] / MIB:.0f} MiB |'
            f' {dev["unmerged"] / MIB:.0f} MiB | {dev["merge"] / MIB:.0f} MiB |'
            f' {dev["merge"] / dev["plain"]:.2f} | {dev["merge"] / dev["unmerged"]:.2f} |'
            f' target {target_mib:.0f} MiB |')


if __name__ == '__main__':
  main()

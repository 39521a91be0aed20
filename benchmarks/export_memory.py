"""Peak host memory of `orbax-tunix export` against the model's size and the budget.

Writes a Qwen3-shaped Tunix checkpoint (nnx `value` level; incompressible
float32 weights, `--layers` layers of width `--dim`, MLP `4 * dim`, by default
~1.1 GiB), then runs `orbax-tunix export --model qwen3` in a fresh process per
memory budget (sampling its resident memory every few ms, as
`convert_memory.py` does) with shards of `--max-shard-size`. The baseline is
the peak RSS of `orbax-tunix inspect --json` on the same checkpoint (the
interpreter, JAX, Orbax, TensorStore, the metadata read; no array). The bound
the export must keep: baseline + budget + the largest tensor. The commands work on
the host: `--devices N` sets how many CPU devices their JAX simulates; JAX_PLATFORMS
passes through to them (`harness.py`).

  python benchmarks/export_memory.py [--layers 8 --dim 1024 --budgets 128M,512M --repeat 3]
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import tempfile

import harness  # sibling module; the script's directory is on sys.path

MIB = harness.MIB


def write_checkpoint(root: pathlib.Path, layers: int, dim: int) -> pathlib.Path:
  """A Qwen3-shaped Tunix step of random float32 weights (heads 8, kv heads 2)."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

  rng = np.random.default_rng(0)
  heads, kv, head_dim, ffn, vocab = 8, 2, dim // 8, 4 * dim, 8 * dim

  def noise(*shape):
    return {'value': np.frombuffer(rng.bytes(int(np.prod(shape)) * 4), np.float32).reshape(shape)}

  layer = lambda: {  # noqa: E731
      'attn': {'q_proj': {'w': noise(dim, heads, head_dim)}, 'k_proj': {'w': noise(dim, kv, head_dim)},
               'v_proj': {'w': noise(dim, kv, head_dim)}, 'o_proj': {'w': noise(heads, head_dim, dim)},
               'q_norm': {'w': noise(head_dim)}, 'k_norm': {'w': noise(head_dim)}},
      'mlp': {'gate_proj': {'kernel': noise(dim, ffn)}, 'up_proj': {'kernel': noise(dim, ffn)},
              'down_proj': {'kernel': noise(ffn, dim)}},
      'input_layernorm': {'w': noise(dim)}, 'post_attention_layernorm': {'w': noise(dim)},
  }
  weights = {'embedder': {'input_embedding': noise(vocab, dim)}, 'final_norm': {'w': noise(dim)},
             'lm_head': {'w': noise(dim, vocab)},
             'layers': {str(i): layer() for i in range(layers)}}
  with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckptr:
    ckptr.save(root / '1', args=ocp.args.Composite(model_params=ocp.args.PyTreeSave(weights)))
  return root / '1'


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--layers', type=int, default=8)
  parser.add_argument('--dim', type=int, default=1024)
  parser.add_argument('--budgets', default='128M,512M')
  parser.add_argument('--max-shard-size', default='500MB')
  parser.add_argument('--repeat', type=int, default=3)
  parser.add_argument('--workdir')
  harness.add_flags(parser, cpu_default=None)
  args = parser.parse_args(argv)
  harness.keep_off_devices()  # The writer's JAX: an accelerator stays free for the commands.
  env = harness.child_env(args.devices)

  def peak_rss(argv):
    return harness.sampled_peak_rss(argv, env)

  work = pathlib.Path(args.workdir or tempfile.mkdtemp(prefix='export-bench-'))
  step = work / 'src' / '1'
  if not step.exists():
    write_checkpoint(work / 'src', args.layers, args.dim)
  from orbax_tunix.cli.flags import parse_size  # pylint: disable=g-import-not-at-top
  from orbax_tunix.reading import reader

  leaves = reader.open_source(step, weights_only=True).items['model_params']
  model = sum(leaf.nbytes for leaf in leaves)
  largest = max(leaf.nbytes for leaf in leaves)
  cli = [sys.executable, '-m', 'orbax_tunix.cli']
  baseline, _, status = peak_rss(cli + ['inspect', str(step), '--json'])
  assert status == 0, 'inspect failed'
  print(f'\nCommand: `python benchmarks/export_memory.py --layers {args.layers} --dim {args.dim}'
        f' --budgets {args.budgets} --max-shard-size {args.max_shard_size} --repeat {args.repeat}'
        + (f' --devices {args.devices}`' if args.devices else '`'))
  print(harness.commands_line(args.devices))
  print(f'model {model / MIB:.0f} MiB float32 ({len(leaves)} tensors, the largest'
        f' {largest / MIB:.0f} MiB); baseline (inspect --json) {harness.mib(baseline)} MiB\n')
  print('| --memory-budget | peak RSS (median of runs) | above baseline | bound: budget +'
        ' largest tensor | peak / model | wall (median) |')
  print('|---|---|---|---|---|---|')
  for budget in args.budgets.split(','):
    peaks, times = [], []
    for i in range(args.repeat):
      out = work / f'out-{budget}-{i}'
      peak, seconds, status = peak_rss(cli + [
          'export', str(step), str(out), '--model', 'qwen3', '--memory-budget', budget,
          '--max-shard-size', args.max_shard_size])
      assert status == 0, 'export failed'
      peaks.append(peak)
      times.append(seconds)
      files = sorted(p.name for p in out.iterdir())
      for p in out.iterdir():
        p.unlink()
      out.rmdir()
    bound = parse_size(budget) + largest
    if baseline is None or None in peaks:  # RSS unreadable here
      print(f'| {budget} | n/a | n/a | {bound / MIB:.0f} MiB | n/a |'
            f' {statistics.median(times):.1f} s |')
      continue
    peak = statistics.median(peaks)
    verdict = 'MET' if peak - baseline <= bound else 'MISSED'
    print(f'| {budget} | {peak / MIB:.0f} MiB | {(peak - baseline) / MIB:.0f} MiB |'
          f' {bound / MIB:.0f} MiB {verdict} | {peak / model:.2f} | {statistics.median(times):.1f} s |')
  print(f'\nfiles of the last export: {files}')


if __name__ == '__main__':
  main()

"""A MaxText step to Hugging Face safetensors: `orbax-tunix export` beside MaxText 0.2.5's own.

Writes, with Orbax directly, a llama3.1-shaped MaxText params-only step (scanned: every layer
weight stacked on `param_scan_axis` 1; float32 incompressible values; `items/params/params/...`,
the layout MaxText's checkpointing writes; by default ~1.2 GiB), then, in alternating rounds,
each run a fresh process:

  ours    `orbax-tunix export ROOT OUT --model llama3 --memory-budget B` (this venv);
  theirs  MaxText 0.2.5's `checkpoint_conversion/to_huggingface.py` path on CPU, in the MaxText
          venv (scripts/maxtext_venv.sh), its own functions in `main`'s order:
          `load_orbax_checkpoint`, `HF_MODEL_CONFIGS['llama3.1-8b']` fitted with
          `_validate_or_update_architecture(override=True)`, `_get_model_mappings`,
          `detect_and_extract_checkpoint`, `validate_and_filter_param_map_keys`,
          `_transform_weights_to_full_model`, then its writer `save_model_files` (config.json
          and safetensors shards; no tokenizer: that is the one step needing the Hub).

Peak RSS is sampled every few ms (harness.sampled_peak_rss, the house way); each side's baseline
is its own no-array run: `orbax-tunix inspect --json` for ours (interpreter, JAX, Orbax, the
metadata), and for theirs the same child up to the metadata read (MaxText imported, its config
built, Orbax's metadata of the step read; no array). The bound ours must keep: baseline +
`--memory-budget` + the largest tensor. Both outputs are checked equal, tensor by tensor
(MaxText's float32 values are ours bit for bit). Both work on the host: `--devices N` sets how
many CPU devices their JAX simulates; ours honours JAX_PLATFORMS, theirs runs on the CPU (the
MaxText venv's jaxlib is the CPU one, and its conversion says `hardware=cpu`).

  python benchmarks/export_maxtext.py [--layers 16 --dim 1024 --budgets 256M --reps 2]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile

MIB = 2**20
HEADS, KV_HEADS = 8, 2
MODEL_NAME = 'llama3.1-8b'  # MaxText's llama3.1 (llama2 decoder block) and HF config entry
STEP = 0


def dims(dim: int) -> dict[str, int]:
  return {'head_dim': dim // HEADS, 'mlp': dim * 7 // 2, 'vocab': dim * 32}


def maxtext_argv(args) -> list[str]:
  """MaxText's pyconfig keys for the checkpoint's model (llama3.1-8b fitted to its dims)."""
  d = dims(args.dim)
  return [f'model_name={MODEL_NAME}', 'override_model_config=True', f'base_emb_dim={args.dim}',
          f'base_num_query_heads={HEADS}', f'base_num_kv_heads={KV_HEADS}',
          f'head_dim={d["head_dim"]}', f'base_mlp_dim={d["mlp"]}',
          f'base_num_decoder_layers={args.layers}', f'vocab_size={d["vocab"]}',
          'scan_layers=True', 'weight_dtype=float32', 'hardware=cpu',
          'skip_jax_distributed_system=True', 'attention=dot_product',
          'run_name=export_maxtext_bench', 'enable_checkpointing=False']


# --------------------------------------------------------------------------- #
# The checkpoint (this venv, plain Orbax)
# --------------------------------------------------------------------------- #
def shapes(layers: int, dim: int) -> dict[str, tuple[int, ...]]:
  """MaxText llama3.1's scanned weights ('/'-joined path -> shape), layers on axis 1."""
  d = dims(dim)
  h, f, v, L = d['head_dim'], d['mlp'], d['vocab'], layers
  return {
      'token_embedder/embedding': (v, dim),
      'decoder/decoder_norm/scale': (dim,),
      'decoder/logits_dense/kernel': (dim, v),
      'decoder/layers/self_attention/query/kernel': (dim, L, HEADS, h),
      'decoder/layers/self_attention/key/kernel': (dim, L, KV_HEADS, h),
      'decoder/layers/self_attention/value/kernel': (dim, L, KV_HEADS, h),
      'decoder/layers/self_attention/out/kernel': (HEADS, L, h, dim),
      'decoder/layers/mlp/wi_0/kernel': (dim, L, f),
      'decoder/layers/mlp/wi_1/kernel': (dim, L, f),
      'decoder/layers/mlp/wo/kernel': (f, L, dim),
      'decoder/layers/pre_self_attention_layer_norm/scale': (dim, L),
      'decoder/layers/post_self_attention_layer_norm/scale': (dim, L),
  }


def write_checkpoint(root: pathlib.Path, layers: int, dim: int, chunks: str = 'whole') -> pathlib.Path:
  """`<root>/0/items` = {'params': {'params': <shapes(), random float32>}}: each array one
  chunk (`chunks='whole'`, as one device saves it), or (`'layer'`) the stacked ones a chunk
  per layer and the 2-d ones in eighths (as a save sharded that way stores them)."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

  rng = np.random.default_rng(0)
  weights: dict = {}
  save_args: dict = {}
  for path, shape in shapes(layers, dim).items():
    *parents, leaf = path.split('/')
    node, args = weights, save_args
    for p in parents:
      node, args = node.setdefault(p, {}), args.setdefault(p, {})
    node[leaf] = rng.standard_normal(shape, np.float32)
    nbytes = node[leaf].nbytes
    if chunks == 'layer' and len(shape) >= 3:
      args[leaf] = ocp.SaveArgs(chunk_byte_size=nbytes // layers, shard_axes=(1,))
    elif chunks == 'layer' and len(shape) == 2 and path.startswith(('token_', 'decoder/logits')):
      args[leaf] = ocp.SaveArgs(chunk_byte_size=nbytes // 8)
    else:
      args[leaf] = ocp.SaveArgs()
  with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckptr:
    ckptr.save(root / str(STEP), args=ocp.args.Composite(items=ocp.args.PyTreeSave(
        {'params': {'params': weights}}, save_args={'params': {'params': save_args}})))
  return root / str(STEP)


# --------------------------------------------------------------------------- #
# Theirs (runs in the MaxText venv)
# --------------------------------------------------------------------------- #
def theirs_child(args) -> None:
  """MaxText 0.2.5's to_huggingface.main on CPU, without the Hub; `--arrays no`: the baseline."""
  os.environ.setdefault('JAX_PLATFORMS', 'cpu')
  import copy  # pylint: disable=g-import-not-at-top

  import jax  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  from maxtext.checkpoint_conversion import to_huggingface as th  # pylint: disable=g-import-not-at-top
  from maxtext.checkpoint_conversion.utils import utils as conv  # pylint: disable=g-import-not-at-top
  from maxtext.checkpoint_conversion.utils.hf_model_configs import HF_MODEL_CONFIGS  # pylint: disable=g-import-not-at-top
  from maxtext.configs import pyconfig  # pylint: disable=g-import-not-at-top

  jax.config.update('jax_default_prng_impl', 'unsafe_rbg')  # as to_huggingface's __main__
  base_yml = str(pathlib.Path(pyconfig.__file__).resolve().parent / 'base.yml')
  config = pyconfig.initialize(['to_huggingface', base_yml, *maxtext_argv(args),
                                f'load_parameters_path={args.src}',
                                f'base_output_directory={args.out}'])
  if args.arrays == 'no':
    ocp.Checkpointer(ocp.PyTreeCheckpointHandler()).metadata(args.src)
    return
  checkpoint = conv.load_orbax_checkpoint(config)
  hf_config = copy.deepcopy(HF_MODEL_CONFIGS[MODEL_NAME])
  th._validate_or_update_architecture(hf_config, config, override=True)  # pylint: disable=protected-access
  maps = th._get_model_mappings(MODEL_NAME, config.scan_layers, hf_config.to_dict(), config)  # pylint: disable=protected-access
  state = conv.detect_and_extract_checkpoint(checkpoint)
  keys = conv.validate_and_filter_param_map_keys(maps['param_mapping'], set(state))
  weights = th._transform_weights_to_full_model(  # pylint: disable=protected-access
      config, keys, state, maps['param_mapping'], maps['hook_fn_mapping'], maps['shape_mapping'])
  conv.save_model_files(weights, hf_config, None, None, args.out)


# --------------------------------------------------------------------------- #
# The driver (this venv)
# --------------------------------------------------------------------------- #
def maxtext_python() -> str:
  root = pathlib.Path(__file__).resolve().parent.parent
  out = subprocess.run(['bash', str(root / 'scripts' / 'maxtext_venv.sh')], capture_output=True,
                       text=True, check=True)
  return out.stdout.strip().splitlines()[-1]


def read_export(out: pathlib.Path):
  """{name: array} of a folder's *.safetensors (numpy reads the bytes; no torch needed)."""
  import numpy as np  # pylint: disable=g-import-not-at-top

  tensors = {}
  for f in sorted(out.glob('*.safetensors')):
    data = f.read_bytes()
    n = int.from_bytes(data[:8], 'little')
    header = json.loads(data[8:8 + n])
    header.pop('__metadata__', None)
    for name, e in header.items():
      assert e['dtype'] == 'F32', (f, name, e['dtype'])
      a, b = e['data_offsets']
      tensors[name] = np.frombuffer(data[8 + n + a:8 + n + b], np.float32).reshape(e['shape'])
  return tensors


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--layers', type=int, default=16)
  parser.add_argument('--dim', type=int, default=1024)
  parser.add_argument('--budgets', default='256M')
  parser.add_argument('--reps', type=int, default=2)
  parser.add_argument('--chunks', choices=('whole', 'layer'), default='whole',
                      help="the source's arrays one chunk each (one device's save), or a"
                      ' chunk per layer (a save sharded on the layer axis)')
  parser.add_argument('--workdir')
  parser.add_argument('--theirs-child', action='store_true', help=argparse.SUPPRESS)
  parser.add_argument('--src', help=argparse.SUPPRESS)
  parser.add_argument('--out', help=argparse.SUPPRESS)
  parser.add_argument('--arrays', default='yes', help=argparse.SUPPRESS)
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
  import harness  # pylint: disable=g-import-not-at-top  (a sibling module)

  harness.add_flags(parser, cpu_default=None)
  args = parser.parse_args(argv)
  if args.theirs_child:
    return theirs_child(args)
  harness.keep_off_devices()  # The writer's JAX: an accelerator stays free for the commands.
  env_ours = harness.child_env(args.devices)
  env_theirs = {**env_ours, 'JAX_PLATFORMS': 'cpu'}

  def peak_rss(argv):
    return harness.sampled_peak_rss(argv, env_theirs if argv[0] == py_mt else env_ours)

  def shown(n):
    return harness.mib(n)

  work = pathlib.Path(args.workdir or tempfile.mkdtemp(prefix='export-maxtext-bench-'))
  root = work / 'src'
  step = root / str(STEP)
  if not step.exists():
    write_checkpoint(root, args.layers, args.dim, args.chunks)
  items = step / 'items'
  sizes = {k: 4 * math.prod(v) for k, v in shapes(args.layers, args.dim).items()}
  model = sum(sizes.values())
  largest_name = max(sizes, key=sizes.get)
  largest = sizes[largest_name]
  d = dims(args.dim)
  D, f, v = args.dim, d['mlp'], d['vocab']
  largest_hf = 4 * max(v * D, D * f)  # the embedding or lm_head, or one layer's MLP kernel

  py_mt = maxtext_python()
  cli = [sys.executable, '-m', 'orbax_tunix.cli']
  me = str(pathlib.Path(__file__).resolve())

  def ours(out, budget):
    return cli + ['export', str(root), str(out), '--model', 'llama3', '--memory-budget', budget]

  def theirs(out, arrays='yes'):
    return [py_mt, me, '--theirs-child', '--src', str(items), '--out', str(out),
            '--arrays', arrays, '--layers', str(args.layers), '--dim', str(args.dim)]

  base_ours, _, status = peak_rss(cli + ['inspect', str(root), '--json'])
  assert status == 0, 'orbax-tunix inspect failed'
  base_theirs, _, status = peak_rss(theirs(work / 'baseline', arrays='no'))
  assert status == 0, 'the MaxText baseline child failed'

  budgets = args.budgets.split(',')
  contenders = [f'ours:{b}' for b in budgets] + ['theirs']
  runs = {c: [] for c in contenders}
  checked = False
  for rep in range(args.reps):
    k = rep % len(contenders)
    for c in (*contenders[k:], *contenders[:k]):
      out = work / f'out-{c.replace(":", "-")}'
      shutil.rmtree(out, ignore_errors=True)
      argv_c = ours(out, c.split(':', 1)[1]) if c.startswith('ours') else theirs(out)
      peak, seconds, status = peak_rss(argv_c)
      assert status == 0, f'{c} failed: {" ".join(argv_c)}'
      runs[c].append((peak, seconds))
      print(c, f'peak {shown(peak)} MiB, {seconds:.1f} s', flush=True)
    if not checked:  # both outputs hold the same tensors, bit for bit (or says which not)
      import numpy as np  # pylint: disable=g-import-not-at-top
      a = read_export(work / f'out-ours-{budgets[0]}')
      b = read_export(work / 'out-theirs')
      assert sorted(a) == sorted(b), (sorted(set(a) ^ set(b)))[:10]
      differ = sorted(n for n in a if not np.array_equal(a[n], b[n]))
      kinds = sorted({'.'.join(n.split('.')[-3:]) for n in differ})
      equality = (f'{len(a) - len(differ)} of {len(a)} tensors bit-equal'
                  + (f'; differ: {kinds}' if differ else ''))
      checked = True
      print(equality, flush=True)

  print(f'\nCommand: `python benchmarks/export_maxtext.py --layers {args.layers} --dim {args.dim}'
        f' --budgets {args.budgets} --reps {args.reps} --chunks {args.chunks}'
        + (f' --devices {args.devices}`' if args.devices else '`'))
  print(f'{harness.commands_line(args.devices)} (theirs: cpu)')
  print(f'MaxText step: {MODEL_NAME}-shaped, scanned, float32, {model / MIB:.0f} MiB'
        f' ({args.layers} layers, emb {D}, mlp {f}, vocab {v}); largest tensor'
        f' {largest / MIB:.0f} MiB ({largest_name}), largest HF tensor {largest_hf / MIB:.0f}'
        f' MiB; baselines (no arrays): ours {shown(base_ours)} MiB, theirs'
        f' {shown(base_theirs)} MiB; outputs: {equality}\n')
  print('| contender | peak RSS (median) | above its baseline | bound (budget + largest) |'
        ' wall (median) |')
  print('|---|---|---|---|---|')
  from orbax_tunix.cli.commands import parse_size  # pylint: disable=g-import-not-at-top
  for c in contenders:
    wall = statistics.median(s for _, s in runs[c])
    if None in (base_ours, base_theirs) or any(p is None for p, _ in runs[c]):  # no RSS here
      print(f'| {c} | n/a | n/a | n/a | {wall:.1f} s |')
      continue
    peak = statistics.median(p for p, _ in runs[c])
    if c.startswith('ours'):
      b = c.split(':', 1)[1]
      bound = parse_size(b) + largest
      verdict = 'MET' if peak - base_ours <= bound else 'MISSED'
      print(f'| ours, --memory-budget {b} | {peak / MIB:.0f} MiB | {(peak - base_ours) / MIB:.0f}'
            f' MiB | {bound / MIB:.0f} MiB {verdict} | {wall:.1f} s |')
    else:
      print(f'| theirs (MaxText 0.2.5 to_huggingface) | {peak / MIB:.0f} MiB |'
            f' {(peak - base_theirs) / MIB:.0f} MiB | - | {wall:.1f} s |')


if __name__ == '__main__':
  main()

"""A MaxText step to Hugging Face safetensors: `orbax-tunix export` beside MaxText 0.2.5's own.

Writes, with Orbax directly, a MaxText params-only step (scanned: every layer weight stacked on
`param_scan_axis` 1; float32 incompressible values; `items/params/params/...`, the layout
MaxText's checkpointing writes): llama3.1-shaped (`--model llama3`, by default ~1.2 GiB), or
qwen3-30b-a3b-shaped (`--model qwen3_moe`: a router and stacked experts per layer, experts on
axis 0 beside the layers on 1), one step per expert count of `--experts` (growing sizes, each
measured, then deleted); then, for each step, in alternating rounds, each run a fresh process:

  ours    `orbax-tunix export ROOT OUT --model M --memory-budget B` (this venv);
  theirs  MaxText 0.2.5's `checkpoint_conversion/to_huggingface.py` path on CPU, in the MaxText
          venv (scripts/maxtext_venv.sh), its own functions in `main`'s order:
          `load_orbax_checkpoint`, `HF_MODEL_CONFIGS[<model>]` fitted with
          `_validate_or_update_architecture(override=True)`, `_get_model_mappings`,
          `detect_and_extract_checkpoint`, `validate_and_filter_param_map_keys`,
          `_transform_weights_to_full_model`, then its writer `save_model_files` (config.json
          and safetensors shards; no tokenizer: that is the one step needing the Hub).

Peak RSS is sampled every few ms (harness.sampled_peak_rss, the house way); each side's baseline
is its own no-array run: `orbax-tunix inspect --json` for ours (interpreter, JAX, Orbax, the
metadata), and for theirs the same child up to the metadata read (MaxText imported, its config
built, Orbax's metadata of the step read; no array). The bound ours must keep: baseline +
`--memory-budget` + the largest stored array (the step's largest chunk is shown beside it: a
store decodes whole chunks). Both outputs are checked equal, tensor by tensor (MaxText's float32
values are ours bit for bit). Both work on the host: `--devices N` sets how many CPU devices
their JAX simulates; ours honours JAX_PLATFORMS, theirs runs on the CPU (the MaxText venv's
jaxlib is the CPU one, and its conversion says `hardware=cpu`).

  python benchmarks/export_maxtext.py [--layers 16 --dim 1024 --budgets 256M --reps 2]
  python benchmarks/export_maxtext.py --model qwen3_moe --experts 8,32,128 --layers 8 --dim 512
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

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import harness  # noqa: E402  (a sibling module)

MIB = 2**20
HEADS, KV_HEADS = 8, 2
# --model -> MaxText's model_name (its decoder block, and its HF_MODEL_CONFIGS entry)
MODEL_NAMES = {'llama3': 'llama3.1-8b', 'qwen3_moe': 'qwen3-30b-a3b'}
STEP = 0


def dims(dim: int, moe_mlp: int | None = None) -> dict[str, int]:
  return {'head_dim': dim // HEADS, 'mlp': dim * 7 // 2, 'vocab': dim * 32,
          'moe_mlp': dim // 4 if moe_mlp is None else moe_mlp}


def maxtext_argv(args, experts: int = 0) -> list[str]:
  """MaxText's pyconfig keys for the checkpoint's model (its MaxText model fitted to its dims)."""
  d = dims(args.dim, args.moe_mlp)
  moe = [f'num_experts={experts}', f'num_experts_per_tok={min(8, experts)}',
         f'base_moe_mlp_dim={d["moe_mlp"]}'] if args.model == 'qwen3_moe' else []
  return [f'model_name={MODEL_NAMES[args.model]}', 'override_model_config=True',
          f'base_emb_dim={args.dim}', f'base_num_query_heads={HEADS}',
          f'base_num_kv_heads={KV_HEADS}', f'head_dim={d["head_dim"]}',
          f'base_mlp_dim={d["mlp"]}', *moe,
          f'base_num_decoder_layers={args.layers}', f'vocab_size={d["vocab"]}',
          'scan_layers=True', 'weight_dtype=float32', 'hardware=cpu',
          'skip_jax_distributed_system=True', 'attention=dot_product',
          'run_name=export_maxtext_bench', 'enable_checkpointing=False']


# --------------------------------------------------------------------------- #
# The checkpoint (this venv, plain Orbax)
# --------------------------------------------------------------------------- #
def shapes(layers: int, dim: int, model: str = 'llama3', experts: int = 0,
           moe_mlp: int | None = None) -> dict[str, tuple[int, ...]]:
  """MaxText's scanned weights of `model` ('/'-joined path -> shape), layers on axis 1 (a
  stacked expert weight: its experts on axis 0), as its `nnx.state` prints them."""
  d = dims(dim, moe_mlp)
  h, f, v, L = d['head_dim'], d['mlp'], d['vocab'], layers
  out = {
      'token_embedder/embedding': (v, dim),
      'decoder/decoder_norm/scale': (dim,),
      'decoder/logits_dense/kernel': (dim, v),
      'decoder/layers/self_attention/query/kernel': (dim, L, HEADS, h),
      'decoder/layers/self_attention/key/kernel': (dim, L, KV_HEADS, h),
      'decoder/layers/self_attention/value/kernel': (dim, L, KV_HEADS, h),
      'decoder/layers/self_attention/out/kernel': (HEADS, L, h, dim),
      'decoder/layers/pre_self_attention_layer_norm/scale': (dim, L),
      'decoder/layers/post_self_attention_layer_norm/scale': (dim, L),
  }
  if model == 'llama3':
    return {**out, 'decoder/layers/mlp/wi_0/kernel': (dim, L, f),
            'decoder/layers/mlp/wi_1/kernel': (dim, L, f),
            'decoder/layers/mlp/wo/kernel': (f, L, dim)}
  fe = d['moe_mlp']
  return {**out, 'decoder/layers/self_attention/query_norm/scale': (h, L),
          'decoder/layers/self_attention/key_norm/scale': (h, L),
          'decoder/layers/moe_block/gate/kernel': (dim, L, experts),
          'decoder/layers/moe_block/wi_0': (experts, L, dim, fe),
          'decoder/layers/moe_block/wi_1': (experts, L, dim, fe),
          'decoder/layers/moe_block/wo': (experts, L, fe, dim)}


def _save_args(path: str, shape: tuple[int, ...], chunks: str):
  """Orbax's save args of one array: one chunk (`whole`); a chunk per layer for the stacked
  ones and eighths of the 2-d ones (`layer`, a save sharded on the layer axis); or a chunk
  per expert, every layer in it (`expert`, a save sharded on the expert axis, as MaxText's
  expert parallelism shards it; the rest as `layer`)."""
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

  nbytes = 4 * math.prod(shape)
  if chunks == 'expert' and '/moe_block/w' in path:
    return ocp.SaveArgs(chunk_byte_size=nbytes // shape[0], shard_axes=(0,))
  if chunks in ('layer', 'expert') and len(shape) >= 3:
    return ocp.SaveArgs(chunk_byte_size=nbytes // shape[1], shard_axes=(1,))
  if chunks in ('layer', 'expert') and len(shape) == 2 and path.startswith(
      ('token_', 'decoder/logits')):
    return ocp.SaveArgs(chunk_byte_size=nbytes // 8)
  return ocp.SaveArgs()


def stored_sizes(step: pathlib.Path) -> tuple[int, int, int]:
  """(the model's bytes, its largest stored array's, its largest chunk's: a store decodes
  whole chunks), from the step's metadata (orbax_tunix's reader; no array read)."""
  from orbax_tunix.reading import reader  # pylint: disable=g-import-not-at-top

  ckpt = reader.open_source(step, weights_only=True)
  leaves = [(item, leaf) for item, found in ckpt.items.items() for leaf in found]
  chunks = [leaf.dtype.itemsize * math.prod(
      ckpt.detection.item_meta(item).chunk_shape(leaf.disk_path) or leaf.shape)
      for item, leaf in leaves]
  return (sum(leaf.nbytes for _, leaf in leaves), max(leaf.nbytes for _, leaf in leaves),
          max(chunks))


def write_checkpoint(root: pathlib.Path, layers: int, dim: int, chunks: str = 'whole',
                     model: str = 'llama3', experts: int = 0, moe_mlp: int | None = None
                     ) -> pathlib.Path:
  """`<root>/0/items` = {'params': {'params': <shapes(), random float32>}}, each array stored
  as `chunks` says (`_save_args`)."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

  rng = np.random.default_rng(0)
  weights: dict = {}
  save_args: dict = {}
  for path, shape in shapes(layers, dim, model, experts, moe_mlp).items():
    *parents, leaf = path.split('/')
    node, args = weights, save_args
    for p in parents:
      node, args = node.setdefault(p, {}), args.setdefault(p, {})
    node[leaf] = rng.standard_normal(shape, np.float32)
    args[leaf] = _save_args(path, shape, chunks)
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
  config = pyconfig.initialize(['to_huggingface', base_yml, *maxtext_argv(args, args.experts),
                                f'load_parameters_path={args.src}',
                                f'base_output_directory={args.out}'])
  if args.arrays == 'no':
    ocp.Checkpointer(ocp.PyTreeCheckpointHandler()).metadata(args.src)
    return
  checkpoint = conv.load_orbax_checkpoint(config)
  name = MODEL_NAMES[args.model]
  hf_config = copy.deepcopy(HF_MODEL_CONFIGS[name])
  th._validate_or_update_architecture(hf_config, config, override=True)  # pylint: disable=protected-access
  maps = th._get_model_mappings(name, config.scan_layers, hf_config.to_dict(), config)  # pylint: disable=protected-access
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
  """{name: array} of a folder's *.safetensors, each a view of the file mapped into memory (numpy
  reads the bytes; no torch needed; the folder is not held in memory)."""
  import numpy as np  # pylint: disable=g-import-not-at-top

  tensors = {}
  for f in sorted(out.glob('*.safetensors')):
    data = np.memmap(f, np.uint8, mode='r')
    n = int.from_bytes(data[:8].tobytes(), 'little')
    header = json.loads(data[8:8 + n].tobytes())
    header.pop('__metadata__', None)
    for name, e in header.items():
      assert e['dtype'] == 'F32', (f, name, e['dtype'])
      a, b = e['data_offsets']
      tensors[name] = data[8 + n + a:8 + n + b].view(np.float32).reshape(e['shape'])
  return tensors


def equality(ours: pathlib.Path, theirs: pathlib.Path) -> str:
  """How many of the two exports' tensors are bit-equal (and which kinds differ)."""
  import numpy as np  # pylint: disable=g-import-not-at-top

  a, b = read_export(ours), read_export(theirs)
  assert sorted(a) == sorted(b), (sorted(set(a) ^ set(b)))[:10]
  differ = sorted(n for n in a if not np.array_equal(a[n], b[n]))
  kinds = sorted({'.'.join(n.split('.')[-3:]) for n in differ})
  return f'{len(a) - len(differ)} of {len(a)} tensors bit-equal' + (
      f'; differ: {kinds}' if differ else '')


def parse(argv):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--model', choices=sorted(MODEL_NAMES), default='llama3')
  parser.add_argument('--layers', type=int, default=16)
  parser.add_argument('--dim', type=int, default=1024)
  parser.add_argument('--experts', default='8',
                      help='qwen3_moe: the expert counts, one step each (e.g. 8,32,128)')
  parser.add_argument('--moe-mlp', type=int, help="qwen3_moe: an expert's MLP width (dim/4)")
  parser.add_argument('--budgets', default='256M')
  parser.add_argument('--reps', type=int, default=2)
  parser.add_argument('--chunks', choices=('whole', 'layer', 'expert'), default='whole',
                      help="the source's arrays one chunk each (one device's save), a chunk"
                      ' per layer (a save sharded on the layer axis), or (qwen3_moe) a chunk'
                      ' per expert of the expert weights (sharded on the expert axis)')
  parser.add_argument('--workdir')
  parser.add_argument('--keep', action='store_true', help='keep each step after measuring it')
  parser.add_argument('--theirs-child', action='store_true', help=argparse.SUPPRESS)
  parser.add_argument('--src', help=argparse.SUPPRESS)
  parser.add_argument('--out', help=argparse.SUPPRESS)
  parser.add_argument('--arrays', default='yes', help=argparse.SUPPRESS)
  harness.add_flags(parser, cpu_default=None)
  args = parser.parse_args(argv)
  if args.theirs_child:
    args.experts = int(args.experts)
  return args


def measure(args, work: pathlib.Path, experts: int, py_mt: str) -> dict:
  """One step (written unless it exists): each side's baseline, then `--reps` rounds of every
  contender in a fresh process, the order rotated; the outputs compared once."""
  env_ours = harness.child_env(args.devices)
  env_theirs = {**env_ours, 'JAX_PLATFORMS': 'cpu'}
  root = work / (f'src-{experts}x' if args.model == 'qwen3_moe' else 'src')
  step = root / str(STEP)
  if not step.exists():
    write_checkpoint(root, args.layers, args.dim, args.chunks, args.model, experts,
                     args.moe_mlp)
  cli = [sys.executable, '-m', 'orbax_tunix.cli']
  me = str(pathlib.Path(__file__).resolve())

  def ours(out, budget):
    return cli + ['export', str(root), str(out), '--model', args.model, '--memory-budget',
                  budget]

  def theirs(out, arrays='yes'):
    return [py_mt, me, '--theirs-child', '--src', str(step / 'items'), '--out', str(out),
            '--arrays', arrays, '--model', args.model, '--experts', str(experts),
            '--layers', str(args.layers), '--dim', str(args.dim),
            *(['--moe-mlp', str(args.moe_mlp)] if args.moe_mlp else [])]

  def peak_rss(argv):
    return harness.sampled_peak_rss(argv, env_theirs if argv[0] == py_mt else env_ours)

  model, largest, chunk = stored_sizes(step)
  base = {'ours': peak_rss(cli + ['inspect', str(root), '--json']),
          'theirs': peak_rss(theirs(work / 'baseline', arrays='no'))}
  assert all(status == 0 for _, _, status in base.values()), f'a baseline failed: {base}'
  budgets = args.budgets.split(',')
  contenders = [f'ours:{b}' for b in budgets] + ['theirs']
  runs = {c: [] for c in contenders}
  for rep in range(args.reps):
    k = rep % len(contenders)
    for c in (*contenders[k:], *contenders[:k]):
      out = work / f'out-{c.replace(":", "-")}'
      shutil.rmtree(out, ignore_errors=True)
      argv_c = ours(out, c.split(':', 1)[1]) if c.startswith('ours') else theirs(out)
      peak, seconds, status = peak_rss(argv_c)
      assert status == 0, f'{c} failed: {" ".join(argv_c)}'
      runs[c].append((peak, seconds))
      print(f'{experts or ""} {c} peak {harness.mib(peak)} MiB, {seconds:.1f} s', flush=True)
    if rep == 0:  # both outputs hold the same tensors, bit for bit (or says which not)
      equal = equality(work / f'out-ours-{budgets[0]}', work / 'out-theirs')
      print(equal, flush=True)
  for c in contenders:
    shutil.rmtree(work / f'out-{c.replace(":", "-")}', ignore_errors=True)
  if not args.keep:
    shutil.rmtree(root)
  return {'experts': experts, 'model': model, 'largest': largest, 'chunk': chunk,
          'base': {k: v[0] for k, v in base.items()}, 'runs': runs, 'equal': equal}


def report(args, m: dict) -> None:
  """The rows of one step: each contender's medians, ours against its bound."""
  from orbax_tunix.cli.flags import parse_size  # pylint: disable=g-import-not-at-top

  what = (f'{m["experts"]} experts, ' if args.model == 'qwen3_moe' else '') + (
      f'{m["model"] / MIB:.0f} MiB (largest array {m["largest"] / MIB:.0f}, chunk'
      f' {m["chunk"] / MIB:.0f})')
  base_ours, base_theirs = m['base']['ours'], m['base']['theirs']
  for c, runs in m['runs'].items():
    wall = statistics.median(s for _, s in runs)
    if None in (base_ours, base_theirs) or any(p is None for p, _ in runs):  # no RSS here
      print(f'| {what} | {c} | n/a | n/a | n/a | {wall:.1f} s |')
      continue
    peak = statistics.median(p for p, _ in runs)
    if c.startswith('ours'):
      b = c.split(':', 1)[1]
      bound = parse_size(b) + m['largest']
      verdict = 'met' if peak - base_ours <= bound else 'MISSED'
      print(f'| {what} | ours, `--memory-budget {b}` | {peak / MIB:.0f} MiB |'
            f' {(peak - base_ours) / MIB:.0f} MiB | {bound / MIB:.0f} MiB: {verdict} |'
            f' {wall:.1f} s |')
    else:
      print(f'| {what} | MaxText 0.2.5 `to_huggingface` | {peak / MIB:.0f} MiB |'
            f' {(peak - base_theirs) / MIB:.0f} MiB ({(peak - base_theirs) / m["model"]:.1f}x'
            f' the model) | - | {wall:.1f} s |')


def main(argv=None) -> None:
  args = parse(argv)
  if args.theirs_child:
    return theirs_child(args)
  harness.keep_off_devices()  # The writer's JAX: an accelerator stays free for the commands.
  work = pathlib.Path(args.workdir or tempfile.mkdtemp(prefix='export-maxtext-bench-'))
  work.mkdir(parents=True, exist_ok=True)
  py_mt = maxtext_python()
  counts = [int(e) for e in args.experts.split(',')] if args.model == 'qwen3_moe' else [0]
  measured = [measure(args, work, e, py_mt) for e in counts]
  d = dims(args.dim, args.moe_mlp)
  print(f'\nCommand: `python benchmarks/export_maxtext.py --model {args.model} --layers'
        f' {args.layers} --dim {args.dim}'
        + (f' --experts {args.experts}' if args.model == 'qwen3_moe' else '')
        + (f' --moe-mlp {args.moe_mlp}' if args.moe_mlp else '')
        + f' --budgets {args.budgets} --reps {args.reps} --chunks {args.chunks}'
        + (f' --devices {args.devices}`' if args.devices else '`'))
  print(f'{harness.commands_line(args.devices)} (theirs: cpu)')
  print(f'MaxText step: {MODEL_NAMES[args.model]}-shaped, scanned, float32 ({args.layers}'
        f' layers, emb {args.dim}, mlp {d["mlp"]}'
        + (f', expert mlp {d["moe_mlp"]}' if args.model == 'qwen3_moe' else '')
        + f', vocab {d["vocab"]}); baselines (no arrays): '
        + '; '.join(f'ours {harness.mib(m["base"]["ours"])} MiB, theirs'
                    f' {harness.mib(m["base"]["theirs"])} MiB' for m in measured[:1])
        + '; outputs: ' + '; '.join(m['equal'] for m in measured) + '\n')
  print('| step | contender | peak RSS (median) | above its baseline |'
        ' bound (budget + largest array) | wall (median) |')
  print('|---|---|---|---|---|---|')
  for m in measured:
    report(args, m)


if __name__ == '__main__':
  main()

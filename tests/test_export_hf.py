"""google-tunix 0.1.7's own loaders accept what `orbax-tunix export` writes from real Tunix runs.

The sources are `tests/data/tunix/hf_*`: Tunix's own Qwen3 / Llama3 / Gemma3 classes, tiny,
every dim distinct, trained by optax and saved by Tunix's CheckpointManager
(scripts/make_tunix_fixtures.py; MANIFEST.json holds each one's ModelConfig arguments and the
fixed tokens). The exports run here with the CLI (`python -m orbax_tunix.cli export`), in
parallel, while one worker process (tests/tunix_client.py, google-tunix from
scripts/tunix_pkgs.sh on this venv's own jax stack) imports Tunix; then the worker runs every
Tunix job of the module in one batch: Tunix's `create_model_from_safe_tensors` on each
export, and the model Tunix restores from each checkpoint (with qwix LoRA in the loop for the
LoRA runs). Tunix is never imported in the pytest process (its model modules flip flax's
`flax_always_shard_variable` process-wide).

Expected values come from the fixtures read with plain Orbax (tests/builders.raw_leaves, the
`/value` suffix stripped here) and, for the files themselves, from this module's own table of
Hugging Face names and layouts (numpy reshapes/transposes by hand; the safetensors headers are
parsed here, 8-byte length + JSON). Nothing expected comes from orbax_tunix.

What the tests hold the exporter to:
  * `export SRC OUT --model F` writes OUT/model.safetensors when one file holds every tensor,
    else model-0000i-of-0000N.safetensors + model.safetensors.index.json =
    {"metadata": {"total_size": sum of tensor bytes}, "weight_map": {name: file}}; every file
    one dtype, `__metadata__` {"format": "pt"}; exactly the family's HF tensor names (no
    lm_head.weight when tied or for Gemma3, no adapter tensors); no config.json unless
    --hf-config (then a note saying one must be added mentions config.json).
  * Tunix's loader then gives back the checkpoint's weights bit for bit (dtype too) and the
    same logits as the model Tunix restores from the checkpoint (bit-exact); `--dtype
    bfloat16`: the raw weights cast to bfloat16.
  * `--merge-lora --lora-alpha A`: W + (A / rank) * a.b in every adapted weight; the plain
    model's logits match the LoRA model's own within MERGE_ATOL.
  * Refusals exit 2 with a message naming the problem (not the generic "run again with
    --debug" crash message), create nothing, and leave the source untouched.
"""

from __future__ import annotations

import concurrent.futures
import json
import math
import os
import pathlib
import re
import shutil
import subprocess
import sys
import time

import ml_dtypes
import numpy as np
import pytest

from tests import builders, clients
from tests.clients import client_env, subprocess_env
from tests.test_faults import snapshot

ROOT = pathlib.Path(__file__).resolve().parent.parent
DATA = ROOT / 'tests' / 'data' / 'tunix'
CLIENT = ROOT / 'tests' / 'tunix_client.py'
MANIFEST = json.loads((DATA / 'MANIFEST.json').read_text())['fixtures']
FAMILY_FIXTURES = {'hf_qwen3': 'qwen3', 'hf_llama3': 'llama3', 'hf_gemma3': 'gemma3',
                   'hf_gemma3_fused': 'gemma3',
                   # Issue 29: Tunix's other families.
                   'hf_qwen2': 'qwen2', 'hf_qwen3_moe': 'qwen3_moe', 'hf_gemma': 'gemma',
                   'hf_gemma2': 'gemma2', 'hf_gemma4': 'gemma4', 'hf_gemma4_moe': 'gemma4'}
LORA_FIXTURES = ('hf_qwen3_lora', 'hf_qwen3_lora_only', 'hf_qwen2_lora', 'hf_qwen3_moe_lora',
                 'hf_gemma2_lora', 'hf_gemma_lora', 'hf_gemma4_lora', 'hf_gemma4_moe_lora')
# Tunix 0.1.7 has its own merged saver for these families only.
TUNIX_MERGE_FIXTURES = ('hf_qwen3_lora', 'hf_qwen3_lora_only')
# Extra arguments of the worker's `load` jobs: Tunix's Gemma loader maps Hugging Face's
# `post_attention_layernorm` to Gemma 2's post-attention norm for every Gemma; Gemma 1's is the
# norm before the MLP (transformers' GemmaDecoderLayer), so its folders load with that one
# entry of Tunix's map put right (tests/tunix_client.py `load_gemma1`).
LOAD_OPTIONS = {'hf_gemma': {'gemma1_norm_name': True}, 'hf_gemma_lora': {'gemma1_norm_name': True}}
WORKER_TIMEOUT = 600
CLI_TIMEOUT = 300
# The LoRA model computes x.W + s (x.a).b, the merged one x.(W + s a.b): the same sums in
# another order, in float32. Measured when the fixture was made (MANIFEST
# lora.logits_max_abs_diff_float32_hand_merge): 6.7e-6 on logits up to 6.3 in size, i.e.
# ~1e-6 relative. 1e-4 leaves a 15x margin over that, while the adapters move the logits
# by 4.4 (lora.logits_max_abs_change_by_adapters): a merge with a wrong scale (alpha instead
# of alpha / rank, or none), a transposed delta or a missed weight is off by far more.
MERGE_ATOL = 1e-4
# Gemma 1 has no final soft cap: logits up to 12.6, and the float32 hand merge lands 4.1e-5
# away (4.5e-5 for the export loaded by Tunix, measured), too close to 1e-4 for another CPU's
# summation order; 2e-4 keeps a 4x margin, and its adapters move the logits by 7.8.
MERGE_ATOL_BY_FIXTURE = {'hf_gemma_lora': 2e-4}
# Merged weights vs a float32 hand merge (or Tunix's own merged saver): one rounding of
# W + s a.b, |W| < ~1.5 here.
WEIGHT_ATOL = 2e-6


def manifest(name: str) -> dict:
  return MANIFEST[name]


def latest_step(name: str) -> int:
  return manifest(name)['steps'][-1]


def raw(name: str, step: int | None = None) -> dict[str, np.ndarray]:
  """The fixture's model_params read with plain Orbax, by Tunix path ('layers/0/attn/q_proj/w')."""
  step = step or latest_step(name)
  out = {}
  for path, value in builders.raw_leaves(DATA / name / str(step) / 'model_params').items():
    assert path.endswith('/value'), path  # nnx's Variable level
    out[path[:-len('/value')]] = value
  return out


# --------------------------------------------------------------------------- #
# The Hugging Face names and layouts, by hand (one table per family)
# --------------------------------------------------------------------------- #
def _same(w):
  return w


def _t(w):
  return w.T


def _proj_in(w):  # Tunix (D, X, H) -> HF (X*H, D)
  d, x, h = w.shape
  return w.reshape(d, x * h).T


def _proj_out(w):  # Tunix (N, H, D) -> HF (D, N*H)
  n, h, d = w.shape
  return w.reshape(n * h, d).T


def _heads_first(w):  # Gemma3 (X, D, H) -> HF (X*H, D)
  return _proj_in(np.transpose(w, (1, 0, 2)))


L = r'layers/(?P<i>\d+)/'
HF_L = 'model.layers.{i}.'
# (Tunix path regex, [(HF name template, numpy transform)]); one entry per Tunix weight.
LLAMA3_MAP = [
    (r'embedder/input_embedding', [('model.embed_tokens.weight', _same)]),
    (r'final_norm/w', [('model.norm.weight', _same)]),
    (r'lm_head/w', [('lm_head.weight', _t)]),
    (L + r'attn/(?P<p>[qkv])_proj/w', [(HF_L + 'self_attn.{p}_proj.weight', _proj_in)]),
    (L + r'attn/o_proj/w', [(HF_L + 'self_attn.o_proj.weight', _proj_out)]),
    (L + r'mlp/(?P<p>gate|up|down)_proj/kernel', [(HF_L + 'mlp.{p}_proj.weight', _t)]),
    (L + r'(?P<p>input_layernorm|post_attention_layernorm)/w', [(HF_L + '{p}.weight', _same)]),
]
QWEN3_MAP = LLAMA3_MAP + [
    (L + r'attn/(?P<p>[qk])_norm/w', [(HF_L + 'self_attn.{p}_norm.weight', _same)]),
]
GEMMA3_MAP = [
    (r'embedder/input_embedding', [('model.embed_tokens.weight', _same)]),
    (r'final_norm/scale', [('model.norm.weight', _same)]),
    (L + r'attn/q_einsum/w', [(HF_L + 'self_attn.q_proj.weight', _heads_first)]),
    (L + r'attn/kv_einsum/w', [(HF_L + 'self_attn.k_proj.weight', lambda w: _heads_first(w[0])),
                              (HF_L + 'self_attn.v_proj.weight', lambda w: _heads_first(w[1]))]),
    (L + r'attn/qkv_einsum/w', [(HF_L + f'self_attn.{p}_proj.weight',
                                 lambda w, j=j: _heads_first(w[j])) for j, p in enumerate('qkv')]),
    (L + r'attn/attn_vec_einsum/w', [(HF_L + 'self_attn.o_proj.weight', _proj_out)]),
    (L + r'attn/_query_norm/scale', [(HF_L + 'self_attn.q_norm.weight', _same)]),
    (L + r'attn/_key_norm/scale', [(HF_L + 'self_attn.k_norm.weight', _same)]),
    (L + r'mlp/(?P<p>gate|up|down)_proj/kernel', [(HF_L + 'mlp.{p}_proj.weight', _t)]),
    (L + r'pre_attention_norm/scale', [(HF_L + 'input_layernorm.weight', _same)]),
    (L + r'post_attention_norm/scale', [(HF_L + 'post_attention_layernorm.weight', _same)]),
    (L + r'pre_ffw_norm/scale', [(HF_L + 'pre_feedforward_layernorm.weight', _same)]),
    (L + r'post_ffw_norm/scale', [(HF_L + 'post_feedforward_layernorm.weight', _same)]),
]


def _experts(w):  # Tunix's stacked experts (E, in, out) -> one HF (out, in) per expert
  return [e.T for e in w]


QWEN2_MAP = LLAMA3_MAP + [
    (L + r'attn/(?P<p>[qkv])_bias', [(HF_L + 'self_attn.{p}_proj.bias', _same)]),
]
QWEN3_MOE_MAP = [row for row in QWEN3_MAP if '/mlp/' not in row[0]] + [
    (L + r'mlp/router/kernel', [(HF_L + 'mlp.gate.weight', _t)]),
    (L + r'mlp/(?P<p>gate|up|down)_proj', [(HF_L + 'mlp.experts.{e}.{p}_proj.weight', _experts)]),
]


def _gemma_rows(hf_l: str) -> list:
  """Tunix Gemma's attention einsums and MLP (gemma, gemma2, gemma3, gemma4 alike)."""
  return [
      (L + r'attn/q_einsum/w', [(hf_l + 'self_attn.q_proj.weight', _heads_first)]),
      (L + r'attn/kv_einsum/w', [(hf_l + 'self_attn.k_proj.weight', lambda w: _heads_first(w[0])),
                                (hf_l + 'self_attn.v_proj.weight', lambda w: _heads_first(w[1]))]),
      (L + r'attn/qkv_einsum/w', [(hf_l + f'self_attn.{p}_proj.weight',
                                   lambda w, j=j: _heads_first(w[j]))
                                  for j, p in enumerate('qkv')]),
      (L + r'attn/attn_vec_einsum/w', [(hf_l + 'self_attn.o_proj.weight', _proj_out)]),
      (L + r'mlp/(?P<p>gate|up|down)_proj/kernel', [(hf_l + 'mlp.{p}_proj.weight', _t)]),
  ]


_GEMMA_TOP = [(r'embedder/input_embedding', [('model.embed_tokens.weight', _same)]),
              (r'final_norm/scale', [('model.norm.weight', _same)])]
GEMMA2_MAP = _GEMMA_TOP + _gemma_rows(HF_L) + [
    (L + r'pre_attention_norm/scale', [(HF_L + 'input_layernorm.weight', _same)]),
    (L + r'post_attn_norm/scale', [(HF_L + 'post_attention_layernorm.weight', _same)]),
    (L + r'pre_ffw_norm/scale', [(HF_L + 'pre_feedforward_layernorm.weight', _same)]),
    (L + r'post_ffw_norm/scale', [(HF_L + 'post_feedforward_layernorm.weight', _same)]),
]
GEMMA_MAP = _GEMMA_TOP + _gemma_rows(HF_L) + [  # Gemma 1: two norms a layer
    (L + r'pre_attention_norm/scale', [(HF_L + 'input_layernorm.weight', _same)]),
    # transformers' GemmaDecoderLayer: post_attention_layernorm normalises the MLP's input.
    (L + r'pre_ffw_norm/scale', [(HF_L + 'post_attention_layernorm.weight', _same)]),
]
G4 = 'model.language_model.'  # Gemma4ForConditionalGeneration's text model
G4_L = G4 + 'layers.{i}.'
GEMMA4_MAP = [
    (r'embedder/input_embedding', [(G4 + 'embed_tokens.weight', _same)]),
    (r'embedder/per_layer_input_embedding',  # (V, L, P) -> (V, L*P)
     [(G4 + 'embed_tokens_per_layer.weight', lambda w: w.reshape(w.shape[0], -1))]),
    (r'embedder/per_layer_model_projection/w',  # (D, L, P) -> (L*P, D)
     [(G4 + 'per_layer_model_projection.weight', _proj_in)]),
    (r'embedder/per_layer_projection_norm/scale', [(G4 + 'per_layer_projection_norm.weight',
                                                   _same)]),
    (r'final_norm/scale', [(G4 + 'norm.weight', _same)]),
    *_gemma_rows(G4_L),
    (L + r'attn/k_einsum/w', [(G4_L + 'self_attn.k_proj.weight', _heads_first)]),  # k == v
    (L + r'attn/_query_norm/scale', [(G4_L + 'self_attn.q_norm.weight', _same)]),
    (L + r'attn/_key_norm/scale', [(G4_L + 'self_attn.k_norm.weight', _same)]),
    (L + r'pre_attention_norm/scale', [(G4_L + 'input_layernorm.weight', _same)]),
    (L + r'post_attention_norm/scale', [(G4_L + 'post_attention_layernorm.weight', _same)]),
    (L + r'pre_ffw_norm/scale', [(G4_L + 'pre_feedforward_layernorm.weight', _same)]),
    (L + r'post_ffw_norm/scale', [(G4_L + 'post_feedforward_layernorm.weight', _same)]),
    (L + r'dense_post_ffw_norm/scale', [(G4_L + 'post_feedforward_layernorm_1.weight', _same)]),
    (L + r'moe_pre_ffw_norm/scale', [(G4_L + 'pre_feedforward_layernorm_2.weight', _same)]),
    (L + r'moe_post_ffw_norm/scale', [(G4_L + 'post_feedforward_layernorm_2.weight', _same)]),
    (L + r'post_per_layer_input_norm/scale', [(G4_L + 'post_per_layer_input_norm.weight',
                                              _same)]),
    (L + r'skip_scale', [(G4_L + 'layer_scalar', _same)]),
    (L + r'per_layer_input_gate/w', [(G4_L + 'per_layer_input_gate.weight', _t)]),
    (L + r'per_layer_projection/w', [(G4_L + 'per_layer_projection.weight', _t)]),
    (L + r'moe/router_logits', [(G4_L + 'router.proj.weight', _t)]),
    (L + r'moe/router_scale', [(G4_L + 'router.scale', _same)]),
    (L + r'moe/per_expert_scale', [(G4_L + 'router.per_expert_scale', _same)]),
    (L + r'moe/gating_einsum',  # (E, 2, F, D) -> (E, 2F, D)
     [(G4_L + 'experts.gate_up_proj', lambda w: w.reshape(w.shape[0], -1, w.shape[-1]))]),
    (L + r'moe/linear',  # (E, F, D) -> (E, D, F)
     [(G4_L + 'experts.down_proj', lambda w: np.transpose(w, (0, 2, 1)))]),
]
HF_MAPS = {'qwen3': QWEN3_MAP, 'llama3': LLAMA3_MAP, 'gemma3': GEMMA3_MAP, 'qwen2': QWEN2_MAP,
           'qwen3_moe': QWEN3_MOE_MAP, 'gemma': GEMMA_MAP, 'gemma2': GEMMA2_MAP,
           'gemma4': GEMMA4_MAP}


def hf_expected(family: str, weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  """{HF name: array} from Tunix weights, by the table above (every weight must map once)."""
  out = {}
  for path, w in weights.items():
    hits = [(m, targets) for pat, targets in HF_MAPS[family]
            if (m := re.fullmatch(pat, path))]
    assert len(hits) == 1, f'{family}: {path} matches {len(hits)} rows of the test table'
    m, targets = hits[0]
    for template, fn in targets:
      # '{e}': one tensor per expert, fn giving them in order.
      made = (enumerate(fn(w)) if '{e}' in template else [(None, fn(w))])
      for e, a in made:
        name = template.format(e=e, **m.groupdict())
        assert name not in out, name
        out[name] = np.ascontiguousarray(a)
  return out


# --------------------------------------------------------------------------- #
# safetensors files, read here (no safetensors package in this venv)
# --------------------------------------------------------------------------- #
ST_DTYPES = {'F64': np.dtype(np.float64), 'F32': np.dtype(np.float32),
             'F16': np.dtype(np.float16), 'BF16': np.dtype(ml_dtypes.bfloat16),
             'I64': np.dtype(np.int64), 'I32': np.dtype(np.int32), 'I16': np.dtype(np.int16),
             'I8': np.dtype(np.int8), 'U8': np.dtype(np.uint8), 'BOOL': np.dtype(np.bool_)}


def read_safetensors(path: pathlib.Path) -> tuple[dict, dict[str, dict], dict[str, np.ndarray]]:
  """(__metadata__, {name: header entry}, {name: array}); checks the byte layout."""
  data = path.read_bytes()
  n = int.from_bytes(data[:8], 'little')
  header = json.loads(data[8:8 + n])
  meta = header.pop('__metadata__', None)
  body = data[8 + n:]
  arrays, spans = {}, []
  for name, e in header.items():
    dtype = ST_DTYPES[e['dtype']]
    start, end = e['data_offsets']
    assert end - start == math.prod(e['shape']) * dtype.itemsize, (path.name, name, e)
    spans.append((start, end))
    arrays[name] = np.frombuffer(body[start:end], dtype).reshape(e['shape'])
  spans.sort()
  assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:], strict=False)), f'{path.name}: overlapping tensors'
  assert not spans or spans[-1][1] <= len(body), f'{path.name}: data past the end'
  return meta, header, arrays


class Export:
  """One exported folder, read back: files, per-file headers, tensors, index."""

  SHARD = re.compile(r'model-(\d{5})-of-(\d{5})\.safetensors')

  def __init__(self, out: pathlib.Path):
    self.out = out
    self.files = sorted(p.name for p in out.iterdir())
    self.weight_files = sorted(f for f in self.files if f.endswith('.safetensors'))
    self.meta, self.headers, self.tensors, self.where = {}, {}, {}, {}
    for f in self.weight_files:
      meta, header, arrays = read_safetensors(out / f)
      self.meta[f], self.headers[f] = meta, header
      for name, a in arrays.items():
        assert name not in self.tensors, f'{name} in {self.where[name]} and {f}'
        self.tensors[name], self.where[name] = a, f
    index = out / 'model.safetensors.index.json'
    self.index = json.loads(index.read_text()) if index.exists() else None

  def nbytes(self, f: str) -> int:
    return sum(e['data_offsets'][1] - e['data_offsets'][0] for e in self.headers[f].values())

  def check_files(self):
    """The layout transformers writes: one file, or numbered shards + index."""
    assert self.weight_files, f'no *.safetensors in {self.out}: {self.files}'
    for f in self.weight_files:
      # transformers' own, and this package's record of the files it wrote: all there are.
      assert self.meta[f] == {'format': 'pt', 'orbax_tunix.files': json.dumps(self.files)}, (
          f'{f}: __metadata__ {self.meta[f]}')
      dtypes = {e['dtype'] for e in self.headers[f].values()}
      assert len(dtypes) == 1, f'{f} mixes dtypes {dtypes} (Tunix reads a file with one dtype)'
    if self.weight_files == ['model.safetensors']:
      assert self.index is None, 'one file and an index'
      return
    assert 'model.safetensors' not in self.weight_files, self.weight_files
    n = len(self.weight_files)
    assert n > 1, self.weight_files
    assert self.weight_files == [f'model-{i:05d}-of-{n:05d}.safetensors'
                                 for i in range(1, n + 1)], self.weight_files
    assert self.index is not None, 'shards without model.safetensors.index.json'
    assert set(self.index) == {'metadata', 'weight_map'}, sorted(self.index)
    assert self.index['weight_map'] == self.where, 'weight_map is not where the tensors are'
    total = sum(self.nbytes(f) for f in self.weight_files)
    assert self.index['metadata']['total_size'] == total, (self.index['metadata'], total)
    if 'total_parameters' in self.index['metadata']:  # newer transformers write it too
      assert self.index['metadata']['total_parameters'] == sum(
          a.size for a in self.tensors.values())


# --------------------------------------------------------------------------- #
# tunix-pkgs and the worker
# --------------------------------------------------------------------------- #
@pytest.fixture(scope='module')
def tunix_pkgs() -> str:
  """scripts/tunix_pkgs.sh's directory (built on first use, ~15 s; then reused)."""
  return client_env('tunix_pkgs.sh', PYTHON=sys.executable)


def export_argv(src: pathlib.Path | str, out: pathlib.Path, *flags: str) -> list[str]:
  return [sys.executable, '-m', 'orbax_tunix.cli', 'export', str(src), str(out), *flags]


def run_cli(argv: list[str]) -> dict:
  t = time.time()
  p = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, env=subprocess_env(),
                     timeout=CLI_TIMEOUT, check=False)
  return {'argv': argv[3:], 'rc': p.returncode, 'stdout': p.stdout, 'stderr': p.stderr,
          'seconds': time.time() - t}


# --------------------------------------------------------------------------- #
# What the module exports (name -> (source, flags)), and what it refuses
# --------------------------------------------------------------------------- #
LORA_ALPHA = str(manifest('hf_qwen3_lora')['lora']['alpha'])
SHARDED = {  # name -> (fixture, --max-shard-size, limit in bytes)
    'shard_gemma4_10KB': ('hf_gemma4', '10KB', 10_000),
    'shard_qwen3_moe_5KB': ('hf_qwen3_moe', '5KB', 5_000),
    'shard_qwen3_10KB': ('hf_qwen3', '10KB', 10_000),
    'shard_llama3_12KiB': ('hf_llama3', '12KiB', 12 * 1024),
    'shard_gemma3_bytes': ('hf_gemma3', '100000', 100_000),
    'shard_gemma3_fused_1MB': ('hf_gemma3_fused', '1MB', 1_000_000),  # holds all: one file
}
HF_CONFIG_DIMS = {  # the exported shapes, as config.json names them
    name: {'vocab_size': 96, 'hidden_size': 40, 'intermediate_size': 56,
           'num_hidden_layers': manifest(name)['model_config']['num_layers'],
           'num_attention_heads': 4,
           'num_key_value_heads': manifest(name)['model_config']['num_kv_heads'],
           'head_dim': 12}
    for name in FAMILY_FIXTURES
}
HF_CONFIG_DIMS['hf_qwen3']['tie_word_embeddings'] = False
HF_CONFIG_DIMS['hf_llama3']['tie_word_embeddings'] = True
HF_CONFIG_EXTRA = {
    'hf_qwen3': {'architectures': ['Qwen3ForCausalLM'], 'model_type': 'qwen3',
                 'hidden_act': 'silu', 'rope_theta': 1000000, 'rms_norm_eps': 1e-06,
                 'torch_dtype': 'float32'},
    'hf_gemma3_fused': {'architectures': ['Gemma3ForCausalLM'], 'model_type': 'gemma3_text',
                        'hidden_activation': 'gelu_pytorch_tanh', 'sliding_window': 4,
                        'rope_theta': 1000000, 'rope_local_base_freq': 10000,
                        'query_pre_attn_scalar': 12, 'torch_dtype': 'float32'},
}
# config.json as the families' Hub repos write them, at the fixtures' dims (issue 29).
_GEMMA4_ROPE = {'sliding_attention': {'rope_type': 'default', 'rope_theta': 10000.0},
                'full_attention': {'rope_type': 'proportional', 'partial_rotary_factor': 0.25,
                                   'rope_theta': 1000000.0}}
HF_CONFIG_FULL = {
    'hf_qwen2': {  # as Qwen2.5-0.5B / DeepSeek-R1-Distill-Qwen-1.5B
        'architectures': ['Qwen2ForCausalLM'], 'model_type': 'qwen2', 'attention_dropout': 0.0,
        'bos_token_id': 151643, 'eos_token_id': 151643, 'hidden_act': 'silu',
        'hidden_size': 40, 'head_dim': 12, 'initializer_range': 0.02, 'intermediate_size': 56,
        'max_position_embeddings': 32768, 'max_window_layers': 2, 'num_attention_heads': 4,
        'num_hidden_layers': 2, 'num_key_value_heads': 2, 'rms_norm_eps': 1e-06,
        'rope_theta': 1000000.0, 'sliding_window': 32768, 'tie_word_embeddings': True,
        'torch_dtype': 'bfloat16', 'transformers_version': '4.43.1', 'use_cache': True,
        'use_sliding_window': False, 'vocab_size': 96},
    'hf_qwen3_moe': {  # as Qwen3-30B-A3B
        'architectures': ['Qwen3MoeForCausalLM'], 'model_type': 'qwen3_moe',
        'attention_bias': False, 'attention_dropout': 0.0, 'bos_token_id': 151643,
        'decoder_sparse_step': 1, 'eos_token_id': 151645, 'head_dim': 12, 'hidden_act': 'silu',
        'hidden_size': 40, 'initializer_range': 0.02, 'intermediate_size': 64,
        'max_position_embeddings': 40960, 'max_window_layers': 2, 'mlp_only_layers': [],
        'moe_intermediate_size': 20, 'norm_topk_prob': True, 'num_attention_heads': 4,
        'num_experts': 3, 'num_experts_per_tok': 2, 'num_hidden_layers': 2,
        'num_key_value_heads': 2, 'output_router_logits': False, 'rms_norm_eps': 1e-06,
        'rope_scaling': None, 'rope_theta': 1000000.0, 'router_aux_loss_coef': 0.001,
        'sliding_window': None, 'tie_word_embeddings': False, 'torch_dtype': 'bfloat16',
        'transformers_version': '4.51.0', 'use_cache': True, 'use_sliding_window': False,
        'vocab_size': 96},
    'hf_gemma': {  # as gemma-2b (one kv head)
        'architectures': ['GemmaForCausalLM'], 'model_type': 'gemma', 'attention_bias': False,
        'attention_dropout': 0.0, 'bos_token_id': 2, 'eos_token_id': 1, 'head_dim': 12,
        'hidden_act': 'gelu', 'hidden_size': 40, 'initializer_range': 0.02,
        'intermediate_size': 56, 'max_position_embeddings': 8192, 'num_attention_heads': 4,
        'num_hidden_layers': 2, 'num_key_value_heads': 1, 'pad_token_id': 0,
        'rms_norm_eps': 1e-06, 'rope_scaling': None, 'rope_theta': 10000.0,
        'torch_dtype': 'bfloat16', 'transformers_version': '4.38.0.dev0', 'use_cache': True,
        'vocab_size': 96},
    'hf_gemma2': {  # as gemma-2-2b
        'architectures': ['Gemma2ForCausalLM'], 'model_type': 'gemma2', 'attention_bias': False,
        'attention_dropout': 0.0, 'attn_logit_softcapping': 50.0, 'bos_token_id': 2,
        'cache_implementation': 'hybrid', 'eos_token_id': 1, 'final_logit_softcapping': 30.0,
        'head_dim': 12, 'hidden_act': 'gelu_pytorch_tanh',
        'hidden_activation': 'gelu_pytorch_tanh', 'hidden_size': 40, 'initializer_range': 0.02,
        'intermediate_size': 56, 'max_position_embeddings': 8192, 'num_attention_heads': 4,
        'num_hidden_layers': 2, 'num_key_value_heads': 2, 'pad_token_id': 0,
        'query_pre_attn_scalar': 12, 'rms_norm_eps': 1e-06, 'rope_theta': 10000.0,
        'sliding_window': 4, 'torch_dtype': 'float32', 'transformers_version': '4.42.4',
        'use_cache': True, 'vocab_size': 96},
    'hf_gemma4': {  # as gemma-4-E2B: per-layer inputs, the last 3 layers reuse kv, double MLP
        'architectures': ['Gemma4ForConditionalGeneration'], 'model_type': 'gemma4',
        'tie_word_embeddings': True, 'dtype': 'bfloat16', 'transformers_version': '5.5.0',
        'text_config': {
            'model_type': 'gemma4_text', 'attention_bias': False, 'attention_dropout': 0.0,
            'attention_k_eq_v': False, 'bos_token_id': 2, 'enable_moe_block': False,
            'eos_token_id': 1, 'final_logit_softcapping': 30.0, 'global_head_dim': 16,
            'head_dim': 12, 'hidden_activation': 'gelu_pytorch_tanh', 'hidden_size': 40,
            'hidden_size_per_layer_input': 10, 'initializer_range': 0.02,
            'intermediate_size': 56, 'layer_types': ['sliding_attention', 'sliding_attention',
                                                     'full_attention'] * 2,
            'max_position_embeddings': 131072, 'num_attention_heads': 4,
            'num_hidden_layers': 6, 'num_key_value_heads': 2, 'num_kv_shared_layers': 3,
            'pad_token_id': 0, 'rms_norm_eps': 1e-06, 'rope_parameters': _GEMMA4_ROPE,
            'sliding_window': 4, 'tie_word_embeddings': True, 'use_cache': True,
            'use_double_wide_mlp': True, 'vocab_size': 96, 'vocab_size_per_layer_input': 96},
    },
    'hf_gemma4_moe': {  # as gemma-4-26B-A4B: MoE blocks, global layers' k == v
        'architectures': ['Gemma4ForConditionalGeneration'], 'model_type': 'gemma4',
        'tie_word_embeddings': True, 'dtype': 'bfloat16', 'transformers_version': '5.5.0',
        'text_config': {
            'model_type': 'gemma4_text', 'attention_bias': False, 'attention_dropout': 0.0,
            'attention_k_eq_v': True, 'bos_token_id': 2, 'enable_moe_block': True,
            'eos_token_id': 1, 'final_logit_softcapping': 30.0, 'global_head_dim': 16,
            'head_dim': 12, 'hidden_activation': 'gelu_pytorch_tanh', 'hidden_size': 40,
            'hidden_size_per_layer_input': 0, 'initializer_range': 0.02,
            'intermediate_size': 56, 'layer_types': ['sliding_attention', 'full_attention'],
            'max_position_embeddings': 262144, 'moe_intermediate_size': 20,
            'num_attention_heads': 4, 'num_experts': 3, 'num_global_key_value_heads': 1,
            'num_hidden_layers': 2, 'num_key_value_heads': 2, 'num_kv_shared_layers': 0,
            'pad_token_id': 0, 'rms_norm_eps': 1e-06, 'rope_parameters': _GEMMA4_ROPE,
            'sliding_window': 4, 'tie_word_embeddings': True, 'top_k_experts': 2,
            'use_cache': True, 'use_double_wide_mlp': False, 'vocab_size': 96,
            'vocab_size_per_layer_input': 96},
    },
}
HF_SIDE_FILES = {  # copied byte for byte
    'generation_config.json': '{"bos_token_id": 1, "eos_token_id": 2, "do_sample": false}\n',
    'tokenizer.json': '{"version": "1.0", "model": {"type": "BPE", "vocab": {"a": 0}}}\n',
    'tokenizer_config.json': '{"model_max_length": 4096, "eos_token": "</s>"}\n',
    'special_tokens_map.json': '{"eos_token": "</s>"}\n',
    'vocab.json': '{"a": 0}\n',
    'merges.txt': '#version: 0.2\na b\n',
}
HF_DECOYS = {  # never copied: the base model's own weights
    'model.safetensors': b'not the export',
    'model-00001-of-00002.safetensors': b'stale shard',
    'model.safetensors.index.json': b'{"metadata": {}, "weight_map": {"x": "y"}}',
    'pytorch_model.bin': b'torch weights',
}
HF_CONFIG_MISMATCH = {  # name -> (fixture, field, wrong value)
    'vocab_size': ('hf_qwen3', 'vocab_size', 97),
    'num_hidden_layers': ('hf_qwen3', 'num_hidden_layers', 3),
    'num_key_value_heads': ('hf_qwen3', 'num_key_value_heads', 4),
    'tie_word_embeddings': ('hf_qwen3', 'tie_word_embeddings', True),
    'intermediate_size': ('hf_llama3', 'intermediate_size', 64),
    'head_dim': ('hf_gemma3', 'head_dim', 16),
}
# Names of weights (Tunix or HF spelling): a refusal must name at least one.
QWEN3_WEIGHT_WORDS = ('q_norm', 'k_norm', 'q_proj', 'k_proj', 'v_proj', 'o_proj', 'lm_head',
                      'final_norm', 'input_layernorm', 'post_attention_layernorm', 'gate_proj',
                      'up_proj', 'down_proj', 'embedder', 'embed_tokens')
GEMMA3_WEIGHT_WORDS = ('q_einsum', 'kv_einsum', 'attn_vec_einsum', '_query_norm', '_key_norm',
                       'pre_attention_norm', 'post_attention_norm', 'pre_ffw_norm',
                       'post_ffw_norm', 'final_norm', 'scale')
REFUSALS = {  # name -> (fixture, flags, words the message must hold (one of each tuple))
    'unknown_family': ('hf_qwen3', ['--model', 'mistral'], [('invalid choice',), ('mistral',)]),
    'llama3_on_qwen3': ('hf_qwen3', ['--model', 'llama3'], [('q_norm', 'k_norm')]),
    'qwen3_on_llama3': ('hf_llama3', ['--model', 'qwen3'], [('q_norm', 'k_norm')]),
    # The first unmapped (source) or missing (family) weight: either family's names.
    'gemma3_on_qwen3': ('hf_qwen3', ['--model', 'gemma3'],
                        [QWEN3_WEIGHT_WORDS + GEMMA3_WEIGHT_WORDS]),
    'qwen3_on_gemma3': ('hf_gemma3', ['--model', 'qwen3'],
                        [QWEN3_WEIGHT_WORDS + GEMMA3_WEIGHT_WORDS]),
    'adapters_only_without_merge': ('hf_qwen3_lora_only', ['--model', 'qwen3'],
                                    [('--merge-lora',), ('--base',)]),
    'adapters_only_without_base': ('hf_qwen3_lora_only',
                                   ['--model', 'qwen3', '--merge-lora', '--lora-alpha', LORA_ALPHA],
                                   [('--base',)]),
    # A full LoRA save exported as is would silently drop the adapters (the base's weights).
    'lora_full_without_merge': ('hf_qwen3_lora', ['--model', 'qwen3'], [('--merge-lora',)]),
    'merge_without_alpha': ('hf_qwen3_lora', ['--model', 'qwen3', '--merge-lora'],
                            [('alpha',)]),
    'missing_step': ('hf_qwen3', ['--model', 'qwen3', '--step', '7'], [('7',)]),
    # Issue 29's families: each refused as its neighbour, naming the weights that differ.
    'llama3_on_qwen2': ('hf_qwen2', ['--model', 'llama3'], [('q_bias', 'k_bias', 'v_bias')]),
    'qwen2_on_llama3': ('hf_llama3', ['--model', 'qwen2'], [('q_bias', 'k_bias', 'v_bias')]),
    'qwen3_on_qwen3_moe': ('hf_qwen3_moe', ['--model', 'qwen3'], [('router', 'gate_proj')]),
    'qwen3_moe_on_qwen3': ('hf_qwen3', ['--model', 'qwen3_moe'], [('router', 'gate_proj')]),
    'gemma_on_gemma2': ('hf_gemma2', ['--model', 'gemma'], [('post_attn_norm',)]),
    'gemma2_on_gemma': ('hf_gemma', ['--model', 'gemma2'], [('post_attn_norm', 'post_ffw_norm')]),
    'gemma3_on_gemma2': ('hf_gemma2', ['--model', 'gemma3'],
                         [('post_attn_norm', '_query_norm', '_key_norm')]),
    'gemma3_on_gemma4': ('hf_gemma4', ['--model', 'gemma3'], [('per_layer', 'skip_scale')]),
    'gemma4_on_gemma3': ('hf_gemma3', ['--model', 'gemma4'], [('skip_scale',)]),
    # Qwen3's names (as Tunix's toy models use them) but not its shapes: say which family to pick.
    'shapes_not_the_family': ('sft_full', ['--model', 'qwen3'], [('q_proj',), ('--model',)]),
}


class Client:
  """What the module's tests assert on: the exports, the CLI runs and the worker's results."""

  def __init__(self, runs: dict[str, dict], worker: clients.Worker, work: pathlib.Path,
               before: dict, after: dict):
    self.runs, self.worker, self.work = runs, worker, work
    self.sources_before, self.sources_after = before, after

  def exported(self, name: str) -> pathlib.Path:
    r = self.runs[name]
    assert r['rc'] == 0, (f"`orbax-tunix {' '.join(r['argv'])}` failed (exit {r['rc']}):\n"
                          f"{r['stderr'][-3000:]}")
    return r['out']

  def result(self, job_id: str, *needs: str) -> dict:
    for name in needs:
      self.exported(name)
    r = self.worker.results.get(job_id)
    assert r is not None, f'the worker gave no result for {job_id}; its log:\n{self.worker.log()}'
    assert r['ok'], (f"Tunix job {job_id} ({r['job']}) failed: {r['error']}\n"
                     + '\n  caused by: '.join(r['error_chain']) + f"\n{r['traceback'][-4000:]}")
    return r

  def arrays(self, job_id: str, *needs: str, prefix: str = 'param/') -> dict[str, np.ndarray]:
    """The job's arrays under `prefix` (prefix removed), bfloat16 ones restored."""
    r = self.result(job_id, *needs)
    out = {}
    with np.load(r['npz']) as z:
      for k in z.files:
        if k.startswith(prefix):
          path = k[len(prefix):]
          a = z[k]
          if r['leaves'].get(path, {}).get('dtype') == 'bfloat16':
            a = a.view(ml_dtypes.bfloat16)
          out[path] = a
    return out

  def logits(self, job_id: str, *needs: str) -> np.ndarray:
    with np.load(self.result(job_id, *needs)['npz']) as z:
      return z['logits']


def _job(name: str, **kw) -> dict:
  e = manifest(name)
  return {'family': e['family'], 'config': e['model_config'], 'tokens': e['tokens'],
          **LOAD_OPTIONS.get(name, {}), **kw}


def _lora_spec(name: str) -> dict:
  lora = manifest(name)['lora']
  spec = {k: lora[k] for k in ('rank', 'alpha', 'module_path')}
  if name.endswith('_only'):
    spec.update(base_root=str(DATA / lora['base']), base_step=lora['base_step'])
  return spec


def _write_hf_dir(d: pathlib.Path, config: dict) -> pathlib.Path:
  d.mkdir(parents=True)
  (d / 'config.json').write_text(json.dumps(config, indent=2) + '\n')
  for f, text in HF_SIDE_FILES.items():
    (d / f).write_text(text)
  for f, data in HF_DECOYS.items():
    (d / f).write_bytes(data)
  return d


@pytest.fixture(scope='module')
def client(tunix_pkgs, tmp_path_factory):
  t0 = time.time()
  work = tmp_path_factory.mktemp('export_hf')
  worker = clients.Worker('Tunix', sys.executable, CLIENT, work / 'worker_out', work / 'worker.log',
                          env=subprocess_env(PYTHONPATH=tunix_pkgs))  # imports meanwhile
  sources = {name: snapshot(DATA / name) for name in (*FAMILY_FIXTURES, *LORA_FIXTURES)}
  out = work / 'out'
  planned: dict[str, tuple[pathlib.Path, list[str]]] = {}

  def plan(name, src, *flags, out_dir=None):
    planned[name] = (out_dir or out / name, export_argv(DATA / src, out_dir or out / name, *flags))

  for name, family in FAMILY_FIXTURES.items():
    plan(f'f32_{name}', name, '--model', family, *(['--json'] if name == 'hf_qwen3' else []))
    plan(f'bf16_{name}', name, '--model', family, '--dtype', 'bfloat16')
  plan('f32_hf_gemma3_budget', 'hf_gemma3', '--model', 'gemma3', '--dtype', 'float32',
       '--memory-budget', '256M')
  plan('step1_hf_llama3', 'hf_llama3', '--model', 'llama3', '--step', '1')
  for name, (src, size, _) in SHARDED.items():
    plan(name, src, '--model', FAMILY_FIXTURES[src], '--max-shard-size', size)
  for name in LORA_FIXTURES:
    base = manifest(name)['lora']['base']
    extra = ['--base', str(DATA / base)] if name.endswith('_only') else []
    plan(f'merged_{name}', name, '--model', FAMILY_FIXTURES[base], '--merge-lora',
         '--lora-alpha', str(manifest(name)['lora']['alpha']), *extra)
  hf_dirs = work / 'hf_dirs'
  for name in (*HF_CONFIG_EXTRA, *HF_CONFIG_FULL):
    d = _write_hf_dir(hf_dirs / name, HF_CONFIG_FULL.get(name) or {**HF_CONFIG_DIMS[name],
                                                                   **HF_CONFIG_EXTRA[name]})
    plan(f'hf_config_{name}', name, '--model', FAMILY_FIXTURES[name], '--hf-config', str(d))
  for case, (src, field, value) in HF_CONFIG_MISMATCH.items():
    config = {**HF_CONFIG_DIMS[src], **HF_CONFIG_EXTRA.get(src, {}), field: value}
    d = _write_hf_dir(hf_dirs / f'mismatch_{case}', config)
    plan(f'mismatch_{case}', src, '--model', FAMILY_FIXTURES[src], '--hf-config', str(d),
         out_dir=work / 'refused' / f'mismatch_{case}' / 'out')
  for case, (src, flags, _) in REFUSALS.items():
    plan(f'refuse_{case}', src, *flags, out_dir=work / 'refused' / case / 'out')
  # An existing OUT_DIR (with stale shards Tunix's glob would pick up): refused, then --force.
  # (The 'force' one is an older sharded export: its shards must not survive.)
  # Both are an earlier export of this package (its record in them: --force replaces only that).
  older = work / 'existing' / 'exists'
  made = run_cli(export_argv(DATA / 'hf_qwen3', older, '--model', 'qwen3', '--max-shard-size',
                             '60KB'))
  assert made['rc'] == 0 and (older / 'model.safetensors.index.json').exists(), made['stderr']
  shutil.copytree(older, work / 'existing' / 'force')
  for case in ('exists', 'force'):
    d = work / 'existing' / case
    plan(f'{case}_hf_qwen3', 'hf_qwen3', '--model', 'qwen3',
         *(['--force'] if case == 'force' else []), out_dir=d)
  existing_before = snapshot(work / 'existing' / 'exists')
  for case in (*HF_CONFIG_MISMATCH, *REFUSALS):
    (work / 'refused' / (f'mismatch_{case}' if case in HF_CONFIG_MISMATCH else case)).mkdir(
        parents=True, exist_ok=True)

  # The worker's jobs: the references at once, each export's loads as soon as it is written.
  after: dict[str | None, list[dict]] = {}

  def job(needs: str | None, **kw):
    after.setdefault(needs, []).append(kw)

  def out_of(name: str) -> str:
    return str(planned[name][0])

  for name in FAMILY_FIXTURES:
    job(None, id=f'ref_{name}', job='reference', **_job(name, root=str(DATA / name)))
    for kind in ('f32', 'bf16'):
      job(f'{kind}_{name}', id=f'load_{kind}_{name}', job='load',
          **_job(name, dir=out_of(f'{kind}_{name}'), logits=kind == 'f32'))
  job(None, id='ref_step1_hf_llama3', job='reference',
      **_job('hf_llama3', root=str(DATA / 'hf_llama3'), step=1))
  job('step1_hf_llama3', id='load_step1_hf_llama3', job='load',
      **_job('hf_llama3', dir=out_of('step1_hf_llama3')))
  for name, (src, _, _) in SHARDED.items():
    job(name, id=f'load_{name}', job='load', **_job(src, dir=out_of(name), logits=False))
  for name in LORA_FIXTURES:
    spec = _lora_spec(name)
    job(None, id=f'ref_{name}', job='reference', **_job(name, root=str(DATA / name), lora=spec))
    job(f'merged_{name}', id=f'load_merged_{name}', job='load',
        **_job(name, dir=out_of(f'merged_{name}')))
    if name in TUNIX_MERGE_FIXTURES:  # Tunix's own merged saver, on our export of the base.
      base = manifest(name)['lora']['base']
      job(f'f32_{base}', id=f'tunix_merge_{name}', job='tunix_merge',
          **_job(name, root=str(DATA / name), lora=spec, base_dir=out_of(f'f32_{base}'),
                 out=str(work / 'tunix_merged' / name)))
  # Tunix's Gemma loader as it is, on a Gemma 1 export (see LOAD_OPTIONS).
  job('f32_hf_gemma', id='load_stock_f32_hf_gemma', job='load',
      **_job('hf_gemma', dir=out_of('f32_hf_gemma'), gemma1_norm_name=False, logits=False))
  for name in (*HF_CONFIG_EXTRA, *HF_CONFIG_FULL):
    job(f'hf_config_{name}', id=f'load_hf_config_{name}', job='load',
        **_job(name, dir=out_of(f'hf_config_{name}'), logits=False))
  n_jobs = sum(len(js) for js in after.values())
  worker.send(*after.pop(None))

  runs = {}
  with concurrent.futures.ThreadPoolExecutor(max(2, os.cpu_count() or 2)) as pool:
    futures = {pool.submit(run_cli, argv): name for name, (_, argv) in planned.items()}
    for f in concurrent.futures.as_completed(futures):
      name = futures[f]
      runs[name] = {**f.result(), 'out': planned[name][0]}
      if runs[name]['rc'] == 0:
        worker.send(*after.get(name, []))
  export_seconds = time.time() - t0
  runs['exists_hf_qwen3']['snapshot_before'] = existing_before
  sources_after = {name: snapshot(DATA / name) for name in sources}
  worker.finish(WORKER_TIMEOUT)
  ready = worker.results.get('__ready__', {})
  slowest = max(runs.values(), key=lambda r: r['seconds'])
  print(f"\n[export_hf] {len(runs)} CLI runs in {export_seconds:.1f} s (slowest"
        f" {slowest['seconds']:.1f} s; parallel with the worker's imports,"
        f" {ready.get('import_seconds', float('nan')):.1f} s); {len(worker.results) - 1} Tunix"
        f' jobs (of {n_jobs} planned); all done'
        f' in {time.time() - t0:.1f} s', file=sys.stderr)
  return Client(runs, worker, work, sources, sources_after)


def assert_equal_arrays(got: dict, want: dict, what: str):
  """Same names, and each array bit-exact with the same dtype."""
  assert sorted(got) == sorted(want), (
      f'{what}: names differ: only got {sorted(set(got) - set(want))}, '
      f'only expected {sorted(set(want) - set(got))}')
  for name, value in want.items():
    assert got[name].dtype == value.dtype, f'{what} {name}: {got[name].dtype} != {value.dtype}'
    assert got[name].shape == value.shape, f'{what} {name}: {got[name].shape} != {value.shape}'
    np.testing.assert_array_equal(got[name], value, err_msg=f'{what} {name}')


def assert_loaded_cleanly(r: dict):
  """Every leaf of the loaded model is a real array, and the loader skipped no tensor."""
  abstract = sorted(p for p, leaf in r['leaves'].items() if leaf['type'] != 'array')
  assert not abstract, f'the loader left these abstract: {abstract}'
  skipped = [m for m in r['log'] if 'skip' in m.lower()]
  assert not skipped, f"Tunix's loader skipped tensors: {skipped}"


def bf16(weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  return {k: v.astype(ml_dtypes.bfloat16) for k, v in weights.items()}


# --------------------------------------------------------------------------- #
# a. float32 as stored: files, names, layouts; Tunix's loader; logits
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize('name', FAMILY_FIXTURES)
def test_a_export_writes_the_hf_names_and_layouts(client, name):
  e = Export(client.exported(f'f32_{name}'))
  e.check_files()
  assert e.files == ['model.safetensors'], e.files  # no config.json without --hf-config
  assert_equal_arrays(e.tensors, hf_expected(FAMILY_FIXTURES[name], raw(name)),
                      'exported tensors vs the HF table applied to the raw weights')
  if manifest(name)['family'].startswith('gemma') or manifest(name)['model_config'].get(
      'weight_tying') or manifest(name)['model_config'].get('use_tied_embedding'):
    assert 'lm_head.weight' not in e.tensors
  r = client.runs[f'f32_{name}']
  assert 'config.json' in r['stdout'] + r['stderr'], (
      'no note that a config.json must be added before loading:\n' + r['stdout'] + r['stderr'])


def test_a_json_output_is_one_document(client):
  r = client.runs['f32_hf_qwen3']
  client.exported('f32_hf_qwen3')
  json.loads(r['stdout'])


@pytest.mark.parametrize('name', FAMILY_FIXTURES)
def test_a_tunix_loader_gives_back_the_raw_weights(client, name):
  r = client.result(f'load_f32_{name}', f'f32_{name}')
  assert_loaded_cleanly(r)
  assert_equal_arrays(client.arrays(f'load_f32_{name}'), raw(name),
                      "Tunix's create_model_from_safe_tensors vs the raw checkpoint")


@pytest.mark.parametrize('name', FAMILY_FIXTURES)
def test_a_logits_equal_the_model_tunix_restores(client, name):
  got = client.logits(f'load_f32_{name}', f'f32_{name}')
  want = client.logits(f'ref_{name}')
  assert got.dtype == want.dtype == np.float32
  assert np.abs(want).max() > 1, 'degenerate reference logits'
  diff = float(np.abs(got.astype(np.float64) - want).max())
  assert np.array_equal(got, want), f'logits differ from the restored model by up to {diff}'


def test_a_gemma3_fixture_has_local_and_global_layers():
  # Tunix's Gemma3 makes every 6th layer global and the others sliding-window (window 4 < 7
  # tokens): 6 layers exercise both, with the two RoPE bases.
  cfg = manifest('hf_gemma3')['model_config']
  assert cfg['num_layers'] == 6 and cfg['sliding_window_size'] < len(
      manifest('hf_gemma3')['tokens'][0])
  assert 'layers/5/attn/kv_einsum/w' in raw('hf_gemma3')
  assert 'layers/0/attn/qkv_einsum/w' in raw('hf_gemma3_fused')


# --------------------------------------------------------------------------- #
# b. --dtype bfloat16, --step
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize('name', FAMILY_FIXTURES)
def test_b_bfloat16_export_is_the_raw_weights_cast(client, name):
  e = Export(client.exported(f'bf16_{name}'))
  e.check_files()
  assert {h['dtype'] for f in e.weight_files for h in e.headers[f].values()} == {'BF16'}
  assert_equal_arrays(e.tensors, bf16(hf_expected(FAMILY_FIXTURES[name], raw(name))),
                      'bf16 export vs the HF table on the raw weights cast to bfloat16')
  r = client.result(f'load_bf16_{name}', f'bf16_{name}')
  assert_loaded_cleanly(r)
  assert_equal_arrays(client.arrays(f'load_bf16_{name}'), bf16(raw(name)),
                      "Tunix's loader on the bf16 export vs raw cast to bfloat16")


def test_b_explicit_float32_and_memory_budget(client):
  e = Export(client.exported('f32_hf_gemma3_budget'))
  e.check_files()
  assert_equal_arrays(e.tensors, hf_expected('gemma3', raw('hf_gemma3')), '--dtype float32')


def test_b_step_option_picks_the_step(client):
  assert manifest('hf_llama3')['steps'] == [1, 2]
  step1, step2 = raw('hf_llama3', 1), raw('hf_llama3', 2)
  assert any(not np.array_equal(step1[k], step2[k]) for k in step1)
  # The default is the latest step.
  assert_equal_arrays(client.arrays('load_f32_hf_llama3', 'f32_hf_llama3'), step2, 'default step')
  r = client.result('load_step1_hf_llama3', 'step1_hf_llama3')
  assert_loaded_cleanly(r)
  assert_equal_arrays(client.arrays('load_step1_hf_llama3'), step1, '--step 1')
  assert client.result('ref_step1_hf_llama3')['step'] == 1
  assert np.array_equal(client.logits('load_step1_hf_llama3'), client.logits('ref_step1_hf_llama3'))


# --------------------------------------------------------------------------- #
# c. --max-shard-size: transformers' file layout, and Tunix loads the shards
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize('name', SHARDED)
def test_c_sharded_export_layout_and_load(client, name):
  src, _, limit = SHARDED[name]
  e = Export(client.exported(name))
  e.check_files()
  expected = hf_expected(FAMILY_FIXTURES[src], raw(src))
  assert_equal_arrays(e.tensors, expected, f'{name} tensors')
  total = sum(a.nbytes for a in expected.values())
  if total <= limit:
    assert e.weight_files == ['model.safetensors'], (total, limit, e.weight_files)
  else:
    assert len(e.weight_files) > 1, e.weight_files
    assert sorted(e.files) == sorted([*e.weight_files, 'model.safetensors.index.json'])
    for f in e.weight_files:
      sizes = {n: h['data_offsets'][1] - h['data_offsets'][0] for n, h in e.headers[f].items()}
      if len(sizes) > 1:
        assert sum(sizes.values()) <= limit, f'{f} holds {sum(sizes.values())} > {limit} bytes'
    for n, a in expected.items():  # a tensor larger than the limit: a shard of its own
      if a.nbytes > limit:
        assert len(e.headers[e.where[n]]) == 1, f'{n} ({a.nbytes} > {limit}) shares its shard'
    assert any(len(h) > 1 for h in e.headers.values()), 'one tensor per shard: not packed'
  r = client.result(f'load_{name}', name)
  assert_loaded_cleanly(r)
  assert_equal_arrays(client.arrays(f'load_{name}'), raw(src), f'Tunix loader on {name}')


def test_c_sharded_cases_cover_oversized_tensors_and_one_file():
  # Some limits lie below the embedding (96 x 40 x 4 = 15360 bytes: a shard of its own), one
  # lies above the whole model (one file, no index), one packs several shards of many tensors.
  cases = {}
  for name, (src, _, limit) in SHARDED.items():
    weights = raw(src)
    total = sum(a.nbytes for a in weights.values())
    emb = weights['embedder/input_embedding'].nbytes
    cases[name] = ('one file' if limit >= total else
                   'oversized' if emb > limit else 'packed')
  assert set(cases.values()) == {'one file', 'oversized', 'packed'}, cases


# --------------------------------------------------------------------------- #
# d. --merge-lora: qwix adapters merged; Tunix's plain model computes the LoRA model's logits
# --------------------------------------------------------------------------- #
def test_d_lora_fixtures_are_one_run_on_hf_qwen3():
  full, only, base = raw('hf_qwen3_lora'), raw('hf_qwen3_lora_only'), raw('hf_qwen3')
  lora = manifest('hf_qwen3_lora')['lora']
  adapters = {k: v for k, v in full.items() if re.search(r'_lora_[ab]$', k)}
  assert_equal_arrays(only, adapters, 'adapters-only save vs the full save\'s adapters')
  assert_equal_arrays({k: v for k, v in full.items() if k not in adapters}, base,
                      'the full LoRA save\'s base weights vs hf_qwen3')
  targets = sorted({re.sub(r'_lora_[ab]$', '', k) for k in adapters})
  assert targets == lora['targets'] and len(targets) == 7 * 2
  assert all(adapters[f'{t}_lora_a'].shape[-1] == lora['rank'] for t in targets)
  assert lora['logits_max_abs_change_by_adapters'] > 1e3 * MERGE_ATOL


@pytest.mark.parametrize('name', [n for n in LORA_FIXTURES if not n.endswith('_only')])
def test_d_lora_runs_train_only_adapters_on_their_base(name):
  """A full LoRA save: its base weights are the base fixture's, its adapters the targets."""
  lora = manifest(name)['lora']
  saved = raw(name)
  adapters = {k: v for k, v in saved.items() if re.search(r'_lora_[ab]$', k)}
  assert_equal_arrays({k: v for k, v in saved.items() if k not in adapters},
                      raw(lora['base'], lora['base_step']), f'{name}\'s base weights')
  assert sorted({re.sub(r'_lora_[ab]$', '', k) for k in adapters}) == lora['targets']


def test_d_gemma4_lora_targets_what_qwix_can_adapt():
  """qwix adapts the einsums a forward pass calls, and modules only: Gemma 4's kv-shared
  layers (3-5, reading layers 1-2's cache) keep a plain kv_einsum, the MoE experts (bare
  Params) none; the k_eq_v global layer's k_einsum is adapted."""
  dense = manifest('hf_gemma4_lora')['lora']['targets']
  assert sorted(t for t in dense if '/kv_einsum/' in t) == [
      f'layers/{i}/attn/kv_einsum/w' for i in range(3)]
  assert len(dense) == 6 * 5 + 3  # q, attn_vec, gate, up, down in every layer; kv in 0-2
  moe = manifest('hf_gemma4_moe_lora')['lora']['targets']
  assert 'layers/1/attn/k_einsum/w' in moe and not [t for t in moe if '/moe/' in t]


LORA_EINSUMS = {'q_einsum': 'dr,rnh->ndh', 'kv_einsum': 'dr,rckh->ckdh', 'k_einsum': 'dr,rkh->kdh'}


def hand_merged(name: str) -> dict[str, np.ndarray]:
  """The base's weights with each adapter merged in float64: W + (alpha / rank) a.b."""
  lora = manifest(name)['lora']
  adapters = raw(name) if name.endswith('_only') else {
      k: v for k, v in raw(name).items() if re.search(r'_lora_[ab]$', k)}
  out = dict(raw(lora['base'], lora['base_step']))
  for t in lora['targets']:
    a = adapters[f'{t}_lora_a'].astype(np.float64)
    b = adapters[f'{t}_lora_b'].astype(np.float64)
    # qwix: a (the axes the einsum's input shares, r), b (r, the rest); Gemma's q/kv/k
    # einsums ('BTD,NDH->BTNH', 'BSD,CKDH->CBSKH', 'BSD,KDH->BSKH') put D inside the weight.
    module = t.split('/')[-2]
    delta = (np.einsum(LORA_EINSUMS[module], a, b) if module in LORA_EINSUMS else
             np.tensordot(a, b, axes=([-1], [0])))
    assert delta.shape == out[t].shape, (t, delta.shape, out[t].shape)
    out[t] = out[t].astype(np.float64) + lora['alpha'] / lora['rank'] * delta
  return out


@pytest.mark.parametrize('name', LORA_FIXTURES)
def test_d_merged_export_weights(client, name):
  e = Export(client.exported(f'merged_{name}'))
  e.check_files()
  lora = manifest(name)['lora']
  family = FAMILY_FIXTURES[lora['base']]
  merged = hand_merged(name)
  want = hf_expected(family, merged)
  assert sorted(e.tensors) == sorted(want), f'merged export names differ from plain {family}\'s'
  targets = set(hf_expected(family, {t: merged[t] for t in lora['targets']}))
  for n, w in want.items():
    got = e.tensors[n]
    assert got.dtype == np.float32, (n, got.dtype)
    if n in targets:
      np.testing.assert_allclose(got, w, rtol=0, atol=WEIGHT_ATOL, err_msg=n)
      assert not np.allclose(got, hf_expected(family, raw(lora['base']))[n], atol=1e-3), (
          f'{n}: the adapter was not merged')
    else:
      np.testing.assert_array_equal(got, w.astype(np.float32), err_msg=n)


@pytest.mark.parametrize('name', TUNIX_MERGE_FIXTURES)
def test_d_merged_export_equals_tunix_own_merged_saver(client, name):
  """Tunix's save_lora_merged_model_as_safetensors (on our export of the base) agrees."""
  r = client.result(f'tunix_merge_{name}', f"f32_{manifest(name)['lora']['base']}")
  assert r['files'] == ['model.safetensors'], r['files']
  _, _, theirs = read_safetensors(pathlib.Path(r['out']) / 'model.safetensors')
  ours = Export(client.exported(f'merged_{name}')).tensors
  assert sorted(ours) == sorted(theirs)
  for n in theirs:
    np.testing.assert_allclose(ours[n], theirs[n], rtol=0, atol=WEIGHT_ATOL, err_msg=n)


@pytest.mark.parametrize('name', LORA_FIXTURES)
def test_d_merged_logits_equal_the_lora_models_own(client, name):
  r = client.result(f'load_merged_{name}', f'merged_{name}')
  assert_loaded_cleanly(r)
  base = manifest(name)['lora']['base']
  assert r['model_class'] == manifest(base)['model']  # Tunix's plain class (Qwen3, Qwen2)
  assert not [p for p in r['leaves'] if 'lora' in p], 'adapter tensors in the plain model'
  got = client.logits(f'load_merged_{name}')
  lora_logits = client.logits(f'ref_{name}')  # qwix in the loop
  base_logits = client.logits(f'ref_{base}')
  assert got.dtype == lora_logits.dtype == np.float32
  effect = float(np.abs(lora_logits - base_logits).max())
  diff = float(np.abs(got.astype(np.float64) - lora_logits).max())
  atol = MERGE_ATOL_BY_FIXTURE.get(name, MERGE_ATOL)
  assert effect > 1e3 * atol, f'the adapters barely move the logits ({effect})'
  assert diff <= atol, (f'merged logits differ from the LoRA model\'s by {diff}'
                        f' (the adapters move them by {effect})')


def test_d_adapters_only_merge_equals_the_full_merge(client):
  full = Export(client.exported('merged_hf_qwen3_lora')).tensors
  only = Export(client.exported('merged_hf_qwen3_lora_only')).tensors
  assert_equal_arrays(only, full, '--base hf_qwen3 + adapters vs the full save')
  np.testing.assert_array_equal(client.logits('ref_hf_qwen3_lora'),
                                client.logits('ref_hf_qwen3_lora_only'))


# --------------------------------------------------------------------------- #
# e. --hf-config: copied after the check; a mismatch is refused, naming the field
# --------------------------------------------------------------------------- #
# What an export may write over the base's config.json (see `hf_config.check_config`).
CONFIG_WRITTEN = frozenset({'architectures', 'model_type', 'tie_word_embeddings', 'torch_dtype',
                            'dtype', 'hidden_activation', 'hidden_act'})


def _without_written(config: dict) -> dict:
  return {k: _without_written(v) if k == 'text_config' else v
          for k, v in config.items() if k not in CONFIG_WRITTEN}


@pytest.mark.parametrize('name', [*HF_CONFIG_EXTRA, *HF_CONFIG_FULL])
def test_e_hf_config_files_are_copied(client, name):
  out = client.exported(f'hf_config_{name}')
  hf_dir = client.work / 'hf_dirs' / name
  e = Export(out)
  e.check_files()
  assert sorted(e.files) == sorted(['model.safetensors', 'config.json', *HF_SIDE_FILES]), e.files
  for f in HF_SIDE_FILES:
    assert (out / f).read_bytes() == (hf_dir / f).read_bytes(), f'{f} not copied as is'
  # config.json: as is, but for what the export writes over it (issue 27): the weights'
  # architecture, tying and dtype, the family's fixed fields (gemma's tanh GELU), and what the
  # base config left to its class's defaults (gemma3_fused's omits tie_word_embeddings).
  got, base = (json.loads((d / 'config.json').read_text()) for d in (out, hf_dir))
  assert _without_written(got) == _without_written(base), (got, base)
  text = got.get('text_config', got)
  assert text['tie_word_embeddings'] is ('lm_head.weight' not in e.tensors), text
  dtypes = {str(a.dtype) for a in e.tensors.values()}
  assert {got.get('torch_dtype', got.get('dtype')), *dtypes} == dtypes, (got, dtypes)
  assert_equal_arrays(e.tensors, hf_expected(FAMILY_FIXTURES[name], raw(name)),
                      'the weights are the export, not the --hf-config folder\'s')
  r = client.result(f'load_hf_config_{name}', f'hf_config_{name}')
  assert_loaded_cleanly(r)
  assert_equal_arrays(client.arrays(f'load_hf_config_{name}'), raw(name), 'Tunix loader')


# transformers (the MaxText venv's, 5.24) reads each exported config.json; what its config
# objects say, printed as JSON. Nothing of orbax_tunix is imported there.
AUTOCONFIG = """
import json, sys
from transformers import AutoConfig
out = {}
for d in sys.argv[1:]:
  c = AutoConfig.from_pretrained(d)
  t = c.get_text_config()
  # Gemma 4's head dim and kv heads are per layer (config.per_layer_config[i]); the others'
  # head dim as their attention reads it (`getattr(config, 'head_dim', None) or D // heads`).
  hetero = getattr(t, 'is_heterogeneous', False)
  layers = [t.per_layer_config[i] if hetero else t for i in range(t.num_hidden_layers)]
  out[d] = {'class': type(c).__name__, 'text_class': type(t).__name__,
            'model_type': c.model_type, 'architectures': c.architectures,
            'layers': [{'head_dim': getattr(lc, 'head_dim', None)
                        or t.hidden_size // t.num_attention_heads,
                        'num_key_value_heads': lc.num_key_value_heads} for lc in layers],
            'text': {k: getattr(t, k, None) for k in (
                'vocab_size', 'hidden_size', 'intermediate_size', 'num_hidden_layers',
                'num_attention_heads', 'attention_k_eq_v', 'num_kv_shared_layers',
                'use_double_wide_mlp', 'hidden_size_per_layer_input', 'layer_types',
                'moe_intermediate_size', 'num_experts', 'tie_word_embeddings')}}
print(json.dumps(out))
"""
# The transformers classes each family's config.json must give (by hand, from transformers).
AUTOCONFIG_CLASSES = {'hf_qwen2': 'Qwen2Config', 'hf_qwen3_moe': 'Qwen3MoeConfig',
                      'hf_gemma': 'GemmaConfig', 'hf_gemma2': 'Gemma2Config',
                      'hf_gemma4': 'Gemma4Config', 'hf_gemma4_moe': 'Gemma4Config'}


@pytest.fixture(scope='module')
def autoconfigs(client) -> dict:
  """transformers' AutoConfig on every --hf-config export of HF_CONFIG_FULL, in one subprocess."""
  python = client_env('maxtext_venv.sh')
  dirs = {name: str(client.exported(f'hf_config_{name}')) for name in HF_CONFIG_FULL}
  p = subprocess.run([python, '-c', AUTOCONFIG, *dirs.values()], capture_output=True, text=True,
                     timeout=CLI_TIMEOUT, check=False, env={**os.environ, 'PYTHONPATH': ''})
  assert p.returncode == 0, p.stderr[-4000:]
  found = json.loads(p.stdout.strip().splitlines()[-1])
  return {name: found[d] for name, d in dirs.items()}


def _layers(tensors: dict) -> list[int]:
  return sorted({int(m.group(1)) for n in tensors if (m := re.search(r'layers\.(\d+)\.', n))})


@pytest.mark.parametrize('name', HF_CONFIG_FULL)
def test_e_transformers_reads_the_config_of_the_exported_weights(client, autoconfigs, name):
  """AutoConfig loads the copied config.json, and it describes the exported tensors' shapes."""
  got = autoconfigs[name]
  want_config = HF_CONFIG_FULL[name]
  assert got['class'] == AUTOCONFIG_CLASSES[name], got
  assert got['architectures'] == want_config['architectures'], got
  t = got['text']
  e = Export(client.exported(f'hf_config_{name}'))
  x = e.tensors
  pre = G4 if FAMILY_FIXTURES[name] == 'gemma4' else 'model.'
  emb = x[pre + 'embed_tokens.weight']
  assert emb.shape == (t['vocab_size'], t['hidden_size'])
  layers = _layers(x)
  assert layers == list(range(t['num_hidden_layers']))
  assert ('lm_head.weight' in x) == (not t['tie_word_embeddings'])
  full = [i for i in layers if t['layer_types'] and t['layer_types'][i] == 'full_attention']
  shared_from = t['num_hidden_layers'] - (t['num_kv_shared_layers'] or 0)
  if FAMILY_FIXTURES[name] == 'gemma4':  # the fixtures' global layers differ from local ones
    assert {got['layers'][i]['head_dim'] for i in full} == {16} != {
        got['layers'][i]['head_dim'] for i in layers if i not in full}
  for i in layers:
    at = f'{pre}layers.{i}.'
    head_dim, kv_heads = got['layers'][i]['head_dim'], got['layers'][i]['num_key_value_heads']
    d = t['hidden_size']
    assert x[at + 'self_attn.q_proj.weight'].shape == (t['num_attention_heads'] * head_dim, d)
    assert x[at + 'self_attn.o_proj.weight'].shape == (d, t['num_attention_heads'] * head_dim)
    assert x[at + 'self_attn.k_proj.weight'].shape == (kv_heads * head_dim, d)
    # k == v (Gemma 4's global layers with attention_k_eq_v): no v_proj at all.
    assert (at + 'self_attn.v_proj.weight' in x) == (not (i in full and t['attention_k_eq_v']))
    if t['num_experts'] and FAMILY_FIXTURES[name] == 'qwen3_moe':
      for e_ in range(t['num_experts']):
        assert x[at + f'mlp.experts.{e_}.gate_proj.weight'].shape == (t['moe_intermediate_size'], d)
        assert x[at + f'mlp.experts.{e_}.down_proj.weight'].shape == (d, t['moe_intermediate_size'])
      assert x[at + 'mlp.gate.weight'].shape == (t['num_experts'], d)
      assert f'{at}mlp.experts.{t["num_experts"]}.gate_proj.weight' not in x
      continue
    wide = 2 if t['use_double_wide_mlp'] and i >= shared_from else 1
    assert x[at + 'mlp.gate_proj.weight'].shape == (wide * t['intermediate_size'], d)
    if t['num_experts']:  # Gemma 4's MoE block beside its dense MLP
      assert x[at + 'experts.gate_up_proj'].shape == (
          t['num_experts'], 2 * t['moe_intermediate_size'], d)
      assert x[at + 'router.proj.weight'].shape == (t['num_experts'], d)
  if t['hidden_size_per_layer_input']:
    assert x[G4 + 'embed_tokens_per_layer.weight'].shape == (
        t['vocab_size'], t['num_hidden_layers'] * t['hidden_size_per_layer_input'])


def test_a_new_fixtures_hold_what_their_families_vary():
  """The issue-29 fixtures exercise what differs within each family."""
  g4 = raw('hf_gemma4')
  cfg = manifest('hf_gemma4')['model_config']
  assert g4['layers/2/attn/q_einsum/w'].shape[-1] == cfg['global_key_size'] != cfg['head_dim']
  assert g4['layers/0/attn/q_einsum/w'].shape[-1] == cfg['head_dim']
  assert 'embedder/per_layer_input_embedding' in g4  # per-layer inputs (E2B, E4B)
  # Layers 3..5 reuse 1's and 2's kv (frac_shared_layers 0.5) with a double-wide MLP.
  assert g4['layers/3/mlp/gate_proj/kernel'].shape[1] == 2 * g4[
      'layers/0/mlp/gate_proj/kernel'].shape[1]
  moe = raw('hf_gemma4_moe')
  assert 'layers/1/attn/k_einsum/w' in moe and 'layers/1/attn/kv_einsum/w' not in moe
  assert 'layers/0/attn/kv_einsum/w' in moe and 'layers/0/moe/gating_einsum' in moe
  assert raw('hf_qwen3_moe')['layers/0/mlp/gate_proj'].shape == (3, 40, 20)
  assert 'layers/0/attn/q_bias' in raw('hf_qwen2')
  assert 'layers/0/post_attn_norm/scale' in raw('hf_gemma2')
  assert not [p for p in raw('hf_gemma') if 'post_' in p]  # Gemma 1: no post norms
  for name in ('hf_qwen2', 'hf_qwen3_moe', 'hf_gemma', 'hf_gemma2', 'hf_gemma4',
               'hf_gemma4_moe'):
    assert manifest(name)['versions']['google-tunix'] == '0.1.7'


def test_a_tunix_gemma_loader_misreads_gemma1(client):
  """Why hf_gemma loads with one entry of Tunix's map changed (LOAD_OPTIONS): as it is,
  Tunix 0.1.7's Gemma loader does not load a Gemma 1 folder in transformers' names."""
  client.exported('f32_hf_gemma')
  r = client.worker.results.get('load_stock_f32_hf_gemma')
  assert r is not None, client.worker.log()
  assert not r['ok'], 'Tunix\'s stock Gemma loader now loads Gemma 1: drop LOAD_OPTIONS'


def assert_refused(client, run_name: str, words: list[tuple[str, ...]]):
  r = client.runs[run_name]
  msg = r['stderr'] + r['stdout']
  assert r['rc'] == 2, f"`orbax-tunix {' '.join(r['argv'])}` exited {r['rc']}, not 2:\n{msg}"
  assert 'run again with --debug' not in msg, f'an unexpected error, not a refusal:\n{msg}'
  for alternatives in words:
    assert any(w in msg for w in alternatives), f'the message names none of {alternatives}:\n{msg}'
  parent = r['out'].parent
  assert sorted(os.listdir(parent)) == [], f'the refusal wrote {sorted(os.listdir(parent))}'


@pytest.mark.parametrize('case', HF_CONFIG_MISMATCH)
def test_e_hf_config_mismatch_is_refused(client, case):
  _, field, _ = HF_CONFIG_MISMATCH[case]
  assert_refused(client, f'mismatch_{case}', [(field,)])


# --------------------------------------------------------------------------- #
# f. refusals, OUT_DIR rules, sources untouched
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize('case', REFUSALS)
def test_f_refusals(client, case):
  assert_refused(client, f'refuse_{case}', REFUSALS[case][2])


def test_f_existing_out_dir_is_refused_without_force(client):
  r = client.runs['exists_hf_qwen3']
  msg = r['stderr'] + r['stdout']
  assert r['rc'] == 2, f'exit {r["rc"]}:\n{msg}'
  assert '--force' in msg, msg
  assert 'run again with --debug' not in msg, msg
  assert snapshot(r['out']) == r['snapshot_before'], 'the existing OUT_DIR was changed'
  assert sorted(os.listdir(r['out'].parent)) == ['exists', 'force']


def test_f_force_replaces_the_out_dir(client):
  out = client.exported('force_hf_qwen3')
  e = Export(out)
  e.check_files()
  # Nothing of the old folder is left: a stale shard would be loaded by Tunix's glob.
  assert e.files == ['model.safetensors'], e.files
  assert_equal_arrays(e.tensors, hf_expected('qwen3', raw('hf_qwen3')), '--force export')


def test_f_nothing_left_beside_the_exports(client):
  """Exports are written beside OUT_DIR and moved: no temporary entry may remain."""
  exported = {r['out'] for r in client.runs.values() if r['rc'] == 0}
  for parent in (client.work / 'out', client.work / 'existing'):
    left = sorted(p.name for p in parent.iterdir() if p not in exported)
    assert left in ([], ['exists']), f'entries left in {parent}: {left}'


def test_f_sources_untouched(client):
  for name, before in client.sources_before.items():
    assert client.sources_after[name] == before, f'exporting changed tests/data/tunix/{name}'


def test_tunix_is_not_imported_in_the_test_process(client, tunix_pkgs):
  # Its model modules set flax_always_shard_variable=False process-wide: only the worker may.
  assert not [m for m in sys.modules if m == 'tunix' or m.startswith('tunix.')]
  ready = client.worker.results['__ready__']
  assert ready['tunix_file'].startswith(tunix_pkgs), ready  # Tunix from tunix-pkgs
  assert ready['qwix_file'].startswith(sys.prefix), ready  # the pinned stack: this venv's
  assert ready['flax_always_shard_variable'] is False, ready  # what Tunix's import does


@pytest.mark.parametrize('where', ['the folder', 'a link to it', 'a folder holding it'])
def test_f_out_dir_over_the_hf_config_folder_is_refused(tmp_path, where):
  """The base model's folder (its weights too) is read, never replaced, even with --force."""
  hf = _write_hf_dir(tmp_path / 'parent' / 'base', HF_CONFIG_DIMS['hf_qwen3'])
  (hf / 'model.safetensors').write_bytes(b'the base model weights')
  out = {'the folder': hf, 'a link to it': tmp_path / 'link', 'a folder holding it': hf.parent}
  (tmp_path / 'link').symlink_to(hf)
  (hf.parent / 'model.safetensors').write_bytes(b'an old export')  # What --force may replace.
  before = snapshot(tmp_path)
  r = run_cli(export_argv(DATA / 'hf_qwen3', out[where], '--model', 'qwen3', '--hf-config',
                          str(hf), '--force'))
  assert r['rc'] == 2, r
  assert re.search(r'the destination is (a directory holding )?the --hf-config folder',
                   r['stderr']), r['stderr']
  assert snapshot(tmp_path) == before


def test_f_force_does_not_replace_a_folder_with_only_a_config(tmp_path):
  """A config.json is no sign of an export (many projects hold one): --force refuses it."""
  project = tmp_path / 'project'
  (project / 'src').mkdir(parents=True)
  (project / 'config.json').write_text('{}')
  (project / 'src' / 'main.py').write_text('print(1)\n')
  before = snapshot(tmp_path)
  r = run_cli(export_argv(DATA / 'hf_qwen3', project, '--model', 'qwen3', '--force'))
  assert r['rc'] == 2, r
  assert 'not a Hugging Face export' in r['stderr'] and 'never written over' in r['stderr'], r
  assert snapshot(tmp_path) == before


# --------------------------------------------------------------------------- #
# g. the config written is one transformers reads as the model the tensors are
# --------------------------------------------------------------------------- #
_AUTOCONFIG = """
import json, sys, transformers
c = transformers.AutoConfig.from_pretrained(sys.argv[1])
print(json.dumps({'class': type(c).__name__, 'architectures': c.architectures,
                  'model_type': c.model_type, 'vocab_size': c.vocab_size,
                  'hidden_size': c.hidden_size, 'num_hidden_layers': c.num_hidden_layers,
                  'head_dim': c.head_dim, 'hidden_activation': c.hidden_activation,
                  'tie_word_embeddings': c.tie_word_embeddings, 'sliding_window': c.sliding_window,
                  'eos_token_id': c.eos_token_id, 'dtype': str(c.dtype)}))
"""


def test_g_gemma3_multimodal_config_becomes_the_text_models(tmp_path):
  """gemma-3-4b-it's config.json (Gemma3ForConditionalGeneration, a text_config inside, written
  here as the Hub's looks, with the fixture's dims and MaxText's "gelu") on an export of text
  weights (model.layers...): written as Gemma3ForCausalLM's, read by transformers' AutoConfig."""
  m = manifest('hf_gemma3')['model_config']
  base = {
      'architectures': ['Gemma3ForConditionalGeneration'], 'boi_token_index': 255999,
      'eoi_token_index': 256000, 'eos_token_id': [1, 106], 'image_token_index': 262144,
      'initializer_range': 0.02, 'mm_tokens_per_image': 256, 'model_type': 'gemma3',
      'text_config': {
          'hidden_size': 40, 'intermediate_size': 56, 'model_type': 'gemma3_text',
          'num_hidden_layers': m['num_layers'], 'num_attention_heads': 4,
          'num_key_value_heads': m['num_kv_heads'], 'head_dim': 12, 'hidden_activation': 'gelu',
          'rope_scaling': {'factor': 8.0, 'rope_type': 'linear'}, 'sliding_window': 1024},
      'torch_dtype': 'bfloat16', 'transformers_version': '4.50.0.dev0',
      'vision_config': {'hidden_size': 1152, 'image_size': 896, 'intermediate_size': 4304,
                        'model_type': 'siglip_vision_model', 'num_attention_heads': 16,
                        'num_hidden_layers': 27, 'patch_size': 14, 'vision_use_head': False},
  }
  hf = tmp_path / 'gemma-3-4b-it'
  hf.mkdir()
  (hf / 'config.json').write_text(json.dumps(base, indent=2))
  out = tmp_path / 'out'
  r = run_cli(export_argv(DATA / 'hf_gemma3', out, '--model', 'gemma3', '--hf-config', str(hf)))
  assert r['rc'] == 0, r['stderr']
  assert 'multimodal' in r['stderr'] and 'hidden_activation' in r['stderr'], r['stderr']
  got = subprocess.run([client_env('maxtext_venv.sh'), '-c', _AUTOCONFIG, str(out)], capture_output=True,
                       text=True, timeout=300, check=False, env=subprocess_env())
  assert got.returncode == 0, got.stderr[-3000:]
  assert json.loads(got.stdout.strip().splitlines()[-1]) == {
      'class': 'Gemma3TextConfig', 'architectures': ['Gemma3ForCausalLM'],
      'model_type': 'gemma3_text', 'vocab_size': 96, 'hidden_size': 40,
      'num_hidden_layers': m['num_layers'], 'head_dim': 12,
      'hidden_activation': 'gelu_pytorch_tanh', 'tie_word_embeddings': True,
      'sliding_window': 1024, 'eos_token_id': [1, 106],
      'dtype': 'float32'}  # The weights' (the fixture's float32), not the base's bfloat16.
  names = Export(out).tensors
  assert all(n.startswith('model.') for n in names), sorted(names)[:5]  # The text model's.


# --------------------------------------------------------------------------- #
# h. options as the library takes them, OUT_DIR states
# --------------------------------------------------------------------------- #
def test_h_library_sizes_as_meant(tmp_path):
  """A float holding whole bytes and a size string are taken; a fraction of a byte is not."""
  import orbax_tunix  # pylint: disable=g-import-not-at-top
  from orbax_tunix import errors

  r = orbax_tunix.export_to_hf(DATA / 'hf_qwen3', tmp_path / 'a', model='qwen3',
                               max_shard_size=5e9, memory_budget='1G')
  assert r.files == ('model.safetensors',)
  r = orbax_tunix.export_to_hf(DATA / 'hf_qwen3', tmp_path / 'b', model='qwen3',
                               max_shard_size='60KB', memory_budget=2.0**30)
  n = len(r.files)  # 131552 bytes of tensors in files of at most 60 KB: 3 or more.
  assert n >= 3 and r.files == tuple(f'model-{i:05d}-of-{n:05d}.safetensors'
                                     for i in range(1, n + 1)), r.files
  for bad in ({'max_shard_size': 1e400}, {'max_shard_size': 1.5}, {'memory_budget': 'lots'},
              {'memory_budget': None}, {'memory_budget': float('nan')}):
    with pytest.raises(errors.InvalidOptionError, match='expected a positive size'):
      orbax_tunix.export_to_hf(DATA / 'hf_qwen3', tmp_path / 'c', model='qwen3', **bad)
  assert sorted(p.name for p in tmp_path.iterdir()) == ['a', 'b']


def test_h_empty_out_dir_is_used_without_force(tmp_path):
  out = tmp_path / 'out'
  out.mkdir()
  r = run_cli(export_argv(DATA / 'hf_qwen3', out, '--model', 'qwen3'))
  assert r['rc'] == 0, r['stderr']
  assert 'replaced' not in r['stdout'], r['stdout']
  assert sorted(p.name for p in tmp_path.iterdir()) == ['out']
  assert_equal_arrays(Export(out).tensors, hf_expected('qwen3', raw('hf_qwen3')), 'export')


def test_h_force_onto_a_link_to_an_export_leaves_nothing_behind(tmp_path):
  old, link = tmp_path / 'old', tmp_path / 'link'
  assert run_cli(export_argv(DATA / 'hf_llama3', old, '--model', 'llama3'))['rc'] == 0
  link.symlink_to(old)
  before = snapshot(old)
  r = run_cli(export_argv(DATA / 'hf_qwen3', link, '--model', 'qwen3', '--force'))
  assert r['rc'] == 0, r['stderr']
  assert sorted(p.name for p in tmp_path.iterdir()) == ['link', 'old']
  assert snapshot(old) == before  # What the link pointed to is not replaced.
  assert_equal_arrays(Export(link).tensors, hf_expected('qwen3', raw('hf_qwen3')), 'export')


_KILLED_MID_EXPORT = """
import os, signal, sys
from orbax_tunix.writing import writer
from orbax_tunix.cli import commands
def die(*args, **kwargs):  # kill -9 once the weights start streaming into the folder.
  os.kill(os.getpid(), signal.SIGKILL)
writer.write = die
sys.exit(commands.main(sys.argv[1:]))
"""


def test_h_rerun_after_kill_names_the_partial_folder(tmp_path):
  out = tmp_path / 'out'
  killed = subprocess.run(
      [sys.executable, '-c', _KILLED_MID_EXPORT, 'export', str(DATA / 'hf_qwen3'), str(out),
       '--model', 'qwen3'], capture_output=True, text=True, cwd=ROOT, env=subprocess_env(),
      timeout=CLI_TIMEOUT, check=False)
  assert killed.returncode == -9, killed.stderr
  assert not out.exists()  # Never looks like a finished export.
  (partial,) = list(tmp_path.iterdir())
  r = run_cli(export_argv(DATA / 'hf_qwen3', out, '--model', 'qwen3'))
  assert r['rc'] == 0, r['stderr']
  assert re.search(rf'note: {re.escape(str(partial))} is left from an interrupted export',
                   r['stderr']), r['stderr']


def test_g_check_config_keeps_a_text_config_of_the_familys_own_architecture():
  """A family that names the multimodal model itself keeps the config's text_config: the
  dims are checked and completed inside it (pure: shapes by hand, expected by hand)."""
  import dataclasses  # pylint: disable=g-import-not-at-top

  from orbax_tunix import errors
  from orbax_tunix.mapping import hf_config, huggingface

  family = dataclasses.replace(huggingface.get('gemma3'), architecture='Gemma3ForConditionalGeneration',
                               model_type='gemma3')
  shapes = {('embedder', 'input_embedding'): (96, 40), ('final_norm', 'scale'): (40,)}
  for i in range(2):
    shapes.update({('layers', str(i), 'attn', 'q_einsum', 'w'): (4, 40, 12),
                   ('layers', str(i), 'attn', 'kv_einsum', 'w'): (2, 2, 40, 12),
                   ('layers', str(i), 'mlp', 'gate_proj', 'kernel'): (40, 56)})
  text = {'hidden_size': 40, 'intermediate_size': 56, 'model_type': 'gemma3_text',
          'num_hidden_layers': 2, 'num_attention_heads': 4, 'num_key_value_heads': 2,
          'head_dim': 12, 'hidden_activation': 'gelu_pytorch_tanh'}
  base = {'architectures': ['Gemma3ForConditionalGeneration'], 'model_type': 'gemma3',
          'text_config': text, 'vision_config': {'model_type': 'siglip_vision_model'}}
  got = hf_config.check_config(family, base, shapes, 'config.json')
  assert got.values == {**base, 'text_config': {**text, 'vocab_size': 96,
                                                'tie_word_embeddings': True}}
  with pytest.raises(errors.UnsupportedLayoutError, match=r'num_hidden_layers: config'):
    hf_config.check_config(family, {**base, 'text_config': {**text, 'num_hidden_layers': 3}},
                           shapes, 'config.json')
  # The text family on the same config: unwrapped, the text model's.
  got = hf_config.check_config(huggingface.get('gemma3'), base, shapes, 'config.json')
  assert got.values == {'architectures': ['Gemma3ForCausalLM'], 'model_type': 'gemma3_text',
                        **text, 'vocab_size': 96, 'tie_word_embeddings': True}


def test_readme_table_of_maps_is_the_families_values():
  """docs/huggingface.md's tables are the families' values (scripts/readme_hf_maps.py writes them)."""
  from orbax_tunix.mapping import huggingface

  readme = (ROOT / 'docs' / 'huggingface.md').read_text()
  begin = '<!-- huggingface maps: generated by scripts/readme_hf_maps.py -->\n'
  end = '<!-- end of huggingface maps -->'
  assert readme.count(begin) == 1 and readme.count(end) == 1
  table = readme.split(begin)[1].split(end)[0]
  assert table == huggingface.markdown(), 'run scripts/readme_hf_maps.py'
  maxtext = readme.split('<!-- maxtext maps: generated by scripts/readme_hf_maps.py -->\n')[1]
  maxtext = maxtext.split('<!-- end of maxtext maps -->')[0]
  for name in huggingface.names():  # every family has rows (a MaxText-only one: there)
    assert any(f' {name} |' in t or f' {name},' in t for t in (table, maxtext)), name
  assert maxtext == huggingface.markdown('maxtext'), 'run scripts/readme_hf_maps.py'
  families = readme.split('<!-- families: generated by scripts/readme_hf_maps.py -->\n')[1]
  families = families.split('<!-- end of families -->')[0]
  assert families == huggingface.families_markdown(), 'run scripts/readme_hf_maps.py'
  for name in huggingface.names():  # every family has its row, and its class named
    assert f'| `{name}`' in families and huggingface.get(name).architecture in families, name


def _unable_to_read(argv: list[str], probe: pathlib.Path) -> list[str]:
  """`argv` as a process that a file's permissions deny: root reads anything, so as root it
  runs without the capabilities that let it (setpriv); else as is. Skips where they cannot
  be dropped (`probe`, a file nobody may read, is then still read)."""
  if os.geteuid() != 0:
    return argv
  setpriv = shutil.which('setpriv')
  drop = [setpriv, '--bounding-set=-dac_override,-dac_read_search', '--'] if setpriv else None
  if drop is None or subprocess.run([*drop, 'cat', str(probe)], capture_output=True,
                                    check=False).returncode == 0:
    pytest.skip('root that cannot drop CAP_DAC_OVERRIDE here: every file is readable')
  return [*drop, *argv]


def test_h_an_unreadable_hf_config_file_is_refused_before_any_write(tmp_path):
  hf = _write_hf_dir(tmp_path / 'base', HF_CONFIG_DIMS['hf_qwen3'])
  (hf / 'tokenizer.json').chmod(0)
  out = tmp_path / 'out'
  r = run_cli(_unable_to_read(export_argv(DATA / 'hf_qwen3', out, '--model', 'qwen3',
                                          '--hf-config', str(hf)), hf / 'tokenizer.json'))
  assert r['rc'] == 2, r['stderr']
  assert f'{hf / "tokenizer.json"}: expected a readable file to copy from --hf-config' in (
      r['stderr']), r['stderr']
  assert 'free space' not in r['stderr'] and 'Traceback' not in r['stderr'], r['stderr']
  assert sorted(p.name for p in tmp_path.iterdir()) == ['base']  # nothing written


def test_h_an_hf_config_file_unreadable_at_run_time_names_itself(tmp_path):
  """Readable when planned, then replaced by something that cannot be read as a file: the
  failure names the file (not the destination), and nothing is left."""
  from orbax_tunix import errors  # pylint: disable=g-import-not-at-top
  from orbax_tunix.tools import export  # pylint: disable=g-import-not-at-top

  hf = _write_hf_dir(tmp_path / 'base', HF_CONFIG_DIMS['hf_qwen3'])
  out = tmp_path / 'out'
  plan = export.plan_export(DATA / 'hf_qwen3', out, model='qwen3', hf_config=hf)
  (hf / 'tokenizer.json').unlink()
  (hf / 'tokenizer.json').mkdir()
  with pytest.raises(errors.InvalidOptionError,
                     match=re.escape(f'{hf / "tokenizer.json"}: cannot read this `hf_config`')):
    export.run_export(plan)
  assert sorted(p.name for p in tmp_path.iterdir()) == ['base']


def test_h_the_top_help_names_every_command():
  p = subprocess.run([sys.executable, '-m', 'orbax_tunix.cli', '--help'], capture_output=True,
                     text=True, cwd=ROOT, env=subprocess_env(), timeout=CLI_TIMEOUT, check=True)
  for command in ('inspect', 'convert', 'diff', 'export'):
    assert re.search(rf'^\s+{command}\s', p.stdout, re.M), (command, p.stdout)
  from orbax_tunix.mapping import huggingface  # pylint: disable=g-import-not-at-top
  for family in huggingface.names():  # export's line names every family
    assert family in p.stdout, (family, p.stdout)

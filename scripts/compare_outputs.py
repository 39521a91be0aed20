#!/usr/bin/env python3
"""What the command line writes and says on the committed fixtures: recorded, then compared.

Issue 47 item 7 asks a refactor of the planning side to change nothing a user sees. `record`
runs the checkout's own CLI (`python -m orbax_tunix.cli`, the repository root first on
PYTHONPATH) over tests/data/tunix and tests/data/maxtext, plus a few tiny MaxText-model runs
this script writes with plain Orbax (Gemma 3 and Gemma 4 blocks, MoE, LoRA: no committed
fixture holds them). For each command it keeps the argv, the exit code, stdout and stderr, and
what the command wrote as digests; `compare` names every command whose result differs.

    .venv/bin/python scripts/compare_outputs.py record /tmp/before.json    # ~170 commands
    ... change the code ...
    .venv/bin/python scripts/compare_outputs.py record /tmp/after.json
    .venv/bin/python scripts/compare_outputs.py compare /tmp/before.json /tmp/after.json \
        --expect-changed 'convert/maxtext/mt_gemma*'

What a record holds, and what is normalized (two records of one tree are byte-identical, in
any checkout and work folder):
  * argv: fixtures relative to the repository (the commands run there), work paths as <work>.
  * stdout, stderr: the repository and work paths as <repo> and <work>; the summary's duration
    and rate (`in 1.1s (10.5 KiB/s)`) and `"seconds"` of --json as <time> and <rate>; the
    progress lines a slow run prints every 10 s dropped.
  * A folder (an export, an adapter): every file's sha256, of its bytes with the work and
    repository paths as <work> and <repo> (an adapter config names its --base-model folder);
    a safetensors file's tensors too (name, dtype, shape, sha256 of the bytes) and its header's
    `__metadata__` (nothing volatile in it: the format and the export's file list); a JSON
    file's content.
  * An Orbax step: each item's leaves restored by plain Orbax (path, shape, dtype, sha256 of
    the bytes; None leaves as such) and their chunk and write shapes; the step's entries;
    `_CHECKPOINT_METADATA`'s item handlers and custom metadata (paths normalized). Its
    timestamps, the OCDBT data file names and `_sharding` are left out: they change on every
    write, or name the writer's devices.
  * A refusal: the exit code and message, and that nothing was written (or what was there).
  * meta: the commit; whether tests/data is as it was (sources are never written to); what lies
    in the output folder besides the outputs (a temporary left behind).
  * inputs: the digests of what the script wrote (MaxText runs, config folders), so that a
    change of the inputs is told apart from a change of the outputs.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import fnmatch
import functools
import hashlib
import json
import os
import pathlib
import re
import resource
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[1]
TUNIX = pathlib.Path('tests/data/tunix')  # Relative: the commands run in ROOT.
MAXTEXT = pathlib.Path('tests/data/maxtext')
MANIFEST = json.loads((ROOT / TUNIX / 'MANIFEST.json').read_text())['fixtures']
# The fixtures of each tunix.models family (tests/test_export_hf.py's FAMILY_FIXTURES).
FAMILIES = {'hf_qwen3': 'qwen3', 'hf_llama3': 'llama3', 'hf_gemma3': 'gemma3',
            'hf_gemma3_fused': 'gemma3', 'hf_qwen2': 'qwen2', 'hf_qwen3_moe': 'qwen3_moe',
            'hf_gemma': 'gemma', 'hf_gemma2': 'gemma2', 'hf_gemma4': 'gemma4',
            'hf_gemma4_moe': 'gemma4', 'hf_qwen3_bf16': 'qwen3'}
LORA = sorted(n for n, e in MANIFEST.items() if isinstance(e.get('lora'), dict) and 'qlora' not in e)
QLORA = sorted(n for n, e in MANIFEST.items() if 'qlora' in e)
CLI_TIMEOUT = 600

# --------------------------------------------------------------------------- #
# Inputs this script writes: Hugging Face config folders, tiny MaxText-model runs
# --------------------------------------------------------------------------- #
SIDE_FILES = {  # copied by --hf-config (and decoys it must not copy)
    'generation_config.json': '{"bos_token_id": 1, "eos_token_id": 2, "do_sample": false}\n',
    'tokenizer.json': '{"version": "1.0", "model": {"type": "BPE", "vocab": {"a": 0}}}\n',
    'tokenizer_config.json': '{"model_max_length": 4096, "eos_token": "</s>"}\n',
    'special_tokens_map.json': '{"eos_token": "</s>"}\n',
    'model.safetensors': 'not the export',
}
QWEN3_CONFIG = {  # hf_qwen3's dims; rope_theta as the Hub's (Tunix trains with 1e6: a note)
    'architectures': ['Qwen3ForCausalLM'], 'model_type': 'qwen3', 'vocab_size': 96,
    'hidden_size': 40, 'intermediate_size': 56, 'num_hidden_layers': 2,
    'num_attention_heads': 4, 'num_key_value_heads': 2, 'head_dim': 12,
    'tie_word_embeddings': False, 'hidden_act': 'silu', 'rope_theta': 10000.0,
    'rms_norm_eps': 1e-06, 'torch_dtype': 'float32'}
GEMMA4_CONFIG = {  # hf_gemma4's dims, as gemma-4-E2B's config.json (a multimodal class)
    'architectures': ['Gemma4ForConditionalGeneration'], 'model_type': 'gemma4',
    'tie_word_embeddings': True, 'dtype': 'bfloat16',
    'text_config': {
        'model_type': 'gemma4_text', 'attention_k_eq_v': False, 'enable_moe_block': False,
        'final_logit_softcapping': 30.0, 'global_head_dim': 16, 'head_dim': 12,
        'hidden_activation': 'gelu_pytorch_tanh', 'hidden_size': 40,
        'hidden_size_per_layer_input': 10, 'intermediate_size': 56,
        'layer_types': ['sliding_attention', 'sliding_attention', 'full_attention'] * 2,
        'num_attention_heads': 4, 'num_hidden_layers': 6, 'num_key_value_heads': 2,
        'num_kv_shared_layers': 3, 'rms_norm_eps': 1e-06, 'sliding_window': 4,
        'tie_word_embeddings': True, 'use_double_wide_mlp': True, 'vocab_size': 96,
        'vocab_size_per_layer_input': 96}}
# MaxText 0.2.5's tiny models (tests/test_export_maxtext.py's dims and names).
D, N, K, H, F, V = 16, 4, 2, 8, 48, 64
MAXTEXT_CONFIG = {'vocab_size': V, 'hidden_size': D, 'num_attention_heads': N,
                  'num_key_value_heads': K, 'head_dim': H, 'intermediate_size': F}
_ATTENTION = {'self_attention/query/kernel': (D, N, H), 'self_attention/key/kernel': (D, K, H),
              'self_attention/value/kernel': (D, K, H), 'self_attention/out/kernel': (N, H, D)}
_MLP = {'mlp/wi_0/kernel': (D, F), 'mlp/wi_1/kernel': (D, F), 'mlp/wo/kernel': (F, D)}
_QK_NORMS = {'self_attention/query_norm/scale': (H,), 'self_attention/key_norm/scale': (H,)}
QWEN3_LAYER = {**_ATTENTION, **_MLP, **_QK_NORMS, 'pre_self_attention_layer_norm/scale': (D,),
               'post_self_attention_layer_norm/scale': (D,)}
GEMMA3_LAYER = {**_ATTENTION, **_MLP, **_QK_NORMS, 'pre_self_attention_norm/scale': (D,),
                'post_self_attention_norm/scale': (D,), 'pre_ffw_norm/scale': (D,),
                'post_ffw_norm/scale': (D,)}
GEMMA4_LOCAL = {**GEMMA3_LAYER, 'layer_scalar': (1,)}
GEMMA4_GLOBAL = {  # its own head_dim and kv heads, no value kernel (the keys are the values)
    **{k: v for k, v in GEMMA4_LOCAL.items() if not k.startswith('self_attention/')},
    'self_attention/query/kernel': (D, N, 12), 'self_attention/key/kernel': (D, 3, 12),
    'self_attention/out/kernel': (N, 12, D), 'self_attention/query_norm/scale': (12,),
    'self_attention/key_norm/scale': (12,)}
QWEN3_MOE_LAYER = {**{k: v for k, v in QWEN3_LAYER.items() if not k.startswith('mlp/')},
                   'moe_block/gate/kernel': (D, 4), 'moe_block/wi_0': (4, D, 24),
                   'moe_block/wi_1': (4, D, 24), 'moe_block/wo': (4, 24, D)}
MAXTEXT_MODELS = {  # model -> (layer i's weights, layers, untied logits_dense)
    'qwen3': (lambda i: QWEN3_LAYER, 3, True),
    'gemma3': (lambda i: GEMMA3_LAYER, 8, False),  # one scanned block of six, two left over
    'gemma4': (lambda i: GEMMA4_GLOBAL if i % 6 == 5 else GEMMA4_LOCAL, 8, False),
    'qwen3_moe': (lambda i: QWEN3_MOE_LAYER, 2, True),
}
LORA_TARGETS = ('self_attention/query/kernel', 'self_attention/out/kernel', 'mlp/wo/kernel')
LORA_RANK, LORA_ALPHA = 2, 4.0


def _nest(flat: dict[str, Any]) -> dict:
  tree: dict = {}
  for path, value in flat.items():
    *parents, last = path.split('/')
    node = tree
    for key in parents:
      node = node.setdefault(key, {})
    node[last] = value
  return tree


def maxtext_weights(model: str, form: str, lora: bool = False) -> dict[str, Any]:
  """MaxText's flat weight paths of `model` in `form` (scanned: layers on axis 1; gemma3 in
  blocks of six, gemma4 in blocks of five local and one global layer), random, seeded; with
  `lora`, qwix's adapters beside LORA_TARGETS (stacked as their kernels are)."""
  import numpy as np

  layer, n, untied = MAXTEXT_MODELS[model]
  rng = np.random.default_rng(0)

  def w(name, shape):
    x = rng.normal(size=shape).astype(np.float32)
    return 1 + 0.1 * x if name.endswith('scale') else x

  flat = {'token_embedder/embedding': w('e', (V, D)), 'decoder/decoder_norm/scale': w('scale', (D,))}
  if untied:
    flat['decoder/logits_dense/kernel'] = w('k', (D, V))
  layers = [{k: w(k, s) for k, s in layer(i).items()} for i in range(n)]
  if lora:
    for weights in layers:
      for target in LORA_TARGETS:
        kernel = weights[target]
        contracted = 2 if target.endswith('out/kernel') else 1
        rows = int(np.prod(kernel.shape[:contracted]))
        weights[f'{target}_lora_a'] = w('a', (rows, LORA_RANK))
        weights[f'{target}_lora_b'] = w('b', (LORA_RANK, kernel.size // rows))

  def stack(group, prefix):
    for k in group[0]:
      flat[f'{prefix}/{k}'] = np.stack([x[k] for x in group], axis=1)

  blocks = n // 6
  if form == 'unscanned':
    for i, weights in enumerate(layers):
      flat.update({f'decoder/layers_{i}/{k}': v for k, v in weights.items()})
  elif model == 'gemma3':
    for j in range(6):
      stack([layers[6 * b + j] for b in range(blocks)], f'decoder/layers/layers_{j}')
    for r, weights in enumerate(layers[6 * blocks:]):
      flat.update({f'decoder/layers_remainder/layers_{r}/{k}': v for k, v in weights.items()})
  elif model == 'gemma4':
    for k in layers[0]:
      flat[f'decoder/scanned_blocks/local_layers/{k}'] = np.stack(
          [np.stack([layers[6 * b + j][k] for j in range(5)], axis=1) for b in range(blocks)],
          axis=1)
    stack([layers[6 * b + 5] for b in range(blocks)], 'decoder/scanned_blocks/global_layer')
    stack(layers[6 * blocks:], 'decoder/layers_remainder/local_layers')
  else:
    stack(layers, 'decoder/layers')
  return flat


def save_tunix_run(root: pathlib.Path, flat: dict[str, Any], step: int = 2) -> None:
  """A Tunix run of a MaxText model (its TunixMaxTextAdapter's `base`, nnx's `value`), with
  the RNG and AQT leaves such runs hold, written by plain Orbax."""
  import numpy as np
  import orbax.checkpoint as ocp

  leaves = {f'base/{p}/value': v for p, v in flat.items()}
  leaves['base/decoder/rngs/params/count/value'] = np.uint32(3)
  leaves['base/decoder/rngs/params/key/value'] = np.array([0, 7], np.uint32)
  leaves['base/decoder/logits_dense/aqt/frozen_scale/value'] = np.ones((1, V), np.float32)
  with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckptr:
    ckptr.save(root / str(step), args=ocp.args.Composite(
        model_params=ocp.args.PyTreeSave(_nest(leaves))))


def write_config(folder: pathlib.Path, config: dict, side_files: bool = True) -> None:
  folder.mkdir(parents=True)
  (folder / 'config.json').write_text(json.dumps(config, indent=2) + '\n')
  for name, text in SIDE_FILES.items() if side_files else ():
    (folder / name).write_text(text)


def write_inputs(inputs: pathlib.Path) -> None:
  """Everything the commands read besides the committed fixtures."""
  write_config(inputs / 'hf_qwen3', QWEN3_CONFIG)
  write_config(inputs / 'hf_qwen3_vocab97', {**QWEN3_CONFIG, 'vocab_size': 97})
  write_config(inputs / 'hf_gemma4', GEMMA4_CONFIG)
  write_config(inputs / 'llama2', {'architectures': ['LlamaForCausalLM'], 'model_type': 'llama',
                                   **MAXTEXT_CONFIG, 'num_hidden_layers': 3,
                                   'tie_word_embeddings': False})
  write_config(inputs / 'mt_qwen3', {'architectures': ['Qwen3ForCausalLM'], 'model_type': 'qwen3',
                                     **MAXTEXT_CONFIG, 'num_hidden_layers': 3,
                                     'tie_word_embeddings': False}, side_files=False)
  (inputs / 'not_a_step').mkdir()
  (inputs / 'not_a_step' / 'keep.txt').write_text('mine\n')
  for model in MAXTEXT_MODELS:
    for form in ('scanned', 'unscanned'):
      save_tunix_run(inputs / f'mt_{model}_{form}', maxtext_weights(model, form))
  for form in ('scanned', 'unscanned'):
    lora = maxtext_weights('qwen3', form, lora=True)
    save_tunix_run(inputs / f'mt_qwen3_lora_{form}', lora)
  save_tunix_run(inputs / 'mt_qwen3_lora_only_scanned',
                 {k: v for k, v in maxtext_weights('qwen3', 'scanned', lora=True).items()
                  if '_lora_' in k})


# --------------------------------------------------------------------------- #
# The commands
# --------------------------------------------------------------------------- #
@dataclasses.dataclass(frozen=True)
class Command:
  """One CLI run: `python -m orbax_tunix.cli ARGV`, writing `out` (digested afterwards)."""
  name: str
  argv: tuple[str, ...]
  out: pathlib.Path | None
  needs: tuple[str, ...] = ()  # commands whose outputs this one reads
  prepare: Callable[[], None] | None = None  # run just before (puts something at `out`)


class Plan:
  """Collects the commands; `src` may be a fixture path, or `@name`: that command's output."""

  def __init__(self, work: pathlib.Path):
    self.work, self.inputs, self.commands = work, work / 'inputs', {}

  def _add(self, name, verb, src, out, flags, copy=None):
    """`copy`: a command's output (`@name`) or a path, copied to `out` before the run."""
    assert name not in self.commands, name
    needs, prepare = (), None
    if isinstance(src, str) and src.startswith('@'):
      needs, src = (src[1:],), self.commands[src[1:]].out
    if copy is not None:
      if isinstance(copy, str):
        needs, copy = (*needs, copy[1:]), self.commands[copy[1:]].out
      prepare = functools.partial(shutil.copytree, copy, out)
    argv = (verb, str(src), *(() if out is None else (str(out),)), *map(str, flags))
    self.commands[name] = Command(name, argv, out, needs, prepare)

  def out(self, name: str) -> pathlib.Path:
    return self.work / 'out' / name.replace('/', '.')

  def export(self, name, src, *flags, copy=None):
    self._add(name, 'export', src, self.out(name), flags, copy)

  def convert(self, name, src, *flags, copy=None):
    self._add(name, 'convert', src, self.out(name) / '1', flags, copy)

  def inspect(self, name, src, *flags):
    self._add(name, 'inspect', src, None, flags)


def _family(name: str) -> str:
  entry = MANIFEST[name]
  return FAMILIES[entry['lora']['base'] if isinstance(entry.get('lora'), dict) else name]


def _alpha(name: str) -> tuple[str, ...]:
  return ('--lora-alpha', str(MANIFEST[name]['lora']['alpha']))


def _merge_flags(name: str) -> tuple[str, ...]:
  """--merge-lora of a (Q)LoRA fixture: its alpha; adapters only: its base (and recipe)."""
  flags = ('--merge-lora', *_alpha(name))
  if not name.endswith('_only'):
    return flags
  flags += ('--base', str(TUNIX / MANIFEST[name]['lora']['base']))
  q = MANIFEST[name].get('qlora')
  if q:
    flags += ('--base-qtype', q['qtype'], '--base-calibration', q['calibration'])
    flags += ('--base-tile-size', str(q['tile_size'])) if q['tile_size'] else ()
  return flags


def plan_commands(work: pathlib.Path) -> dict[str, Command]:
  """The representative set: every family, layout and option kind at least once."""
  p = Plan(work)
  inputs = p.inputs
  # Hugging Face export of every family, as stored and cast; options.
  for name, family in FAMILIES.items():
    p.export(f'export/{name}', TUNIX / name, '--model', family)
    if name != 'hf_qwen3_bf16':
      p.export(f'export/{name}/bf16', TUNIX / name, '--model', family, '--dtype', 'bfloat16')
  p.export('export/hf_qwen3/json', TUNIX / 'hf_qwen3', '--model', 'qwen3', '--json')
  p.export('export/hf_qwen3/float16', TUNIX / 'hf_qwen3', '--model', 'qwen3', '--dtype', 'float16')
  p.export('export/hf_llama3/step1', TUNIX / 'hf_llama3', '--model', 'llama3', '--step', '1')
  p.export('export/hf_gemma4/shards_10KB', TUNIX / 'hf_gemma4', '--model', 'gemma4',
           '--max-shard-size', '10KB')
  p.export('export/hf_qwen3_moe/shards_5KiB', TUNIX / 'hf_qwen3_moe', '--model', 'qwen3_moe',
           '--max-shard-size', '5KiB')
  p.export('export/hf_gemma3/budget_16K', TUNIX / 'hf_gemma3', '--model', 'gemma3',
           '--memory-budget', '16K')
  p.export('export/hf_qwen3/hf_config', TUNIX / 'hf_qwen3', '--model', 'qwen3',
           '--hf-config', inputs / 'hf_qwen3')
  p.export('export/hf_qwen3/hf_config_as_trained', TUNIX / 'hf_qwen3', '--model', 'qwen3',
           '--hf-config', inputs / 'hf_qwen3' / 'config.json', '--config-as-trained')
  p.export('export/hf_gemma4/hf_config', TUNIX / 'hf_gemma4', '--model', 'gemma4',
           '--hf-config', inputs / 'hf_gemma4')
  p.export('export/hf_qwen3/force', TUNIX / 'hf_qwen3', '--model', 'qwen3', '--force',
           copy='@export/hf_llama3')  # An earlier export there: replaced.
  # MaxText's llama2 (Tunix runs of MaxText's own decoder, scanned and not).
  for name in ('tunix_llama2_scan', 'tunix_llama2_unscan'):
    p.export(f'export/{name}', MAXTEXT / name, '--model', 'llama2')
    p.export(f'export/{name}/bf16', MAXTEXT / name, '--model', 'llama3.1', '--dtype', 'bfloat16')
  p.export('export/tunix_llama2_scan/axis1_hf_config', MAXTEXT / 'tunix_llama2_scan',
           '--model', 'llama3', '--param-scan-axis', '1', '--hf-config', inputs / 'llama2')
  # LoRA and QLoRA: merged, base alone, adapters as PEFT.
  for name in LORA + QLORA:
    p.export(f'export/{name}/merged', TUNIX / name, '--model', _family(name), *_merge_flags(name))
  for name in LORA + ['hf_qwen3_qlora_int8', 'hf_gemma3_fused_qlora_fp8',
                      'hf_qwen3_bf16_qlora_only']:  # PEFT reads the adapters alone
    p.export(f'export/{name}/peft', TUNIX / name, '--model', _family(name), '--peft',
             *_alpha(name))
  p.export('export/hf_qwen2_lora/merged_scale_bf16', TUNIX / 'hf_qwen2_lora', '--model', 'qwen2',
           '--merge-lora', '--lora-scale', '1.5', '--dtype', 'bfloat16')
  p.export('export/hf_qwen3_lora_only/peft_hub_name', TUNIX / 'hf_qwen3_lora_only', '--model',
           'qwen3', '--peft', '--lora-alpha', '3', '--base-model', 'Qwen/Qwen3-0.6B')
  p.export('export/hf_qwen3_lora/peft_folder', TUNIX / 'hf_qwen3_lora', '--model', 'qwen3',
           '--peft', '--lora-alpha', '3', '--base-model', inputs / 'hf_qwen3')
  for name in ('hf_qwen3_lora', 'hf_qwen3_qlora_int8', 'hf_gemma3_fused_qlora_fp8',
               'hf_qwen3_bf16_qlora'):
    p.export(f'export/{name}/base_only', TUNIX / name, '--model', _family(name), '--base-only')
  # Tunix runs of MaxText models (written here): each form, exported, re-laid, LoRA.
  for model in MAXTEXT_MODELS:
    for form, other in (('scanned', 'false'), ('unscanned', 'true')):
      run = inputs / f'mt_{model}_{form}'
      p.export(f'export/mt_{model}_{form}', run, '--model', model)
      p.convert(f'convert/maxtext/mt_{model}_{form}/scan_{other}', run, '--layout', 'maxtext',
                '--params-only', '--scan-layers', other)
  for form in ('scanned', 'unscanned'):
    run = inputs / f'mt_qwen3_lora_{form}'
    p.export(f'export/mt_qwen3_lora_{form}/merged', run, '--model', 'qwen3', '--merge-lora',
             '--lora-alpha', LORA_ALPHA)
    p.export(f'export/mt_qwen3_lora_{form}/peft', run, '--model', 'qwen3', '--peft',
             '--lora-alpha', LORA_ALPHA)
  p.export('export/mt_qwen3_lora_only_scanned/peft_folder', inputs / 'mt_qwen3_lora_only_scanned',
           '--model', 'qwen3', '--peft', '--lora-alpha', LORA_ALPHA,
           '--base-model', inputs / 'mt_qwen3')
  p.export('export/mt_qwen3_lora_only_scanned/merged', inputs / 'mt_qwen3_lora_only_scanned',
           '--model', 'qwen3', '--merge-lora', '--lora-alpha', LORA_ALPHA,
           '--base', inputs / 'mt_qwen3_scanned')
  # Canonical converts: every wrapper and optimizer kind, options.
  for name in ('sft_full', 'adapter_inject_clip', 'grad_accum', 'own_base_module', 'v1_writer',
               'rl_actor', 'rng_vars', 'lora_qwix', 'lora_flax', 'hf_qwen3_qlora_int8'):
    p.convert(f'convert/canonical/{name}', TUNIX / name)
  p.convert('convert/canonical/sft_full/step1_budget_2K', TUNIX / 'sft_full', '--step', '1',
            '--memory-budget', '2K')
  p.convert('convert/canonical/sft_full/item_json', TUNIX / 'sft_full', '--item', 'model_params',
            '--json')
  p.convert('convert/canonical/rng_vars/params_only', TUNIX / 'rng_vars', '--params-only')
  p.convert('convert/canonical/rng_vars/bf16', TUNIX / 'rng_vars', '--dtype', 'bfloat16')
  p.convert('convert/canonical/lora_qwix/params_only', TUNIX / 'lora_qwix', '--params-only')
  p.convert('convert/canonical/tunix_llama2_scan', MAXTEXT / 'tunix_llama2_scan')
  # Merges to a step.
  p.convert('convert/merge/lora_qwix_full', TUNIX / 'lora_qwix_full', '--merge-lora',
            '--lora-alpha', '4')
  p.convert('convert/merge/lora_qwix_base_bf16', TUNIX / 'lora_qwix', '--merge-lora',
            '--lora-alpha', '4', '--base', TUNIX / 'lora_base', '--dtype', 'bfloat16')
  p.convert('convert/merge/lora_flax', TUNIX / 'lora_flax', '--merge-lora')
  p.convert('convert/merge/hf_qwen3_qlora_int4_only', TUNIX / 'hf_qwen3_qlora_int4_only',
            *_merge_flags('hf_qwen3_qlora_int4_only'))
  p.convert('convert/merge/hf_qwen3_qlora_int8/maxtext', TUNIX / 'hf_qwen3_qlora_int8',
            '--merge-lora', '--lora-alpha', '3', '--layout', 'maxtext')
  # MaxText's layout: params and full state, scanned <-> unscanned, another axis, chained.
  for name in ('rng_vars', 'hf_qwen3'):
    p.convert(f'convert/maxtext/{name}/params', TUNIX / name, '--layout', 'maxtext',
              '--params-only')
  p.convert('convert/maxtext/sft_full/full', TUNIX / 'sft_full', '--layout', 'maxtext')
  p.convert('convert/maxtext/adapter_inject_clip/full', TUNIX / 'adapter_inject_clip',
            '--layout', 'maxtext')
  for name, other in (('tunix_llama2_scan', 'false'), ('tunix_llama2_unscan', 'true')):
    src = MAXTEXT / name
    p.convert(f'convert/maxtext/{name}/params', src, '--layout', 'maxtext', '--params-only')
    p.convert(f'convert/maxtext/{name}/full', src, '--layout', 'maxtext')
    p.convert(f'convert/maxtext/{name}/params_scan_{other}', src, '--layout', 'maxtext',
              '--params-only', '--scan-layers', other)
    p.convert(f'convert/maxtext/{name}/full_scan_{other}', src, '--layout', 'maxtext',
              '--scan-layers', other)
  p.convert('convert/maxtext/tunix_llama2_scan/axis0', MAXTEXT / 'tunix_llama2_scan', '--layout',
            'maxtext', '--params-only', '--scan-layers', 'true', '--param-scan-axis', '0')
  p.convert('convert/maxtext/tunix_llama2_unscan/axis0_bf16', MAXTEXT / 'tunix_llama2_unscan',
            '--layout', 'maxtext', '--params-only', '--scan-layers', 'true',
            '--param-scan-axis', '0', '--dtype', 'bfloat16')
  # MaxText's own steps (written above) as sources.
  axis0 = '@convert/maxtext/tunix_llama2_scan/axis0'
  p.convert('convert/maxtext/from_axis0/scan_false', axis0, '--layout', 'maxtext',
            '--params-only', '--scan-layers', 'false')
  p.export('export/from_axis0', axis0, '--model', 'llama2')
  full = '@convert/maxtext/tunix_llama2_scan/full'
  p.convert('convert/maxtext/from_full/params_scan_false', full, '--layout', 'maxtext',
            '--params-only', '--scan-layers', 'false')
  p.convert('convert/canonical/from_full', full)
  p.export('export/from_full', full, '--model', 'llama2', '--dtype', 'bfloat16')
  # inspect, on a few kinds of source.
  for src in (TUNIX / 'hf_gemma4', TUNIX / 'lora_qwix', TUNIX / 'hf_qwen3_qlora_int8',
              MAXTEXT / 'tunix_llama2_scan', inputs / 'mt_gemma3_scanned'):
    p.inspect(f'inspect/{src.name}', src, '--json')
  p.inspect('inspect/from_axis0', axis0)
  refusals(p)
  return p.commands


def refusals(p: Plan) -> None:
  """Inputs that must stay refused (exit 2, a message, nothing written)."""
  qwen3 = TUNIX / 'hf_qwen3'
  cases = {  # name -> (verb, source, flags)
      'export/unknown_family': ('export', qwen3, ('--model', 'mistral')),
      'export/llama3_on_qwen3': ('export', qwen3, ('--model', 'llama3')),
      'export/gemma4_on_gemma3': ('export', TUNIX / 'hf_gemma3', ('--model', 'gemma4')),
      'export/shapes_not_the_family': ('export', TUNIX / 'sft_full', ('--model', 'qwen3')),
      'export/adapters_only_without_merge': ('export', TUNIX / 'hf_qwen3_lora_only',
                                             ('--model', 'qwen3')),
      'export/adapters_only_without_base': ('export', TUNIX / 'hf_qwen3_lora_only',
                                            ('--model', 'qwen3', '--merge-lora',
                                             '--lora-alpha', '3')),
      'export/lora_full_without_merge': ('export', TUNIX / 'hf_qwen3_lora', ('--model', 'qwen3')),
      'export/merge_without_alpha': ('export', TUNIX / 'hf_qwen3_lora',
                                     ('--model', 'qwen3', '--merge-lora')),
      'export/missing_step': ('export', qwen3, ('--model', 'qwen3', '--step', '7')),
      'export/hf_config_mismatch': ('export', qwen3, ('--model', 'qwen3', '--hf-config',
                                                      p.inputs / 'hf_qwen3_vocab97')),
      'export/qlora_recipe_misfit': ('export', TUNIX / 'hf_qwen3_qlora_int4_only',
                                     ('--model', 'qwen3', '--merge-lora', '--lora-alpha', '3',
                                      '--base', qwen3, '--base-qtype', 'int8',
                                      '--base-tile-size', '3')),
      'export/llama2_axis0': ('export', MAXTEXT / 'tunix_llama2_scan',
                              ('--model', 'llama2', '--param-scan-axis', '0')),
      'export/peft_no_adapters': ('export', qwen3, ('--model', 'qwen3', '--peft',
                                                    '--lora-alpha', '3')),
      'export/peft_with_merge': ('export', TUNIX / 'hf_qwen3_lora',
                                 ('--model', 'qwen3', '--peft', '--lora-alpha', '3',
                                  '--merge-lora')),
      'export/peft_other_family': ('export', TUNIX / 'hf_qwen3_lora',
                                   ('--model', 'gemma2', '--peft', '--lora-alpha', '3')),
      'export/peft_maxtext_adapters_alone': ('export', p.inputs / 'mt_qwen3_lora_only_scanned',
                                             ('--model', 'qwen3', '--peft', '--lora-alpha', '3')),
      'export/base_only_no_adapters': ('export', qwen3, ('--model', 'qwen3', '--base-only')),
      'export/base_only_of_adapters_only': ('export', TUNIX / 'hf_qwen3_lora_only',
                                            ('--model', 'qwen3', '--base-only')),
      'convert/maxtext_full_without_optimizer': ('convert', TUNIX / 'lora_base',
                                                 ('--layout', 'maxtext')),
      'convert/maxtext_adapters_only': ('convert', TUNIX / 'lora_qwix',
                                        ('--layout', 'maxtext', '--params-only')),
      'convert/missing_step': ('convert', TUNIX / 'sft_full', ('--step', '9')),
      'convert/int8_dtype': ('convert', TUNIX / 'rng_vars', ('--dtype', 'int8')),
      'convert/flax_with_alpha': ('convert', TUNIX / 'lora_flax',
                                  ('--merge-lora', '--lora-alpha', '16')),
      'convert/scan_axis_misfit': ('convert', MAXTEXT / 'tunix_llama2_scan',
                                   ('--layout', 'maxtext', '--params-only', '--scan-layers',
                                    'false', '--param-scan-axis', '0')),
      'convert/full_state_other_axis': ('convert', MAXTEXT / 'tunix_llama2_scan',
                                        ('--layout', 'maxtext', '--scan-layers', 'true',
                                         '--param-scan-axis', '0')),
  }
  for name, (verb, src, flags) in cases.items():
    getattr(p, verb)(f'refuse/{name}', src, *flags)
  # Destinations that are there already.
  # A MaxText step has no Tunix optimizer item: its full state is not re-laid.
  p.convert('refuse/convert/maxtext_step_full_state', '@convert/maxtext/tunix_llama2_scan/full',
            '--layout', 'maxtext', '--scan-layers', 'false')
  p.export('refuse/export/exists', qwen3, '--model', 'qwen3', copy='@export/hf_llama3')
  p.convert('refuse/convert/not_a_step', TUNIX / 'sft_full', '--force',
            copy=p.inputs / 'not_a_step')


# --------------------------------------------------------------------------- #
# Running, normalizing, digesting
# --------------------------------------------------------------------------- #
def cli_env() -> dict[str, str]:
  """This environment, the checkout first on the path, one CPU device (as the tests run the CLI)."""
  env = dict(os.environ)
  env['PYTHONPATH'] = os.pathsep.join([str(ROOT), *filter(None, [env.get('PYTHONPATH')])])
  env['JAX_PLATFORMS'] = 'cpu'
  flags = [f for f in env.get('XLA_FLAGS', '').split()
           if not f.startswith('--xla_force_host_platform_device_count')]
  env['XLA_FLAGS'] = ' '.join(flags)
  return env


# A progress line (cli/progress.py, printed every 10 s by a slow run): volatile, dropped.
PROGRESS = re.compile(r'^.*: [\d.]+ \S*B / [\d.]+ \S*B \(\d+%\), [\d.]+ \S*B/s, \S+ left$')
DURATION = r'(?:\d+\.\d+s|\d+m\d\ds|\d+h\d\dm)'


def normalize(text: str, work: pathlib.Path) -> str:
  """The text without what changes from run to run: paths, durations, rates, progress."""
  for path, name in ((work, '<work>'), (ROOT, '<repo>')):
    text = text.replace(str(path.resolve()), name).replace(str(path), name)
  text = '\n'.join(line for line in text.split('\n') if not PROGRESS.match(line))
  text = re.sub(rf' in {DURATION}( \([\d.]+ \S*B/s\))?',
                lambda m: ' in <time>' + (' (<rate>)' if m.group(1) else ''), text)
  return re.sub(r'"seconds": [\d.e+-]+', '"seconds": "<time>"', text)


def normalize_tree(value: Any, work: pathlib.Path) -> Any:
  if isinstance(value, str):
    return normalize(value, work)
  if isinstance(value, dict):
    return {k: normalize_tree(v, work) for k, v in value.items()}
  if isinstance(value, list):
    return [normalize_tree(v, work) for v in value]
  return value


def run_command(c: Command, work: pathlib.Path) -> tuple[dict, float]:
  """(the command's argv, exit code and messages, normalized; its seconds)."""
  if c.prepare is not None:
    c.prepare()
  t = time.time()
  p = subprocess.run([sys.executable, '-m', 'orbax_tunix.cli', *c.argv], capture_output=True,
                     text=True, cwd=ROOT, env=cli_env(), timeout=CLI_TIMEOUT, check=False)
  return {'argv': [normalize(a, work) for a in c.argv], 'rc': p.returncode,
          'stdout': normalize(p.stdout, work), 'stderr': normalize(p.stderr, work)}, time.time() - t


def sha256(data: bytes) -> str:
  return hashlib.sha256(data).hexdigest()


def array_digest(value: Any) -> dict:
  import jax
  import numpy as np

  if jax.dtypes.issubdtype(getattr(value, 'dtype', np.float32), jax.dtypes.prng_key):
    value = jax.random.key_data(value)
  a = np.ascontiguousarray(np.asarray(value))
  return {'shape': list(a.shape), 'dtype': str(a.dtype), 'sha256': sha256(a.tobytes())}


def safetensors_digest(data: bytes) -> dict:
  """The header's `__metadata__` and each tensor (dtype, shape, sha256 of its bytes)."""
  size = struct.unpack('<Q', data[:8])[0]
  header = json.loads(data[8:8 + size])
  body = data[8 + size:]
  tensors = {name: {'dtype': t['dtype'], 'shape': t['shape'],
                    'sha256': sha256(body[t['data_offsets'][0]:t['data_offsets'][1]])}
             for name, t in header.items() if name != '__metadata__'}
  return {'metadata': header.get('__metadata__'), 'tensors': tensors}


def folder_digest(folder: pathlib.Path, work: pathlib.Path) -> dict:
  """Every file's sha256 (the work and repository paths in it normalized: an adapter config
  names its --base-model folder), with details; an Orbax step in it (a run) as a step."""
  steps = sorted(x.parent for x in folder.rglob('_CHECKPOINT_METADATA'))
  files: dict[str, Any] = {str(x.relative_to(folder)): step_digest(x, work) for x in steps}
  for f in sorted(x for x in folder.rglob('*') if x.is_file()):
    if any(f.is_relative_to(x) for x in steps):
      continue
    data = f.read_bytes()
    for path, name in ((work, b'<work>'), (ROOT, b'<repo>')):
      data = data.replace(str(path).encode(), name)
    entry: dict[str, Any] = {'sha256': sha256(data)}
    try:  # The details, where the file is what its name says (else its sha256 alone).
      if f.suffix == '.safetensors':
        entry.update(safetensors_digest(data))
      elif f.suffix == '.json' and len(data) < 100_000:
        entry['json'] = normalize_tree(json.loads(data), work)
    except (ValueError, KeyError, struct.error):
      pass
    files[str(f.relative_to(folder))] = entry
  return {'kind': 'folder', 'files': files}


def item_digest(item: pathlib.Path) -> dict:
  """An Orbax item read by plain Orbax: every leaf's digest and storage."""
  import jax
  import orbax.checkpoint as ocp

  handler = ocp.PyTreeCheckpointHandler()
  leaves = jax.tree_util.tree_flatten_with_path(handler.restore(item),
                                                is_leaf=lambda x: x is None)[0]
  storage = jax.tree_util.tree_flatten_with_path(handler.metadata(item).tree)[0]

  def key(path):
    return '/'.join(str(getattr(k, 'key', getattr(k, 'idx', k))) for k in path)

  def shapes(m):  # (chunk shape, write shape); either may be unrecorded
    s = getattr(m, 'storage', None)
    return [None if x is None else list(x) for x in (s.chunk_shape, s.write_shape)] if s else None

  return {'leaves': {key(k): None if v is None else array_digest(v) for k, v in leaves},
          'storage': {key(k): shapes(m) for k, m in storage}}


def step_digest(step: pathlib.Path, work: pathlib.Path) -> dict:
  meta = json.loads((step / '_CHECKPOINT_METADATA').read_text())
  items = sorted(x.name for x in step.iterdir() if (x / '_METADATA').exists())
  return {'kind': 'orbax_step', 'entries': sorted(x.name for x in step.iterdir()),
          'item_handlers': meta.get('item_handlers'),
          'custom_metadata': normalize_tree(meta.get('custom_metadata'), work),
          'items': {name: item_digest(step / name) for name in items}}


def digest(path: pathlib.Path | None, work: pathlib.Path) -> dict | None:
  """What is at `path` after a command (None: nothing written, or nothing to write)."""
  if path is None or not path.exists():
    return None
  try:
    if (path / '_CHECKPOINT_METADATA').exists():
      return step_digest(path, work)
    return folder_digest(path, work)
  except Exception as e:  # noqa: BLE001 - an unreadable output is a result to compare too.
    return {'kind': 'unreadable', 'error': normalize(f'{type(e).__name__}: {e}', work)}


def strays(commands: dict[str, Command], work: pathlib.Path) -> list[str]:
  """What lies in <work>/out besides the commands' outputs: a temporary or an empty folder left
  behind (a failed or refused command leaves nothing)."""
  outs = {c.out for c in commands.values() if c.out is not None}
  parents = {o.parent for o in outs}
  found = []
  for x in sorted((work / 'out').iterdir()) if (work / 'out').exists() else ():
    if x in parents:
      inside = [y for y in sorted(x.iterdir()) if y not in outs]
      found += inside if inside or any(x.iterdir()) else [x]
    elif x not in outs:
      found.append(x)
  return [normalize(str(x), work) for x in found]


def git(*argv: str) -> str:
  p = subprocess.run(['git', *argv], capture_output=True, text=True, cwd=ROOT, check=False)
  return p.stdout.strip()


def record(out_json: pathlib.Path, work: pathlib.Path | None, jobs: int) -> int:
  os.environ.update({k: v for k, v in cli_env().items() if k in ('JAX_PLATFORMS', 'XLA_FLAGS')})
  import warnings
  warnings.filterwarnings('ignore')  # Orbax's "sharding from file" warning on plain restores.
  t0 = time.time()
  keep = work is not None
  work = pathlib.Path(work or tempfile.mkdtemp(prefix='compare_outputs-')).resolve()
  if keep and work.exists() and any(work.iterdir()):
    print(f'{work}: expected an empty or new folder for --work', file=sys.stderr)
    return 2
  write_inputs(work / 'inputs')
  commands = plan_commands(work)
  fixtures_before = git('status', '--porcelain', '--', 'tests/data')
  results, seconds = {}, {}
  with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
    pending = dict(commands)
    while pending:  # Waves: a command runs once the commands it reads from are done.
      ready = [c for c in pending.values() if all(n in results for n in c.needs)]
      futures = {pool.submit(run_command, c, work): c.name for c in ready}
      for f in concurrent.futures.as_completed(futures):
        name = futures[f]
        results[name], seconds[name] = f.result()
        del pending[name]
        r = results[name]
        print(f'[{len(results)}/{len(commands)}] {name}: exit {r["rc"]} in {seconds[name]:.1f}s',
              file=sys.stderr)
  for name, c in commands.items():
    results[name]['output'] = digest(c.out, work)
  inputs = {x.name: digest(x, work) for x in sorted((work / 'inputs').iterdir())}
  doc = {'meta': {'git': git('rev-parse', 'HEAD'), 'command_count': len(commands),
                  'fixtures_untouched': git('status', '--porcelain', '--', 'tests/data')
                  == fixtures_before, 'strays': strays(commands, work)},
         'inputs': inputs, 'commands': results}
  out_json.write_text(json.dumps(doc, indent=1, sort_keys=True) + '\n')
  if not keep:
    shutil.rmtree(work)
  slowest = max(seconds, key=seconds.get)
  cpu = resource.getrusage(resource.RUSAGE_CHILDREN)
  print(f'recorded {len(commands)} commands to {out_json} in {time.time() - t0:.0f}s'
        f' ({jobs} at a time; the commands used {cpu.ru_utime + cpu.ru_stime:.0f} CPU seconds;'
        f' slowest {slowest}, {seconds[slowest]:.1f}s)', file=sys.stderr)
  return 0


# --------------------------------------------------------------------------- #
# Comparing two records
# --------------------------------------------------------------------------- #
def _lines(a: str, b: str) -> list[str]:
  import difflib
  return list(difflib.unified_diff(a.splitlines(), b.splitlines(), 'A', 'B', lineterm='', n=1))[2:]


def _output_differences(a: dict | None, b: dict | None) -> list[str]:
  """What differs between two output digests, by file, tensor, item and leaf."""
  if a is None or b is None or a['kind'] != b['kind']:
    def what(x):
      return 'nothing' if x is None else x['kind']
    return [f'output: A wrote {what(a)}, B wrote {what(b)}']
  out = []
  if a['kind'] == 'folder':
    for f in sorted(a['files'].keys() | b['files'].keys()):
      fa, fb = a['files'].get(f), b['files'].get(f)
      if fa is None or fb is None:
        out.append(f'file {f}: only in {"B" if fa is None else "A"}')
      elif fa != fb:
        out.append(f'file {f}: sha256 {fa["sha256"][:12]} -> {fb["sha256"][:12]}')
        out += [f'  {line}' for line in _dict_differences(fa, fb, skip=('sha256',))]
    return out
  for field in ('entries', 'item_handlers', 'custom_metadata'):
    if a[field] != b[field]:
      out.append(f'{field}:')
      out += [f'  {line}' for line in _dict_differences({field: a[field]}, {field: b[field]})]
  for item in sorted(a['items'].keys() | b['items'].keys()):
    ia, ib = a['items'].get(item), b['items'].get(item)
    if ia != ib:
      out.append(f'item {item}:')
      out += [f'  {line}' for line in _dict_differences(ia or {}, ib or {})]
  return out


def _dict_differences(a: Any, b: Any, path: str = '', skip: tuple[str, ...] = ()) -> list[str]:
  """Leaf-level differences of two JSON values, each as `path: A -> B` (at most 20)."""
  out: list[str] = []
  if isinstance(a, dict) and isinstance(b, dict):
    for k in sorted(a.keys() | b.keys()):
      if k in skip:
        continue
      where = f'{path}/{k}' if path else str(k)
      if k not in a or k not in b:
        out.append(f'{where}: only in {"A" if k in a else "B"}')
      elif a[k] != b[k]:
        out += _dict_differences(a[k], b[k], where)
  elif a != b:
    out.append(f'{path}: {json.dumps(a)[:200]} -> {json.dumps(b)[:200]}')
  return out[:20] + ([f'... and {len(out) - 20} more'] if len(out) > 20 else [])


def command_differences(a: dict, b: dict) -> list[str]:
  out = []
  for field in ('argv', 'rc'):
    if a[field] != b[field]:
      out.append(f'{field}: {a[field]} -> {b[field]}')
  for field in ('stdout', 'stderr'):
    if a[field] != b[field]:
      out.append(f'{field}:')
      out += [f'  {line}' for line in _lines(a[field], b[field])]
  return out + (_output_differences(a['output'], b['output'])
                if a['output'] != b['output'] else [])


def compare(path_a: pathlib.Path, path_b: pathlib.Path, expected: list[str]) -> int:
  a, b = (json.loads(p.read_text()) for p in (path_a, path_b))
  unexpected, expected_diff, same = [], [], 0
  for name in sorted(a['inputs'].keys() | b['inputs'].keys()):
    if a['inputs'].get(name) != b['inputs'].get(name):
      print(f'input {name} differs: the commands that read it are not comparable')
      unexpected.append(f'input {name}')
  for field in ('fixtures_untouched', 'strays'):
    if a['meta'][field] != b['meta'][field]:
      print(f"{field}: A {a['meta'][field]}, B {b['meta'][field]}")
      unexpected.append(field)
  for name in sorted(a['commands'].keys() | b['commands'].keys()):
    ca, cb = a['commands'].get(name), b['commands'].get(name)
    if ca is None or cb is None:
      lines = [f'only in {"A" if cb is None else "B"}']
    else:
      lines = command_differences(ca, cb)
    if not lines:
      same += 1
      continue
    is_expected = any(fnmatch.fnmatchcase(name, pattern) for pattern in expected)
    (expected_diff if is_expected else unexpected).append(name)
    print(f'{name}: differs{" (expected)" if is_expected else ""}')
    print('\n'.join(f'  {line}' for line in lines))
  print(f'{same} commands the same, {len(expected_diff)} differ as expected,'
        f' {len(unexpected)} differ unexpectedly (A {a["meta"]["git"][:12]},'
        f' B {b["meta"]["git"][:12]})')
  return 1 if unexpected else 0


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  sub = parser.add_subparsers(dest='command', required=True)
  r = sub.add_parser('record', help='run the commands and write their results as JSON')
  r.add_argument('out', type=pathlib.Path)
  r.add_argument('--work', type=pathlib.Path, help='keep the outputs here (default: a temporary'
                 ' folder, removed)')
  r.add_argument('--jobs', type=int, default=os.cpu_count() or 2, help='commands at a time')
  c = sub.add_parser('compare', help='print every command whose result differs')
  c.add_argument('a', type=pathlib.Path)
  c.add_argument('b', type=pathlib.Path)
  c.add_argument('--expect-changed', nargs='*', default=[], metavar='PATTERN',
                 help='command names (globs, e.g. "convert/maxtext/mt_gemma*") allowed to differ')
  args = parser.parse_args(argv)
  if args.command == 'record':
    return record(args.out, args.work, args.jobs)
  return compare(args.a, args.b, args.expect_changed)


if __name__ == '__main__':
  sys.exit(main())

"""`transformers` and `peft` load what `orbax-tunix export` writes, and compute the Tunix model.

The sources are the Tunix fixtures of tests/test_export_hf.py (tests/data/tunix/hf_*: Tunix's
own model classes, trained by optax, saved by Tunix's CheckpointManager). The exports run here
with the CLI, each with a config.json as the family's Hub repos write it (at the fixtures'
dims); meanwhile two workers import their clients: tests/hf_client.py in the Hugging Face venv
(scripts/hf_venv.sh: torch CPU, transformers, peft; neither jax nor orbax_tunix) and
tests/tunix_client.py (google-tunix 0.1.7, for the expected values). Every job of the module
runs in one batch per worker, each as soon as the exports it needs are written.

Expected values never come from orbax_tunix: logits from the model Tunix restores from the
checkpoint (tunix_client `reference`, with qwix's LoRA live for the LoRA runs), merged weights
from the `--merge-lora` export (itself checked against a float32 hand merge and Tunix's own
merged saver in tests/test_export_hf.py), vLLM's rules as vLLM states them.

What the tests hold the exports to:
  (a) every full export (each Tunix family, every registered family having a fixture; each
      --merge-lora export) loads in
      `AutoModelForCausalLM.from_pretrained` with no missing, unexpected or mismatched key, as
      the family's class, and computes the Tunix model's logits within LOGITS_RTOL; where
      google-tunix 0.1.7 computes otherwise than transformers reads the config (TRAINER_FACTS),
      the difference is measured, the export says so in a note, and for `rope_theta`
      `--config-as-trained` writes the value that gives the Tunix model back.
  (b) each LoRA run's `--peft` adapter folder loads onto its base's export (`--base-only` for
      a full save, the base run's export for an adapters-only one) with no missing or
      unexpected adapter key, every adapted weight wrapped; the PeftModel computes the Tunix
      LoRA model's logits (qwix live) within LOGITS_RTOL; `merge_and_unload()` equals the
      `--merge-lora` export tensor by tensor within WEIGHT_ATOL; the folder meets vLLM's rules.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import pathlib
import sys
import time

import numpy as np
import pytest

from tests import clients
from tests.clients import subprocess_env
from tests.test_export_hf import (
    DATA,
    FAMILY_FIXTURES,
    HF_CONFIG_DIMS,
    HF_CONFIG_EXTRA,
    HF_CONFIG_FULL,
    LORA_FIXTURES,
    _job,
    _lora_spec,
    export_argv,
    manifest,
    read_safetensors,
    run_cli,
)

ROOT = pathlib.Path(__file__).resolve().parent.parent
HF_CLIENT = ROOT / 'tests' / 'hf_client.py'
TUNIX_CLIENT = ROOT / 'tests' / 'tunix_client.py'
WORKER_TIMEOUT = 600

# Two float32 forward passes of one model by two libraries (XLA on CPU vs torch on CPU): the
# same sums in other orders and other kernels (RMSNorm, softmax, GELU's tanh, RoPE's sin/cos
# tables computed otherwise). Measured here (transformers 5.24, torch 2.13 vs jax 0.10.2):
# at most 6.8e-5 on logits up to 14.1 (gemma3, 6 layers), 4.1e-5 on 11.5 (gemma), <= 2e-5
# for the others, the PeftModel with its adapters live <= 2e-5: at most 4.8e-6 of the largest
# logit. The bound, 2e-5 of the largest logit (1.2e-4 to 3.2e-4 here), keeps a >4x margin,
# while a different model moves them far more: a RoPE base 500000 for 1e6 by 0.33, Gemma 4's
# router input by 1.6, the LoRA adapters by 2.4 to 7.8 (MANIFEST's
# lora.logits_max_abs_change_by_adapters).
LOGITS_RTOL = 2e-5
# merge_and_unload (torch: W + (B @ A) * scaling) vs --merge-lora (W + s a.b): the same float32
# product, each side rounded once (measured: equal bit for bit); |W| < ~1.5 here, so 2e-6 is a
# few float32 ulps (tests/test_export_hf.py's WEIGHT_ATOL).
WEIGHT_ATOL = 2e-6

# config.json as the families' Hub repos write them, at the fixtures' dims; test_export_hf's
# where it has a whole one.
_LLAMA3 = {  # as Meta-Llama-3-8B: RoPE base 500000
    'architectures': ['LlamaForCausalLM'], 'model_type': 'llama', 'attention_bias': False,
    'attention_dropout': 0.0, 'bos_token_id': 128000, 'eos_token_id': 128001,
    'hidden_act': 'silu', 'initializer_range': 0.02, 'max_position_embeddings': 8192,
    'mlp_bias': False, 'pretraining_tp': 1, 'rms_norm_eps': 1e-05, 'rope_scaling': None,
    'rope_theta': 500000.0, 'torch_dtype': 'bfloat16', 'transformers_version': '4.40.0.dev0',
    'use_cache': True,
}
_GEMMA3 = {  # as gemma-3-1b-it: every 6th layer global
    'architectures': ['Gemma3ForCausalLM'], 'model_type': 'gemma3_text',
    'attention_bias': False, 'attention_dropout': 0.0, 'attn_logit_softcapping': None,
    'bos_token_id': 2, 'eos_token_id': 1, 'final_logit_softcapping': None,
    'hidden_activation': 'gelu_pytorch_tanh', 'initializer_range': 0.02,
    'max_position_embeddings': 32768, 'pad_token_id': 0, 'query_pre_attn_scalar': 12,
    'rms_norm_eps': 1e-06, 'rope_local_base_freq': 10000, 'rope_scaling': None,
    'rope_theta': 1000000, 'sliding_window': 4, 'sliding_window_pattern': 6,
    'torch_dtype': 'bfloat16', 'transformers_version': '4.50.0.dev0', 'use_cache': True,
}
HUB_CONFIGS = {
    **HF_CONFIG_FULL,
    'hf_qwen3': {**HF_CONFIG_DIMS['hf_qwen3'], **HF_CONFIG_EXTRA['hf_qwen3']},  # as Qwen3-0.6B
    'hf_llama3': {**HF_CONFIG_DIMS['hf_llama3'], **_LLAMA3},
    'hf_gemma3': {**HF_CONFIG_DIMS['hf_gemma3'], **_GEMMA3},
    'hf_gemma3_fused': {**HF_CONFIG_DIMS['hf_gemma3_fused'], **_GEMMA3},
}
# Gemma 4 as the Hub's are, with its vision and audio towers (tiny): their linear layers are
# Gemma4ClippableLinear modules named as the text model's (q_proj, gate_proj, ...), which PEFT
# cannot adapt: an adapter must name the text model's modules alone.
GEMMA4_TOWERS = {
    'vision_config': {'model_type': 'gemma4_vision', 'hidden_size': 16, 'intermediate_size': 24,
                      'num_hidden_layers': 1, 'num_attention_heads': 2,
                      'num_key_value_heads': 2, 'head_dim': 8, 'patch_size': 4,
                      'position_embedding_size': 64, 'pooling_kernel_size': 2},
    'audio_config': {'model_type': 'gemma4_audio', 'hidden_size': 16, 'num_hidden_layers': 1,
                     'num_attention_heads': 2, 'subsampling_conv_channels': [8, 4],
                     'output_proj_dims': 16, 'conv_kernel_size': 3},
}
# A LoRA run (tests/test_export_peft.py `_mixed_ranks`: hf_qwen3's weights, adapters of ranks 2,
# 4 and 8, some layers only) and its qwix alpha.
MIXED_ALPHA = 6
HF_CLASSES = {  # fixture -> the class AutoModelForCausalLM must build
    'hf_qwen3': 'Qwen3ForCausalLM', 'hf_llama3': 'LlamaForCausalLM',
    'hf_gemma3': 'Gemma3ForCausalLM', 'hf_gemma3_fused': 'Gemma3ForCausalLM',
    'hf_qwen2': 'Qwen2ForCausalLM', 'hf_qwen3_moe': 'Qwen3MoeForCausalLM',
    'hf_gemma': 'GemmaForCausalLM', 'hf_gemma2': 'Gemma2ForCausalLM',
    'hf_gemma4': 'Gemma4ForConditionalGeneration',
    'hf_gemma4_moe': 'Gemma4ForConditionalGeneration',
}
# Where google-tunix 0.1.7 computes otherwise than transformers does from the Hub config
# (item 7 of issue 37), measured here: fixture -> (what, the max |logits difference| it makes
# at least). Llama 3's attention rotates with base 1e6 (tunix.models.llama3.model.apply_rope's
# default; the ModelConfig's rope_theta is never passed to it) while its Hub config says
# 500000; Gemma 4's MoE router reads moe_pre_ffw_norm(x) where transformers' reads x.
TRAINER_FACTS = {'hf_llama3': ('rope_theta', 0.05), 'hf_gemma4_moe': ('router', 0.05)}
# The runs whose clients feed Gemma 4's MoE router what Tunix's reads (tests/hf_client.py
# `router_reads_normed`): with it transformers computes the Tunix model.
ROUTER_PATCHED = ('hf_gemma4_moe_lora',)
# The LoRA runs whose adapter export is given --lora-scale (the others --lora-alpha).
BY_SCALE = ('hf_qwen2_lora',)
# vLLM's limits on a LoRA adapter (vllm/lora: max_lora_rank is at most 512).
VLLM_MAX_RANK = 512


def hub_config(name: str) -> dict:
  return HUB_CONFIGS[manifest(name)['lora']['base'] if manifest(name).get('lora') else name]


def base_family(name: str) -> str:
  return FAMILY_FIXTURES[manifest(name)['lora']['base'] if manifest(name).get('lora') else name]


class Runs:
  """What the module's tests assert on: the CLI runs and both workers' results."""

  def __init__(self, runs: dict[str, dict], hf: clients.Worker, tunix: clients.Worker):
    self.runs, self.hf, self.tunix = runs, hf, tunix

  def exported(self, name: str) -> pathlib.Path:
    r = self.runs[name]
    assert r['rc'] == 0, (f"`orbax-tunix {' '.join(r['argv'])}` failed (exit {r['rc']}):\n"
                          f"{r['stderr'][-3000:]}")
    return r['out']

  def result(self, worker: clients.Worker, job_id: str, *needs: str) -> dict:
    for name in needs:
      self.exported(name)
    r = worker.results.get(job_id)
    assert r is not None, f'the {worker.name} worker gave no result for {job_id}:\n{worker.log()}'
    assert r['ok'], (f"{worker.name} job {job_id} ({r['job']}) failed: {r['error']}\n"
                     + '\n  caused by: '.join(r['error_chain']) + f"\n{r['traceback'][-4000:]}")
    return r

  def hf_result(self, job_id: str, *needs: str) -> dict:
    return self.result(self.hf, job_id, *needs)

  def arrays(self, worker: clients.Worker, job_id: str, *needs: str) -> dict[str, np.ndarray]:
    with np.load(self.result(worker, job_id, *needs)['npz']) as z:
      return {k: z[k] for k in z.files}

  def reference(self, name: str) -> np.ndarray:
    logits = self.arrays(self.tunix, f'ref_{name}')['logits']
    assert logits.dtype == np.float32 and np.abs(logits).max() > 1, 'degenerate reference'
    return logits

  def note(self, name: str) -> str:
    r = self.runs[name]
    return r['stdout'] + r['stderr']


def _write_config(d: pathlib.Path, config: dict) -> pathlib.Path:
  d.mkdir(parents=True)
  (d / 'config.json').write_text(json.dumps(config, indent=2) + '\n')
  return d


def start_workers(hf_python: str, work: pathlib.Path) -> tuple[clients.Worker, clients.Worker]:
  """The two reference workers: transformers (+ peft) in the hf venv, and Tunix's own model
  classes (google-tunix 0.1.7 from scripts/tunix_pkgs.sh) in this interpreter."""
  tunix_pkgs = clients.client_env('tunix_pkgs.sh', PYTHON=sys.executable)
  hf_worker = clients.Worker('transformers', hf_python, HF_CLIENT, work / 'hf_out',
                             work / 'hf.log', env=subprocess_env())
  tunix_worker = clients.Worker('Tunix', sys.executable, TUNIX_CLIENT, work / 'tunix_out',
                                work / 'tunix.log', env=subprocess_env(PYTHONPATH=tunix_pkgs))
  return hf_worker, tunix_worker


def export_then_send(planned: dict[str, tuple[pathlib.Path, list[str]]],
                     after: dict[tuple[str, ...] | None, list[tuple[clients.Worker, dict]]]
                     ) -> dict[str, dict]:
  """Runs the planned CLI exports (name -> (output, argv)) side by side, and sends each
  worker job of `after` (the exports it needs, sorted, or None -> [(worker, job)]) as soon
  as every export it needs exited 0: the jobs needing none first.

  Returns:
    name -> the CLI run (`run_cli`'s, with 'out' its output).
  """
  def send(key):
    for worker, kw in after.pop(key, []):
      worker.send(kw)

  send(None)
  runs: dict[str, dict] = {}
  with concurrent.futures.ThreadPoolExecutor(max(2, os.cpu_count() or 2)) as pool:
    futures = {pool.submit(run_cli, argv): name for name, (_, argv) in planned.items()}
    for f in concurrent.futures.as_completed(futures):
      name = futures[f]
      runs[name] = {**f.result(), 'out': planned[name][0]}
      done = {n for n, r in runs.items() if r['rc'] == 0}
      for key in [k for k in after if k and set(k) <= done]:
        send(key)
  return runs


@pytest.fixture(scope='module')
def hf(hf_python, tmp_path_factory):
  t0 = time.time()
  work = tmp_path_factory.mktemp('hf_clients')
  hf_worker, tunix_worker = start_workers(hf_python, work)
  out, configs = work / 'out', work / 'configs'
  planned: dict[str, tuple[pathlib.Path, list[str]]] = {}

  def plan(name, src, *flags):
    planned[name] = (out / name, export_argv(DATA / src, out / name, *flags))

  for name, family in FAMILY_FIXTURES.items():
    d = _write_config(configs / name, HUB_CONFIGS[name])
    plan(f'full_{name}', name, '--model', family, '--hf-config', str(d))
  plan('trained_hf_llama3', 'hf_llama3', '--model', 'llama3', '--hf-config',
       str(configs / 'hf_llama3'), '--config-as-trained')
  plan('refuse_trained_without_config', 'hf_llama3', '--model', 'llama3', '--config-as-trained')
  for name in LORA_FIXTURES:
    lora, family = manifest(name)['lora'], base_family(name)
    config = str(configs / lora['base'])
    only = name.endswith('_only')
    if not only:
      plan(f'base_{name}', name, '--model', family, '--base-only', '--hf-config', config)
    scale = (['--lora-scale', str(lora['scale'])] if name in BY_SCALE
             else ['--lora-alpha', str(lora['alpha'])])
    plan(f'peft_{name}', name, '--model', family, '--peft', *scale,
         '--base-model', f'tiny/{lora["base"]}')
    plan(f'merged_{name}', name, '--model', family, '--merge-lora', '--lora-alpha',
         str(lora['alpha']), '--hf-config', config,
         *(['--base', str(DATA / lora['base'])] if only else []))

  # Issue 46: mixed ranks and some layers only (served as vLLM reads the config), and
  # Gemma 4's adapter on a base with its vision and audio towers.
  from tests.test_export_peft import _mixed_ranks
  mixed = _mixed_ranks(work / 'mixed_run')
  plan('peft_mixed', mixed, '--model', 'qwen3', '--peft', '--lora-alpha', str(MIXED_ALPHA),
       '--base-model', 'tiny/hf_qwen3')
  plan('merged_mixed', mixed, '--model', 'qwen3', '--merge-lora', '--lora-alpha',
       str(MIXED_ALPHA), '--hf-config', str(configs / 'hf_qwen3'))
  towers = _write_config(configs / 'hf_gemma4_towers', {**HUB_CONFIGS['hf_gemma4'],
                                                        **GEMMA4_TOWERS})
  plan('towers_hf_gemma4_lora', 'hf_gemma4_lora', '--model', 'gemma4', '--base-only',
       '--hf-config', str(towers))

  after: dict[str | None, list[tuple[clients.Worker, dict]]] = {}

  def job(worker, needs, **kw):
    for need in needs:  # sent once the last export it needs is written
      if need not in planned:
        raise AssertionError(need)
    after.setdefault(tuple(sorted(needs)) or None, []).append((worker, kw))

  def dir_of(name: str) -> str:
    return str(planned[name][0])

  for name in FAMILY_FIXTURES:
    tokens = manifest(name)['tokens']
    job(tunix_worker, (), id=f'ref_{name}', job='reference', **_job(name, root=str(DATA / name)))
    job(hf_worker, (f'full_{name}',), id=f'load_full_{name}', job='load',
        dir=dir_of(f'full_{name}'), tokens=tokens)
  qwen3 = _job('hf_qwen3', root=str(DATA / 'hf_qwen3'))
  job(tunix_worker, (), id='ref_theta5e6_hf_qwen3', job='reference',
      **{**qwen3, 'config': {**qwen3['config'], 'rope_theta': 5_000_000}})
  job(hf_worker, ('trained_hf_llama3',), id='load_trained_hf_llama3', job='load',
      dir=dir_of('trained_hf_llama3'), tokens=manifest('hf_llama3')['tokens'])
  job(hf_worker, ('full_hf_gemma4_moe',), id='load_normed_router_hf_gemma4_moe', job='load',
      dir=dir_of('full_hf_gemma4_moe'), tokens=manifest('hf_gemma4_moe')['tokens'],
      router_reads_normed=True)
  for name in LORA_FIXTURES:
    tokens, lora = manifest(name)['tokens'], manifest(name)['lora']
    job(tunix_worker, (), id=f'ref_{name}', job='reference',
        **_job(name, root=str(DATA / name), lora=_lora_spec(name)))
    base = f'full_{lora["base"]}' if name.endswith('_only') else f'base_{name}'
    job(hf_worker, (base, f'peft_{name}'), id=f'peft_{name}', job='peft', base=dir_of(base),
        adapter=dir_of(f'peft_{name}'), tokens=tokens, router_reads_normed=name in ROUTER_PATCHED)
    if not name.endswith('_only'):
      job(hf_worker, (base,), id=f'load_base_{name}', job='load', dir=dir_of(base), tokens=tokens)
    job(hf_worker, (f'merged_{name}',), id=f'load_merged_{name}', job='load',
        dir=dir_of(f'merged_{name}'), tokens=tokens)

  job(hf_worker, ('full_hf_qwen3', 'peft_mixed'), id='peft_mixed', job='peft',
      base=dir_of('full_hf_qwen3'), adapter=dir_of('peft_mixed'),
      tokens=manifest('hf_qwen3')['tokens'], as_vllm=True)
  job(hf_worker, ('merged_mixed',), id='load_merged_mixed', job='load',
      dir=dir_of('merged_mixed'), tokens=manifest('hf_qwen3')['tokens'])
  job(hf_worker, ('towers_hf_gemma4_lora', 'peft_hf_gemma4_lora'), id='peft_towers', job='peft',
      base=dir_of('towers_hf_gemma4_lora'), adapter=dir_of('peft_hf_gemma4_lora'),
      tokens=manifest('hf_gemma4_lora')['tokens'])

  runs = export_then_send(planned, after)
  export_seconds = time.time() - t0
  for worker in (tunix_worker, hf_worker):
    worker.finish(WORKER_TIMEOUT)
  ready = hf_worker.results.get('__ready__', {})
  print(f"\n[hf_clients] {len(runs)} CLI runs in {export_seconds:.1f} s; transformers worker"
        f" (imports {ready.get('import_seconds', float('nan')):.1f} s) {len(hf_worker.results) - 1}"
        f' jobs, Tunix worker {len(tunix_worker.results) - 1} jobs; all done in'
        f' {time.time() - t0:.1f} s', file=sys.stderr)
  return Runs(runs, hf_worker, tunix_worker)


def max_diff(a: np.ndarray, b: np.ndarray) -> float:
  assert a.shape == b.shape, (a.shape, b.shape)
  return float(np.abs(a.astype(np.float64) - b).max())


def assert_logits_close(got: np.ndarray, want: np.ndarray, what: str):
  diff, bound = max_diff(got, want), LOGITS_RTOL * float(np.abs(want).max())
  assert diff <= bound, f'{what}: logits differ from the Tunix model by {diff} (bound {bound})'


def base_dir(hf: Runs, name: str) -> pathlib.Path:
  """The export a LoRA run's adapter applies to: --base-only, or the base run's own."""
  return hf.exported(f'base_{name}' if not name.endswith('_only')
                     else f"full_{manifest(name)['lora']['base']}")


def assert_clean_load(r: dict, what: str):
  info = r['loading_info']
  bad = {k: v for k, v in info.items() if v}
  assert not bad, f'{what}: transformers loaded it with {bad}'


def safetensors_names(folder: pathlib.Path) -> dict[str, tuple[int, ...]]:
  out = {}
  for f in sorted(folder.glob('*.safetensors')):
    _, header, _ = read_safetensors(f)
    out.update({n: tuple(e['shape']) for n, e in header.items()})
  return out


# --------------------------------------------------------------------------- #
# a. full exports in transformers
# --------------------------------------------------------------------------- #
def test_a_every_family_has_a_full_export_loaded():
  """Each Hugging Face family with a Tunix naming has a Tunix fixture whose full export
  transformers loads below (MaxText-only families: tests/test_export_maxtext_clients.py and the
  tests/test_zoo_*_clients.py modules)."""
  from orbax_tunix.mapping import huggingface, trainers
  tunix = {n for n in huggingface.names()
           if huggingface.get(n).naming_of(trainers.TUNIX) is not None}
  assert tunix, 'no family has a Tunix naming'
  assert tunix <= set(FAMILY_FIXTURES.values()), sorted(tunix - set(FAMILY_FIXTURES.values()))


@pytest.mark.parametrize('name', FAMILY_FIXTURES)
def test_a_full_export_loads_in_transformers_as_the_tunix_model(hf, name):
  r = hf.hf_result(f'load_full_{name}', f'full_{name}')
  assert_clean_load(r, f'full_{name}')
  assert r['model_class'] == HF_CLASSES[name]
  got, want = hf.arrays(hf.hf, f'load_full_{name}')['logits'], hf.reference(name)
  diff = max_diff(got, want)
  if name in TRAINER_FACTS:  # transformers computes another model: measured, and said
    what, at_least = TRAINER_FACTS[name]
    assert diff > at_least, (f'{name}: transformers now computes the Tunix model ({what}) within'
                             f' {diff}: TRAINER_FACTS and the export note are stale')
    return
  assert_logits_close(got, want, name)


def test_a_rope_theta_note_names_the_field_the_value_and_the_consequence(hf):
  note = hf.note('full_hf_llama3')
  hf.exported('full_hf_llama3')
  assert 'rope_theta' in note and '1000000' in note and '500000' in note, note
  assert '--config-as-trained' in note, note
  for name in ('full_hf_qwen3', 'full_hf_qwen3_moe', 'full_hf_qwen2', 'full_hf_gemma3'):
    assert 'rope_theta' not in hf.note(name), hf.note(name)


def test_a_rope_theta_as_trained_gives_the_tunix_model_back(hf):
  r = hf.hf_result('load_trained_hf_llama3', 'trained_hf_llama3')
  assert_clean_load(r, 'trained_hf_llama3')
  config = json.loads((hf.exported('trained_hf_llama3') / 'config.json').read_text())
  assert config['rope_theta'] == 1000000, config
  got = hf.arrays(hf.hf, 'load_trained_hf_llama3')['logits']
  assert_logits_close(got, hf.reference('hf_llama3'), 'trained_hf_llama3')
  assert 'config.json: rope_theta=1000000 (the base config has 500000.0)' in hf.note(
      'trained_hf_llama3'), hf.note('trained_hf_llama3')


def test_a_tunix_qwen3_rotates_with_1e6_whatever_its_config_says(hf):
  """The fact behind the qwen3 families' note: Tunix's Qwen3 given rope_theta 5e6 (as
  Qwen3-4B-Instruct-2507's config) computes the very logits it computes with 1e6."""
  got = hf.arrays(hf.tunix, 'ref_theta5e6_hf_qwen3')['logits']
  np.testing.assert_array_equal(got, hf.reference('hf_qwen3'))
  assert manifest('hf_llama3')['model_config']['rope_theta'] == 500000  # and llama3's, above


def test_a_config_as_trained_needs_hf_config(hf):
  r = hf.runs['refuse_trained_without_config']
  assert r['rc'] == 2 and '--hf-config' in r['stderr'] and '--config-as-trained' in r['stderr'], r
  assert not r['out'].exists()


def test_a_gemma4_router_note_and_its_cause(hf):
  """The one difference is the router's input: fed what Tunix's is, transformers gives the
  Tunix model back; the export says so (no config value reproduces it)."""
  note = hf.note('full_hf_gemma4_moe')
  assert 'router' in note and 'moe_pre_ffw_norm' in note, note
  assert 'router' not in hf.note('full_hf_gemma4'), 'a dense Gemma 4 has no router'
  r = hf.hf_result('load_normed_router_hf_gemma4_moe', 'full_hf_gemma4_moe')
  assert r['patched_routers'] == manifest('hf_gemma4_moe')['model_config']['num_layers']
  got = hf.arrays(hf.hf, 'load_normed_router_hf_gemma4_moe')['logits']
  assert_logits_close(got, hf.reference('hf_gemma4_moe'), 'hf_gemma4_moe, router as Tunix')


@pytest.mark.parametrize('name', LORA_FIXTURES)
def test_a_merged_export_loads_in_transformers_as_the_tunix_lora_model(hf, name):
  r = hf.hf_result(f'load_merged_{name}', f'merged_{name}')
  assert_clean_load(r, f'merged_{name}')
  assert r['model_class'] == HF_CLASSES[manifest(name)['lora']['base']]
  got = hf.arrays(hf.hf, f'load_merged_{name}')['logits']
  diff = max_diff(got, hf.reference(name))
  if manifest(name)['lora']['base'] in TRAINER_FACTS:  # as the base's, measured
    assert diff > TRAINER_FACTS[manifest(name)['lora']['base']][1]
    return
  assert_logits_close(got, hf.reference(name), f'merged {name}')


# --------------------------------------------------------------------------- #
# b. adapters in peft
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize('name', [n for n in LORA_FIXTURES if not n.endswith('_only')])
def test_b_base_only_export_is_the_run_base(hf, name):
  """--base-only: the full LoRA save's base weights, a model transformers loads (the adapters
  moved the logits: the base's differ from the LoRA model's)."""
  r = hf.hf_result(f'load_base_{name}', f'base_{name}')
  assert_clean_load(r, f'base_{name}')
  base = hf.arrays(hf.hf, f'load_base_{name}')['logits']
  lora = manifest(name)['lora']
  assert max_diff(base, hf.reference(name)) > lora['logits_max_abs_change_by_adapters'] / 10


@pytest.mark.parametrize('name', LORA_FIXTURES)
def test_b_adapter_loads_in_peft_and_computes_the_tunix_lora_model(hf, name):
  r = hf.hf_result(f'peft_{name}', f'peft_{name}')
  assert_clean_load(r, f'the base of {name}')
  assert r['adapter_missing_keys'] == [], r['adapter_missing_keys']
  assert r['adapter_unexpected_keys'] == [], r['adapter_unexpected_keys']
  lora = manifest(name)['lora']
  adapter = safetensors_names(hf.exported(f'peft_{name}'))
  wrapped = {n.removeprefix('base_model.model.') for n in r['lora_modules']}
  in_file = {n.removeprefix('base_model.model.').rsplit('.lora_', 1)[0] for n in adapter}
  assert wrapped == in_file, (sorted(wrapped ^ in_file))
  # One adapted HF weight per Tunix target (Gemma's fused kv_einsum is two: k and v).
  assert len(in_file) >= len(lora['targets'])
  cfg = r['adapter_config']
  assert cfg['r'] == lora['rank'] and cfg['lora_alpha'] / cfg['r'] == lora['scale'], cfg
  got = hf.arrays(hf.hf, f'peft_{name}')
  assert r['patched_routers'] == (manifest(name)['model_config']['num_layers']
                                  if name in ROUTER_PATCHED else 0)
  assert_logits_close(got['logits'], hf.reference(name), f'PeftModel of {name}')
  assert_logits_close(got['merged_logits'], got['logits'], f'merge_and_unload of {name}')


@pytest.mark.parametrize('name', LORA_FIXTURES)
def test_b_merge_and_unload_equals_the_merge_lora_export(hf, name):
  """`merge_and_unload()` then `save_pretrained` (the Hub's names) vs the --merge-lora export."""
  merged = {}
  for f in sorted(pathlib.Path(hf.hf_result(f'peft_{name}')['merged_dir']).glob('*.safetensors')):
    merged.update(read_safetensors(f)[2])
  export = {}
  for f in sorted(hf.exported(f'merged_{name}').glob('*.safetensors')):
    export.update(read_safetensors(f)[2])
  assert set(merged) <= set(export), sorted(set(merged) - set(export))
  # Gemma 4's kv-shared layers reuse an earlier layer's keys and values: transformers drops
  # their own k/v projections and k norm on load (`_keys_to_ignore_on_load_unexpected`),
  # Tunix's checkpoint holds them, the export writes them.
  text = hub_config(name).get('text_config', {})
  shared = range(text.get('num_hidden_layers', 0) - text.get('num_kv_shared_layers', 0),
                 text.get('num_hidden_layers', 0))
  unused = {f'model.language_model.layers.{i}.self_attn.{w}.weight'
            for i in shared for w in ('k_proj', 'v_proj', 'k_norm')}
  assert set(export) - set(merged) == unused & set(export), sorted(set(export) - set(merged))
  worst = max((max_diff(merged[n], export[n]), n) for n in merged)
  assert worst[0] <= WEIGHT_ATOL, f'{name}: {worst[1]} differs by {worst[0]}'
  base = {}
  for f in sorted(base_dir(hf, name).glob('*.safetensors')):
    base.update(read_safetensors(f)[2])
  assert [n for n in merged if not np.array_equal(merged[n], base[n])], 'the merge changed nothing'


@pytest.mark.parametrize('name', LORA_FIXTURES)
def test_b_adapter_meets_vllm_rules(hf, name):
  """vLLM (vllm/lora): one adapter_model.safetensors beside adapter_config.json; `r` at most
  max_lora_rank (512 at most); `bias` "none"; no `modules_to_save`; no DoRA; each adapted
  module a module of the base, its A (r, in) and B (out, r) fitting the base's (out, in)."""
  folder = hf.exported(f'peft_{name}')
  files = sorted(p.name for p in folder.iterdir())
  assert files == ['adapter_config.json', 'adapter_model.safetensors'], files
  cfg = json.loads((folder / 'adapter_config.json').read_text())
  assert cfg['peft_type'] == 'LORA' and cfg.get('task_type') == 'CAUSAL_LM', cfg
  assert isinstance(cfg['r'], int) and 0 < cfg['r'] <= VLLM_MAX_RANK, cfg['r']
  assert cfg.get('bias', 'none') == 'none', cfg.get('bias')
  assert not cfg.get('modules_to_save'), cfg.get('modules_to_save')
  assert not cfg.get('use_dora'), cfg.get('use_dora')
  assert cfg.get('base_model_name_or_path') == f"tiny/{manifest(name)['lora']['base']}"
  base = safetensors_names(base_dir(hf, name))
  adapter = safetensors_names(folder)
  r = cfg['r']
  targets = cfg['target_modules']
  assert isinstance(targets, list), targets
  assert not cfg.get('rank_pattern') and not cfg.get('alpha_pattern'), cfg  # vLLM reads neither
  for t in targets:  # a module of the base, by its full name
    assert f'{t}.weight' in base, (t, sorted(base))
  modules = {}
  for n, shape in adapter.items():
    assert n.startswith('base_model.model.'), n
    module, part = n.removeprefix('base_model.model.').rsplit('.lora_', 1)
    assert part in ('A.weight', 'B.weight'), n
    modules.setdefault(module, {})[part[0]] = shape
  for module, parts in modules.items():
    assert set(parts) == {'A', 'B'}, (module, parts)
    assert f'{module}.weight' in base, f'{module}: no such module in the base'
    out_dim, in_dim = base[f'{module}.weight']
    assert parts['A'] == (r, in_dim) and parts['B'] == (out_dim, r), (module, parts)
  assert sorted(modules) == sorted(targets), sorted(set(modules) ^ set(targets))


def test_b_mixed_ranks_on_some_layers_are_served_as_trained(hf):
  """Ranks 2, 4 and 8 on some layers only, the config read as vLLM reads it (r and lora_alpha
  alone): every module, and no other, is wrapped (layer 1's q_proj is not), no adapter key is
  missing or left over, and the PeftModel's logits are the --merge-lora export's."""
  from tests.test_export_peft import MIXED_RANKS
  r = hf.hf_result('peft_mixed', 'peft_mixed', 'full_hf_qwen3')
  assert_clean_load(r, 'full_hf_qwen3')
  assert r['adapter_missing_keys'] == [] and r['adapter_unexpected_keys'] == [], r
  wrapped = {n.removeprefix('base_model.model.') for n in r['lora_modules']}
  assert wrapped == set(MIXED_RANKS), sorted(wrapped ^ set(MIXED_RANKS))
  cfg = r['adapter_config']
  assert (cfg['r'], cfg['lora_alpha']) == (8, MIXED_ALPHA), cfg
  assert not cfg.get('rank_pattern') and not cfg.get('alpha_pattern'), cfg
  assert_clean_load(hf.hf_result('load_merged_mixed', 'merged_mixed'), 'merged_mixed')
  want = hf.arrays(hf.hf, 'load_merged_mixed')['logits']
  got = hf.arrays(hf.hf, 'peft_mixed')
  assert max_diff(want, hf.arrays(hf.hf, 'load_full_hf_qwen3')['logits']) > 0.1, (
      'the adapters hardly move the logits')
  assert_logits_close(got['logits'], want, 'PeftModel of the mixed ranks, as vLLM reads it')
  assert_logits_close(got['merged_logits'], want, 'merge_and_unload of the mixed ranks')


def test_b_gemma4_adapter_loads_onto_a_gemma4_with_vision_and_audio_towers(hf):
  """The towers' linear layers share the text model's module names (q_proj, gate_proj, ...)
  and are Gemma4ClippableLinear, which PEFT refuses to adapt: the adapter names the text
  model's modules in full, so PEFT wraps exactly those, and computes the Tunix LoRA model."""
  r = hf.hf_result('peft_towers', 'towers_hf_gemma4_lora', 'peft_hf_gemma4_lora')
  missing = r['loading_info']['missing_keys']
  assert missing and all('vision' in k or 'audio' in k for k in missing), missing  # towers
  assert r['adapter_missing_keys'] == [] and r['adapter_unexpected_keys'] == [], r
  wrapped = {n.removeprefix('base_model.model.') for n in r['lora_modules']}
  in_file = {n.removeprefix('base_model.model.').rsplit('.lora_', 1)[0]
             for n in safetensors_names(hf.exported('peft_hf_gemma4_lora'))}
  assert wrapped == in_file, sorted(wrapped ^ in_file)
  assert all(n.startswith('model.language_model.') for n in wrapped), sorted(wrapped)
  got = hf.arrays(hf.hf, 'peft_towers')
  assert_logits_close(got['logits'], hf.reference('hf_gemma4_lora'), 'PeftModel with towers')


# --------------------------------------------------------------------------- #
# c. the facts' config handling, in process (no client)
# --------------------------------------------------------------------------- #
def _llama_paths():
  from orbax_tunix.mapping import huggingface, trainers
  family = huggingface.get('llama3').naming_of(trainers.TUNIX)  # Tunix's class: its facts.
  return family, [('layers', '0', 'attn', 'q_proj', 'w')], ['0']


@pytest.mark.parametrize('config, want', [
    # transformers 5 writes the RoPE base in rope_parameters: set there, not added at the top.
    ({'rope_parameters': {'rope_type': 'default', 'rope_theta': 500000.0}},
     {'rope_parameters': {'rope_type': 'default', 'rope_theta': 1000000}}),
    # Left to the class's default (10000 for LlamaConfig): written.
    ({'model_type': 'llama'}, {'model_type': 'llama', 'rope_theta': 1000000}),
    # Already the trained value: unchanged, no note.
    ({'rope_theta': 1000000.0}, {'rope_theta': 1000000.0}),
])
def test_c_config_as_trained_writes_where_transformers_reads(config, want):
  from orbax_tunix.mapping import as_trained
  family, paths, layers = _llama_paths()
  kept, notes = as_trained.apply(family.as_trained, 'llama3', paths, layers, config, write=False)
  assert kept == config
  written, wrote = as_trained.apply(family.as_trained, 'llama3', paths, layers, config, write=True)
  assert written == want
  assert bool(notes) == bool(wrote) == (want != config), (notes, wrote)
  if not config.get('rope_theta') and not config.get('rope_parameters'):
    assert "its class's default" in notes[0], notes


def test_c_config_as_trained_is_refused_without_hf_config():
  from orbax_tunix import errors
  from orbax_tunix.tools import export
  with pytest.raises(errors.InvalidOptionError, match='`hf_config`'):
    export.plan_export(DATA / 'hf_llama3', pathlib.Path('/nonexistent/out'), model='llama3',
                       config_as_trained=True)


def test_c_facts_are_tunix_models_only():
  """Qwen2's Tunix class passes its config's RoPE base (no fact); MaxText's models are not
  Tunix's classes (the facts are Tunix's namings': `Naming.as_trained`)."""
  from orbax_tunix.mapping import huggingface, trainers

  def facts(name, trainer=trainers.TUNIX):
    return huggingface.get(name).naming_of(trainer).as_trained

  assert [f.field for f in facts('qwen2')] == []
  for name in ('llama3', 'qwen3', 'qwen3_moe'):
    assert [(f.field, f.value) for f in facts(name)] == [('rope_theta', 1_000_000)]
    assert facts(name, trainers.MAXTEXT) == ()
  assert [f.what for f in facts('gemma4')] == ['router']

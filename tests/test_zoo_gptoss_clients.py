"""Issue 51's gpt-oss (and Qwen3-VL, Qwen3-VL MoE, Qwen3-Omni) from MaxText, checked against
MaxText 0.2.5, transformers 5.24 and peft.

As tests/test_export_maxtext_clients.py (whose workers and helpers this module reuses): MaxText
itself makes each source (tests/maxtext_client.py `family_case`: a tiny random model, saved as a
Tunix run of TunixMaxTextAdapter and as MaxText's params-only step, MaxText's own
`to_huggingface` conversion of it, its logits on fixed tokens), the CLI exports both sources,
the MaxText worker reads each export with `safetensors` and `transformers.AutoConfig`, and
transformers (tests/hf_client.py) loads it as the family's class with no missing, unexpected
or mismatched key and computes MaxText's logits (HF_LOGITS_ATOL; MoE routing, gpt-oss's sinks,
its alternating sliding window and YaRN RoPE included: MaxText's own forward pass is the
reference).

gpt-oss (gpt-oss-20b's config, tiny: 4 experts, 2 per token, sliding window 6 of 16 tokens):
scanned in blocks of two layers (4 layers: two blocks) and unscanned (2 layers). The export
gets MaxText's HF config fitted to the tiny model with what the Hub's openai/gpt-oss-20b
config.json says otherwise (TINY_FIELDS): its MXFP4 `quantization_config`, which the export
leaves out (the weights it writes are float), and special tokens inside the tiny vocabulary.
Its LoRA (a `lora_case`: MaxText's own `lora_utils.apply_lora_to_model`, qwix on gpt-oss's
`lora_module_path`, which adapts the attention's query, key, value and out kernels and no
expert) exports merged (`--merge-lora`), and as a PEFT adapter on the `--base-only` export,
which peft loads: both compute the LoRA model's logits, which the base alone does not.

Qwen3-VL (qwen3-vl-2b's config, tiny, with a tiny vision tower: MaxText's `use_multimodal`):
unscanned, MaxText's only form with its tower (deepstack refuses scan_layers); the export is
Qwen3VLForConditionalGeneration, text model, tower and lm_head as MaxText's converter writes
them, which transformers loads (AutoModelForImageTextToText) with no missing key and runs on
text tokens. Its LoRA (qwen3's `lora_module_path`: the text model's attention and MLP) exports
as gpt-oss's does. Trained on text alone (`use_multimodal=False`), it is exported by
`--model qwen3` as Qwen3ForCausalLM and compared with MaxText's tensors under the text model's
names. qwen3-vl-30b-a3b (`qwen3_vl_moe`): MaxText's converter fails on it (the test says with
what), so transformers computing the MaxText model's logits is the proof.

Qwen3-Omni trained on text alone (`use_multimodal=False`, `use_audio=False`): transformers has
no causal-LM class of its thinker's text model (the thinker's class needs the towers), which is
MaxText's qwen3 MoE decoder; `--model qwen3_moe` exports it as Qwen3MoeForCausalLM from the
Omni config (its `thinker_config.text_config`), and transformers computes the MaxText model's
logits (MaxText's converter has no shape map for Qwen3-Omni: no reference tensors).
"""

from __future__ import annotations

import copy
import json
import pathlib
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from tests import clients
from tests.clients import client_env, subprocess_env
from tests.test_export_maxtext_clients import (
  CLI_TIMEOUT,
  HF_CLIENT,
  HF_LOGITS_ATOL,
  MAXTEXT_CLIENT,
  ROOT,
  STEP,
  WORKER_TIMEOUT,
  Run,
  assert_equals_maxtexts_conversion,
  wait,
)

# Tiny dims every case shares (all distinct): emb 36, q 4×8, kv 2×8, vocab 72, seq 16.
DIMS = ['base_emb_dim=36', 'base_num_query_heads=4', 'base_num_kv_heads=2', 'head_dim=8',
        'vocab_size=72']
GPT_OSS = ['base_mlp_dim=20', 'base_moe_mlp_dim=20', 'num_experts=4', 'num_experts_per_tok=2',
           'sliding_window_size=6']


# Qwen3-VL's vision tower, tiny (MaxText's `*_for_vit` keys): 2 blocks of width 16 (2 heads),
# MLP 64 (4 x 16: MaxText's converter sizes the mergers by it, transformers by 4 x width), one
# deepstack merger, 16 positions (a 4 x 4 grid); mrope's sections for head_dim 8.
VIT = ['hidden_size_for_vit=16', 'intermediate_size_for_vit=64', 'num_attention_heads_for_vit=2',
       'num_hidden_layers_for_vit=2', 'deepstack_visual_indexes_for_vit=[0]',
       'out_hidden_size_for_vit=36', 'num_position_embeddings_for_vit=16',
       'image_size_for_vit=64', 'mrope_section=[2,1,1]']
MOE = ['base_moe_mlp_dim=20', 'num_experts=4', 'num_experts_per_tok=2']
VISION_CLASSES = 'AutoModelForImageTextToText'  # transformers' auto class of the VL models


class Case:
  """One MaxText model: its name, its family (`--model`), its pyconfig keys, its form, the
  class transformers builds (with `auto`), what MaxText's converter is known to fail with
  (`converter_fails`), and whether the export names the text model (`text_names`: MaxText's
  converter writes the multimodal class's `model.language_model.`)."""

  def __init__(self, model_name: str, family: str, scan: bool, dims: list[str],
               hf_class: str, auto: str = 'AutoModelForCausalLM',
               converter_fails: str | None = None, text_names: bool = False):
    self.model_name, self.family, self.scan = model_name, family, scan
    self.dims, self.hf_class, self.auto = [*DIMS, *dims], hf_class, auto
    self.converter_fails, self.text_names = converter_fails, text_names


CASES = {
    'gpt_oss_scan': Case('gpt-oss-20b', 'gpt-oss', True,
                         [*GPT_OSS, 'base_num_decoder_layers=4'], 'GptOssForCausalLM'),
    'gpt_oss_unscan': Case('gpt-oss-20b', 'gpt-oss', False,
                           [*GPT_OSS, 'base_num_decoder_layers=2'], 'GptOssForCausalLM'),
    # With its vision tower (use_multimodal): unscanned only (MaxText refuses scan_layers with
    # deepstack's visual injection); trained on text alone: a qwen3.
    'qwen3_vl_unscan': Case('qwen3-vl-2b', 'qwen3_vl', False,
                            [*VIT, 'base_mlp_dim=40', 'base_num_decoder_layers=2'],
                            'Qwen3VLForConditionalGeneration', auto=VISION_CLASSES),
    'qwen3_vl_text_unscan': Case('qwen3-vl-2b', 'qwen3', False,
                                 [*VIT, 'base_mlp_dim=40', 'base_num_decoder_layers=2',
                                  'use_multimodal=False'], 'Qwen3ForCausalLM', text_names=True),
    'qwen3_vl_moe_unscan': Case('qwen3-vl-30b-a3b', 'qwen3_vl_moe', False,
                                [*VIT, *MOE, 'base_mlp_dim=20', 'base_num_decoder_layers=2'],
                                'Qwen3VLMoeForConditionalGeneration', auto=VISION_CLASSES,
                                converter_fails="HF path 'model.language_model.layers.0.mlp."
                                                "experts.down_proj' not found in hf_shape_map"),
    # Qwen3-Omni trained on text alone (no vision or audio tower): its thinker's text model is
    # MaxText's qwen3 MoE decoder; MaxText's converter has no shape map for the model at all.
    'qwen3_omni_text_unscan': Case(
        'qwen3-omni-30b-a3b', 'qwen3_moe', False,
        [*MOE, 'base_mlp_dim=20', 'base_num_decoder_layers=2', 'mrope_section=[2,1,1]',
         'use_multimodal=False', 'use_audio=False', 'deepstack_visual_indexes_for_vit=[]'],
        'Qwen3MoeForCausalLM', converter_fails='Mappings not found for model: qwen3-omni-30b-a3b'),
}
SOURCES = ('tunix', 'maxtext')
EXPORTS = [f'{case}_{src}' for case in CASES for src in SOURCES]
# LoRA runs (`lora_case`): case -> the case whose HF config and dims it shares.
LORA = {'gpt_oss_lora_scan': 'gpt_oss_scan', 'qwen3_vl_lora_unscan': 'qwen3_vl_unscan'}
# The weights MaxText's `lora_module_path` adapts (its configs/post_train/lora_module_path.yml:
# gpt-oss's attention alone; qwen3's, which Qwen3-VL's name starts with, attention and MLP).
LORA_TARGETS = {'gpt_oss': {'query', 'key', 'value', 'out'},
                'qwen3_vl': {'query', 'key', 'value', 'out', 'wi_0', 'wi_1', 'wo'}}
LORA_RANK, LORA_ALPHA = 2, 4.0

# The Hub's openai/gpt-oss-20b config.json (the MXFP4 checkpoint) where MaxText's HF config
# says otherwise: its quantization_config (MaxText's entry leaves it out: "since we are using
# bf16"), which the export leaves out; special tokens inside the tiny vocabulary (the Hub's
# 199999 and 200002 are past it: transformers' embedding refuses the padding index).
TINY_FIELDS = {
    'gpt_oss': lambda c: {
        'quantization_config': {'quant_method': 'mxfp4', 'modules_to_not_convert': [
            'model.layers.*.self_attn', 'model.layers.*.mlp.router', 'model.embed_tokens',
            'lm_head']},
        'pad_token_id': c['vocab_size'] - 1, 'eos_token_id': c['vocab_size'] - 2},
    # MaxText's Qwen3-VL entries are bare PreTrainedConfigs: the config.json its converter
    # writes has model_type "" (AutoConfig cannot read it); the Hub's says qwen3_vl.
    'qwen3_vl': lambda c: {'model_type': 'qwen3_vl'},
    'qwen3_vl_text': lambda c: {'model_type': 'qwen3_vl'},
    # ... and its 30b-a3b entry says tied where the model (and the Hub's) has an lm_head.
    'qwen3_vl_moe': lambda c: {'model_type': 'qwen3_vl_moe', 'tie_word_embeddings': False,
                               'text_config': {'tie_word_embeddings': False}},
    # MaxText's Qwen3-Omni entry is "pure text, to fill in" (transformers' defaults: 28 heads,
    # vocab 3584): the thinker's text model as the Hub's Qwen3-Omni-30B-A3B has it, tiny.
    'qwen3_omni_text': lambda c: {'thinker_config': {'text_config': {
        'hidden_size': c['emb_dim'], 'vocab_size': c['vocab_size'],
        'num_hidden_layers': c['num_decoder_layers'], 'num_attention_heads': c['num_query_heads'],
        'num_key_value_heads': c['num_kv_heads'], 'head_dim': c['head_dim'],
        'moe_intermediate_size': c['moe_mlp_dim'], 'num_experts': c['num_experts'],
        'num_experts_per_tok': c['num_experts_per_tok'], 'norm_topk_prob': c['norm_topk_prob'],
        'rope_parameters': {'rope_type': 'default', 'rope_theta': c['rope_max_timescale'],
                            'mrope_section': [2, 1, 1], 'interleaved': True}}}},
}


def family_of(case: str) -> str:
  """A case's family part (`gpt_oss_scan` -> `gpt_oss`)."""
  return case.rsplit('_', 1)[0]


def _merged(into: dict, changes: dict) -> dict:
  """`into` with `changes` set, a nested config's fields (`text_config`) field by field."""
  for field, value in changes.items():
    if isinstance(value, dict) and isinstance(into.get(field), dict) and field != (
        'rope_parameters'):
      _merged(into[field], value)
    else:
      into[field] = value
  return into


def tiny_hf_config(case: str, hf_config: dict, cfg: dict) -> dict:
  """MaxText's HF config fitted to the tiny model, with TINY_FIELDS."""
  return _merged(copy.deepcopy(hf_config), TINY_FIELDS[family_of(case)](cfg))


def export(src: pathlib.Path, out: pathlib.Path, model: str, hf_config: str | None,
           *flags: str) -> dict:
  """`orbax-tunix export SRC OUT --model MODEL [--hf-config DIR] FLAGS...`, its outcome."""
  argv = [sys.executable, '-m', 'orbax_tunix.cli', 'export', str(src), str(out), '--model',
          model, *(('--hf-config', hf_config) if hf_config else ()), *flags]
  t = time.time()
  p = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, env=subprocess_env(),
                     timeout=CLI_TIMEOUT, check=False)
  return {'argv': argv[3:], 'rc': p.returncode, 'stdout': p.stdout, 'stderr': p.stderr,
          'seconds': time.time() - t, 'out': out}


@pytest.fixture(scope='module')
def maxtext_python() -> str:
  return client_env('maxtext_venv.sh')


def _make_cases(maxtext: clients.Worker, work: pathlib.Path) -> None:
  for i, (case, c) in enumerate(CASES.items()):
    maxtext.send({'id': f'case_{case}', 'job': 'family_case', 'model_name': c.model_name,
                  'scan': c.scan, 'dims': c.dims, 'seed': i, 'step': STEP,
                  'out': str(work / case)})
  for i, (lora, case) in enumerate(LORA.items()):
    c = CASES[case]
    maxtext.send({'id': f'case_{lora}', 'job': 'lora_case', 'model_name': c.model_name,
                  'scan': c.scan, 'dims': c.dims, 'seed': 50 + i, 'step': STEP,
                  'rank': LORA_RANK, 'alpha': LORA_ALPHA, 'out': str(work / lora)})


def _lora_exports(pool, work: pathlib.Path, lora: str, src: pathlib.Path, hf_config: str):
  """The LoRA run merged, and its base alone (its PEFT adapter names the base's folder)."""
  cli = CASES[LORA[lora]].family
  merged = pool.submit(export, src, work / f'{lora}_merged_hf', cli, hf_config,
                       '--merge-lora', '--lora-alpha', str(LORA_ALPHA))
  base = pool.submit(export, src, work / f'{lora}_base_hf', cli, hf_config, '--base-only')
  return {f'{lora}_merged': merged, f'{lora}_base': base}


@pytest.fixture(scope='module')
def run(maxtext_python, tmp_path_factory):
  """Every case made by MaxText, exported (two at a time), read back by the MaxText worker."""
  work = tmp_path_factory.mktemp('zoo_gptoss')
  (work / 'mt_out').mkdir()
  maxtext = clients.Worker('MaxText', maxtext_python, MAXTEXT_CLIENT, work / 'mt_out',
                           work / 'maxtext.log')
  deadline = time.time() + WORKER_TIMEOUT
  _make_cases(maxtext, work)
  futures, configs = {}, {}
  with ThreadPoolExecutor(2) as pool:
    for case, c in CASES.items():
      wait(maxtext, [f'case_{case}'], deadline)
      r = maxtext.results.get(f'case_{case}')
      if not (r and r['ok']):
        continue
      configs[case] = work / case / 'hf_config_tiny'
      configs[case].mkdir()
      base = json.loads((pathlib.Path(r['hf_config']) / 'config.json').read_text())
      (configs[case] / 'config.json').write_text(
          json.dumps(tiny_hf_config(case, base, r['config']), indent=2) + '\n')
      for src in SOURCES:
        futures[f'{case}_{src}'] = pool.submit(
            export, pathlib.Path(r[src]), work / f'{case}_{src}_hf', c.family,
            str(configs[case]))
    for lora, case in LORA.items():
      wait(maxtext, [f'case_{lora}'], deadline)
      r = maxtext.results.get(f'case_{lora}')
      if r and r['ok'] and case in configs:
        futures.update(_lora_exports(pool, work, lora, pathlib.Path(r['tunix']),
                                     str(configs[case])))
    exports = {name: f.result() for name, f in futures.items()}
    for lora in LORA:  # The adapter names its base: the base-only export's folder.
      base = exports.get(f'{lora}_base')
      r = maxtext.results.get(f'case_{lora}')
      if base and base['rc'] == 0:
        exports[f'{lora}_peft'] = export(pathlib.Path(r['tunix']), work / f'{lora}_peft',
                                         CASES[LORA[lora]].family, None, '--peft', '--lora-alpha',
                                         str(LORA_ALPHA), '--base-model', str(base['out']))
  for name in EXPORTS:
    e = exports.get(name)
    if e and e['rc'] == 0:
      maxtext.send(*clients.read_back(name, e['out']))
  maxtext.finish(max(60.0, deadline - time.time()))
  return Run(work, maxtext, None, exports)


def _tokens(run: Run, case: str) -> list:
  with np.load(run.result(run.maxtext, f'case_{case}')['npz']) as z:
    return z['tokens'].tolist()


@pytest.fixture(scope='module')
def hf(run, hf_python) -> clients.Worker:
  """transformers loads every export (`load`); peft loads each LoRA run's adapter on its
  base-only export (`peft`)."""
  (run.work / 'hf_out').mkdir()
  worker = clients.Worker('transformers', hf_python, HF_CLIENT, run.work / 'hf_out',
                          run.work / 'hf.log', env=subprocess_env())
  for name in EXPORTS:
    e = run.exports.get(name)
    if e and e['rc'] == 0 and run.maxtext.results.get(f"case_{name.rsplit('_', 1)[0]}"):
      case = name.rsplit('_', 1)[0]
      worker.send({'id': f'load_{name}', 'job': 'load', 'dir': str(e['out']),
                   'tokens': _tokens(run, case), 'auto': CASES[case].auto})
  for lora in LORA:
    merged, base, adapter = (run.exports.get(f'{lora}_{k}') for k in ('merged', 'base', 'peft'))
    if not all(e and e['rc'] == 0 for e in (merged, base, adapter)):
      continue
    tokens, auto = _tokens(run, lora), CASES[LORA[lora]].auto
    worker.send({'id': f'load_{lora}_merged', 'job': 'load', 'dir': str(merged['out']),
                 'tokens': tokens, 'auto': auto},
                {'id': f'load_{lora}_base', 'job': 'load', 'dir': str(base['out']),
                 'tokens': tokens, 'auto': auto},
                {'id': f'peft_{lora}', 'job': 'peft', 'base': str(base['out']),
                 'adapter': str(adapter['out']), 'tokens': tokens, 'auto': auto})
  worker.finish(WORKER_TIMEOUT)
  return worker


# --------------------------------------------------------------------------- #
# Tests
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize('case', list(CASES))
def test_a_sources_are_maxtexts_layouts(run, case):
  """gpt-oss scanned is MaxText's blocks of two (`decoder/layers/layers_{0,1}`, blocks on
  axis 1); the Tunix run is the adapter's `base/<path>/value`; no leaf is one value."""
  r = run.case(case)
  names = list(r['mt'])
  layers = r['config']['num_decoder_layers']
  if CASES[case].scan:
    sinks = r['mt']['decoder/layers/layers_1/GptOssAttention/sinks']
    assert sinks == [4, layers // 2], sinks  # (heads, blocks)
    assert not any(n.startswith('decoder/layers/layers_2/') for n in names), names
  else:
    assert any(n.startswith(f'decoder/layers_{layers - 1}/') for n in names), names
  # The vision tower is the model's where MaxText builds it (use_multimodal), else none.
  vision = any(n.startswith('vision_encoder/') for n in names)
  assert vision == (CASES[case].auto == VISION_CLASSES), sorted(names)[-5:]
  meta = json.loads((pathlib.Path(r['tunix']) / str(STEP) / 'model_params' / '_METADATA')
                    .read_text())['tree_metadata']
  keys = [tuple(k['key'] for k in e['key_metadata']) for e in meta.values()]
  assert all(k[0] == 'base' and k[-1] == 'value' for k in keys), keys[:5]
  with np.load(r['npz']) as z:
    for name in z.files:
      if name.startswith('mt/'):
        assert z[name].size == 1 or len(np.unique(z[name])) > 1, f'{name} is one value'


@pytest.mark.parametrize('name', EXPORTS)
def test_b_export_equals_maxtexts_own_conversion(run, name):
  """Every tensor MaxText's converter writes, by name, shape, dtype and value; nothing else."""
  case = name.rsplit('_', 1)[0]
  run.exported(name)  # it exited 0
  err, fails = run.case(case)['convert_error'], CASES[case].converter_fails
  if fails:  # No expected values: transformers computing MaxText's logits proves the export.
    assert err and fails in err, f"MaxText's converter was expected to fail ({fails}): {err}"
    return
  assert err is None, err
  # MaxText's text-only Qwen3-VL as the text model names it.
  rename = ((lambda k: k.replace('model.language_model.', 'model.', 1))
            if CASES[case].text_names else (lambda k: k))
  assert_equals_maxtexts_conversion(run, case, name, rename=rename)


@pytest.mark.parametrize('name', EXPORTS)
def test_c_autoconfig_loads_the_written_config(run, name):
  """transformers.AutoConfig loads config.json as the family's; gpt-oss's holds no
  quantization_config (the weights are float) and a layer type per layer."""
  case = name.rsplit('_', 1)[0]
  out = run.exported(name)
  r = run.result(run.maxtext, f'auto_{name}')
  assert r['architectures'] == [CASES[case].hf_class], r
  cfg = run.case(case)['config']
  written = json.loads((out / 'config.json').read_text())
  assert 'quantization_config' not in written and 'quantization_config' not in r['config']
  text = r['config'].get('text_config', r['config'])
  assert (text['hidden_size'], text['num_hidden_layers'], text['vocab_size']) == (
      cfg['emb_dim'], cfg['num_decoder_layers'], cfg['vocab_size']), text
  if family_of(case) == 'gpt_oss':
    layers = cfg['num_decoder_layers']
    assert text['layer_types'] == ['sliding_attention', 'full_attention'] * (layers // 2)
    assert text['sliding_window'] == cfg['sliding_window_size']


def _logits_of(run: Run, hf: clients.Worker, job: str) -> tuple[dict, np.ndarray]:
  r = run.result(hf, job)
  bad = {k: v for k, v in r['loading_info'].items() if v}
  assert not bad, f'{job}: transformers loaded it with {bad}'
  return r, run.arrays(hf, job)['logits']


@pytest.mark.parametrize('name', EXPORTS)
def test_d_transformers_loads_the_export_and_computes_maxtexts_logits(run, hf, name):
  """AutoModelForCausalLM.from_pretrained (float32, eager): the family's class, no missing,
  unexpected or mismatched key, and MaxText's logits (routing, sinks, sliding window)."""
  case = name.rsplit('_', 1)[0]
  run.exported(name)
  r, got = _logits_of(run, hf, f'load_{name}')
  assert r['model_class'] == CASES[case].hf_class, r['model_class']
  want = run.arrays(run.maxtext, f'case_{case}')['logits']
  assert np.abs(want).max() > 0.1, f'{name}: degenerate MaxText logits'
  np.testing.assert_allclose(got, want, rtol=0, atol=HF_LOGITS_ATOL, err_msg=name)


@pytest.mark.parametrize('lora', list(LORA))
def test_e_lora_merged_and_as_peft_compute_the_lora_models_logits(run, hf, lora):
  """MaxText's LoRA model (qwix's adapters live): its logits are the merged export's in
  transformers, and the PEFT adapter's on the base-only export in peft (adapters live and
  merged by peft); the base alone computes others (the adapters matter)."""
  want = run.arrays(run.maxtext, f'case_{lora}')['logits']
  adapted = {k.split('/')[-2] for k in run.case(lora)['lora']}
  assert adapted == LORA_TARGETS[family_of(LORA[lora])], adapted
  _, merged = _logits_of(run, hf, f'load_{lora}_merged')
  np.testing.assert_allclose(merged, want, rtol=0, atol=HF_LOGITS_ATOL, err_msg='merged')
  _, base = _logits_of(run, hf, f'load_{lora}_base')
  assert np.abs(base - want).max() > 100 * HF_LOGITS_ATOL, 'the adapters change nothing'
  r = run.result(hf, f'peft_{lora}')
  assert not r['adapter_missing_keys'] and not r['adapter_unexpected_keys'], r
  layers = run.case(LORA[lora])['config']['num_decoder_layers']
  assert len(r['lora_modules']) == len(adapted) * layers, r['lora_modules']
  peft = run.arrays(hf, f'peft_{lora}')
  np.testing.assert_allclose(peft['logits'], want, rtol=0, atol=HF_LOGITS_ATOL, err_msg='peft')
  np.testing.assert_allclose(peft['merged_logits'], want, rtol=0, atol=HF_LOGITS_ATOL,
                             err_msg='peft merge_and_unload')

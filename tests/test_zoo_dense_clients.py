"""`orbax-tunix export` of MaxText 0.2.5's Qwen2.5, Mixtral, Gemma 2, OLMo 3 and gemma4-26b
(issue 51), checked against MaxText's own converter and against `transformers` and `peft`.

As tests/test_export_maxtext_clients.py (whose machinery this reuses), the sources are made
by MaxText itself (tests/maxtext_client.py's `family_case` job, MaxText venv): a tiny random
MaxText model of each family, scanned and unscanned, saved as a Tunix run
(`model_params/base/<path>/value`) and as MaxText's params-only step
(`items/params/params/<path>`); MaxText's own `to_huggingface` pieces convert the step (the
expected tensors), and its forward pass gives the logits on fixed tokens. The scanned model is
also given LoRA as MaxText's SFT gives it for Tunix (`lora_utils.apply_lora_to_model`: qwix on
the modules MaxText's lora_module_path.yml names for the model; the adapters drawn at random)
and saved as a Tunix run, with the LoRA model's logits (adapters live).

  qwen2    qwen2.5-7b (untied), 3 layers: q/k/v biases
  mixtral  mixtral-8x7b, 3 layers, 4 experts (top 2): query stored divided by sqrt(head_dim),
           a sparse `MoeBlock_0` per layer (no LoRA target there: MaxText's default LoRA path
           adapts the attention alone)
  gemma2   gemma2-2b, 2 MaxText layers = 4 Hugging Face layers (local, global), query stored
           divided by sqrt(head_dim), norms `1 + w`, embedding times sqrt(hidden), soft caps
  olmo3    olmo3-7b-pt, 8 layers (two scanned blocks of 4: 3 sliding, 1 global), norms after
           attention and MLP only, q/k norms over all heads
  gemma4moe  gemma4-26b as `--model gemma4`, 6 layers (gemma4's block: 5 local, 1 global),
           4 experts (top 2) and a shared expert a layer; no LoRA run (see LORA)

Dims: emb 32 for qwen2 and mixtral, where heads·head_dim must equal the hidden size for
MaxText's converter (its qwen shape map takes head_dim = hidden / heads, and its mixtral hook
reshapes the (heads, head_dim, hidden) output kernel to (hidden, -1) before transposing it:
right only when the two are equal, as in every Mixtral MaxText configures); 36 otherwise
(every dim distinct). MaxText 0.2.5's converter has no shape map for OLMo 3 (`hf_shape.py`):
its failure is asserted (naming it) and those exports are proven by `transformers` alone.
gemma4's shape map reads the global layers' heads from `global_head_dim` and
`num_global_key_value_heads` where `per_layer_config` is null (as fitted to a tiny model), and
transformers 5's config holds them only in `per_layer_config`: the client fits them back
(`fit_global_heads`), so MaxText's converter converts gemma4-26b's tiny model.

Checks: every tensor equals MaxText's converter's (name, shape, float32 value; exact),
`transformers.AutoConfig` loads every config.json, and `transformers`
(`AutoModelForCausalLM.from_pretrained`, float32, eager; tests/hf_client.py in the Hugging
Face venv) loads every export as the family's class with no missing, unexpected or mismatched
key and computes MaxText's logits within HF_LOGITS_ATOL; the LoRA run's `--merge-lora` export
computes the LoRA model's logits, and its `--peft` adapter loaded by `peft` on its
`--base-only` export computes them too (adapters live and after `merge_and_unload`).
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import pathlib
import time

import numpy as np
import pytest

from orbax_tunix import cli
from tests import clients
from tests.clients import client_env, subprocess_env
from tests.test_export_maxtext_clients import (
  DROP,
  HF_CLIENT,
  HF_LOGITS_ATOL,
  MAXTEXT_CLIENT,
  STEP,
  WORKER_TIMEOUT,
  Run,
  assert_equals_maxtexts_conversion,
  wait,
)

RANK, ALPHA = 3, 6.0  # the LoRA runs' qwix rank and alpha
DIMS = ['base_num_query_heads=4', 'base_num_kv_heads=2', 'base_mlp_dim=40', 'vocab_size=72',
        'head_dim=8']


def _rope(theta: float) -> dict:
  return {'rope_type': 'default', 'rope_theta': theta}


# family -> (MaxText model_name, its dims, the class transformers builds, the text-config
# fields that describe the tiny MaxText model `c` where MaxText's HF_MODEL_CONFIGS entry,
# fitted by `_validate_or_update_architecture`, describes another one). Gemma 2: MaxText's
# gemma2 keeps its query kernel divided by sqrt(head_dim), which its converter multiplies
# back, so transformers must scale by head_dim**-0.5 (query_pre_attn_scalar = head_dim).
FAMILIES = {
    'qwen2': ('qwen2.5-7b', ['base_emb_dim=32', 'base_num_decoder_layers=3'],
              'Qwen2ForCausalLM', lambda c: {'rope_parameters': _rope(c['rope_max_timescale'])}),
    'mixtral': ('mixtral-8x7b', ['base_emb_dim=32', 'base_num_decoder_layers=3',
                                 'base_moe_mlp_dim=40', 'num_experts=4', 'num_experts_per_tok=2'],
                'MixtralForCausalLM',
                lambda c: {'rope_parameters': _rope(c['rope_max_timescale'])}),
    'gemma2': ('gemma2-2b', ['base_emb_dim=36', 'base_num_decoder_layers=2',
                             'sliding_window_size=6'],
               'Gemma2ForCausalLM', lambda c: {'query_pre_attn_scalar': c['head_dim']}),
    'olmo3': ('olmo3-7b-pt', ['base_emb_dim=36', 'base_num_decoder_layers=8',
                              'sliding_window_size=6'],
              'Olmo3ForCausalLM', lambda c: {'rope_parameters': _rope(c['rope_max_timescale']),
                                             'pad_token_id': None}),  # (100277: no tiny row)
    # gemma4-26b (`--model gemma4`): one block of six (5 local, 1 global whose keys are its
    # values), every MLP a MoE block with a shared expert. MaxText's dense matmul for its
    # experts (sparse_matmul=False): the same model, a forward pass 4x faster on a CPU.
    # transformers derives the global layers' heads from global_head_dim where the fitted
    # `per_layer_config` (null: no overrides) is left out, as for gemma4-31b.
    'gemma4moe': ('gemma4-26b', ['base_emb_dim=36', 'head_dim=8', 'global_head_dim=16',
                                 'global_num_kv_heads=1', 'base_num_decoder_layers=6',
                                 'base_moe_mlp_dim=20', 'num_experts=4', 'num_experts_per_tok=2',
                                 'sliding_window_size=6', 'sparse_matmul=False'],
                  'Gemma4ForCausalLM', lambda c: {
                      'per_layer_config': DROP, 'top_k_experts': c['num_experts_per_tok'],
                      'rope_parameters': {
                          'full_attention': {**_rope(c['global_rope_max_timescale']),
                                             'rope_type': 'proportional',
                                             'partial_rotary_factor': c['global_rope_proportion']},
                          'sliding_attention': _rope(c['local_rope_max_timescale'])}}),
}
# A case family's `--model`, where it is not the family's name (gemma4-26b is gemma4's).
MODEL = {'gemma4moe': 'gemma4'}
# MaxText 0.2.5's converter cannot convert these: what it raises (asserted, then the tensors
# are proven by transformers alone).
# (olmo3: its PARAM_MAPPING and HOOK_FNS entries are there, its HF_SHAPE entry is not, and
# `_get_model_mappings` asks for all three.)
# gemma4's shape map reads the global heads from `global_head_dim` and
# `num_global_key_value_heads` once `per_layer_config` is null (as fitted to a tiny model):
# transformers 5's config keeps them only in per_layer_config, so the client puts them back.
FIT = {'gemma4moe': {'fit_global_heads': True}}
CONVERTER_FAILS = {'olmo3': 'ValueError: Mappings not found for model: olmo3-7b-pt'}
# gemma2's and gemma4's embedding is one float32 division by sqrt(hidden) = 6: MaxText's
# converter divides (numpy), the export's XLA may multiply by the reciprocal: 1 ulp, as for
# gemma3's.
ONE_ULP = {('gemma2', 'model.embed_tokens.weight'), ('gemma4moe', 'model.embed_tokens.weight')}
FORMS = {'scan': True, 'unscan': False}
SOURCES = ('tunix', 'maxtext')
CASES = [f'{fam}_{form}' for fam in FAMILIES for form in FORMS]
EXPORTS = [f'{case}_{src}' for case in CASES for src in SOURCES]
# The cases with a LoRA run (gemma4-26b's: MaxText's LoRA path adapts its experts, which
# Hugging Face fuses as gate_up_proj, a parameter no PEFT LoRA module takes).
LORA = [f'{fam}_scan' for fam in FAMILIES if fam != 'gemma4moe']
# the LoRA run's exports: name -> flags
LORA_EXPORTS = {'merged': ('--merge-lora', '--lora-alpha', str(ALPHA)),
                'base': ('--base-only',),
                'peft': ('--peft', '--lora-alpha', str(ALPHA))}


def family(case: str) -> str:
  return case.split('_', 1)[0]


def tiny_hf_config(case: str, hf_config: dict, cfg: dict) -> dict:
  """MaxText's HF config fitted to the tiny model `cfg` (its MaxText config keys), with
  FAMILIES' fields set in its text config (DROP: removed)."""
  out = copy.deepcopy(hf_config)
  text = out.get('text_config') or out
  for field, value in FAMILIES[family(case)][3](cfg).items():
    if value is DROP:
      text.pop(field, None)
    else:
      text[field] = value
  return out


def export(src: pathlib.Path, out: pathlib.Path, model: str, *flags: str) -> dict:
  """`orbax-tunix export SRC OUT --model MODEL FLAGS`, in this process (its 8 devices): 28
  exports, each a process importing jax, would cost more than they do."""
  argv = ['export', str(src), str(out), '--model', model, *flags]
  t = time.time()
  stdout, stderr = io.StringIO(), io.StringIO()
  with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
    rc = cli.main(argv)
  return {'argv': argv, 'rc': rc, 'stdout': stdout.getvalue(), 'stderr': stderr.getvalue(),
          'seconds': time.time() - t, 'out': out}


def _exports(case: str, r: dict, work: pathlib.Path) -> dict[str, tuple]:
  """The exports of one case: name -> (source, out, flags)."""
  config = work / case / 'hf_config_tiny'
  config.mkdir()
  base = json.loads((pathlib.Path(r['hf_config']) / 'config.json').read_text())
  (config / 'config.json').write_text(
      json.dumps(tiny_hf_config(case, base, r['config']), indent=2) + '\n')
  out = {f'{case}_{src}': (r[src], work / f'{case}_{src}_hf', ('--hf-config', str(config)))
         for src in SOURCES}
  if case in LORA:
    for name, flags in LORA_EXPORTS.items():
      given = ('--base-model', str(config)) if name == 'peft' else ('--hf-config', str(config))
      out[f'{case}_lora_{name}'] = (r['tunix_lora'], work / f'{case}_lora_{name}',
                                    (*flags, *given))
  return out


@pytest.fixture(scope='module')
def maxtext_python() -> str:
  """The MaxText venv's python (scripts/maxtext_venv.sh, built on first use)."""
  return client_env('maxtext_venv.sh')


@pytest.fixture(scope='module')
def run(maxtext_python, tmp_path_factory):
  """Makes every case (MaxText worker), exports each source (the CLI, each case's as soon as
  it is made), then reads each export (MaxText worker: safetensors, AutoConfig)."""
  work = tmp_path_factory.mktemp('zoo_dense')
  (work / 'mt_out').mkdir()
  maxtext = clients.Worker('MaxText', maxtext_python, MAXTEXT_CLIENT, work / 'mt_out',
                           work / 'maxtext.log')
  deadline = time.time() + WORKER_TIMEOUT
  for i, case in enumerate(CASES):
    model_name, dims, _, _ = FAMILIES[family(case)]
    lora = {'lora': {'rank': RANK, 'alpha': ALPHA}} if case in LORA else {}
    maxtext.send({'id': f'case_{case}', 'job': 'family_case', 'model_name': model_name,
                  'scan': FORMS[case.rsplit('_', 1)[1]], 'dims': [*DIMS, *dims], 'seed': i,
                  'step': STEP, 'out': str(work / case), **lora, **FIT.get(family(case), {})})
  exports = {}
  for case in CASES:  # each case's exports while MaxText makes the next
    wait(maxtext, [f'case_{case}'], deadline)
    r = maxtext.results.get(f'case_{case}')
    if not (r and r['ok']):
      continue
    for name, (src, out, flags) in _exports(case, r, work).items():
      exports[name] = export(pathlib.Path(src), out, MODEL.get(family(case), family(case)),
                             *flags)
  for name in EXPORTS:
    e = exports.get(name)
    if e and e['rc'] == 0:
      maxtext.send(*clients.read_back(name, e['out']))
  maxtext.finish(max(60.0, deadline - time.time()))
  return Run(work, maxtext, None, exports)


@pytest.fixture(scope='module')
def hf(run, hf_python) -> clients.Worker:
  """transformers (tests/hf_client.py, Hugging Face venv) loads every export (`load`) and
  each LoRA run's adapter on its base (`peft`), on the tokens MaxText's model was given."""
  (run.work / 'hf_out').mkdir()
  worker = clients.Worker('transformers', hf_python, HF_CLIENT, run.work / 'hf_out',
                          run.work / 'hf.log', env=subprocess_env())
  for case in CASES:
    r = run.maxtext.results.get(f'case_{case}')
    if not (r and r['ok']):
      continue  # the tests name what is missing
    with np.load(r['npz']) as z:
      tokens = z['tokens'].tolist()
    ok = {n for n, e in run.exports.items() if n.startswith(case) and e['rc'] == 0}
    for name in sorted(ok & {*EXPORTS, f'{case}_lora_merged'}):
      worker.send({'id': f'load_{name}', 'job': 'load', 'dir': str(run.exports[name]['out']),
                   'tokens': tokens})
    if {f'{case}_lora_base', f'{case}_lora_peft'} <= ok:
      worker.send({'id': f'peft_{case}', 'job': 'peft', 'tokens': tokens,
                   'base': str(run.exports[f'{case}_lora_base']['out']),
                   'adapter': str(run.exports[f'{case}_lora_peft']['out'])})
  worker.finish(WORKER_TIMEOUT)
  return worker


# --------------------------------------------------------------------------- #
# Tests
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize('case', CASES)
def test_a_sources_are_maxtexts_layouts(run, case):
  """The fixtures are MaxText's: its scanned and unscanned trees, the Tunix adapter's levels,
  MaxText's step layout; the LoRA run holds qwix's adapters beside its kernels."""
  r = run.case(case)
  names = list(r['mt'])
  form = case.rsplit('_', 1)[1]
  if form == 'unscan':
    assert any(n.startswith('decoder/layers_1/') for n in names), names
  elif family(case) == 'gemma4moe':  # gemma4's blocks: 5 local layers, 1 global
    assert r['mt']['decoder/scanned_blocks/local_layers/mlp/moe_block/MoeBlock_0/wi_0'][1:3] == [
        1, 5], sorted(names)[:20]
  elif family(case) == 'olmo3':  # blocks of 4: `layers_{j}` stacked by block
    q = r['mt']['decoder/layers/layers_3/attention/query/kernel']
    assert q[1] == r['config']['num_decoder_layers'] // 4, q
  else:
    q = next(s for n, s in r['mt'].items() if n.endswith('query/kernel'))
    assert q[1] == r['config']['num_decoder_layers'], (q, sorted(names)[:20])
  root = pathlib.Path(r['tunix']) / str(STEP)
  meta = json.loads((root / 'model_params' / '_METADATA').read_text())['tree_metadata']
  keys = [tuple(k['key'] for k in e['key_metadata']) for e in meta.values()]
  assert all(k[0] == 'base' and k[-1] == 'value' for k in keys), keys[:5]
  meta = json.loads((pathlib.Path(r['maxtext']) / str(STEP) / 'items' / '_METADATA')
                    .read_text())['tree_metadata']
  assert all(e['key_metadata'][0]['key'] == 'params' for e in meta.values())
  if case in LORA:
    assert r['lora'] and all(n.endswith(('_lora_a', '_lora_b')) for n in r['lora']), r['lora']
    assert {n.rsplit('_lora_', 1)[0] for n in r['lora']} <= set(names)


@pytest.mark.parametrize('name', EXPORTS)
def test_b_export_equals_maxtexts_own_conversion(run, name):
  """Every tensor MaxText's converter writes, by name, shape, dtype and value; nothing else."""
  case = name.rsplit('_', 1)[0]
  run.exported(name)
  err = run.case(case)['convert_error']
  if family(case) in CONVERTER_FAILS:
    assert err and err.startswith(CONVERTER_FAILS[family(case)]), err
    pytest.xfail(f"MaxText 0.2.5's converter cannot convert {family(case)}:"
                 f" {err.split('. Available')[0]}")
  assert err is None, f"MaxText's converter failed on {case}: {err}"
  assert_equals_maxtexts_conversion(run, case, name,
                                    one_ulp=lambda k: (family(case), k) in ONE_ULP)


@pytest.mark.parametrize('name', EXPORTS)
def test_c_autoconfig_loads_the_written_config(run, name):
  """transformers.AutoConfig loads config.json as the family's; its layer count is the Hugging
  Face model's (gemma2: two a MaxText layer)."""
  case = name.rsplit('_', 1)[0]
  run.exported(name)
  r = run.result(run.maxtext, f'auto_{name}')
  assert r['architectures'] == [FAMILIES[family(case)][2]], r
  cfg, text = run.case(case)['config'], r['config']
  layers = cfg['num_decoder_layers'] * (2 if family(case) == 'gemma2' else 1)
  assert (text['hidden_size'], text['num_hidden_layers'], text['vocab_size']) == (
      cfg['emb_dim'], layers, cfg['vocab_size']), text
  assert len(text.get('layer_types') or [None] * layers) == layers, text
  has_head = 'lm_head.weight' in run.result(run.maxtext, f'read_{name}')['tensors']
  assert has_head == (not cfg['logits_via_embedding']), name


def _logits_match(hf: clients.Worker, run: Run, job: str, case: str, key: str = 'logits',
                  want_key: str = 'logits') -> dict:
  r = run.result(hf, job)
  bad = {k: v for k, v in r['loading_info'].items() if v}
  assert not bad, f'{job}: transformers loaded it with {bad}'
  assert r['model_class'] == FAMILIES[family(case)][2], r['model_class']
  want = run.arrays(run.maxtext, f'case_{case}')[want_key]
  got = run.arrays(hf, job)[key]
  assert np.abs(want).max() > 0.1, f'{job}: degenerate MaxText logits'
  np.testing.assert_allclose(got, want, rtol=0, atol=HF_LOGITS_ATOL, err_msg=job)
  return r


@pytest.mark.parametrize('name', EXPORTS)
def test_d_transformers_loads_the_export_and_computes_maxtexts_logits(run, hf, name):
  run.exported(name)
  _logits_match(hf, run, f'load_{name}', name.rsplit('_', 1)[0])


@pytest.mark.parametrize('case', LORA)
def test_e_lora_run_merged_computes_the_lora_models_logits(run, hf, case):
  """The LoRA run's `--merge-lora` export computes what MaxText's model computes with the
  adapters live (and not the base model's: the adapters move the logits)."""
  run.exported(f'{case}_lora_merged')
  _logits_match(hf, run, f'load_{case}_lora_merged', case, want_key='logits_lora')
  z = run.arrays(run.maxtext, f'case_{case}')
  assert np.abs(z['logits_lora'] - z['logits']).max() > 100 * HF_LOGITS_ATOL


@pytest.mark.parametrize('case', LORA)
def test_f_lora_run_peft_adapter_on_its_base_computes_the_lora_models_logits(run, hf, case):
  """`peft` loads the `--peft` adapter onto the `--base-only` export (every adapter tensor
  taken, one module per target) and computes the LoRA model's logits, live and merged."""
  for name in ('base', 'peft'):
    run.exported(f'{case}_lora_{name}')
  r = _logits_match(hf, run, f'peft_{case}', case, want_key='logits_lora')
  assert not r['adapter_unexpected_keys'], r['adapter_unexpected_keys']
  assert not [k for k in r['adapter_missing_keys'] if 'lora_' in k], r['adapter_missing_keys']
  # One module per layer of each adapted (stacked) kernel: its `a` holds the layers on axis 1.
  layers = sum(s[1] for n, s in run.case(case)['lora'].items() if n.endswith('_lora_a'))
  assert len(r['lora_modules']) == layers, r['lora_modules']
  want = run.arrays(run.maxtext, f'case_{case}')['logits_lora']
  np.testing.assert_allclose(run.arrays(hf, f'peft_{case}')['merged_logits'], want, rtol=0,
                             atol=HF_LOGITS_ATOL)

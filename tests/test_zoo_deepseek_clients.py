"""`orbax-tunix export` of MaxText's DeepSeek V2, V3, V3.2 and V4, checked against MaxText 0.2.5
and transformers 5.

Tiny models written by MaxText itself (tests/maxtext_client.py's `family_case`, as
tests/test_export_maxtext_clients.py makes the other families; every dim distinct, every
nnx.Param and the routing bias, an `MoEBiasVar`, drawn at random), scanned and unscanned, each
saved as a Tunix run (`nnx.state` whole: the bias too) and as MaxText's params-only step
(nnx.Param only: no bias). MaxText's DeepSeek models run on a CPU as configured (its default
`sparse_matmul`/`megablox` MoE path; the forward pass jitted, `jit_logits`); nothing needs a TPU.

Expected values, none from orbax_tunix:
  * tensors: MaxText 0.2.5's own `to_huggingface` pieces on the MaxText step, and on the Tunix
    run (its converter reads Tunix's `base` level; the only source of the bias it can convert).
    Scanned, that converter slices the stacked routing bias along `param_scan_axis` (1) where
    nnx stacked it on axis 0 (MaxText's own `_build_linen_params` says so): it fails (the test
    asserts its error), and the bias is checked against the drawn arrays instead.
  * logits: MaxText's forward pass of the model; for the params-only step, of the model MaxText
    makes of it (its nnx.Param leaves, the bias at its zero init: `logits_params_only`), which
    differs from the trained one's where the bias routes tokens elsewhere (checked).
  * LoRA (`lora_case`): qwix LoRA applied as MaxText applies it (`lora_utils`), on the attention
    (wq_a, wq_b, wkv_a, wkv_b, out), the dense MLP and the shared experts; the logits of that
    model with and without its adapters.

V4 (MaxText's deepseek4-284b configured tiny: 3 hash layers, then a block of a heavily
compressed and a compressed layer): MaxText's converter drops the hyper-connections' norm scale,
which the export folds into `hc_*_fn` (checked against numpy on the drawn arrays, and by
transformers computing MaxText's logits); it cannot read the Tunix run (its V4 map names the
non-Param variables by Linen collection) nor convert the scanned step (both asserted); MaxText's
params-only step lacks the hash layers' routing tables (`tid2eid`): its export is refused.

The export's config.json comes from MaxText's HF_MODEL_CONFIGS entry fitted to the tiny model
(tests/maxtext_client.py: dims, `first_k_dense_replace`, the YaRN rope as `to_huggingface`
rewrites it), with what that entry says otherwise than the tiny MaxText model computes
(`TINY_HF_FIELDS`): no group-limited routing (MaxText's `n_routing_groups` is -1 in these
models; the entry's n_group 8 cannot even split 4 experts) and V3.2's indexer top-k.
transformers (tests/hf_client.py) loads every export as the family's class.
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
from tests.clients import subprocess_env
from tests.test_export_maxtext import read_safetensors
from tests.test_export_maxtext_clients import (  # noqa: F401 - maxtext_python: a fixture
  CLI_TIMEOUT,
  HF_CLIENT,
  HF_LOGITS_ATOL,
  MAXTEXT_CLIENT,
  ROOT,
  WORKER_TIMEOUT,
  Run,
  maxtext_python,
  wait,
)

STEP = 3
# Every dim distinct: emb 36, heads 4, q LoRA 12, kv LoRA 10, nope 8, rope 4, v 6, dense MLP 40,
# vocab 72, 4 experts (2 per token); one dense layer first.
DIMS = ['base_emb_dim=36', 'base_num_query_heads=4', 'base_num_kv_heads=4', 'base_mlp_dim=40',
        'vocab_size=72', 'first_num_dense_layers=1', 'num_experts=4', 'num_experts_per_tok=2',
        'kv_lora_rank=10', 'qk_nope_head_dim=8', 'qk_rope_head_dim=4', 'v_head_dim=6']
# V4: hidden 32, 4 heads of 16 (rope 8), one kv head, q LoRA 12, output LoRA 2 groups of 10,
# expert MLP 24, 2 streams; 3 hash layers, then a block (ratios 128, 4).
V4_DIMS = ['base_emb_dim=32', 'base_num_query_heads=4', 'base_num_kv_heads=1', 'head_dim=16',
           'qk_rope_head_dim=8', 'base_mlp_dim=24', 'base_moe_mlp_dim=24', 'vocab_size=72',
           'base_num_decoder_layers=5', 'compress_ratios=[0,0,4,128,4]', 'num_experts=4',
           'num_experts_per_tok=2', 'q_lora_rank=12', 'o_groups=2', 'o_lora_rank=10',
           'indexer_n_heads=2', 'indexer_head_dim=16', 'indexer_topk=4', 'sliding_window_size=8',
           'mhc_expansion_rate=2']
# family -> (MaxText model, --model, its extra keys, whether MaxText's converter is run on the
# Tunix run too: only where that run holds more than the MaxText step, the routing bias).
FAMILIES = {
    # V3: q LoRA, sigmoid routing with the score-correction bias; two MoE layers.
    'v3': ('deepseek3-671b', 'deepseek_v3',
           ['base_num_decoder_layers=3', 'q_lora_rank=12', 'base_moe_mlp_dim=20'], True),
    # V2-Lite-like: a plain query (q_lora_rank 0), softmax routing, two shared experts, no bias.
    'v2': ('deepseek2-16b', 'deepseek_v2',
           ['base_num_decoder_layers=2', 'q_lora_rank=0', 'base_moe_mlp_dim=12'], False),
    # V3.2: V3 and the sparse attention's indexer (top 4 of 16 tokens). 8 indexer heads: with 2,
    # many scores are exactly 0 (every head's ReLU zero) and the implementations break such
    # ties differently (MaxText keeps the first tokens, torch.topk does not say).
    'v32': ('deepseek3.2-671b', 'deepseek_v32',
            ['base_num_decoder_layers=2', 'q_lora_rank=12', 'base_moe_mlp_dim=20',
             'indexer_n_heads=8', 'indexer_head_dim=16', 'indexer_topk=4'], True),
    'v4': ('deepseek4-284b', 'deepseek_v4', V4_DIMS, True),
}
FORMS = {'scan': True, 'unscan': False}
SOURCES = ('tunix', 'maxtext')
CASES = [f'{fam}_{form}' for fam in FAMILIES for form in FORMS]
EXPORTS = [f'{case}_{src}' for case in CASES for src in SOURCES]
# MaxText's params-only step of V4 lacks the hash layers' routing tables: refused (test_j).
REFUSED = [f'v4_{form}_maxtext' for form in FORMS]
LOADED = [e for e in EXPORTS if e not in REFUSED]
V3_STYLE = [e for e in LOADED if not e.startswith('v4_')]
HF_CLASSES = {'v3': 'DeepseekV3ForCausalLM', 'v2': 'DeepseekV2ForCausalLM',
              'v32': 'DeepseekV32ForCausalLM', 'v4': 'DeepseekV4ForCausalLM'}
V4_HASH_LAYERS = 3
BIAS = 'mlp.gate.e_score_correction_bias'
# MaxText's module path regex for qwix LoRA (its `lora.lora_module_path`): MLA's projections,
# the dense MLP and the shared experts, in both stacks.
LORA_PATH = ('decoder/(dense|moe)_layers.*/(self_attention/(wq_a|wq_b|wkv_a|wkv_b|out)'
             '|mlp/(wi_0|wi_1|wo)|shared_experts/(wi_0|wi_1|wo))')
LORA_RANK, LORA_ALPHA = 2, 4.0
LORA_CASE = 'v3_scan'
LORA_EXPORTS = {'merged': ['--merge-lora', '--lora-alpha', '4'], 'base': ['--base-only']}
# The modules PEFT 0.21.2 re-targets on a transformers 5 MoE model (see test_i).
PEFT_REMAPPED = ('gate_proj', 'up_proj', 'down_proj')


def tiny_hf_config(case: str, hf_config: dict, cfg: dict) -> dict:
  """MaxText's fitted HF config with what describes the tiny MaxText model otherwise
  (`cfg`: its MaxText config keys): no group-limited routing, the indexers' top-k; V4: no fp8
  quantization (the weights are float32), MaxText's plain RoPE (deepseek4-284b's
  `rope_type: default`, where the entry says YaRN), its compression ratios for these layers."""
  out = copy.deepcopy(hf_config)
  if case.startswith('v4_'):
    out.pop('quantization_config', None)
    n = cfg['num_decoder_layers']
    out.update(rope_parameters=None, rope_scaling=None, rope_theta=cfg['rope_max_timescale'],
               compress_rope_theta=cfg['compressed_rope_max_timescale'],
               compress_ratios=list(cfg['compress_ratios'])[:n], index_topk=cfg['indexer_topk'])
    return out
  assert cfg['n_routing_groups'] == -1, cfg  # MaxText routes over all experts at once
  out.update(n_group=1, topk_group=1)
  if cfg.get('use_indexer'):
    out['index_topk'] = cfg['indexer_topk']
  return out


def export(src: pathlib.Path, out: pathlib.Path, model: str, *flags: str) -> dict:
  argv = [sys.executable, '-m', 'orbax_tunix.cli', 'export', str(src), str(out),
          '--model', model, *flags]
  t = time.time()
  p = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, env=subprocess_env(),
                     timeout=CLI_TIMEOUT, check=False)
  return {'argv': argv[3:], 'rc': p.returncode, 'stdout': p.stdout, 'stderr': p.stderr,
          'seconds': time.time() - t, 'out': out}


def _case_jobs(work: pathlib.Path) -> list[dict]:
  jobs = []
  for i, case in enumerate(CASES):
    fam, form = case.rsplit('_', 1)
    model_name, _, extra, convert_tunix = FAMILIES[fam]
    v4 = fam == 'v4'  # its own dims; its params-only step is refused, not run
    jobs.append({'id': f'case_{case}', 'job': 'family_case', 'model_name': model_name,
                 'scan': FORMS[form], 'dims': extra if v4 else [*DIMS, *extra], 'seed': 20 + i,
                 'step': STEP, 'jit_logits': True, 'params_only_logits': not v4,
                 'convert_tunix': convert_tunix and not (v4 and form == 'scan'),
                 'out': str(work / case)})
  fam, form = LORA_CASE.rsplit('_', 1)
  jobs.append({'id': 'lora', 'job': 'lora_case', 'model_name': FAMILIES[fam][0],
               'scan': FORMS[form], 'seed': 40, 'step': STEP, 'jit_logits': True,
               'out': str(work / 'lora'),
               'dims': [*DIMS, *FAMILIES[fam][2], 'lora.enable_lora=True',
                        f'lora.lora_rank={LORA_RANK}', f'lora.lora_alpha={LORA_ALPHA}',
                        f'lora.lora_module_path={LORA_PATH}']})
  return jobs


def _submit(pool, work: pathlib.Path, case: str, r: dict) -> dict:
  """The case's tiny HF config written, and its exports submitted (both sources)."""
  model = FAMILIES[case.rsplit('_', 1)[0]][1]
  hf_config = work / case / 'hf_config_tiny'
  hf_config.mkdir()
  base = json.loads((pathlib.Path(r['hf_config']) / 'config.json').read_text())
  (hf_config / 'config.json').write_text(
      json.dumps(tiny_hf_config(case, base, r['config']), indent=2) + '\n')
  return {f'{case}_{src}': pool.submit(export, pathlib.Path(r[src]), work / f'{case}_{src}_hf',
                                       model, '--hf-config', str(hf_config))
          for src in SOURCES}


@pytest.fixture(scope='module')
def run(maxtext_python, tmp_path_factory):  # noqa: F811 - the imported fixture
  """Makes every case (MaxText worker) and exports each source as it comes (the CLI, two at a
  time), the LoRA run three ways; then reads each export (safetensors, AutoConfig)."""
  work = tmp_path_factory.mktemp('zoo_deepseek')
  (work / 'mt_out').mkdir()
  maxtext = clients.Worker('MaxText', maxtext_python, MAXTEXT_CLIENT, work / 'mt_out',
                           work / 'maxtext.log')
  deadline = time.time() + WORKER_TIMEOUT
  maxtext.send(*_case_jobs(work))
  futures = {}
  with ThreadPoolExecutor(2) as pool:
    for case in CASES:
      wait(maxtext, [f'case_{case}'], deadline)
      r = maxtext.results.get(f'case_{case}')
      if r and r['ok']:
        futures.update(_submit(pool, work, case, r))
    wait(maxtext, ['lora'], deadline)
    r = maxtext.results.get('lora')
    config = work / LORA_CASE / 'hf_config_tiny'
    if r and r['ok'] and config.is_dir():
      model = FAMILIES[LORA_CASE.split('_')[0]][1]
      for name, flags in LORA_EXPORTS.items():
        futures[f'lora_{name}'] = pool.submit(export, pathlib.Path(r['tunix']),
                                              work / f'lora_{name}', model, '--hf-config',
                                              str(config), *flags)
      futures['lora_peft'] = pool.submit(
          export, pathlib.Path(r['tunix']), work / 'lora_peft', model, '--peft',
          '--lora-alpha', '4', '--base-model', str(config))
    exports = {name: f.result() for name, f in futures.items()}
  for name, e in exports.items():
    if e['rc'] == 0 and name != 'lora_peft':
      maxtext.send(*clients.read_back(name, e['out']))
  maxtext.finish(max(60.0, deadline - time.time()))
  return Run(work, maxtext, None, exports)


@pytest.fixture(scope='module')
def hf(run, hf_python) -> clients.Worker:
  """transformers loads every export (job `load`) and peft the LoRA run's adapter on its
  base-only export (job `peft`), on the tokens MaxText's model was given."""
  (run.work / 'hf_out').mkdir()
  worker = clients.Worker('transformers', hf_python, HF_CLIENT, run.work / 'hf_out',
                          run.work / 'hf.log', env=subprocess_env())
  for name, e in run.exports.items():
    job = 'lora' if name.startswith('lora') else f"case_{name.rsplit('_', 1)[0]}"
    r = run.maxtext.results.get(job)
    if not (r and r['ok'] and e['rc'] == 0):
      continue  # the test names what is missing
    with np.load(r['npz']) as z:
      tokens = z['tokens'].tolist()
    if name == 'lora_peft':
      worker.send({'id': 'peft', 'job': 'peft', 'base': str(run.exports['lora_base']['out']),
                   'adapter': str(e['out']), 'tokens': tokens})
    else:
      worker.send({'id': f'load_{name}', 'job': 'load', 'dir': str(e['out']), 'tokens': tokens})
  worker.finish(WORKER_TIMEOUT)
  return worker


def _hf(arrays: dict[str, np.ndarray], prefix: str) -> dict[str, np.ndarray]:
  return {k[len(prefix):]: v for k, v in arrays.items() if k.startswith(prefix)}


def _moe_layers(case: str) -> range:
  """The MoE layers of a case's model (after its one dense layer)."""
  layers = int(next(d for d in FAMILIES[case.split('_')[0]][2] if 'decoder_layers' in d)
               .split('=')[1])
  return range(1, layers)


def _drawn_bias(arrays: dict[str, np.ndarray], case: str, i: int) -> np.ndarray:
  """Layer i's routing bias as MaxText's model held it: its drawn leaf (scanned: the stack's
  row i - 1, nnx having stacked the MoEBiasVar on axis 0; unscanned: moe_layers_{i-1})."""
  gate = 'DeepSeekMoeBlock_0/MoeBlock_0/gate/bias'
  if case.endswith('_scan'):
    return arrays[f'mt/decoder/moe_layers/{gate}'][i - 1]
  return arrays[f'mt/decoder/moe_layers_{i - 1}/{gate}']


# --------------------------------------------------------------------------- #
# Tests
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize('case', [c for c in CASES if not c.startswith('v4_')])
def test_a_sources_are_maxtexts_deepseek_layouts(run, case):
  """MaxText keeps the dense and MoE layers apart (two stacks scanned, dense_layers_{j} and
  moe_layers_{j} unscanned); the bias, no nnx.Param, is stacked on axis 0 and only the Tunix
  run holds it (a V3 model's; V2 has none)."""
  r = run.case(case)
  fam, form = case.rsplit('_', 1)
  names, n_moe = r['mt'], len(_moe_layers(case))
  bias = [n for n in names if n.endswith('gate/bias')]
  if form == 'scan':
    assert names['decoder/dense_layers/self_attention/out/kernel'][1] == 1, names
    assert names['decoder/moe_layers/self_attention/out/kernel'][1] == n_moe, names
    assert [names[b] for b in bias] == ([[n_moe, 4]] if fam != 'v2' else []), bias
  else:
    assert 'decoder/dense_layers_0/self_attention/out/kernel' in names, sorted(names)[:9]
    assert len([n for n in names if n.endswith('out/kernel')]) == 1 + n_moe
    assert [names[b] for b in bias] == ([[4]] * n_moe if fam != 'v2' else []), bias
  for src, item in (('tunix', 'model_params'), ('maxtext', 'items')):
    meta = json.loads((pathlib.Path(r[src]) / str(STEP) / item / '_METADATA').read_text())
    paths = ['/'.join(k['key'] for k in e['key_metadata']) for e in meta['tree_metadata'].values()]
    held = [p for p in paths if p.endswith(('gate/bias', 'gate/bias/value'))]
    assert len(held) == (len(bias) if src == 'tunix' else 0), (src, held)


@pytest.mark.parametrize('name', V3_STYLE)
def test_b_export_equals_maxtexts_own_conversion(run, name):
  """Every tensor MaxText's converter writes from the same source, by name, shape, dtype and
  value; and the routing bias: the Tunix run's as MaxText converts it (unscanned), as the model
  held it (scanned: MaxText's converter fails, test_c); the params-only step's zeros."""
  case, src = name.rsplit('_', 1)
  out = run.exported(name)
  r = run.case(case)
  assert r['convert_error'] is None, r['convert_error']
  arrays = run.arrays(run.maxtext, f'case_{case}')
  from_tunix = _hf(arrays, 'hf_tunix/')
  want = from_tunix if src == 'tunix' and from_tunix else _hf(arrays, 'hf/')
  got = _hf(run.arrays(run.maxtext, f'read_{name}'), 'hf/')
  meta = run.result(run.maxtext, f'read_{name}')['tensors']
  has_bias = not case.startswith('v2')
  made = {f'model.layers.{i}.{BIAS}' for i in _moe_layers(case)} if has_bias else set()
  assert set(want) <= set(got) and set(got) - set(want) <= made, (
      f'{out}: missing {sorted(set(want) - set(got))}, extra {sorted(set(got) - set(want))}')
  for k, w in want.items():
    assert (tuple(meta[k][0]), meta[k][1]) == (w.shape, 'float32'), (k, meta[k], w.shape)
    np.testing.assert_array_equal(got[k], w, err_msg=f'{name}: {k}')
  for i in _moe_layers(case) if has_bias else ():
    bias = got[f'model.layers.{i}.{BIAS}']
    expected = _drawn_bias(arrays, case, i) if src == 'tunix' else np.zeros(4, np.float32)
    np.testing.assert_array_equal(bias, expected, err_msg=f'{name}: layer {i} bias')
    assert src == 'tunix' or 'absent in layers' in run.exports[name]['stderr'], (
        run.exports[name]['stderr'])


@pytest.mark.parametrize('case', [c for c in CASES if c.split('_')[0] in ('v3', 'v32')])
def test_c_maxtexts_converter_slices_the_scanned_bias_on_the_wrong_axis(run, case):
  """MaxText's converter on the Tunix run (which holds the bias): unscanned it converts the
  bias; scanned it slices the (layers, experts) stack along param_scan_axis=1, taking a layer's
  bias from the experts axis, and fails reshaping (layers,) into (experts,)."""
  r = run.case(case)
  n_moe = len(_moe_layers(case))
  if case.endswith('_unscan'):
    assert r['convert_tunix_error'] is None, r['convert_tunix_error']
    return
  assert r['convert_tunix_error'] == (f'ValueError: cannot reshape array of size {n_moe} into'
                                      ' shape (4,)'), r['convert_tunix_error']


@pytest.mark.parametrize('name', LOADED)
def test_d_autoconfig_loads_the_written_config(run, name):
  case = name.rsplit('_', 1)[0]
  run.exported(name)
  r = run.result(run.maxtext, f'auto_{name}')
  assert r['architectures'] == [HF_CLASSES[case.split('_')[0]]], r
  cfg, text = run.case(case)['config'], r['config']
  assert (text['hidden_size'], text['num_hidden_layers'], text['vocab_size']) == (
      cfg['emb_dim'], cfg['num_decoder_layers'], cfg['vocab_size']), text
  if case.startswith('v4_'):  # transformers' own layer kinds from the config written
    assert (text['hc_mult'], text['o_groups'], text['o_lora_rank']) == (
        cfg['mhc_expansion_rate'], cfg['o_groups'], cfg['o_lora_rank']), text
    assert text['mlp_layer_types'] == ['hash_moe'] * V4_HASH_LAYERS + ['moe'] * 2, text
    return
  assert text['first_k_dense_replace'] == cfg['first_num_dense_layers'], text
  assert (text['q_lora_rank'] or 0, text['kv_lora_rank']) == (cfg['q_lora_rank'],
                                                              cfg['kv_lora_rank']), text
  rope = text['rope_parameters']  # MaxText's YaRN, as to_huggingface rewrites it
  assert (rope['rope_type'], rope['factor'], rope['truncate']) == (
      'yarn', cfg['rope_factor'], cfg['rope_truncate']), rope


@pytest.mark.parametrize('name', LOADED)
def test_e_transformers_loads_the_export_and_computes_maxtexts_logits(run, hf, name):
  """AutoModelForCausalLM loads every export (no missing, unexpected or mismatched key) as the
  family's class and computes MaxText's logits, MoE routing included: of the trained model
  (the Tunix run), or of the model MaxText makes of its params-only step (the bias at zero),
  which the trained one's routing bias moves far."""
  case, src = name.rsplit('_', 1)
  run.exported(name)
  r = run.result(hf, f'load_{name}')
  assert not {k: v for k, v in r['loading_info'].items() if v}, r['loading_info']
  assert r['model_class'] == HF_CLASSES[case.split('_')[0]], r['model_class']
  arrays = run.arrays(run.maxtext, f'case_{case}')
  want = arrays['logits_params_only' if src == 'maxtext' and 'logits_params_only' in arrays
                else 'logits']
  got = run.arrays(hf, f'load_{name}')['logits']
  assert np.abs(want).max() > 0.1, f'{name}: degenerate MaxText logits'
  np.testing.assert_allclose(got, want, rtol=0, atol=HF_LOGITS_ATOL, err_msg=name)
  if 'logits_params_only' in arrays:  # the bias changes the routing: not a no-op
    assert np.abs(arrays['logits'] - arrays['logits_params_only']).max() > 100 * HF_LOGITS_ATOL


def test_f_lora_merged_export_computes_the_lora_models_logits(run, hf):
  """qwix LoRA as MaxText applies it, merged (--merge-lora): transformers computes the LoRA
  model's logits; the base-only export (--base-only) the base model's."""
  arrays = run.arrays(run.maxtext, 'lora')
  for name, key in (('lora_merged', 'logits'), ('lora_base', 'base_logits')):
    run.exported(name)
    r = run.result(hf, f'load_{name}')
    assert not {k: v for k, v in r['loading_info'].items() if v}, (name, r['loading_info'])
    got = run.arrays(hf, f'load_{name}')['logits']
    np.testing.assert_allclose(got, arrays[key], rtol=0, atol=HF_LOGITS_ATOL, err_msg=name)
  assert np.abs(arrays['logits'] - arrays['base_logits']).max() > 0.1  # the adapters matter


def _tensors(folder: pathlib.Path) -> dict[str, np.ndarray]:
  """Every tensor of a folder's safetensors files (read without the `safetensors` package)."""
  return {k: v for f in sorted(folder.glob('*.safetensors'))
          for k, v in read_safetensors(f).items()}


def test_g_peft_adapter_on_the_base_only_export_is_the_merged_export(run):
  """--peft: every adapted module of the run (MLA, dense MLP, shared experts, each layer),
  lora_B @ lora_A scaled by lora_alpha / r and added to the base-only export, is the merged
  export's weight; the modules qwix did not adapt are the base's."""
  base, merged = (_tensors(run.exported(f'lora_{n}')) for n in ('base', 'merged'))
  adapter = _tensors(run.exported('lora_peft'))
  config = json.loads((run.exported('lora_peft') / 'adapter_config.json').read_text())
  assert (config['r'], config['lora_alpha']) == (LORA_RANK, LORA_ALPHA), config
  prefix = 'base_model.model.'
  modules = {k[len(prefix):-len('.lora_A.weight')] for k in adapter if k.endswith('lora_A.weight')}
  assert sorted(modules) == sorted(config['target_modules'])
  # One module per layer of each stack qwix adapted (`decoder/<stack>/.../<module>`).
  adapted = run.result(run.maxtext, 'lora')['adapted']
  layers = {'dense_layers': 1, 'moe_layers': len(_moe_layers(LORA_CASE))}
  assert len(modules) == sum(layers[a.split('/')[1]] for a in adapted), (modules, adapted)
  for k, w in merged.items():
    m = k[:-len('.weight')]
    if m not in modules:
      np.testing.assert_array_equal(w, base[k], err_msg=k)
      continue
    a, b = adapter[f'{prefix}{m}.lora_A.weight'], adapter[f'{prefix}{m}.lora_B.weight']
    got = base[k] + LORA_ALPHA / LORA_RANK * (b.astype(np.float64) @ a)
    np.testing.assert_allclose(got, w, rtol=0, atol=2e-5, err_msg=m)


def test_i_peft_loads_the_adapter_and_applies_its_attention_modules(run, hf):
  """The real peft 0.21.2 on transformers 5 loads the adapter on the base-only export: every
  MLA module is wrapped and, merged (`merge_and_unload`), is the merged export's weight. peft
  re-targets every `gate_proj`/`up_proj`/`down_proj` of an MoE model (qwen2_moe-converted, as
  DeepSeek's are) to the fused experts' parameters (its `_convert_peft_config_moe`), so the
  dense MLP's and the shared experts' adapters are left unloaded there: asserted, not hidden."""
  r = run.result(hf, 'peft')
  run.exported('lora_peft')
  adapter = _tensors(run.exported('lora_peft'))
  attention = sorted(k for k in adapter if 'self_attn' in k)
  remapped = sorted(k for k in adapter if k.rsplit('.', 3)[-3] in PEFT_REMAPPED)
  assert sorted(attention + remapped) == sorted(adapter)
  assert r['adapter_unexpected_keys'] == remapped, r['adapter_unexpected_keys']
  wrapped = {m.removeprefix('base_model.model.') for m in r['lora_modules']}
  assert {k.removeprefix('base_model.model.').rsplit('.', 2)[0] for k in attention} <= wrapped
  merged = _tensors(pathlib.Path(r['merged_dir']))
  ours = _tensors(run.exported('lora_merged'))
  for k in {k.removeprefix('base_model.model.').rsplit('.', 2)[0] + '.weight' for k in attention}:
    np.testing.assert_allclose(merged[k], ours[k], rtol=0, atol=2e-5, err_msg=k)


def _v4_drawn(arrays: dict[str, np.ndarray], case: str, i: int, w: str) -> np.ndarray:
  """Layer i's weight `w` as MaxText's V4 model held it (drawn): scanned, the hash layers are
  `decoder/layers_{i}`, then block a = (i - 3) // 2 at position k of `scanned_blocks/layers_{k}`
  (on axis 1; the routing bias, no nnx.Param, on axis 0)."""
  if case.endswith('_unscan') or i < V4_HASH_LAYERS:
    return arrays[f'mt/decoder/layers_{i}/{w}']
  a, k = divmod(i - V4_HASH_LAYERS, 2)
  stacked = arrays[f'mt/decoder/scanned_blocks/layers_{k}/{w}']
  return stacked[a] if w.endswith('gate/bias') else np.take(stacked, a, axis=1)


@pytest.mark.parametrize('name', [e for e in LOADED if e.startswith('v4_')])
def test_k_v4_export_equals_maxtexts_conversion_but_the_hyper_connections_norm(run, name):
  """V4 from the Tunix run: every tensor MaxText's converter writes from the params-only step
  (unscanned; scanned it fails, test_l), the same; the routing tables and biases the run holds;
  each hyper-connection's `hc_*_fn` is its alphas scaled by the norm before them (numpy on the
  drawn arrays), where MaxText's drops that scale."""
  case = name.rsplit('_', 1)[0]
  arrays = run.arrays(run.maxtext, f'case_{case}')
  got = _hf(run.arrays(run.maxtext, f'read_{name}'), 'hf/')
  want = _hf(arrays, 'hf/')
  n = run.case(case)['config']['num_decoder_layers']
  routing = {f'layers.{i}.ffn.gate.{"tid2eid" if i < V4_HASH_LAYERS else "bias"}'
             for i in range(n)}
  if case.endswith('_unscan'):
    assert sorted(got) == sorted(set(want) | routing), sorted(set(got) ^ set(want) ^ routing)
    for k, w in want.items():
      if '.hc_' not in k or not k.endswith('_fn'):
        np.testing.assert_array_equal(got[k], w, err_msg=k)
  for i in range(n):
    table, w = ('tid2eid', 'mlp/MoeBlock_0/tid2eid') if i < V4_HASH_LAYERS else (
        'bias', 'mlp/MoeBlock_0/gate/bias')
    np.testing.assert_array_equal(got[f'layers.{i}.ffn.gate.{table}'],
                                  _v4_drawn(arrays, case, i, w))
    for mt, hf_name in (('mhc_attention', 'hc_attn'), ('mhc_mlp', 'hc_ffn')):
      part = {p: _v4_drawn(arrays, case, i, f'{mt}/{p}') for p in (
          'pre_alpha', 'post_alpha', 'res_alpha', 'mhc_norm/scale', 'pre_beta', 'post_beta',
          'res_beta', 'pre_alpha_scale', 'post_alpha_scale', 'res_alpha_scale')}
      alphas = np.concatenate([part['pre_alpha'], part['post_alpha'], part['res_alpha']], -1)
      fn = got[f'layers.{i}.{hf_name}_fn']
      np.testing.assert_array_equal(fn, (alphas * part['mhc_norm/scale'][:, None]).T)
      if case.endswith('_unscan'):  # MaxText's: the alphas alone, the trained scale dropped
        np.testing.assert_array_equal(want[f'layers.{i}.{hf_name}_fn'], alphas.T)
        assert not np.array_equal(fn, alphas.T)
      np.testing.assert_array_equal(got[f'layers.{i}.{hf_name}_base'], np.concatenate(
          [part['pre_beta'], part['post_beta'], part['res_beta'].reshape(-1)]))
      np.testing.assert_array_equal(got[f'layers.{i}.{hf_name}_scale'], np.concatenate(
          [part['pre_alpha_scale'], part['post_alpha_scale'], part['res_alpha_scale']]))


def test_l_maxtexts_converter_cannot_read_v4_tunix_runs_nor_scanned_steps(run):
  """MaxText's V4 map names the non-Param variables by their Linen collection
  (`Tid2EidVar-decoder-...`), which a Tunix run (nnx.state) does not hold them under; and it
  slices the scanned step's stacked experts as if their layers led."""
  assert run.case('v4_unscan')['convert_tunix_error'].startswith(
      'ValueError: maxtext_state_dict must be a subset of flattened param_map')
  error = run.case('v4_scan')['convert_error']
  assert error.startswith('TypeError: cannot reshape array of shape'), error


@pytest.mark.parametrize('name', REFUSED)
def test_j_a_v4_params_only_step_is_refused(run, name):
  """The hash layers route by a table (`tid2eid`, no nnx.Param) MaxText's params-only step
  leaves out: the base config's hash layers are not in the weights, refused (exit 2)."""
  e = run.exports[name]
  assert e['rc'] == 2 and 'num_hash_layers: config.json has 3, the weights have 0' in (
      e['stderr']), e['stderr'][-2000:]

"""`orbax-tunix export` of MaxText's hybrid decoders, Qwen3.5 MoE and Qwen3-Next (gated delta
net linear attention, three layers in every cycle of four, interleaved with gated full
attention; MoE with a shared expert), checked against MaxText 0.2.5 and transformers 5.

The sources are made by MaxText itself (tests/maxtext_client.py's `family_case` job, in the
MaxText venv): a tiny qwen3.5-35b-a3b and qwen3-next-80b-a3b (the pyconfig overrides below,
every dim distinct where a mix-up could pass, every nnx.Param drawn from N(0, 0.3²)), scanned
and unscanned, each saved as a Tunix run and as a MaxText params-only step, with the model's
own logits. Qwen3.5's scanned model has 4 layers (MaxText 0.2.5 builds no remainder for it:
its `int(layers / 4)` blocks drop the rest); Qwen3-Next's has 5 (one block of four, a
remainder). MaxText's gated delta net runs on CPU (its pure-JAX chunked rule; no TPU kernel
is needed outside vLLM's paged path), so every form is made and run.

Qwen3.5's scanned and Qwen3-Next's unscanned cases are also LoRA runs: LoRA applied as
MaxText applies it (`lora_utils.apply_lora_to_model`: qwix on the linear attention's fused
projections and output, the gated query and output, and Qwen3.5's shared expert's down
projection (Qwen3-Next's attention alone: see LORA_ATTENTION); rank 3, alpha 6), its adapters
drawn at random, saved as a Tunix run (with the MoE blocks' sown `moe_has_overflow`, as a
run saved after a forward pass holds it), with the LoRA model's logits. (MaxText 0.2.5 cannot
apply LoRA to a scanned Qwen3-Next: see LORA_CASES.) Logits are computed compiled
(`jit_logits`: the unscanned decoders' delta rule runs op by op otherwise).

Checks (every export by the CLI, `--hf-config` = MaxText's HF config fitted to the tiny
model, as tests/maxtext_client.py fits it, with the RoPE sections the tiny model uses):
  * Qwen3.5: every tensor equals MaxText's own `to_huggingface` output (float32, exact), its
    `model.language_model.*` names read as the text model's `model.*`;
  * Qwen3-Next: MaxText's converter cannot run (its shape map reads `full_attention_interval`,
    which transformers 5 no longer keeps, ends without `return`, and sizes the linear value
    dimension by `head_dim`): each failure is shown, and the export is proven by transformers;
  * transformers (`AutoModelForCausalLM`, float32, eager) loads every export as the family's
    text class with no missing, unexpected or mismatched key, and computes MaxText's logits
    (MoE routing included) within HYBRID_LOGITS_ATOL; `AutoConfig` loads each config.json;
  * `--merge-lora` exports compute the LoRA model's logits in transformers; the `--peft`
    adapter loads in peft on the `--base-only` export (no missing or unexpected adapter key)
    and computes them too, live and merged.
"""

from __future__ import annotations

import copy
import json
import pathlib
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from tests import clients
from tests.clients import client_env, subprocess_env

ROOT = pathlib.Path(__file__).resolve().parent.parent
MAXTEXT_CLIENT = ROOT / 'tests' / 'maxtext_client.py'
HF_CLIENT = ROOT / 'tests' / 'hf_client.py'
WORKER_TIMEOUT = 1500
CLI_TIMEOUT = 600
STEP = 3
# transformers (torch, CPU) vs MaxText (XLA, CPU), float32, on logits up to ~7: the gated delta
# net's recurrence is computed chunk by chunk on both sides (MaxText in chunks of
# gdn_chunk_size = 16, the whole sequence; transformers in chunks of 64), its decays as
# exp(cumsum) differences, so the same sums round otherwise than in softmax attention.
# Measured (transformers 5.24, torch 2.13 vs MaxText 0.2.5, jax 0.10.2): at most 7.1e-5 over
# every export, LoRA and peft included (chunks of 4 gave 6.5e-4); 3e-4 keeps a 4x margin,
# while each layout mistake moves them by 7 to 11 (on qwen3_5_unscan: in_proj_qkvz's rows
# taken as stored, not per key head, 9.6; b and a swapped, 7.5; the experts' gate and up
# interleaved, 11.3; the conv taps reversed, 10.4).
HYBRID_LOGITS_ATOL = 3e-4
# Tiny dims: hidden 36, 4 query heads of 16 (query and gate: 32), 2 kv heads, 4 experts of 20
# (top 2), vocab 72; linear attention: 2 key heads of 6, 4 value heads of 10, conv 3.
DIMS = ['base_emb_dim=36', 'base_num_query_heads=4', 'base_num_kv_heads=2', 'head_dim=16',
        'base_mlp_dim=20', 'base_moe_mlp_dim=20', 'num_experts=4', 'num_experts_per_tok=2',
        'vocab_size=72', 'gdn_conv_kernel_dim=3', 'gdn_key_head_dim=6', 'gdn_value_head_dim=10',
        'gdn_num_key_heads=2', 'gdn_num_value_heads=4', 'gdn_chunk_size=16']
LORA = {'module_path': 'decoder/layers.*/(attention/(in_proj_qkvz|in_proj_ba|out_proj)'
                       '|attention/attention/(query|out)|mlp/shared_expert/wo)',
        'rank': 3, 'alpha': 6.0}
# Qwen3-Next's LoRA run adapts the attention alone: peft 0.21 loads a Qwen3-Next adapter's
# shared-expert modules onto the routed experts (the export says so: hf_maxtext_hybrid).
LORA_ATTENTION = {**LORA, 'module_path': 'decoder/layers.*/(attention/(in_proj_qkvz|in_proj_ba'
                                         '|out_proj)|attention/attention/(query|out))'}
# case -> (MaxText model, scan, extra keys, export --model, its text class)
CASES = {
    # mrope_section: the tiny head's 4 rotary dims are 2 frequencies (MaxText requires the
    # sections to add up to them; a text-only input rotates alike whatever the split).
    'qwen3_5_scan': ('qwen3.5-35b-a3b', True, ['base_num_decoder_layers=4',
                                               'mrope_section=[1,1,0]'], 'qwen3_5_moe'),
    'qwen3_5_unscan': ('qwen3.5-35b-a3b', False, ['base_num_decoder_layers=4',
                                                  'mrope_section=[1,1,0]'], 'qwen3_5_moe'),
    'qwen3_next_scan': ('qwen3-next-80b-a3b', True, ['base_num_decoder_layers=5'], 'qwen3_next'),
    'qwen3_next_unscan': ('qwen3-next-80b-a3b', False, ['base_num_decoder_layers=4'],
                          'qwen3_next'),
}
HF_CLASSES = {'qwen3_5_moe': 'Qwen3_5MoeForCausalLM', 'qwen3_next': 'Qwen3NextForCausalLM'}
# MaxText 0.2.5 cannot apply LoRA to a scanned Qwen3-Next (qwix's parameter init inside its
# inner scan of the linear layers fails: `fold_in accepts a single key, but was given a key
# array of shape (3,)`): its LoRA run is the unscanned model's.
LORA_CASES = ('qwen3_5_scan', 'qwen3_next_unscan')
SOURCES = ('tunix', 'maxtext')
EXPORTS = [f'{case}_{src}' for case in CASES for src in SOURCES]


def text_name(name: str) -> str:
  return name.replace('model.language_model.', 'model.', 1)


def tiny_hf_config(hf_config: dict, cfg: dict) -> dict:
  """MaxText's HF config fitted to the tiny model (its MaxText config keys `cfg`), with the
  RoPE sections the tiny model uses (Qwen3.5's mrope)."""
  out = copy.deepcopy(hf_config)
  text = out.get('text_config') or out
  rope = text.get('rope_parameters') or {}
  if 'mrope_section' in rope:
    rope['mrope_section'] = list(cfg['mrope_section'])
  return out


def cli(argv: list[str], out: pathlib.Path) -> dict:
  argv = [sys.executable, '-m', 'orbax_tunix.cli', *argv]
  p = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, env=subprocess_env(),
                     timeout=CLI_TIMEOUT, check=False)
  return {'argv': argv[3:], 'rc': p.returncode, 'stderr': p.stderr, 'out': out}


def exports_of(case: str, r: dict, work: pathlib.Path) -> list[tuple[str, list[list[str]]]]:
  """(name, [CLI argv, ...] run one after another) of every export of a made case."""
  model = CASES[case][3]
  cfg = str(work / case / 'hf_config_tiny')
  out = [(f'{case}_{src}', [['export', r[src], str(work / f'{case}_{src}_hf'), '--model',
                             model, '--hf-config', cfg]]) for src in SOURCES]
  if case in LORA_CASES:
    run, alpha = r['tunix_lora'], str(LORA['alpha'])
    base = str(work / f'{case}_base_hf')
    out += [
        (f'{case}_merged', [['export', run, str(work / f'{case}_merged_hf'), '--model', model,
                             '--hf-config', cfg, '--merge-lora', '--lora-alpha', alpha]]),
        # The adapter names its modules as the exported base holds them (its config).
        (f'{case}_peft', [['export', run, base, '--model', model, '--hf-config', cfg,
                           '--base-only'],
                          ['export', run, str(work / f'{case}_peft'), '--model', model, '--peft',
                           '--lora-alpha', alpha, '--base-model', base]]),
    ]
  return out


def run_all(argvs: list[list[str]], out: pathlib.Path, then) -> dict:
  """The CLI runs one after another (the first that fails ends them), then `then(result)`."""
  for argv in argvs:
    done = cli(argv, out)
    if done['rc'] != 0:
      break
  then(done)
  return done


class Run:
  def __init__(self, work, maxtext, hf, exports):
    self.work, self.maxtext, self.hf, self.exports = work, maxtext, hf, exports

  def result(self, worker: clients.Worker, job_id: str) -> dict:
    r = worker.results.get(job_id)
    assert r is not None, f'{worker.name} job {job_id}: no result; log:\n{worker.log()}'
    assert r['ok'], f"{worker.name} job {job_id} failed: {r['error']}\n{r.get('traceback', '')[-3000:]}"
    return r

  def case(self, case: str) -> dict:
    return self.result(self.maxtext, f'case_{case}')

  def exported(self, name: str) -> pathlib.Path:
    e = self.exports.get(name)
    assert e is not None, f'{name}: not exported (its case failed)'
    assert e['rc'] == 0, f"orbax-tunix {' '.join(e['argv'])} exited {e['rc']}:\n{e['stderr'][-3000:]}"
    return e['out']

  def arrays(self, worker: clients.Worker, job_id: str) -> dict[str, np.ndarray]:
    with np.load(self.result(worker, job_id)['npz']) as z:
      return {k: z[k] for k in z.files}


def _checks(name: str, e: dict, tokens) -> list[tuple[str, dict]]:
  """The workers' jobs on one export ('maxtext' or 'hf', the job), once it exited 0."""
  if e['rc'] != 0:
    return []
  if name.endswith('_peft'):
    case = name.removesuffix('_peft')
    return [('hf', {'id': f'peft_{case}', 'job': 'peft', 'adapter': str(e['out']),
                    'base': str(e['out'].parent / f'{case}_base_hf'), 'tokens': tokens})]
  return [('hf', {'id': f'load_{name}', 'job': 'load', 'dir': str(e['out']), 'tokens': tokens}),
          *(('maxtext', job) for job in clients.read_back(name, e['out']))]


@pytest.fixture(scope='module')
def run(hf_python, tmp_path_factory):
  """Makes every case (MaxText worker), exports each (the CLI, two at a time, as soon as its
  case is made), then reads and loads each export (MaxText and transformers workers)."""
  t0 = time.time()
  work = tmp_path_factory.mktemp('zoo_qwen')
  for d in ('mt_out', 'hf_out'):
    (work / d).mkdir()
  maxtext = clients.Worker('MaxText', client_env('maxtext_venv.sh'), MAXTEXT_CLIENT,
                           work / 'mt_out', work / 'maxtext.log')
  hf = clients.Worker('transformers', hf_python, HF_CLIENT, work / 'hf_out', work / 'hf.log',
                      env=subprocess_env())
  deadline = time.time() + WORKER_TIMEOUT
  for i, (case, (model, scan, extra, _)) in enumerate(CASES.items()):
    maxtext.send({'id': f'case_{case}', 'job': 'family_case', 'model_name': model, 'scan': scan,
                  'dims': [*DIMS, *extra], 'seed': i, 'step': STEP, 'out': str(work / case),
                  'repair_shape_map': model.startswith('qwen3-next'), 'jit_logits': True,
                  **({'lora': LORA if model.startswith('qwen3.5') else LORA_ATTENTION}
                     if case in LORA_CASES else {})})
  workers, lock = {'maxtext': maxtext, 'hf': hf}, threading.Lock()

  def then(name, tokens):
    def send(done):
      with lock:  # one job line at a time on each worker's pipe
        for worker, job in _checks(name, done, tokens):
          workers[worker].send(job)
    return send

  futures = {}
  with ThreadPoolExecutor(2) as pool:
    for case in CASES:
      while f'case_{case}' not in maxtext.results and maxtext.proc.poll() is None \
          and time.time() < deadline:
        time.sleep(0.2)
      r = maxtext.results.get(f'case_{case}')
      if not (r and r['ok']):
        continue
      (work / case / 'hf_config_tiny').mkdir()
      base = json.loads((pathlib.Path(r['hf_config']) / 'config.json').read_text())
      (work / case / 'hf_config_tiny' / 'config.json').write_text(
          json.dumps(tiny_hf_config(base, r['config']), indent=2) + '\n')
      with np.load(r['npz']) as z:
        tokens = z['tokens'].tolist()
      for name, argvs in exports_of(case, r, work):
        futures[name] = pool.submit(run_all, argvs, pathlib.Path(argvs[-1][2]),
                                    then(name, tokens))
    exports = {name: f.result() for name, f in futures.items()}
  for w in (maxtext, hf):
    w.finish(max(60.0, deadline - time.time()))
  print(f'[zoo-qwen] made, exported and checked in {time.time() - t0:.0f} s')
  return Run(work, maxtext, hf, exports)


# --------------------------------------------------------------------------- #
# Tests
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize('case', CASES)
def test_a_sources_are_maxtexts_hybrid_layouts(run, case):
  """MaxText's own trees: Qwen3.5 scanned in `layer_{j}` cycles of four, Qwen3-Next scanned
  as linear layers in an inner scan, a full-attention `global_layer` and a remainder; the
  Tunix run's adapter levels; MaxText's step layout; no leaf left at its initial value."""
  r = run.case(case)
  names = list(r['mt'])
  if case == 'qwen3_5_scan':
    assert r['mt']['decoder/layers/layer_3/attention/attention/query/kernel'] == [36, 1, 4, 32]
    assert r['mt']['decoder/layers/layer_0/attention/in_proj_qkvz/kernel'] == [36, 1, 104]
  elif case == 'qwen3_next_scan':
    assert r['mt']['decoder/layers/local_layers/attention/in_proj_qkvz/kernel'] == [36, 1, 3, 104]
    assert r['mt']['decoder/layers/global_layer/attention/attention/out/kernel'] == [64, 1, 36]
    assert r['mt']['decoder/layers_remainder/local_layers/attention/A_log'] == [4, 1]
  else:
    assert r['mt']['decoder/layers_3/attention/attention/query/kernel'] == [36, 4, 32], names
    assert 'decoder/layers_2/attention/conv1d/kernel' in r['mt'], names
  root = pathlib.Path(r['tunix']) / str(STEP)
  meta = json.loads((root / 'model_params' / '_METADATA').read_text())['tree_metadata']
  keys = [tuple(k['key'] for k in e['key_metadata']) for e in meta.values()]
  assert all(k[0] == 'base' and k[-1] == 'value' for k in keys), keys[:5]
  with np.load(r['npz']) as z:
    for name in z.files:
      if name.startswith('mt/'):
        v = z[name]
        assert not np.all(np.isin(v, (0.0, 1.0))) and (v.size == 1 or len(np.unique(v)) > 1), name


@pytest.mark.parametrize('name', [e for e in EXPORTS if e.startswith('qwen3_5')])
def test_b_qwen3_5_export_equals_maxtexts_own_conversion(run, name):
  """Every tensor MaxText's converter writes (the in_proj_qkvz split per key head, conv
  transposed, experts fused gate then up), by name, shape, dtype and value; nothing else."""
  case = name.rsplit('_', 1)[0]
  run.exported(name)
  assert run.case(case)['convert_error'] is None, run.case(case)['convert_error']
  want = {text_name(k[3:]): v for k, v in run.arrays(run.maxtext, f'case_{case}').items()
          if k.startswith('hf/')}
  meta = run.result(run.maxtext, f'read_{name}')['tensors']
  got = {k[3:]: v for k, v in run.arrays(run.maxtext, f'read_{name}').items()}
  assert sorted(got) == sorted(want), (sorted(set(want) ^ set(got)))
  assert any(k.endswith('linear_attn.in_proj_z.weight') for k in want), sorted(want)
  for k, w in want.items():
    assert (tuple(meta[k][0]), meta[k][1]) == (w.shape, 'float32'), (k, meta[k], w.shape)
    np.testing.assert_array_equal(got[k], w, err_msg=f'{name}: {k}')


@pytest.mark.parametrize('case', ['qwen3_next_scan', 'qwen3_next_unscan'])
def test_b_qwen3_next_maxtexts_converter_fails_as_said(run, case):
  """MaxText 0.2.5's Qwen3-Next conversion, on transformers 5: its shape map raises on the
  fitted config (`full_attention_interval`, which Qwen3NextConfig turns into `layer_types`);
  given that key it returns None (no `return`: the map it builds is dropped); handed the map
  it builds, the unscanned conversion still fails on in_proj_qkvz, whose shape the map makes
  of `linear_num_value_heads x head_dim` instead of `x linear_value_head_dim` (the scanned
  one earlier: its mapping names no remainder layer). So there is no MaxText reference: the
  export is proven by transformers (test_c)."""
  r = run.case(case)
  assert r['convert_error'] == "KeyError: 'full_attention_interval'", r['convert_error']
  assert r['shape_map']['as_given'] == "KeyError: 'full_attention_interval'", r['shape_map']
  assert r['shape_map']['with_interval'] == 'None' and r['shape_map']['built'] > 100
  c = r['config']
  if case.endswith('unscan'):
    qkvz = 2 * c['gdn_num_key_heads'] * c['gdn_key_head_dim']
    wrong = qkvz + 2 * c['gdn_num_value_heads'] * c['head_dim']
    right = qkvz + 2 * c['gdn_num_value_heads'] * c['gdn_value_head_dim']
    assert r['repaired_error'] == (f"ValueError: cannot reshape array of size {right * 36}"
                                   f" into shape ({wrong},36)"), r['repaired_error']
  else:
    assert 'subset of flattened param_map' in r['repaired_error'], r['repaired_error']


@pytest.mark.parametrize('name', EXPORTS + [f'{c}_merged' for c in LORA_CASES])
def test_c_transformers_loads_the_export_and_computes_maxtexts_logits(run, name):
  """AutoModelForCausalLM loads the export as the family's text class, every key used, and
  computes the MaxText model's logits (the LoRA model's for a `--merge-lora` export)."""
  case = name.rsplit('_', 1)[0]
  run.exported(name)
  r = run.result(run.hf, f'load_{name}')
  bad = {k: v for k, v in r['loading_info'].items() if v}
  assert not bad, f'{name}: transformers loaded it with {bad}'
  assert r['model_class'] == HF_CLASSES[CASES[case][3]], r['model_class']
  mt = run.arrays(run.maxtext, f'case_{case}')
  want = mt['logits_lora' if name.endswith('_merged') else 'logits']
  got = run.arrays(run.hf, f'load_{name}')['logits']
  assert np.abs(want).max() > 0.5, f'{name}: degenerate MaxText logits'
  if name.endswith('_merged'):  # the adapters moved the model
    assert np.abs(mt['logits_lora'] - mt['logits']).max() > 100 * HYBRID_LOGITS_ATOL
  np.testing.assert_allclose(got, want, rtol=0, atol=HYBRID_LOGITS_ATOL, err_msg=name)


@pytest.mark.parametrize('name', EXPORTS + [f'{c}_merged' for c in LORA_CASES])
def test_d_autoconfig_reads_the_text_models_config(run, name):
  case = name.rsplit('_', 1)[0]
  run.exported(name)
  r = run.result(run.maxtext, f'auto_{name}')
  family = CASES[case][3]
  assert r['architectures'] == [HF_CLASSES[family]], r
  assert r['model_type'] == {'qwen3_5_moe': 'qwen3_5_moe_text', 'qwen3_next': 'qwen3_next'}[family]
  c, cfg = r['config'], run.case(case)['config']
  assert 'text_config' not in c and c['hidden_size'] == cfg['emb_dim'], c
  assert c['linear_num_key_heads'] == cfg['gdn_num_key_heads'], c
  n = cfg['num_decoder_layers']
  assert c['layer_types'] == ['full_attention' if (i + 1) % 4 == 0 else 'linear_attention'
                              for i in range(n)], c['layer_types']


@pytest.mark.parametrize('case', LORA_CASES)
def test_e_peft_adapter_on_the_base_export_computes_the_lora_models_logits(run, case):
  """The `--peft` adapter loads in peft on the `--base-only` export, adapting each MaxText
  kernel's Hugging Face modules (Qwen3.5's in_proj_qkvz as in_proj_qkv and in_proj_z, one A,
  B regrouped per key head), and computes the MaxText LoRA model's logits, live and merged."""
  run.exported(f'{case}_peft')
  r = run.result(run.hf, f'peft_{case}')
  assert not r['adapter_missing_keys'] and not r['adapter_unexpected_keys'], r
  assert not any(r['loading_info'].values()), r['loading_info']
  kinds = {m.rsplit('.', 1)[-1] for m in r['lora_modules']}
  linear = ({'in_proj_qkv', 'in_proj_z', 'in_proj_b', 'in_proj_a'} if case.startswith('qwen3_5')
            else {'in_proj_qkvz', 'in_proj_ba'})
  shared = {'down_proj'} if case.startswith('qwen3_5') else set()
  assert kinds == linear | {'out_proj', 'q_proj', 'o_proj'} | shared, kinds
  want = run.arrays(run.maxtext, f'case_{case}')['logits_lora']
  got = run.arrays(run.hf, f'peft_{case}')
  for key in ('logits', 'merged_logits'):
    np.testing.assert_allclose(got[key], want, rtol=0, atol=HYBRID_LOGITS_ATOL, err_msg=key)

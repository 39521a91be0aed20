"""`export --peft`: a Tunix LoRA run's adapters as a PEFT adapter, checked against the merged export.

The sources are the committed LoRA runs of every Tunix family (`tests/data/tunix/hf_*_lora*`,
written by google-tunix with qwix; MANIFEST.json holds rank and alpha). The expected values are
independent of the adapter export: the family's merged export (`export --merge-lora`, which
tests/test_export_hf.py proves against the LoRA model's own logits under Tunix) and the plain
export of the run's base fixture (proven there against the raw weights). For every module PEFT
would adapt, `W + (lora_alpha / r) * B @ A` from the adapter file must be the merged tensor
(float32, one rounding apart), and the modules the adapter holds must be exactly the tensors the
merge changed. The safetensors files are parsed here (8-byte length, JSON header).
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import numpy as np
import orbax.checkpoint as ocp
import pytest

import orbax_tunix as ot
from orbax_tunix.mapping import huggingface as hf
from orbax_tunix.mapping import lora, peft
from orbax_tunix.mapping.transforms import chain, take
from orbax_tunix.tools import export as export_lib
from tests import builders
from tests.clients import subprocess_env
from tests.test_export_hf import (
  DATA,
  FAMILY_FIXTURES,
  LORA_FIXTURES,
  ROOT,
  manifest,
  read_safetensors,
)
from tests.test_faults import snapshot

PREFIX = 'base_model.model.'
FULL_SAVES = tuple(n for n in LORA_FIXTURES if not n.endswith('_only'))
# One rounding of W + s·B·A in float32 against the merge's own, |W| < ~1.5 (as WEIGHT_ATOL of
# test_export_hf.py); the adapters move the weights by ~1e-2 and more.
ATOL = 2e-6
CONFIG_FIXED = {'peft_type': 'LORA', 'task_type': 'CAUSAL_LM', 'bias': 'none',
                'lora_dropout': 0.0, 'use_rslora': False, 'use_dora': False,
                'inference_mode': True, 'modules_to_save': None, 'fan_in_fan_out': False,
                'init_lora_weights': True, 'layers_to_transform': None}


def family_of(name: str) -> str:
  return FAMILY_FIXTURES[manifest(name)['lora']['base']]


def tensors(path: pathlib.Path) -> dict[str, np.ndarray]:
  return read_safetensors(path)[2]


@pytest.fixture(scope='module')
def exports(tmp_path_factory) -> dict[str, dict]:
  """Per LoRA fixture: the adapter, the merged model and the base model, exported."""
  work = tmp_path_factory.mktemp('peft')
  out = {}
  for name in LORA_FIXTURES:
    spec, model = manifest(name)['lora'], family_of(name)
    d = work / name
    result = ot.export_peft_adapter(DATA / name, d / 'adapter', model=model, alpha=spec['alpha'])
    extra = {'base': DATA / spec['base']} if name.endswith('_only') else {}
    ot.export_to_hf(DATA / name, d / 'merged', model=model, merge_lora=True,
                    lora_alpha=spec['alpha'], **extra)
    ot.export_to_hf(DATA / spec['base'], d / 'base', model=model)
    out[name] = {'dir': d, 'result': result,
                 'adapter': tensors(d / 'adapter' / peft.ADAPTER_FILE),
                 'config': json.loads((d / 'adapter' / peft.CONFIG_FILE).read_text()),
                 'merged': tensors(d / 'merged' / 'model.safetensors'),
                 'base': tensors(d / 'base' / 'model.safetensors')}
  return out


def changed_modules(e: dict) -> set[str]:
  """The Hugging Face modules whose weight the merge changed (independent of the adapter)."""
  names = {k for k, w in e['merged'].items() if not np.array_equal(w, e['base'][k])}
  assert all(k.endswith('.weight') for k in names), names
  return {k[:-len('.weight')] for k in names}


@pytest.mark.parametrize('name', LORA_FIXTURES)
def test_adapter_folder_and_config(exports, name):
  e, spec = exports[name], manifest(name)['lora']
  assert sorted(p.name for p in (e['dir'] / 'adapter').iterdir()) == [
      'adapter_config.json', 'adapter_model.safetensors']
  modules = changed_modules(e)
  assert e['config'] == {
      **CONFIG_FIXED, 'r': spec['rank'], 'lora_alpha': spec['alpha'],
      'target_modules': sorted({m.rsplit('.', 1)[-1] for m in modules}),
      'base_model_name_or_path': None, 'rank_pattern': {}, 'alpha_pattern': {}}
  assert sorted(e['adapter']) == sorted(
      f'{PREFIX}{m}.lora_{x}.weight' for m in modules for x in 'AB')


@pytest.mark.parametrize('name', LORA_FIXTURES)
def test_adapter_on_the_base_is_the_merged_export(exports, name):
  e = exports[name]
  scale = e['config']['lora_alpha'] / e['config']['r']
  assert scale == manifest(name)['lora']['scale']
  for module in changed_modules(e):
    a = e['adapter'][f'{PREFIX}{module}.lora_A.weight']
    b = e['adapter'][f'{PREFIX}{module}.lora_B.weight']
    w = e['base'][f'{module}.weight']
    r = e['config']['r']
    assert a.dtype == b.dtype == np.float32
    assert a.shape == (r, w.shape[1]) and b.shape == (w.shape[0], r), (module, a.shape, b.shape)
    got = w.astype(np.float64) + scale * (b.astype(np.float64) @ a.astype(np.float64))
    want = e['merged'][f'{module}.weight']
    np.testing.assert_allclose(got, want, rtol=0, atol=ATOL, err_msg=module)
    assert np.abs(want - w).max() > 100 * ATOL, f'{module}: the adapter hardly moves it'


@pytest.mark.parametrize('name', LORA_FIXTURES)
def test_only_the_adapter_arrays_are_read(exports, name):
  step = str(manifest(name)['steps'][-1])
  leaves = manifest(name)['step_items'][step]['items']['model_params']
  adapters = [x for x in leaves if '_lora_' in x['path']]
  want = sum(np.prod(x['shape']) * np.dtype(x['dtype']).itemsize for x in adapters)
  assert exports[name]['result'].bytes_read == want
  total = sum(np.prod(x['shape']) * np.dtype(x['dtype']).itemsize for x in leaves)
  if not name.endswith('_only'):
    assert want < total / 5  # The base weights are most of a full save.


def test_adapters_only_save_gives_the_full_saves_adapter(exports):
  a, b = exports['hf_qwen3_lora_only'], exports['hf_qwen3_lora']
  assert a['config'] == b['config']
  assert sorted(a['adapter']) == sorted(b['adapter'])
  for k, v in b['adapter'].items():
    np.testing.assert_array_equal(a['adapter'][k], v, err_msg=k)


def _save_model_params(step_dir: pathlib.Path, weights: dict[str, np.ndarray]) -> None:
  """Writes weights ({'a/b/w': array}) as a Tunix run's model_params, nnx's `value` level kept."""
  tree: dict = {}
  for path, value in weights.items():
    node = tree
    for key in path.split('/'):
      node = node.setdefault(key, {})
    node['value'] = value
  with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckptr:
    ckptr.save(step_dir, args=ocp.args.Composite(model_params=ocp.args.PyTreeSave(tree)))


def raw_weights(name: str) -> dict[str, np.ndarray]:
  step = manifest(name)['steps'][-1]
  return {p[:-len('/value')]: v for p, v in
          builders.raw_leaves(DATA / name / str(step) / 'model_params').items()}


@pytest.mark.parametrize('name', ['hf_gemma2_lora', 'hf_gemma_lora', 'hf_gemma4_moe_lora'])
def test_gemma_adapters_saved_alone_are_arranged_by_the_familys_data(exports, tmp_path, name):
  """Without the base weights the shapes cannot say where qwix put D among Gemma's einsum
  axes; the family's `lora` data does, and gives the adapter the full save gives."""
  alone = {p: v for p, v in raw_weights(name).items() if lora.is_adapter(p.split('/'))}
  _save_model_params(tmp_path / 'run' / '3', alone)
  ot.export_peft_adapter(tmp_path / 'run', tmp_path / 'adapter', model=family_of(name),
                         alpha=manifest(name)['lora']['alpha'])
  got = tensors(tmp_path / 'adapter' / peft.ADAPTER_FILE)
  want = exports[name]['adapter']
  assert sorted(got) == sorted(want)
  for k, v in want.items():
    np.testing.assert_array_equal(got[k], v, err_msg=k)


def test_scale_instead_of_alpha(exports, tmp_path):
  spec = manifest('hf_qwen3_lora')['lora']
  ot.export_peft_adapter(DATA / 'hf_qwen3_lora', tmp_path / 'a', model='qwen3',
                         scale=spec['scale'], base_model='Qwen/Qwen3-0.6B')
  config = json.loads((tmp_path / 'a' / peft.CONFIG_FILE).read_text())
  assert config == {**exports['hf_qwen3_lora']['config'], 'lora_alpha': spec['scale'] * 2,
                    'base_model_name_or_path': 'Qwen/Qwen3-0.6B'}


def test_bfloat16_adapter_is_the_float32_one_cast(exports, tmp_path):
  import ml_dtypes
  ot.export_peft_adapter(DATA / 'hf_gemma2_lora', tmp_path / 'a', model='gemma2', alpha=3,
                         dtype='bfloat16')
  got = tensors(tmp_path / 'a' / peft.ADAPTER_FILE)
  for k, v in exports['hf_gemma2_lora']['adapter'].items():
    assert got[k].dtype == ml_dtypes.bfloat16, k
    np.testing.assert_array_equal(got[k], v.astype(ml_dtypes.bfloat16), err_msg=k)


def test_gemma4_k_eq_v_layer_says_what_vllm_does():
  plan = export_lib.plan_peft_export(DATA / 'hf_gemma4_moe_lora', '/nonexistent/out',
                                     model='gemma4', alpha=3)
  said = [n for n in plan.notes if 'k_eq_v' in n]
  assert len(said) == 1 and 'vLLM' in said[0], plan.notes
  assert 'model.language_model.layers.1.self_attn.k_proj' in said[0]
  assert 'layers.0.' not in said[0]  # Layer 0 has its own values (kv_einsum).


@pytest.mark.parametrize('name', FULL_SAVES)
def test_base_only_is_the_base_fixtures_export(exports, tmp_path, name):
  ot.export_to_hf(DATA / name, tmp_path / 'b', model=family_of(name), base_only=True)
  assert (tmp_path / 'b' / 'model.safetensors').read_bytes() == (
      exports[name]['dir'] / 'base' / 'model.safetensors').read_bytes()


# --------------------------------------------------------------------------- #
# The command line, and what it refuses
# --------------------------------------------------------------------------- #
def cli(*argv: str) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, '-m', 'orbax_tunix.cli', 'export', *map(str, argv)],
                        capture_output=True, text=True, cwd=ROOT, env=subprocess_env(),
                        timeout=300, check=False)


def test_cli_peft_writes_the_libraries_adapter(exports, tmp_path):
  p = cli(DATA / 'hf_qwen3_lora_only', tmp_path / 'a', '--model', 'qwen3', '--peft',
          '--lora-alpha', '3', '--base-model', 'Qwen/Qwen3-0.6B')
  assert p.returncode == 0, p.stderr
  assert sorted(x.name for x in (tmp_path / 'a').iterdir()) == [
      'adapter_config.json', 'adapter_model.safetensors']
  config = json.loads((tmp_path / 'a' / peft.CONFIG_FILE).read_text())
  assert config == {**exports['hf_qwen3_lora_only']['config'],
                    'base_model_name_or_path': 'Qwen/Qwen3-0.6B'}
  assert (tmp_path / 'a' / peft.ADAPTER_FILE).read_bytes() == (
      exports['hf_qwen3_lora_only']['dir'] / 'adapter' / peft.ADAPTER_FILE).read_bytes()


def _with(name: str, extra: dict[str, np.ndarray], root: pathlib.Path) -> pathlib.Path:
  _save_model_params(root / '1', {**raw_weights(name), **extra})
  return root


def _experts_adapted(root: pathlib.Path) -> pathlib.Path:
  """hf_qwen3_moe_lora with qwix's adapters on the stacked experts of layer 0 (E, D, F):
  a (E, D, r) (E is a batch dimension of the einsum), b (r, F)."""
  rng = np.random.default_rng(0)
  return _with('hf_qwen3_moe_lora', {
      'layers/0/mlp/gate_proj_lora_a': rng.normal(size=(3, 40, 2)).astype(np.float32),
      'layers/0/mlp/gate_proj_lora_b': rng.normal(size=(2, 20)).astype(np.float32)}, root)


def _embedding_adapted(root: pathlib.Path) -> pathlib.Path:
  """hf_qwen3_lora with adapters on the embedding (as on a tied output projection)."""
  rng = np.random.default_rng(0)
  return _with('hf_qwen3_lora', {
      'embedder/input_embedding_lora_a': rng.normal(size=(40, 2)).astype(np.float32),
      'embedder/input_embedding_lora_b': rng.normal(size=(2, 96)).astype(np.float32)}, root)


PEFT = ('--peft', '--lora-alpha', '3')
REFUSED = {  # case -> (source, model, flags, words the message holds (one of each tuple))
    'no_adapters': ('hf_qwen3', 'qwen3', PEFT, [('no LoRA run', 'found none'), ('--peft',)]),
    'no_alpha': ('hf_qwen3_lora', 'qwen3', ('--peft',), [('--lora-alpha',), ('--lora-scale',)]),
    'with_merge': ('hf_qwen3_lora', 'qwen3', (*PEFT, '--merge-lora'), [('--merge-lora',)]),
    'with_base': ('hf_qwen3_lora_only', 'qwen3', (*PEFT, '--base', DATA / 'hf_qwen3'),
                  [('--base',)]),
    'with_hf_config': ('hf_qwen3_lora', 'qwen3', (*PEFT, '--hf-config', DATA), [('--hf-config',)]),
    'with_base_only': ('hf_qwen3_lora', 'qwen3', (*PEFT, '--base-only'), [('--base-only',)]),
    'base_model_alone': ('hf_qwen3_lora', 'qwen3', ('--base-model', 'x'), [('--peft',)]),
    'base_only_no_adapters': ('hf_qwen3', 'qwen3', ('--base-only',), [('none',)]),
    'base_only_of_adapters_only': ('hf_qwen3_lora_only', 'qwen3', ('--base-only',),
                                   [('adapters only',), ('base weights',)]),
    'other_family': ('hf_qwen3_lora', 'gemma2', PEFT, [('q_proj', 'o_proj'), ('--model',)]),
    'experts': (_experts_adapted, 'qwen3_moe', PEFT,
                [('experts',), ('layers/0/mlp/gate_proj',), ('--merge-lora',)]),
    'embedding': (_embedding_adapted, 'qwen3', PEFT,
                  [('embedding',), ('embedder/input_embedding',), ('--merge-lora',)]),
}


@pytest.mark.parametrize('case', REFUSED)
def test_cli_refusals(tmp_path, case):
  source, model, flags, words = REFUSED[case]
  src = source(tmp_path / 'run') if callable(source) else DATA / source
  before = snapshot(src)
  p = cli(src, tmp_path / 'out', '--model', model, *flags)
  message = p.stderr
  assert p.returncode == 2, (p.returncode, p.stdout, message)
  assert message.startswith('orbax-tunix: error:') and 'Traceback' not in message, message
  for alternatives in words:
    assert any(w in message for w in alternatives), (alternatives, message)
  assert not (tmp_path / 'out').exists()
  assert [x.name for x in tmp_path.iterdir()] == (['run'] if callable(source) else [])
  assert snapshot(src) == before


def test_refusal_names_every_module_at_once(tmp_path):
  root = _experts_adapted(tmp_path / 'run')
  rng = np.random.default_rng(1)
  _save_model_params(root / '2', {
      **raw_weights('hf_qwen3_moe_lora'),
      **{f'layers/{i}/mlp/{p}_proj_lora_{x}': rng.normal(size=s).astype(np.float32)
         for i in (0, 1) for p in ('up', 'down')
         for x, s in (('a', (3, 40 if p == 'up' else 20, 2)), ('b', (2, 20 if p == 'up' else 40)))}})
  with pytest.raises(ot.LoraError) as e:
    export_lib.plan_peft_export(root, tmp_path / 'out', model='qwen3_moe', alpha=3)
  assert str(e.value).count('MoE experts') == 4 * 3  # 4 weights, 3 experts each.
  assert '`merge_lora=True`' in str(e.value)


# --------------------------------------------------------------------------- #
# The factorization itself
# --------------------------------------------------------------------------- #
def test_factors_refuse_a_module_feature_mixing_rows_of_a():
  # a holds (D, N): an output feature (n, h) of HF's (N·H, D) would take a row of `a` per n.
  contraction = lora.contraction((40, 4, 12), (40, 4, 2), (2, 12))
  assert contraction is not None
  found = peft.Factors.of(contraction, hf.IN_PROJ, (40, 4, 2), (2, 12))
  assert isinstance(found, str) and 'not B·A' in found


def test_factors_of_a_fused_kv_einsum_share_a_and_split_b():
  rng = np.random.default_rng(0)
  a, b = rng.normal(size=(40, 2)), rng.normal(size=(2, 2, 3, 12))  # (D, r), (r, C, K, H)
  w = np.einsum('dr,rckh->ckdh', a, b)  # Tunix's kv_einsum (C, K, D, H), as qwix adds it
  contraction = lora.contraction(w.shape, a.shape, b.shape)
  for c, name in enumerate('kv'):
    transform = chain(take(0, c), hf.HEADS_FIRST)
    f = peft.Factors.of(contraction, transform, a.shape, b.shape)
    big_a = peft.lora_a(f, 2).apply([a])
    big_b = peft.lora_b(f, 2).apply([b])
    np.testing.assert_allclose(big_b @ big_a, np.transpose(w[c], (1, 0, 2)).reshape(40, 36).T,
                               err_msg=name, atol=1e-12)
    np.testing.assert_array_equal(big_a, a.T)

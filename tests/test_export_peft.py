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
from orbax_tunix.mapping import hf_naming, lora, peft, trainers
from orbax_tunix.mapping import huggingface as hf
from orbax_tunix.mapping.transforms import chain, take
from orbax_tunix.tools import export as export_lib
from tests import builders
from tests.clients import subprocess_env
from tests.test_export_hf import (
  DATA,
  FAMILY_FIXTURES,
  HF_CONFIG_DIMS,
  HF_CONFIG_EXTRA,
  HF_CONFIG_FULL,
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
    result = ot.export_peft_adapter(DATA / name, d / 'adapter', model=model,
                                    lora_alpha=spec['alpha'])
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
      'target_modules': sorted(modules),  # each by its full name: those, and no other
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


@pytest.mark.parametrize('name', ['hf_qwen3_lora', 'hf_gemma4_lora'])
def test_a_full_save_is_read_for_its_adapters_alone(tmp_path, monkeypatch, name):
  """Measured at Orbax's restore: the leaves asked for are the adapters, each once."""
  want = sorted(p + '/value' for p in raw_weights(name) if '_lora_' in p)
  calls = builders.spy_restores(monkeypatch)
  ot.export_peft_adapter(DATA / name, tmp_path / 'a', model=family_of(name), lora_alpha=3)
  asked = [leaf for _, leaves in calls for leaf in leaves]
  assert {item for item, _ in calls} == {'model_params'}
  assert sorted(asked) == want


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
                         lora_alpha=manifest(name)['lora']['alpha'])
  got = tensors(tmp_path / 'adapter' / peft.ADAPTER_FILE)
  want = exports[name]['adapter']
  assert sorted(got) == sorted(want)
  for k, v in want.items():
    np.testing.assert_array_equal(got[k], v, err_msg=k)


def test_scale_instead_of_alpha(exports, tmp_path):
  spec = manifest('hf_qwen3_lora')['lora']
  ot.export_peft_adapter(DATA / 'hf_qwen3_lora', tmp_path / 'a', model='qwen3',
                         lora_scale=spec['scale'], base_model='Qwen/Qwen3-0.6B')
  config = json.loads((tmp_path / 'a' / peft.CONFIG_FILE).read_text())
  assert config == {**exports['hf_qwen3_lora']['config'], 'lora_alpha': spec['scale'] * 2,
                    'base_model_name_or_path': 'Qwen/Qwen3-0.6B'}


def test_bfloat16_adapter_is_the_float32_one_cast(exports, tmp_path):
  import ml_dtypes
  ot.export_peft_adapter(DATA / 'hf_gemma2_lora', tmp_path / 'a', model='gemma2', lora_alpha=3,
                         dtype='bfloat16')
  got = tensors(tmp_path / 'a' / peft.ADAPTER_FILE)
  for k, v in exports['hf_gemma2_lora']['adapter'].items():
    assert got[k].dtype == ml_dtypes.bfloat16, k
    np.testing.assert_array_equal(got[k], v.astype(ml_dtypes.bfloat16), err_msg=k)


def test_gemma4_k_eq_v_layer_says_what_vllm_does():
  plan = export_lib.plan_peft_export(DATA / 'hf_gemma4_moe_lora', '/nonexistent/out',
                                     model='gemma4', lora_alpha=3)
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
def cli(*argv: str, cwd: pathlib.Path = ROOT) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, '-m', 'orbax_tunix.cli', 'export', *map(str, argv)],
                        capture_output=True, text=True, cwd=cwd, env=subprocess_env(),
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


def _flax_adapted(root: pathlib.Path) -> pathlib.Path:
  """hf_qwen3 with flax's adapters (no alpha): an `nnx.LoRALinear` on layer 0's gate_proj
  (`<m>/lora/lora_a`) and an `nnx.LoRA(base_module=...)` on layer 1's down_proj (its kernel
  under `base_module`)."""
  rng = np.random.default_rng(3)
  weights = raw_weights('hf_qwen3')
  weights['layers/1/mlp/down_proj/base_module/kernel'] = weights.pop(
      'layers/1/mlp/down_proj/kernel')
  _save_model_params(root / '1', {
      **weights,
      'layers/0/mlp/gate_proj/lora/lora_a': rng.normal(size=(40, 2)).astype(np.float32),
      'layers/0/mlp/gate_proj/lora/lora_b': rng.normal(size=(2, 56)).astype(np.float32),
      'layers/1/mlp/down_proj/lora_a': rng.normal(size=(56, 2)).astype(np.float32),
      'layers/1/mlp/down_proj/lora_b': rng.normal(size=(2, 40)).astype(np.float32)})
  return root


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
    # flax's LoRA has no alpha: refused as the merge refuses it (served, PEFT would scale it).
    'flax_alpha': (_flax_adapted, 'qwen3', ('--peft', '--lora-alpha', '16'),
                   [("flax's",), ('no alpha',), ('--lora-alpha',)]),
    'flax_scale': (_flax_adapted, 'qwen3', ('--peft', '--lora-scale', '2'),
                   [("flax's",), ('no alpha',), ('--lora-scale',)]),
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


def test_flax_adapters_are_an_adapter_of_scale_one(tmp_path):
  """flax adds a·b unscaled: the adapter's lora_alpha is r, and on the base it is the merged
  export (nnx.LoRALinear and nnx.LoRA(base_module=...) alike)."""
  run = _flax_adapted(tmp_path / 'run')
  ot.export_to_hf(run, tmp_path / 'base', model='qwen3', base_only=True)
  ot.export_to_hf(run, tmp_path / 'merged', model='qwen3', merge_lora=True)
  ot.export_peft_adapter(run, tmp_path / 'a', model='qwen3')
  config = json.loads((tmp_path / 'a' / peft.CONFIG_FILE).read_text())
  assert config['lora_alpha'] == config['r'] == 2, config
  base, merged = (tensors(tmp_path / k / 'model.safetensors') for k in ('base', 'merged'))
  adapter = tensors(tmp_path / 'a' / peft.ADAPTER_FILE)
  changed = {k[:-len('.weight')] for k, w in merged.items() if not np.array_equal(w, base[k])}
  assert changed == {'model.layers.0.mlp.gate_proj', 'model.layers.1.mlp.down_proj'}, changed
  for m in changed:
    a, b = adapter[f'{PREFIX}{m}.lora_A.weight'], adapter[f'{PREFIX}{m}.lora_B.weight']
    got = base[f'{m}.weight'] + b.astype(np.float64) @ a
    np.testing.assert_allclose(got, merged[f'{m}.weight'], rtol=0, atol=1e-5, err_msg=m)


def test_refusal_names_every_module_at_once(tmp_path):
  root = _experts_adapted(tmp_path / 'run')
  rng = np.random.default_rng(1)
  _save_model_params(root / '2', {
      **raw_weights('hf_qwen3_moe_lora'),
      **{f'layers/{i}/mlp/{p}_proj_lora_{x}': rng.normal(size=s).astype(np.float32)
         for i in (0, 1) for p in ('up', 'down')
         for x, s in (('a', (3, 40 if p == 'up' else 20, 2)), ('b', (2, 20 if p == 'up' else 40)))}})
  with pytest.raises(ot.LoraError) as e:
    export_lib.plan_peft_export(root, tmp_path / 'out', model='qwen3_moe', lora_alpha=3)
  assert str(e.value).count('MoE experts') == 4 * 3  # 4 weights, 3 experts each.
  assert '`merge_lora=True`' in str(e.value)


# --------------------------------------------------------------------------- #
# The factorization itself
# --------------------------------------------------------------------------- #
def test_factors_refuse_a_module_feature_mixing_rows_of_a():
  # a holds (D, N): an output feature (n, h) of HF's (N·H, D) would take a row of `a` per n.
  contraction = lora.contraction((40, 4, 12), (40, 4, 2), (2, 12))
  assert contraction is not None
  found = peft.Factors.of(contraction, hf_naming.IN_PROJ, (40, 4, 2), (2, 12))
  assert isinstance(found, str) and 'not B·A' in found


def test_factors_of_a_fused_kv_einsum_share_a_and_split_b():
  rng = np.random.default_rng(0)
  a, b = rng.normal(size=(40, 2)), rng.normal(size=(2, 2, 3, 12))  # (D, r), (r, C, K, H)
  w = np.einsum('dr,rckh->ckdh', a, b)  # Tunix's kv_einsum (C, K, D, H), as qwix adds it
  contraction = lora.contraction(w.shape, a.shape, b.shape)
  for c, name in enumerate('kv'):
    transform = chain(take(0, c), hf_naming.HEADS_FIRST)
    f = peft.Factors.of(contraction, transform, a.shape, b.shape)
    big_a = peft.lora_a(f, 2).apply([a])
    big_b = peft.lora_b(f, 2).apply([b])
    np.testing.assert_allclose(big_b @ big_a, np.transpose(w[c], (1, 0, 2)).reshape(40, 36).T,
                               err_msg=name, atol=1e-12)
    np.testing.assert_array_equal(big_a, a.T)


# --------------------------------------------------------------------------- #
# --base-model: the config checked, a multimodal class's names
# --------------------------------------------------------------------------- #
QWEN3_CONFIG = {'architectures': ['Qwen3ForCausalLM'], 'model_type': 'qwen3', 'vocab_size': 96,
                'hidden_size': 40, 'intermediate_size': 56, 'num_hidden_layers': 2,
                'num_attention_heads': 4, 'num_key_value_heads': 2, 'head_dim': 12,
                'tie_word_embeddings': False}


def _folder(root: pathlib.Path, config: dict) -> pathlib.Path:
  root.mkdir(parents=True)
  (root / 'config.json').write_text(json.dumps(config))
  return root


@pytest.mark.parametrize('name', ['hf_qwen3_lora', 'hf_qwen3_lora_only'])
def test_base_model_folder_config_is_checked(exports, tmp_path, name):
  good = _folder(tmp_path / 'good', QWEN3_CONFIG)
  ot.export_peft_adapter(DATA / name, tmp_path / 'a', model='qwen3', lora_alpha=3, base_model=good)
  config = json.loads((tmp_path / 'a' / peft.CONFIG_FILE).read_text())
  assert config['base_model_name_or_path'] == str(good)
  assert (tmp_path / 'a' / peft.ADAPTER_FILE).read_bytes() == (
      exports[name]['dir'] / 'adapter' / peft.ADAPTER_FILE).read_bytes()
  for field, value in (('num_attention_heads', 8), ('intermediate_size', 64),
                       ('model_type', 'llama'), ('num_hidden_layers', 1)):
    bad = _folder(tmp_path / f'bad_{field}', {**QWEN3_CONFIG, field: value})
    p = cli(DATA / name, tmp_path / 'out', '--model', 'qwen3', *PEFT, '--base-model', bad)
    assert p.returncode == 2, p.stderr
    assert field in p.stderr and str(value) in p.stderr and '--base-model' in p.stderr, p.stderr
    assert not (tmp_path / 'out').exists()


def _refused(run: pathlib.Path, out: pathlib.Path, error=ot.TunixCheckpointError, *,
             model: str = 'qwen3', **kwargs) -> str:
  """The planning error of an adapter export of `run`, as the command prints it (its
  parameters named as flags)."""
  from orbax_tunix.cli.commands import as_flags
  with pytest.raises(error) as e:
    export_lib.plan_peft_export(run, out, model=model, lora_alpha=3, **kwargs)
  return as_flags(str(e.value))


def test_base_model_given_as_its_config_json_is_that_folder(exports, tmp_path, monkeypatch):
  """`--base-model DIR/config.json` is DIR: its config is read and checked, and DIR (absolute)
  is what adapter_config.json names; a relative folder is named absolute too."""
  good = _folder(tmp_path / 'good', QWEN3_CONFIG)
  bad = _folder(tmp_path / 'bad', {**QWEN3_CONFIG, 'num_attention_heads': 8})
  monkeypatch.chdir(tmp_path)
  for given in (good / 'config.json', 'good/config.json', 'good', './good/'):
    plan = export_lib.plan_peft_export(DATA / 'hf_qwen3_lora', tmp_path / 'a', model='qwen3',
                                       lora_alpha=3, base_model=given)
    config = json.loads(dict(plan.other_files)[peft.CONFIG_FILE])
    assert config['base_model_name_or_path'] == str(good), (given, config)
  p = cli(DATA / 'hf_qwen3_lora', tmp_path / 'a', '--model', 'qwen3', *PEFT, '--base-model',
          'good/config.json', cwd=tmp_path)
  assert p.returncode == 0, p.stderr
  assert json.loads((tmp_path / 'a' / peft.CONFIG_FILE).read_text())[
      'base_model_name_or_path'] == str(good)
  assert (tmp_path / 'a' / peft.ADAPTER_FILE).read_bytes() == (
      exports['hf_qwen3_lora']['dir'] / 'adapter' / peft.ADAPTER_FILE).read_bytes()
  said = _refused(DATA / 'hf_qwen3_lora', tmp_path / 'out', base_model=bad / 'config.json')
  assert 'num_attention_heads' in said and str(bad / 'config.json') in said, said


def test_base_model_path_to_anything_else_is_refused(tmp_path, monkeypatch):
  """A path (one no Hub name looks like) to nothing, or to a file other than config.json, is
  refused naming what is there; a Hub name is written as it is, unchecked (a note says so)."""
  good = _folder(tmp_path / 'good', QWEN3_CONFIG)
  (good / 'generation_config.json').write_text('{}')
  monkeypatch.chdir(tmp_path)
  for given in ('./nowhere', 'nowhere/at/all', '/nowhere', 'nowhere/config.json',
                'good/generation_config.json'):
    said = _refused(DATA / 'hf_qwen3_lora', tmp_path / 'out', ot.InvalidOptionError,
                    base_model=given)
    assert said.startswith(f'--base-model {given}:') and 'found ' in said, said
    assert 'Hub name' in said, said
  plan = export_lib.plan_peft_export(DATA / 'hf_qwen3_lora', tmp_path / 'out', model='qwen3',
                                     lora_alpha=3, base_model='org/no-such-folder')
  assert any('is no folder here' in n for n in plan.notes), plan.notes
  config = json.loads(dict(plan.other_files)[peft.CONFIG_FILE])
  assert config['base_model_name_or_path'] == 'org/no-such-folder'


def _config_cases(root: pathlib.Path) -> dict[str, pathlib.Path]:
  """A base model folder per way its config.json can be wrong."""
  cases = {}
  for name, text in (('not_json', '{"hidden_size": 40,'), ('a_list', '[1, 2]'),
                     ('text_config', json.dumps({**QWEN3_CONFIG, 'text_config': [1],
                                                 'architectures': ['X']})),
                     ('field', json.dumps({**QWEN3_CONFIG, 'num_attention_heads': 8})),
                     ('model_type', json.dumps({**QWEN3_CONFIG, 'model_type': 'llama'}))):
    (root / name).mkdir(parents=True)
    (root / name / 'config.json').write_text(text)
    cases[name] = root / name
  (root / 'no_config').mkdir()
  cases['no_config'] = root / 'no_config'
  return cases


def test_every_base_model_config_error_names_base_model(tmp_path):
  """--peft refuses --hf-config: its config errors say --base-model, the flag that gave it."""
  for case, folder in _config_cases(tmp_path / 'bases').items():
    said = _refused(DATA / 'hf_qwen3_lora', tmp_path / 'out', base_model=folder)
    assert '--base-model' in said and '--hf-config' not in said, (case, said)
    assert str(folder) in said, (case, said)
  p = cli(DATA / 'hf_qwen3_lora_only', tmp_path / 'out', '--model', 'qwen3', *PEFT,
          '--base-model', tmp_path / 'bases' / 'field')
  assert p.returncode == 2 and '--base-model' in p.stderr, p.stderr
  assert '--hf-config' not in p.stderr, p.stderr
  assert not (tmp_path / 'out').exists()


def _hub_config(name: str) -> dict:
  """The config.json of a LoRA fixture's base, as the family's Hub repos write it."""
  base = manifest(name)['lora']['base']
  return json.loads(json.dumps(HF_CONFIG_FULL.get(base) or {**HF_CONFIG_DIMS[base],
                                                            **HF_CONFIG_EXTRA.get(base, {})}))


def _alone(name: str, root: pathlib.Path) -> pathlib.Path:
  """A LoRA fixture's adapters saved alone (as the run's adapters-only save holds them)."""
  if name.endswith('_only'):
    return DATA / name
  _save_model_params(root / '3', {p: v for p, v in raw_weights(name).items()
                                   if lora.is_adapter(p.split('/'))})
  return root


_ATTENTION = ('hidden_size', 'num_attention_heads', 'num_key_value_heads', 'head_dim')
# The config fields each LoRA fixture's adapted weights have an axis of (MANIFEST's targets:
# attention and MLP; qwen3_moe's experts are not adapted; gemma4's global layers read
# global_head_dim, its MoE model's global keys num_global_key_value_heads) and, as (field,
# value, the field the message names), use_double_wide_mlp off: gemma4's kv-shared layers'
# MLP is then intermediate_size wide, not twice that.
IMPLIED = {
    'hf_qwen3_lora': (*_ATTENTION, 'intermediate_size'),
    'hf_qwen3_lora_only': (*_ATTENTION, 'intermediate_size'),
    'hf_qwen2_lora': (*_ATTENTION, 'intermediate_size'),
    'hf_qwen3_moe_lora': _ATTENTION,
    'hf_gemma2_lora': (*_ATTENTION, 'intermediate_size'),
    'hf_gemma_lora': (*_ATTENTION, 'intermediate_size'),
    'hf_gemma4_lora': (*_ATTENTION, 'intermediate_size', 'global_head_dim',
                       ('use_double_wide_mlp', False, 'intermediate_size')),
    'hf_gemma4_moe_lora': (*_ATTENTION, 'intermediate_size', 'global_head_dim',
                           'num_global_key_value_heads'),
}


@pytest.mark.parametrize('name', LORA_FIXTURES)
def test_adapters_alone_are_checked_against_every_size_of_the_base_config(exports, tmp_path,
                                                                          name):
  """A save of adapters alone with --base-model FOLDER: the Hub's config gives the full save's
  adapter; a config that differs in any size the adapters imply (each field, one at a time)
  or holds fewer layers is refused, naming the field and both values."""
  src = _alone(name, tmp_path / 'run')
  config = _hub_config(name)
  folder = _folder(tmp_path / 'hub', config)
  ot.export_peft_adapter(src, tmp_path / 'a', model=family_of(name), lora_alpha=3,
                         base_model=folder)
  got = tensors(tmp_path / 'a' / peft.ADAPTER_FILE)
  assert sorted(got) == sorted(exports[name]['adapter'])
  text = config.get('text_config', config)
  changes = [(f, {f: text[f] + 1}, f, text[f] + 1) for f in IMPLIED[name]
             if isinstance(f, str)]
  changes += [(c[0], {c[0]: c[1]}, c[2], text[c[2]]) for c in IMPLIED[name]
              if not isinstance(c, str)]
  layers = text['num_hidden_layers'] - 1  # (and one entry per layer: a consistent config)
  changes.append(('num_hidden_layers', {'num_hidden_layers': layers, **(
      {'layer_types': text['layer_types'][:layers]} if 'layer_types' in text else {})},
      'num_hidden_layers', layers))
  for i, (field, change, said, shown) in enumerate(changes):
    changed = {**text, **change}
    bad = _folder(tmp_path / f'bad{i}', {**config, 'text_config': changed}
                  if 'text_config' in config else changed)
    message = _refused(src, tmp_path / 'out', model=family_of(name), base_model=bad)
    assert any(f'{said}: config.json {verb} {shown},' in message for verb in ('has', 'gives')), (
        field, message)
    assert str(bad / 'config.json') in message and '--base-model' in message, message


def _lm_head_adapted(root: pathlib.Path, alone: bool) -> pathlib.Path:
  """hf_qwen3_lora (its own lm_head, untied) with adapters on lm_head too, saved in full or
  its adapters alone."""
  rng = np.random.default_rng(4)
  weights = {**raw_weights('hf_qwen3_lora'),
             'lm_head/w_lora_a': rng.normal(size=(40, 2)).astype(np.float32),
             'lm_head/w_lora_b': rng.normal(size=(2, 96)).astype(np.float32)}
  _save_model_params(root / '3', {p: v for p, v in weights.items()
                                   if not alone or lora.is_adapter(p.split('/'))})
  return root


@pytest.mark.parametrize('alone', [False, True])
def test_adapters_on_lm_head_refuse_a_tied_base_saved_in_full_or_alone(tmp_path, alone):
  """An adapted lm_head is the model's own: a base config that ties it to the embedding is
  refused, whether the run saved its base weights or its adapters alone (the same rule); its
  vocabulary is checked too."""
  src = _lm_head_adapted(tmp_path / 'run', alone)
  good = _folder(tmp_path / 'good', QWEN3_CONFIG)
  plan = export_lib.plan_peft_export(src, tmp_path / 'a', model='qwen3', lora_alpha=3,
                                     base_model=good)
  assert 'lm_head' in ' '.join(json.loads(dict(plan.other_files)[peft.CONFIG_FILE])[
      'target_modules'])
  tied = _folder(tmp_path / 'tied', {**QWEN3_CONFIG, 'tie_word_embeddings': True})
  said = _refused(src, tmp_path / 'out', base_model=tied)
  assert 'tie_word_embeddings: config.json has True, the weights have False' in said, said
  vocab = _folder(tmp_path / 'vocab', {**QWEN3_CONFIG, 'vocab_size': 100})
  said = _refused(src, tmp_path / 'out', base_model=vocab)
  assert 'vocab_size: config.json' in said and '100' in said and '96' in said, said


def _gemma3_with_adapters(root: pathlib.Path) -> pathlib.Path:
  """hf_gemma3 with qwix-shaped adapters on layer 0's q_einsum (N, D, H) and up_proj."""
  rng = np.random.default_rng(0)
  return _with('hf_gemma3', {
      'layers/0/attn/q_einsum/w_lora_a': rng.normal(size=(40, 2)).astype(np.float32),
      'layers/0/attn/q_einsum/w_lora_b': rng.normal(size=(2, 4, 12)).astype(np.float32),
      'layers/0/mlp/up_proj/kernel_lora_a': rng.normal(size=(40, 2)).astype(np.float32),
      'layers/0/mlp/up_proj/kernel_lora_b': rng.normal(size=(2, 56)).astype(np.float32)}, root)


def test_multimodal_base_names_the_text_models_modules_as_it_holds_them(tmp_path):
  """gemma-3-4b's class (Gemma3ForConditionalGeneration) holds the text model's modules under
  model.language_model (transformers 5); the weights' own class, under model."""
  run = _gemma3_with_adapters(tmp_path / 'run')
  text = {'hidden_size': 40, 'intermediate_size': 56, 'model_type': 'gemma3_text',
          'num_hidden_layers': manifest('hf_gemma3')['model_config']['num_layers'],
          'num_attention_heads': 4, 'num_key_value_heads': 2, 'head_dim': 12}
  multimodal = _folder(tmp_path / 'gemma-3-4b', {
      'architectures': ['Gemma3ForConditionalGeneration'], 'model_type': 'gemma3',
      'text_config': text, 'vision_config': {'model_type': 'siglip_vision_model'}})
  causal = _folder(tmp_path / 'gemma-3-1b', {'architectures': ['Gemma3ForCausalLM'], **text,
                                            'vocab_size': 96})
  got = {}
  for base in (multimodal, causal):
    ot.export_peft_adapter(run, tmp_path / base.name / 'a', model='gemma3', lora_scale=1.0,
                           base_model=base)
    got[base.name] = tensors(tmp_path / base.name / 'a' / peft.ADAPTER_FILE)
  modules = ['layers.0.mlp.up_proj', 'layers.0.self_attn.q_proj']
  assert sorted(got['gemma-3-1b']) == sorted(
      f'{PREFIX}model.{m}.lora_{x}.weight' for m in modules for x in 'AB')
  assert sorted(got['gemma-3-4b']) == sorted(
      f'{PREFIX}model.language_model.{m}.lora_{x}.weight' for m in modules for x in 'AB')
  for k, v in got['gemma-3-1b'].items():
    np.testing.assert_array_equal(
        got['gemma-3-4b'][k.replace(PREFIX + 'model.', PREFIX + 'model.language_model.')], v)


# --------------------------------------------------------------------------- #
# Tunix runs of MaxText models (qwix's dot_general adapters, flattened; scanned: stacked)
# --------------------------------------------------------------------------- #
MAXTEXT_CASES = [(m, f) for m in ('qwen3', 'llama3', 'gemma3', 'gemma4')
                 for f in ('unscanned', 'scanned')]


def _gemma4_blocks(flat: dict[str, np.ndarray], n: int) -> dict[str, np.ndarray]:
  """MaxText's scanned gemma4 (per block of six: five local layers on axes 1, 2 and a global
  one on axis 1; then a remainder of local layers on axis 1) of an unscanned tree, its
  adapters stacked as its kernels are."""
  blocks, out = n // 6, {}
  layer = {}
  for path, value in flat.items():
    if not path.startswith('decoder/layers_'):
      out[path] = value
      continue
    _, name, rest = path.split('/', 2)
    layer.setdefault(int(name.removeprefix('layers_')), {})[rest] = value
  for rest in layer[0]:
    out[f'decoder/scanned_blocks/local_layers/{rest}'] = np.stack(
        [np.stack([layer[6 * b + j][rest] for j in range(5)], axis=1) for b in range(blocks)],
        axis=1)
    out[f'decoder/layers_remainder/local_layers/{rest}'] = np.stack(
        [layer[i][rest] for i in range(6 * blocks, n)], axis=1)
  for rest in layer[5]:
    out[f'decoder/scanned_blocks/global_layer/{rest}'] = np.stack(
        [layer[6 * b + 5][rest] for b in range(blocks)], axis=1)
  return out


def _gemma3_blocks(flat: dict[str, np.ndarray], n: int) -> dict[str, np.ndarray]:
  """MaxText's scanned gemma3 (blocks of six `layers_{j}` stacked on axis 1, the rest as a
  remainder) of an unscanned tree, its adapters stacked as its kernels are."""
  blocks, out = n // 6, {}
  for path, value in flat.items():
    if not path.startswith('decoder/layers_'):
      out[path] = value
      continue
    _, layer, rest = path.split('/', 2)
    i = int(layer.removeprefix('layers_'))
    if i >= 6 * blocks:
      out[f'decoder/layers_remainder/layers_{i - 6 * blocks}/{rest}'] = value
    elif i < 6:
      out[f'decoder/layers/layers_{i}/{rest}'] = np.stack(
          [flat[f'decoder/layers_{6 * b + i}/{rest}'] for b in range(blocks)], axis=1)
  return out


@pytest.mark.parametrize(('model', 'form'), MAXTEXT_CASES)
def test_maxtext_model_run_adapter_on_its_base_is_the_merged_export(tmp_path, model, form):
  """tests/test_export_maxtext.py's LoRA runs of MaxText models (adapters as qwix writes them
  on MaxText's layers): the adapter on the --base-only export is the merged export. Llama's
  query is stored divided by sqrt(head_dim) with its rotary pairs interleaved: B carries both."""
  from tests import test_export_maxtext as mt
  flat = mt.maxtext_tree(model, 'unscanned')
  if form == 'unscanned':
    lora_flat, _ = mt.with_lora(flat)
  elif model in ('gemma3', 'gemma4'):
    blocks = _gemma3_blocks if model == 'gemma3' else _gemma4_blocks
    lora_flat = blocks(mt.with_lora(flat)[0], mt.MODELS[model][1])
  else:
    lora_flat, _ = mt.stacked_lora(flat, mt.MODELS[model][1])
  src = mt.save_tunix_run(tmp_path / 'run', lora_flat, per_layer_chunks=True)
  ot.export_to_hf(src, tmp_path / 'base', model=model, base_only=True)
  ot.export_to_hf(src, tmp_path / 'merged', model=model, merge_lora=True, lora_alpha=mt.ALPHA)
  result = ot.export_peft_adapter(src, tmp_path / 'a', model=model, lora_alpha=mt.ALPHA)
  base = tensors(tmp_path / 'base' / 'model.safetensors')
  merged = tensors(tmp_path / 'merged' / 'model.safetensors')
  adapter = tensors(tmp_path / 'a' / peft.ADAPTER_FILE)
  config = json.loads((tmp_path / 'a' / peft.CONFIG_FILE).read_text())
  assert config['r'] == mt.RANK and config['lora_alpha'] == mt.ALPHA
  changed = {k[:-len('.weight')] for k, w in merged.items() if not np.array_equal(w, base[k])}
  assert len(changed) == 3 * mt.MODELS[model][1]
  assert sorted(adapter) == sorted(f'{PREFIX}{m}.lora_{x}.weight' for m in changed for x in 'AB')
  for m in changed:
    a, b = adapter[f'{PREFIX}{m}.lora_A.weight'], adapter[f'{PREFIX}{m}.lora_B.weight']
    got = base[f'{m}.weight'] + mt.ALPHA / mt.RANK * (b.astype(np.float64) @ a)
    np.testing.assert_allclose(got, merged[f'{m}.weight'], rtol=0, atol=2e-5, err_msg=m)
  assert result.bytes_read == sum(v.nbytes for k, v in lora_flat.items() if '_lora_' in k)


def test_one_r_and_lora_alpha_serve_every_modules_own_scale():
  """vLLM reads r and lora_alpha alone: r is the largest rank, lora_alpha the alpha given
  (qwix's alpha / rank is then the largest-rank modules' scale), and B carries the ratio of
  each other module's scale to lora_alpha / r."""
  modules = {'model.layers.0.self_attn.q_proj': (4, 0.5),
             'model.layers.1.self_attn.q_proj': (4, 0.5),
             'model.layers.0.mlp.up_proj': (8, 0.25)}  # qwix: alpha 2 over ranks 4 and 8.
  one = peft.Scaling.of(modules, 2.0)
  assert (one.r, one.alpha) == (8, 2.0)
  for name, (_, scale) in modules.items():
    assert one.folds[name] * one.alpha / one.r == scale, name
  assert one.folds['model.layers.0.mlp.up_proj'] == 1.0
  scaled = {n: (rank, 0.5) for n, (rank, _) in modules.items()}  # --lora-scale 0.5
  one = peft.Scaling.of(scaled, None)
  assert (one.r, one.alpha, set(one.folds.values())) == (8, 4.0, {1.0})
  config = peft.config(modules, one, None)
  assert (config['r'], config['lora_alpha']) == (8, 4)
  assert config['rank_pattern'] == config['alpha_pattern'] == {}
  assert config['target_modules'] == sorted(modules)
  assert peft.Scaling.of({'m': (2, 0.0)}, 0.0) == peft.Scaling(2, 0.0, {'m': 1.0})


def _mixed_ranks(root: pathlib.Path) -> pathlib.Path:
  """hf_qwen3 (saved in full) with qwix's adapters of three ranks on some layers only: q_proj
  of layer 0 (rank 4), up_proj of both layers (rank 2), o_proj of layer 1 (rank 8)."""
  rng = np.random.default_rng(5)
  shapes = {'layers/0/attn/q_proj/w': ((40, 4), (4, 4, 12)),
            'layers/0/mlp/up_proj/kernel': ((40, 2), (2, 56)),
            'layers/1/mlp/up_proj/kernel': ((40, 2), (2, 56)),
            'layers/1/attn/o_proj/w': ((4, 12, 8), (8, 40))}
  extra = {}
  for weight, (a, b) in shapes.items():
    extra[weight + '_lora_a'] = (rng.normal(size=a) / 4).astype(np.float32)
    extra[weight + '_lora_b'] = (rng.normal(size=b) / 4).astype(np.float32)
  return _with('hf_qwen3', extra, root)


MIXED_RANKS = {'model.layers.0.self_attn.q_proj': 4, 'model.layers.0.mlp.up_proj': 2,
               'model.layers.1.mlp.up_proj': 2, 'model.layers.1.self_attn.o_proj': 8}


@pytest.mark.parametrize('scaling', [{'alpha': 6}, {'scale': 0.5}])
def test_mixed_ranks_are_served_at_their_own_scale_under_one_r(tmp_path, scaling):
  """Ranks 2, 4 and 8 under one alpha (scales 3, 1.5, 0.75): one r (8: lower ranks padded with
  zeros), one lora_alpha, no rank_pattern or alpha_pattern (vLLM reads neither), and
  W + (lora_alpha / r)·B·A, as vLLM computes it, is the merged export for every module; the
  adapter targets exactly the adapted modules (layer 1's q_proj is not one)."""
  run = _mixed_ranks(tmp_path / 'run')
  ot.export_to_hf(run, tmp_path / 'base', model='qwen3', base_only=True)
  merge = {'lora_alpha': scaling['alpha']} if 'alpha' in scaling else {
      'lora_scale': scaling['scale']}
  ot.export_to_hf(run, tmp_path / 'merged', model='qwen3', merge_lora=True, **merge)
  plan = export_lib.plan_peft_export(run, tmp_path / 'a', model='qwen3', **scaling)
  export_lib.run_export(plan)
  config = json.loads((tmp_path / 'a' / peft.CONFIG_FILE).read_text())
  assert config['r'] == 8 and config['rank_pattern'] == config['alpha_pattern'] == {}, config
  assert config['lora_alpha'] == (6 if 'alpha' in scaling else 4), config
  assert config['target_modules'] == sorted(MIXED_RANKS), config
  base, merged = (tensors(tmp_path / k / 'model.safetensors') for k in ('base', 'merged'))
  adapter = tensors(tmp_path / 'a' / peft.ADAPTER_FILE)
  changed = {k[:-len('.weight')] for k, w in merged.items() if not np.array_equal(w, base[k])}
  assert changed == set(MIXED_RANKS), changed
  scale = config['lora_alpha'] / config['r']
  for m, rank in MIXED_RANKS.items():
    a, b = adapter[f'{PREFIX}{m}.lora_A.weight'], adapter[f'{PREFIX}{m}.lora_B.weight']
    assert a.shape[0] == b.shape[1] == 8, (m, a.shape, b.shape)
    assert not a[rank:].any() and not b[:, rank:].any(), m  # padding: zeros
    got = base[f'{m}.weight'] + scale * (b.astype(np.float64) @ a)
    np.testing.assert_allclose(got, merged[f'{m}.weight'], rtol=0, atol=2e-6, err_msg=m)
  said = '\n'.join(plan.notes)
  assert 'ranks differ (2, 4 and 8)' in said and '--max-lora-rank' in said, said
  assert ('lora_B carries' in said) == ('alpha' in scaling), said


# qwix's adapters of Tunix Gemma's einsums, as `_parse_einsum_str_for_lora` shapes them: `a` the
# weight's dims the input shares (D) then r, `b` r then the others in the weight's order.
GEMMA3_SYNTHETIC = {
    'hf_gemma3': {'layers/0/attn/q_einsum/w': ((40, 2), (2, 4, 12)),
                  'layers/1/attn/kv_einsum/w': ((40, 2), (2, 2, 2, 12)),
                  'layers/2/attn/attn_vec_einsum/w': ((4, 12, 2), (2, 40))},
    'hf_gemma3_fused': {'layers/1/attn/qkv_einsum/w': ((40, 2), (2, 3, 4, 12))},
}


@pytest.mark.parametrize('name', GEMMA3_SYNTHETIC)
def test_gemma3_einsum_adapters_with_and_without_their_base(tmp_path, name):
  """Gemma 3 (no LoRA fixture): random qwix-shaped adapters on its einsums, fused qkv too. The
  adapter on the --base-only export is the merged export, and saved alone (no base weight to
  tell the arrangement: the family's lora data does) it is the same adapter."""
  rng = np.random.default_rng(0)
  extra = {}
  for weight, (a, b) in GEMMA3_SYNTHETIC[name].items():
    extra[weight + '_lora_a'] = rng.normal(size=a).astype(np.float32)
    extra[weight + '_lora_b'] = rng.normal(size=b).astype(np.float32)
  _save_model_params(tmp_path / 'full' / '1', {**raw_weights(name), **extra})
  _save_model_params(tmp_path / 'alone' / '1', extra)
  ot.export_to_hf(tmp_path / 'full', tmp_path / 'base', model='gemma3', base_only=True)
  ot.export_to_hf(tmp_path / 'full', tmp_path / 'merged', model='gemma3', merge_lora=True,
                  lora_scale=0.5)
  for kind in ('full', 'alone'):
    ot.export_peft_adapter(tmp_path / kind, tmp_path / f'a_{kind}', model='gemma3', lora_scale=0.5)
  base, merged = (tensors(tmp_path / k / 'model.safetensors') for k in ('base', 'merged'))
  adapter = tensors(tmp_path / 'a_full' / peft.ADAPTER_FILE)
  alone = tensors(tmp_path / 'a_alone' / peft.ADAPTER_FILE)
  changed = {k[:-len('.weight')] for k, w in merged.items() if not np.array_equal(w, base[k])}
  assert len(changed) == {'hf_gemma3': 4, 'hf_gemma3_fused': 3}[name], changed
  assert sorted(adapter) == sorted(alone) == sorted(
      f'{PREFIX}{m}.lora_{x}.weight' for m in changed for x in 'AB')
  for m in changed:
    a, b = adapter[f'{PREFIX}{m}.lora_A.weight'], adapter[f'{PREFIX}{m}.lora_B.weight']
    got = base[f'{m}.weight'] + 0.5 * (b.astype(np.float64) @ a)
    np.testing.assert_allclose(got, merged[f'{m}.weight'], rtol=0, atol=1e-5, err_msg=m)
  for k, v in adapter.items():
    np.testing.assert_array_equal(alone[k], v, err_msg=k)


def test_an_existing_adapter_is_replaced_only_with_force(exports, tmp_path):
  """An adapter this package exported (its record) is replaced with `force` only; files of
  an adapter's names it did not write are never replaced."""
  stale = tmp_path / 'stale'
  stale.mkdir()
  (stale / peft.ADAPTER_FILE).write_bytes(b'stale')
  (stale / peft.CONFIG_FILE).write_text('{}')
  with pytest.raises(ot.TunixCheckpointError):
    ot.export_peft_adapter(DATA / 'hf_qwen3_lora', stale, model='qwen3', lora_alpha=3, force=True)
  assert (stale / peft.ADAPTER_FILE).read_bytes() == b'stale'
  out = tmp_path / 'a'
  ot.export_peft_adapter(DATA / 'hf_qwen3_lora', out, model='qwen3', lora_alpha=6)
  with pytest.raises(ot.DestinationExistsError):
    ot.export_peft_adapter(DATA / 'hf_qwen3_lora', out, model='qwen3', lora_alpha=3)
  assert json.loads((out / peft.CONFIG_FILE).read_text())['lora_alpha'] == 6
  ot.export_peft_adapter(DATA / 'hf_qwen3_lora', out, model='qwen3', lora_alpha=3, force=True)
  assert json.loads((out / peft.CONFIG_FILE).read_text())['lora_alpha'] == 3
  assert (out / peft.ADAPTER_FILE).read_bytes() == (
      exports['hf_qwen3_lora']['dir'] / 'adapter' / peft.ADAPTER_FILE).read_bytes()
  (out / 'notes.txt').write_text('mine')  # Not an adapter export's: never replaced.
  with pytest.raises(ot.TunixCheckpointError, match='notes.txt'):
    ot.export_peft_adapter(DATA / 'hf_qwen3_lora', out, model='qwen3', lora_alpha=3, force=True)
  model = tmp_path / 'model'
  ot.export_to_hf(DATA / 'hf_qwen3', model, model='qwen3')  # A model folder is no adapter's.
  with pytest.raises(ot.TunixCheckpointError):
    ot.export_peft_adapter(DATA / 'hf_qwen3_lora', model, model='qwen3', lora_alpha=3, force=True)
  assert (model / 'model.safetensors').exists()


@pytest.mark.parametrize('base_model', [None, 'Qwen/Qwen3-0.6B'])
def test_maxtext_adapters_saved_alone_say_why_they_cannot_be_arranged(tmp_path, base_model):
  """qwix flattens a MaxText kernel's (heads, head_dim) into its adapters: without the kernel
  or a base model folder whose config gives its shape, the adapter is refused (not guessed),
  saying what to do instead (a Hub name is no folder: its config is not at hand)."""
  from tests import test_export_maxtext as mt
  lora_flat, _ = mt.with_lora(mt.maxtext_tree('qwen3', 'unscanned'))
  src = mt.save_tunix_run(tmp_path / 'run', {k: v for k, v in lora_flat.items() if '_lora_' in k})
  given = () if base_model is None else ('--base-model', base_model)
  p = cli(src, tmp_path / 'out', '--model', 'qwen3', *PEFT, *given)
  assert p.returncode == 2, p.stderr
  assert 'adapters alone' in p.stderr and '--merge-lora' in p.stderr and '--base' in p.stderr
  assert '--base-model' in p.stderr and 'folder' in p.stderr, p.stderr
  assert 'query/kernel' in p.stderr, p.stderr
  assert base_model is None or base_model in p.stderr
  assert not (tmp_path / 'out').exists()


def _maxtext_lora_run(model: str, form: str) -> tuple[dict, dict]:
  """(a Tunix LoRA run of a MaxText model in `form`, flat; its per-layer adapters unscanned)."""
  from tests import test_export_maxtext as mt
  flat = mt.maxtext_tree(model, 'unscanned')
  unscanned, _ = mt.with_lora(flat)
  if form == 'unscanned':
    return unscanned, unscanned
  if model in ('gemma3', 'gemma4'):
    blocks = _gemma3_blocks if model == 'gemma3' else _gemma4_blocks
    return blocks(unscanned, mt.MODELS[model][1]), unscanned
  return mt.stacked_lora(flat, mt.MODELS[model][1])[0], unscanned


def _maxtext_base_folder(root: pathlib.Path, model: str) -> pathlib.Path:
  """The base model's folder: config.json as Hugging Face writes it for the family (gemma3's
  multimodal class: the text model's fields in text_config)."""
  from tests import test_export_maxtext as mt
  folder = mt.hf_config(root, model, **mt.FAMILY_CONFIG.get(model, {}))
  if model == 'gemma3':
    text = json.loads((folder / 'config.json').read_text())
    (folder / 'config.json').write_text(json.dumps({
        'architectures': ['Gemma3ForConditionalGeneration'], 'model_type': 'gemma3',
        'text_config': {**text, 'model_type': 'gemma3_text'},
        'vision_config': {'model_type': 'siglip_vision_model'}}))
  return folder


def _halves(x: np.ndarray, head_dim: int) -> np.ndarray:
  """Rows (heads·head_dim) with each head's interleaved rotary pairs as evens then odds."""
  x = x.reshape(-1, head_dim, *x.shape[1:])
  return np.concatenate([x[:, 0::2], x[:, 1::2]], axis=1).reshape(-1, *x.shape[2:])


@pytest.mark.parametrize('form', ['unscanned', 'scanned'])
@pytest.mark.parametrize('model', ['qwen3', 'llama3', 'gemma3', 'gemma4'])
def test_maxtext_adapters_saved_alone_take_their_shapes_from_the_base_config(
    tmp_path, model, form):
  """A save of adapters alone with --base-model FOLDER: each kernel's shape comes from its
  config.json; the adapter is the full save's, byte for byte, and each module's lora_A / lora_B
  is the raw a / b transposed (llama's q: its head_dim's rotary halves put back, times
  sqrt(head_dim); gemma4's global layers: their own head_dim)."""
  from tests import test_export_maxtext as mt
  run, per_layer = _maxtext_lora_run(model, form)
  full = mt.save_tunix_run(tmp_path / 'full', run)
  alone = mt.save_tunix_run(tmp_path / 'alone', {k: v for k, v in run.items() if '_lora_' in k})
  folder = _maxtext_base_folder(tmp_path / 'base', model)
  for src, out in ((full, 'a_full'), (alone, 'a_alone')):
    ot.export_peft_adapter(src, tmp_path / out, model=model, lora_alpha=mt.ALPHA, base_model=folder)
  for name in (peft.ADAPTER_FILE, peft.CONFIG_FILE):
    assert (tmp_path / 'a_alone' / name).read_bytes() == (
        tmp_path / 'a_full' / name).read_bytes(), name
  got = tensors(tmp_path / 'a_alone' / peft.ADAPTER_FILE)
  prefix = PREFIX + ('model.language_model.' if model == 'gemma3' else 'model.')
  modules = {'self_attention/query/kernel': 'self_attn.q_proj',
             'self_attention/out/kernel': 'self_attn.o_proj', 'mlp/wo/kernel': 'mlp.down_proj'}
  assert len(got) == 2 * len(modules) * mt.MODELS[model][1]
  for i in range(mt.MODELS[model][1]):
    for weight, module in modules.items():
      a = per_layer[f'decoder/layers_{i}/{weight}_lora_a']
      b = per_layer[f'decoder/layers_{i}/{weight}_lora_b']
      want_b = b.T
      if model == 'llama3' and module == 'self_attn.q_proj':
        want_b = (_halves(b.T, mt.H) * np.float32(np.sqrt(mt.H))).astype(np.float32)
      name = f'{prefix}layers.{i}.{module}'
      np.testing.assert_array_equal(got[f'{name}.lora_A.weight'], a.T, err_msg=name)
      np.testing.assert_array_equal(got[f'{name}.lora_B.weight'], want_b, err_msg=name)


@pytest.mark.parametrize(('field', 'value', 'said'), [
    ('num_attention_heads', 8, 'num_attention_heads 4 (found 8)'),
    ('intermediate_size', 64, 'intermediate_size 48 (found 64)'),
    ('head_dim', None, 'expected head_dim (a positive integer'),
])
def test_maxtext_adapters_saved_alone_refuse_a_config_that_does_not_fit(tmp_path, field, value,
                                                                        said):
  from tests import test_export_maxtext as mt
  run, _ = _maxtext_lora_run('qwen3', 'scanned')
  alone = mt.save_tunix_run(tmp_path / 'alone', {k: v for k, v in run.items() if '_lora_' in k})
  folder = mt.hf_config(tmp_path / 'base', 'qwen3')
  config = json.loads((folder / 'config.json').read_text())
  config[field] = value
  (folder / 'config.json').write_text(json.dumps(config))
  p = cli(alone, tmp_path / 'out', '--model', 'qwen3', *PEFT, '--base-model', folder)
  assert p.returncode == 2, p.stderr
  assert str(folder / 'config.json') in p.stderr and said in p.stderr, p.stderr
  assert '--base-model' in p.stderr, p.stderr
  assert not (tmp_path / 'out').exists()


def test_a_llama_config_without_head_dim_reads_it_as_transformers_does(tmp_path):
  """The Hub's Llama 3 configs have no head_dim: LlamaConfig takes hidden_size //
  num_attention_heads, and so do the kernels' shapes of a save of adapters alone (here 16 // 4
  = 4, where the run's head_dim is 8: refused, naming the value it read)."""
  from tests import test_export_maxtext as mt
  llama = hf.get('llama3').naming_of(trainers.MAXTEXT)
  assert llama.config_value({'hidden_size': 4096, 'num_attention_heads': 32}, 'head_dim') == 128
  assert llama.config_value({'hidden_size': 4096, 'num_attention_heads': 32,
                             'head_dim': 64}, 'head_dim') == 64
  assert hf.get('qwen3').naming_of(trainers.MAXTEXT).config_value({'hidden_size': 4096}, 'head_dim') is None
  run, _ = _maxtext_lora_run('llama3', 'unscanned')
  alone = mt.save_tunix_run(tmp_path / 'alone', {k: v for k, v in run.items() if '_lora_' in k})
  folder = mt.hf_config(tmp_path / 'base', 'llama3')
  config = json.loads((folder / 'config.json').read_text())
  del config['head_dim']
  (folder / 'config.json').write_text(json.dumps(config))
  p = cli(alone, tmp_path / 'out', '--model', 'llama3', *PEFT, '--base-model', folder)
  assert p.returncode == 2, p.stderr
  assert 'head_dim 8 (found 4)' in p.stderr, p.stderr
  assert not (tmp_path / 'out').exists()


def _gemma4_keys_adapted(form: str) -> dict[str, np.ndarray]:
  """A MaxText gemma4 LoRA run with adapters on the key kernels too: layer 5 is global (no
  value kernel: its keys are its values), the others local."""
  from tests import test_export_maxtext as mt
  flat = mt.maxtext_tree('gemma4', 'unscanned')
  rng = np.random.default_rng(2)
  extra = {}
  for i in range(mt.MODELS['gemma4'][1]):
    w = flat[f'decoder/layers_{i}/self_attention/key/kernel']
    extra[f'decoder/layers_{i}/self_attention/key/kernel_lora_a'] = rng.normal(
        size=(w.shape[0], mt.RANK)).astype(np.float32)
    extra[f'decoder/layers_{i}/self_attention/key/kernel_lora_b'] = rng.normal(
        size=(mt.RANK, w.shape[1] * w.shape[2])).astype(np.float32)
  run = {**mt.with_lora(flat)[0], **extra}
  return run if form == 'unscanned' else _gemma4_blocks(run, mt.MODELS['gemma4'][1])


@pytest.mark.parametrize('form', ['unscanned', 'scanned'])
def test_maxtext_gemma4_global_key_adapter_says_what_vllm_does(tmp_path, form):
  """MaxText gemma4's global layers have no value kernel (the keys are the values): the
  k_eq_v note names their k_proj, and no local layer's; for adapters saved alone, the base
  model's config says which layers are global."""
  from tests import test_export_maxtext as mt
  run = _gemma4_keys_adapted(form)
  full = mt.save_tunix_run(tmp_path / 'full', run)
  alone = mt.save_tunix_run(tmp_path / 'alone', {k: v for k, v in run.items() if '_lora_' in k})
  folder = _maxtext_base_folder(tmp_path / 'base', 'gemma4')
  for src in (full, alone):
    plan = export_lib.plan_peft_export(src, tmp_path / 'out', model='gemma4', lora_alpha=mt.ALPHA,
                                       base_model=folder)
    said = [n for n in plan.notes if 'k_eq_v' in n]
    assert len(said) == 1 and 'vLLM' in said[0], plan.notes
    assert said[0].startswith('model.layers.5.self_attn.k_proj:'), said
    assert 'layers.0.' not in said[0] and 'layers.6.' not in said[0], said
  p = cli(full, tmp_path / 'out', '--model', 'gemma4', '--peft', '--lora-alpha', str(mt.ALPHA))
  assert p.returncode == 0, p.stderr
  assert 'model.layers.5.self_attn.k_proj: the layer reuses its keys' in p.stdout + p.stderr
  assert 'model.layers.4.self_attn.k_proj:' not in p.stdout + p.stderr


def test_inspect_says_maxtext_adapters_alone_need_the_base_models_folder(tmp_path):
  from tests import test_export_maxtext as mt
  run, _ = _maxtext_lora_run('qwen3', 'unscanned')
  alone = mt.save_tunix_run(tmp_path / 'alone', {k: v for k, v in run.items() if '_lora_' in k})
  p = subprocess.run([sys.executable, '-m', 'orbax_tunix.cli', 'inspect', str(alone)],
                     capture_output=True, text=True, cwd=ROOT, env=subprocess_env(),
                     timeout=300, check=False)
  assert p.returncode == 0, p.stderr
  assert 'export --peft --lora-alpha A --base-model FOLDER' in p.stdout, p.stdout


@pytest.mark.parametrize('model', ['qwen3', 'llama3', 'gemma3', 'gemma4', 'qwen3_moe', 'qwen2',
                                   'mixtral', 'gemma2', 'olmo3'])
def test_maxtext_axes_are_the_dims_read_the_other_way(model):
  """Every config field `dims` reads off a MaxText kernel's axis is the one `axes` names for
  that axis (layer 5: gemma4's first global layer, as transformers' default layer_types)."""
  naming = hf.get(model).naming_of(trainers.MAXTEXT)
  checked = 0
  for field, alternatives in naming.dims.items():
    for pattern, axis in alternatives:
      fields = naming.axis_fields(tuple(pattern.split('/')), {})
      if fields is not None:
        assert fields[axis] == field, (pattern, axis, fields)
        checked += 1
  assert checked >= 3, naming.dims  # heads and head_dim (query), kv heads (key)


def test_peft_honours_the_axis_the_step_records(tmp_path):
  """A LoRA run of MaxText's gemma3, converted to MaxText's scanned blocks (adapters stacked as
  their kernels), records its layer axis: `--peft` of the converted step takes the layers apart
  along it, giving the adapter of the unscanned run itself byte for byte; another axis is
  refused naming the recorded one (the model export alike), before anything is written."""
  from orbax_tunix.tools import convert
  from tests import test_export_maxtext as mt
  run, _ = _maxtext_lora_run('gemma3', 'unscanned')
  src = mt.save_tunix_run(tmp_path / 'run', run)
  step = tmp_path / 'scanned' / '1'
  convert.run_convert(convert.plan_convert(src, step, layout='maxtext', params_only=True,
                                           scan_layers=True))
  meta = json.loads((step / '_CHECKPOINT_METADATA').read_text())['custom_metadata']
  assert (meta['scan_layers'], meta['param_scan_axis']) == (True, 1)
  for source, out in ((src, 'a_run'), (step, 'a_step')):
    ot.export_peft_adapter(source, tmp_path / out, model='gemma3', lora_alpha=mt.ALPHA)
  for name in (peft.ADAPTER_FILE, peft.CONFIG_FILE):
    assert (tmp_path / 'a_step' / name).read_bytes() == (tmp_path / 'a_run' / name).read_bytes()
  for flags in (PEFT, ('--base-only',)):
    p = cli(step, tmp_path / 'out', '--model', 'gemma3', *flags, '--param-scan-axis', '0')
    assert p.returncode == 2 and 'records its layers stacked along axis 1' in p.stderr, p.stderr
  assert not (tmp_path / 'out').exists()


@pytest.mark.parametrize(('source', 'axis', 'said'), [
    ('scanned', '0', ('stacked along axis 1', 'param_scan_axis=0', '--param-scan-axis 1')),
    ('scanned_alone', '0', ('stacked along axis 1', 'param_scan_axis=0', '--param-scan-axis 1')),
    ('hf_qwen3_lora', '1', ('--param-scan-axis 1', 'no stacked layers')),
])
def test_peft_resolves_the_layer_axis_as_the_model_export(tmp_path, source, axis, said):
  """--param-scan-axis is resolved by the model export's own function: an axis along which the
  layers are not stacked, or one given for weights that stack none, is refused with the model
  export's message (not 'pick the family', not accepted silently)."""
  from tests import test_export_maxtext as mt
  if source.startswith('scanned'):
    run, _ = _maxtext_lora_run('qwen3', 'scanned')
    alone = source == 'scanned_alone'
    src = mt.save_tunix_run(tmp_path / 'run', {k: v for k, v in run.items()
                                               if '_lora_' in k or not alone})
    base = ('--base-model', mt.hf_config(tmp_path / 'base', 'qwen3')) if alone else ()
  else:
    src, base = DATA / source, ()
  p = cli(src, tmp_path / 'out', '--model', 'qwen3', *PEFT, *base, '--param-scan-axis', axis)
  assert p.returncode == 2, p.stderr
  assert all(w in p.stderr for w in said) and '--model' not in p.stderr, p.stderr
  if source != 'scanned_alone':  # The model export of the same weights says the same.
    m = cli(src, tmp_path / 'out', '--model', 'qwen3', '--base-only', '--param-scan-axis', axis)
    assert m.returncode == 2 and m.stderr.splitlines()[0] == p.stderr.splitlines()[0], (
        m.stderr, p.stderr)
  assert not (tmp_path / 'out').exists()

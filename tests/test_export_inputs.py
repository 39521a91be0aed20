"""Export inputs that used to give wrong answers or misleading errors (issue 36).

A config.json given as the file rather than its folder; a config whose
`vocab_size` would cut a Tunix model's trained rows; per-layer config fields
(`layer_types`) of another length than the weights' layers, whose folder
`transformers` would refuse. Every export here is of a committed google-tunix
fixture (tests/data/tunix); what `transformers` makes of a written config is
asked of `transformers` itself (the Hugging Face client venv).
"""

from __future__ import annotations

import json
import pathlib
import subprocess

import pytest

import orbax_tunix as ot
from orbax_tunix.mapping import hf_config, huggingface, trainers
from orbax_tunix.tools import export as export_lib
from tests.clients import client_env, subprocess_env
from tests.test_cli import run
from tests.test_export_hf import (
  DATA,
  HF_CONFIG_DIMS,
  HF_CONFIG_EXTRA,
  HF_CONFIG_FULL,
  raw,
)


def _hf_dir(path: pathlib.Path, config: dict) -> pathlib.Path:
  path.mkdir(parents=True)
  (path / 'config.json').write_text(json.dumps(config, indent=2))
  (path / 'tokenizer.json').write_text('{"version": "1.0"}\n')
  return path


def _qwen3_config(**changes) -> dict:
  return {**HF_CONFIG_DIMS['hf_qwen3'], **HF_CONFIG_EXTRA['hf_qwen3'], **changes}


# --- issue 36.15: --hf-config DIR/config.json ---------------------------------------


def test_hf_config_may_name_the_config_file_itself(tmp_path):
  """`--hf-config DIR/config.json` is DIR: its config is checked and its tokenizer copied."""
  hf = _hf_dir(tmp_path / 'Qwen3', _qwen3_config())
  plan = export_lib.plan_export(DATA / 'hf_qwen3', tmp_path / 'out', model='qwen3',
                        hf_config=hf / 'config.json')
  assert plan.summary['config'] == str(hf / 'config.json')
  assert dict(plan.other_files) == {'config.json': hf / 'config.json',
                                    'tokenizer.json': hf / 'tokenizer.json'}


def test_hf_config_naming_another_file_says_what_to_pass(tmp_path, capsys):
  hf = _hf_dir(tmp_path / 'Qwen3', _qwen3_config())
  status, _, err = run(capsys, 'export', DATA / 'hf_qwen3', tmp_path / 'out', '--model', 'qwen3',
                       '--hf-config', hf / 'tokenizer.json')
  assert status == 2
  assert f'{hf / "tokenizer.json"}: --hf-config must be a Hugging Face model folder' in err, err
  assert 'found a file' in err and 'Not a directory' not in err, err
  assert not (tmp_path / 'out').exists()


# --- issue 36.5: a smaller vocab_size cuts only padding -------------------------------


@pytest.mark.parametrize('fixture, family, rows', [
    ('hf_qwen3', 'qwen3', ('embedder/input_embedding', 'lm_head/w')),  # untied: both
    ('hf_gemma3', 'gemma3', ('embedder/input_embedding',)),
])
def test_smaller_vocab_size_of_a_tunix_model_is_refused(tmp_path, capsys, fixture, family, rows):
  """A Tunix model's rows are trained tokens: a config with fewer is not this model's, and
  the export is refused naming the field and both sizes, before anything is written."""
  stored = raw(fixture)['embedder/input_embedding'].shape[0]
  config = {**HF_CONFIG_DIMS[fixture], **HF_CONFIG_EXTRA.get(fixture, {}),
            'vocab_size': stored - 6}
  if family == 'gemma3':
    config.update(architectures=['Gemma3ForCausalLM'], model_type='gemma3_text')
  hf = _hf_dir(tmp_path / 'hf', config)
  status, _, err = run(capsys, 'export', DATA / fixture, tmp_path / 'out', '--model', family,
                       '--hf-config', hf)
  assert status == 2, err
  assert f'vocab_size {stored - 6} is smaller than the weights\' vocabulary' in err, err
  assert f'{rows[0]} ({stored}, 40) has {stored} along axis 0' in err, err
  assert '--hf-config' in err and f'vocab_size {stored}' in err, err
  assert not (tmp_path / 'out').exists()


@pytest.mark.parametrize('family, rows, vocab_size, cut', [
    ('gemma2', 256128, 256000, True),   # Gemma's own checkpoints pad 256000 to 256128
    ('gemma', 256128, 256000, True),
    ('gemma2', 256130, 256000, False),  # any other cut is of trained rows
    ('gemma3', 262208, 262144, False),
    ('qwen3', 151936, 151669, False),   # Qwen3's tokenizer size: its rows are still the model's
])
def test_only_known_padding_is_cut_from_a_tunix_model(family, rows, vocab_size, cut):
  naming = huggingface.get(family).naming_of(trainers.TUNIX)
  shapes = {('embedder', 'input_embedding'): (rows, 8)}
  weights = naming.form.unstack(shapes)
  if not cut:
    with pytest.raises(ot.UnsupportedLayoutError, match=f'vocab_size {vocab_size} is smaller'):
      hf_config.cut_vocab(naming, weights, vocab_size, 'config.json')
    return
  out, notes = hf_config.cut_vocab(naming, weights, vocab_size, 'config.json')
  assert out[('embedder', 'input_embedding')].shape == (vocab_size, 8)
  assert notes == [f'embedder/input_embedding: vocabulary padding cut, {rows} -> {vocab_size}'
                   " (the config's vocab_size; Gemma's checkpoints pad 256000 tokens to 256128"
                   ' rows)']


# --- issue 36.8: per-layer config fields against the weights' layers ------------------

# transformers in the Hugging Face client venv: AutoConfig on each folder (its error, or what it
# read), and the causal LM where asked (the keys it did not find or did not use).
_HF_LOAD = """
import json, sys, transformers
out = {}
for d, model in zip(sys.argv[1::2], sys.argv[2::2]):
  try:
    c = transformers.AutoConfig.from_pretrained(d)
  except Exception as e:  # what transformers says of the folder
    out[d] = {'error': f'{type(e).__name__}: {e}'}
    continue
  t = c.get_text_config()
  out[d] = {'class': type(c).__name__, 'layer_types': t.layer_types,
            'num_hidden_layers': t.num_hidden_layers}
  if model == 'model':
    _, info = transformers.AutoModelForCausalLM.from_pretrained(d, output_loading_info=True)
    out[d]['missing'] = sorted(info['missing_keys'])
    out[d]['unexpected'] = sorted(info['unexpected_keys'])
print(json.dumps(out))
"""


def _hf_load(*folders: tuple[pathlib.Path, bool]) -> dict[str, dict]:
  python = client_env('hf_venv.sh')
  argv = [a for d, model in folders for a in (str(d), 'model' if model else 'config')]
  p = subprocess.run([python, '-c', _HF_LOAD, *argv], capture_output=True, text=True,
                     timeout=600, check=False, env=subprocess_env(PYTHONPATH=''))
  assert p.returncode == 0, p.stderr[-4000:]
  return json.loads(p.stdout.strip().splitlines()[-1])


_G3_LAYERS = ['sliding_attention'] * 5 + ['full_attention']  # hf_gemma3: 6 layers, 5 local


def _gemma_config(fixture: str, layer_types: list[str]) -> dict:
  if fixture == 'hf_gemma3':
    return {**HF_CONFIG_DIMS['hf_gemma3'], **HF_CONFIG_EXTRA['hf_gemma3_fused'],
            'layer_types': layer_types}
  config = json.loads(json.dumps(HF_CONFIG_FULL[fixture]))
  config['text_config']['layer_types'] = layer_types
  return config


def test_layer_types_of_another_length_than_the_layers_is_refused(tmp_path, capsys):
  """A config.json whose `layer_types` has 7 entries for 6 layers: transformers refuses such a
  folder, so the export is refused (naming the field and both counts) and writes nothing; with
  one entry per layer the folder written loads in transformers (config and model)."""
  cases = {'hf_gemma3': ('gemma3', _G3_LAYERS),
           'hf_gemma4': ('gemma4', HF_CONFIG_FULL['hf_gemma4']['text_config']['layer_types'])}
  bad, good = {}, {}
  for fixture, (family, layer_types) in cases.items():
    bad[fixture] = _hf_dir(tmp_path / f'bad_{fixture}',
                           _gemma_config(fixture, [*layer_types, 'sliding_attention']))
    status, _, err = run(capsys, 'export', DATA / fixture, tmp_path / f'out_bad_{fixture}',
                         '--model', family, '--hf-config', bad[fixture])
    assert status == 2, err
    assert 'layer_types: config.json has 7 entries, the weights have 6 layers' in err, err
    assert not (tmp_path / f'out_bad_{fixture}').exists()
    hf = _hf_dir(tmp_path / f'good_{fixture}', _gemma_config(fixture, layer_types))
    good[fixture] = tmp_path / f'out_{fixture}'
    status, _, err = run(capsys, 'export', DATA / fixture, good[fixture], '--model', family,
                         '--hf-config', hf)
    assert status == 0, err
  got = _hf_load(*[(d, False) for d in bad.values()], (good['hf_gemma3'], True),
                 (good['hf_gemma4'], False))
  for d in bad.values():  # What the check stands for: transformers' own refusal.
    assert 'ValueError' in got[str(d)].get('error', ''), got[str(d)]  # layer_types, or gemma4's
    # per_layer_config built from it
  g3 = got[str(good['hf_gemma3'])]
  assert g3['layer_types'] == _G3_LAYERS and g3['num_hidden_layers'] == 6, g3
  assert g3['missing'] == [] and g3['unexpected'] == [], g3
  g4 = got[str(good['hf_gemma4'])]
  assert g4['class'] == 'Gemma4Config' and len(g4['layer_types']) == 6, g4

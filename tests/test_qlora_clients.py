"""QLoRA runs in the clients: exports of real QLoRA runs loaded by transformers and peft.

The committed QLoRA runs (`tests/data/tunix`, MANIFEST's `qlora` record: google-tunix 0.1.7's
own Qwen3 and Gemma3 classes, quantized and adapted by qwix 0.1.8, saved by Tunix's
CheckpointManager, full and adapters-only) are exported with the CLI:
  merged_<run>  `--merge-lora` (a full save onto its saved quantized base, no `--base`; an
                adapters-only one with `--base` and the run's `--base-qtype ...`);
  peft_<run>    `--peft` (the adapters, with the note that they were trained on a quantized
                base);
  base_<run>    `--base-only` of a full save (its base, dequantized).
The expected logits are those of the QLoRA model Tunix itself restores from the checkpoint
(tests/tunix_client.py's `reference` job with the run's qwix rules: the quantized base and the
adapters live), checked against the logits the fixture recorded from the live model when it
was made (`lora_reference.json`). transformers (the hf venv, tests/hf_client.py) loads each
folder with no missing, unexpected or mismatched key; peft loads each adapter.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.test_export_hf import DATA, MANIFEST, _job, export_argv, manifest
from tests.test_hf_clients import (
  HUB_CONFIGS,
  LOGITS_RTOL,
  WORKER_TIMEOUT,
  Runs,
  _write_config,
  assert_clean_load,
  export_then_send,
  max_diff,
  start_workers,
)

QLORA_FIXTURES = tuple(sorted(n for n, e in MANIFEST.items() if 'qlora' in e))
REFERENCE = json.loads((DATA / 'lora_reference.json').read_text())


def qlora(name: str) -> dict:
  return manifest(name)['qlora']


def is_full(name: str) -> bool:
  return not name.endswith('_only')


def hub_config(base: str) -> dict:
  """The base's Hub config (a bfloat16 base: its float32 twin's, at the same dims)."""
  return HUB_CONFIGS[base.removesuffix('_bf16')]


def bound(name: str, want: np.ndarray) -> float:
  """How close the export's logits must be: two float32 libraries (LOGITS_RTOL of the largest
  logit); for a bfloat16 run, its bfloat16 forward pass against a float32 one (the fixture
  measured it, `logits_max_abs_diff_dequantized_merge_float32`), with a margin."""
  if qlora(name)['dtype'] == 'float32':
    return LOGITS_RTOL * float(np.abs(want).max())
  return 1.5 * qlora(name)['logits_max_abs_diff_dequantized_merge_float32']


def recipe_flags(name: str) -> list[str]:
  q = qlora(name)
  return ['--base', str(DATA / q['base']), '--base-qtype', q['qtype'],
          *(['--base-tile-size', str(q['tile_size'])] if q['tile_size'] else []),
          '--base-calibration', q['calibration']]


def lora_spec(name: str) -> dict:
  q = qlora(name)
  spec = {'rank': q['rank'], 'alpha': q['alpha'], 'rules': q['rules']}
  if not is_full(name):
    spec.update(base_root=str(DATA / q['base']), base_step=q['base_step'])
  return spec


@pytest.fixture(scope='module')
def hf(hf_python, tmp_path_factory):
  work = tmp_path_factory.mktemp('qlora_clients')
  hf_worker, tunix_worker = start_workers(hf_python, work)
  out, configs = work / 'out', work / 'configs'
  planned, after = {}, {}

  def plan(key, src, *flags):
    planned[key] = (out / key, export_argv(DATA / src, out / key, *flags))

  def job(worker, needs, **kw):
    after.setdefault(tuple(sorted(needs)) or None, []).append((worker, kw))

  for name in QLORA_FIXTURES:
    q, family, tokens = qlora(name), manifest(name)['family'], manifest(name)['tokens']
    config = configs / q['base']
    if not config.exists():
      _write_config(config, hub_config(q['base']))
    alpha = ['--lora-alpha', str(q['alpha'])]
    plan(f'merged_{name}', name, '--model', family, '--merge-lora', *alpha, '--hf-config',
         str(config), *([] if is_full(name) else recipe_flags(name)))
    plan(f'peft_{name}', name, '--model', family, '--peft', *alpha,
         '--base-model', f'tiny/{q["base"]}')
    base = f'base_{name}' if is_full(name) else f'full_{q["base"]}'
    plan(base, name if is_full(name) else q['base'], '--model', family, '--hf-config',
         str(config), *(['--base-only'] if is_full(name) else []))
    job(tunix_worker, (), id=f'ref_{name}', job='reference',
        **_job(name, root=str(DATA / name), lora=lora_spec(name)))
    job(hf_worker, (f'merged_{name}',), id=f'load_merged_{name}', job='load',
        dir=str(out / f'merged_{name}'), tokens=tokens)
    job(hf_worker, (base, f'peft_{name}'), id=f'peft_{name}', job='peft', base=str(out / base),
        adapter=str(out / f'peft_{name}'), tokens=tokens)

  runs = export_then_send(planned, after)
  for worker in (tunix_worker, hf_worker):
    worker.finish(WORKER_TIMEOUT)
  return Runs(runs, hf_worker, tunix_worker)


def test_every_recipe_axis_is_covered():
  recipes = [qlora(n) for n in QLORA_FIXTURES]
  assert {q['qtype'] for q in recipes} == {'int8', 'int4', 'nf4', 'float8_e4m3fn'}
  assert {q['calibration'] for q in recipes} == {'absmax', 'minmax'}
  assert {bool(q['tile_size']) for q in recipes} == {True, False}
  assert {q['dtype'] for q in recipes} == {'float32', 'bfloat16'}
  assert {manifest(n)['family'] for n in QLORA_FIXTURES} >= {'qwen3', 'gemma3'}
  assert {is_full(n) for n in QLORA_FIXTURES} == {True, False}


@pytest.mark.parametrize('name', QLORA_FIXTURES)
def test_tunix_restores_the_live_qlora_model(hf, name):
  """The reference: Tunix's QLoRA model from the checkpoint computes what the live model did
  when the run was saved (the logits the fixture recorded)."""
  live = np.asarray(REFERENCE[name]['logits'], np.float32)
  assert max_diff(hf.reference(name), live) <= 1e-5 * float(np.abs(live).max())


@pytest.mark.parametrize('name', QLORA_FIXTURES)
def test_merged_export_loads_in_transformers_as_the_tunix_qlora_model(hf, name):
  r = hf.hf_result(f'load_merged_{name}', f'merged_{name}')
  assert_clean_load(r, f'merged_{name}')
  want = hf.reference(name)
  with np.load(r['npz']) as z:
    diff = max_diff(z['logits'], want)
  assert diff <= bound(name, want), f'{name}: {diff} from the Tunix QLoRA model'
  # The float base merged instead (what `--base` used to write with exit 0) is not within it.
  assert qlora(name)['logits_max_abs_diff_float_base_merge'] > 5 * bound(name, want)
  notes = hf.note(f'merged_{name}')
  assert ('saved quantized' if is_full(name) else 're-quantized with the recipe given') in notes


@pytest.mark.parametrize('name', QLORA_FIXTURES)
def test_adapter_loads_in_peft(hf, name):
  """The adapters load cleanly. On a full save's `--base-only` export (its base, dequantized)
  they compute the QLoRA model; on the float base, as a QLoRA adapter is served, they do
  not quite (the note says so)."""
  r = hf.hf_result(f'peft_{name}', f'peft_{name}')
  assert not r['adapter_missing_keys'] and not r['adapter_unexpected_keys'], r
  assert_clean_load(r, f'peft_{name}')
  want = hf.reference(name)
  with np.load(r['npz']) as z:
    diff = max_diff(z['logits'], want)
  if is_full(name):
    assert diff <= bound(name, want), f'{name}: {diff} from the Tunix QLoRA model'
    assert 'trained against a quantized base' in hf.note(f'peft_{name}')
    assert 'written dequantized' in hf.note(f'base_{name}')
  else:
    # On the float base the adapter computes W_float + s·A·B: the float-base merge whose
    # distance from the QLoRA model the fixture measured with Tunix's own model classes. Equal
    # distances within the bound (a max-abs distance moves by at most the logits' difference);
    # a zeroed or mis-scaled adapter lands at the bare float base's distance, far from it.
    q = qlora(name)
    assert diff > 5 * bound(name, want)
    assert abs(q['logits_max_abs_diff_float_base'] - q['logits_max_abs_diff_float_base_merge']) \
        > 2 * bound(name, want), name  # the check below can tell the adapter's absence
    assert abs(diff - q['logits_max_abs_diff_float_base_merge']) <= bound(name, want), (
        f'{name}: {diff} from the QLoRA model, the float-base merge'
        f' {q["logits_max_abs_diff_float_base_merge"]}')

"""Hostile QLoRA inputs: a quantized weight's parts damaged, a QLoRA recipe where no QLoRA run
could be, notes that say on whose word a base is the run's, a pre-quantized base config.

The inputs are the committed runs written by google-tunix (tests/data/tunix, `MANIFEST.json`
says what each holds), copied and edited with plain Orbax: a part's shape, dtype, presence.
Expected shapes come from the arrays written here and from the manifest, never from the code
under test. Everything is refused from metadata, before any array is read.
"""

from __future__ import annotations

import json
import pathlib
import re
import shutil

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

import orbax_tunix as ot
from orbax_tunix import errors
from orbax_tunix.keypaths import nest
from orbax_tunix.mapping import merge
from orbax_tunix.tools import convert, export, inspection
from tests import builders
from tests.conftest import DATA

MANIFEST = json.loads((DATA / 'MANIFEST.json').read_text())['fixtures']
ALPHA = 3.0  # The QLoRA and LoRA fixtures' LoRA alpha (MANIFEST: lora.alpha, qlora.alpha).

# --- a quantized weight's parts, damaged --------------------------------------------------

FULL = 'hf_gemma3_qlora_int8'  # int8, minmax (zero points), tiles of 4: every part there is.
WEIGHT = 'layers/0/mlp/down_proj/kernel'  # qvalue (56, 40), scale and zero point (14, 40).
PART = f'{WEIGHT}/array/{{}}/value'


def _set(part: str, value: np.ndarray):
  return lambda raw: raw.__setitem__(PART.format(part), value)


def _drop(part: str):
  return lambda raw: raw.pop(PART.format(part))


# case -> (the edit of the raw leaves, what the refusal must say of it)
DAMAGE = {
    'a scale that does not tile qvalue': (
        _set('scale', np.ones((3, 40), np.float32)), r"scale's axis 0 \(3\) does not tile"),
    'a scale of another rank': (
        _set('scale', np.ones((14, 40, 1), np.float32)), 'scale has rank 3, qvalue 2'),
    'a zero point of another shape': (
        _set('zero_point', np.zeros((1, 40), np.int8)),
        r"zero_point \(1, 40\) is not the scale's shape \(14, 40\)"),
    'a zero point of another dtype': (
        _set('zero_point', np.zeros((14, 40), np.float32)), 'zero_point is float32, qvalue int8'),
    'no scale': (_drop('scale'), 'no scale'),
    'no qvalue': (_drop('qvalue'), 'no qvalue'),
    'a part qwix has not': (_set('bias', np.zeros((40,), np.float32)),
                            'bias is no part of qwix'),
}


@pytest.fixture(scope='module')
def damaged(tmp_path_factory):
  root = tmp_path_factory.mktemp('damaged')
  step = DATA / FULL / str(MANIFEST[FULL]['steps'][-1])
  return {case: (root / str(i), builders.edited_copy(step, root / str(i), edit))
          for i, (case, (edit, _)) in enumerate(DAMAGE.items())}


def _shown(raw: dict, part: str) -> str:
  value = raw[PART.format(part)]
  return f'{part} {value.shape} {value.dtype}'


def _weight_target():
  return {'model_params': nest([(tuple(WEIGHT.split('/')),
                                 jax.ShapeDtypeStruct((56, 40), np.float32))])}


@pytest.mark.parametrize('case', DAMAGE)
def test_damaged_parts_are_refused_before_any_read(damaged, case, tmp_path, monkeypatch):
  """inspect, convert, export, a merge, a restore through the handler (with a target naming
  the weight, without one, its metadata) and Orbax v1: one error naming the weight, each
  part's shape and what is wrong, and no array read."""
  root, raw = damaged[case]
  step = root / '3'
  parts = sorted(k.split('/')[-2] for k in raw if k.startswith(f'{WEIGHT}/array/'))
  says = [re.escape(f'{step}/model_params: {WEIGHT}: saved quantized by qwix'),
          *(re.escape(_shown(raw, p)) for p in parts), DAMAGE[case][1]]
  reads = builders.spy_restores(monkeypatch)
  ckptr = ocp.Checkpointer(ot.TunixAwareHandler())
  ot.register()
  attempts = {
      'inspect': lambda: inspection.inspect_checkpoint(root),
      'convert': lambda: convert.plan_convert(root, tmp_path / 'converted'),
      'export': lambda: export.plan_export(root, tmp_path / 'exported', model='gemma3'),
      'merge': lambda: merge.plan_merge(root, merge.MergeOptions(alpha=ALPHA)),
      'restore': lambda: ckptr.restore(step),
      'restore into a target': lambda: ckptr.restore(step, args=ocp.args.Composite(
          model_params=ocp.args.PyTreeRestore(item=_weight_target()['model_params']))),
      'metadata': lambda: ckptr.metadata(step).item_metadata['model_params'],
      'v1': lambda: ocp.v1.load_checkpointables(step),
      'maxtext': lambda: ot.maxtext.plan_restore(root, {'step': jax.ShapeDtypeStruct(
          (), np.int32)}, params_only=True),
  }
  for what, attempt in attempts.items():
    with pytest.raises(errors.CorruptMetadataError) as raised:
      attempt()
    for pattern in says:
      assert re.search(pattern, str(raised.value)), (what, pattern, str(raised.value))
  assert not reads, reads
  assert not list(tmp_path.iterdir())


def test_weights_beside_a_damaged_one_still_restore(damaged):
  """The refusal is the damaged weight's: a target without it reads as before."""
  root, raw = damaged['no scale']
  other = 'layers/1/mlp/down_proj/kernel'
  got = ocp.Checkpointer(ot.TunixAwareHandler()).restore(root / '3', args=ocp.args.Composite(
      model_params=ocp.args.PyTreeRestore(item=nest([(tuple(other.split('/')),
                                                      jax.ShapeDtypeStruct((56, 40),
                                                                           np.float32))]))))
  q, s, z = (raw[f'{other}/array/{p}/value'] for p in ('qvalue', 'scale', 'zero_point'))
  want = (q.astype(np.float32) - np.repeat(z, 4, 0)) * np.repeat(s, 4, 0)
  np.testing.assert_allclose(np.asarray(got['model_params']['layers']['1']['mlp']['down_proj']
                                        ['kernel']), want, rtol=1e-6)


# --- the recipe flags only where a QLoRA run could be ---------------------------------------


def _flax_adapters_only(root: pathlib.Path) -> pathlib.Path:
  """lora_flax (nnx.LoRA) with its adapters alone, saved by plain Orbax."""
  def adapters_only(raw):
    for key in [k for k in raw if '/lora_' not in k]:
      del raw[key]

  builders.edited_copy(DATA / 'lora_flax' / '1', root, adapters_only)
  return root


@pytest.mark.parametrize('run,base,match', [
    # A full plain-LoRA save: its own float base shows the run quantized nothing.
    ('lora_qwix_full', 'lora_base', r'lora_qwix_full/1: `base_qtype=int8` given, but the save'
                                    r' holds the base of 4 adapted weights in float'),
    ('lora_flax', 'lora_flax', r"`base_qtype=int8` given, but these adapters are flax's"),
])
def test_a_recipe_where_no_qlora_run_could_be_is_refused(run, base, match, monkeypatch):
  reads = builders.spy_restores(monkeypatch)
  with pytest.raises(errors.LoraError, match=match):
    merge.plan_merge(DATA / run, merge.MergeOptions.given(
        {'lora_alpha': ALPHA if run != 'lora_flax' else None, 'base': DATA / base,
         'base_qtype': 'int8'}, merging=True))
  assert not reads


def test_flax_adapters_only_merge_suggests_no_recipe(tmp_path):
  plan = merge.plan_merge(_flax_adapters_only(tmp_path / 'flax_only'),
                          merge.MergeOptions(base=DATA / 'lora_flax'))
  assert len(plan.merges) == 2
  assert not any('base_qtype' in n or 'quantized' in n for n in plan.notes), plan.notes


# --- notes: what was done, on whose word ------------------------------------------------------

ONLY = 'hf_qwen3_qlora_int4_only'  # An int4 run's adapters alone.
MIXED = 'hf_qwen3_qlora_int8'  # A full save: plain-LoRA attention, quantized MLP.


def _mixed() -> tuple[list[str], list[str]]:
  """The mixed run's adapted weights, quantized and not (its manifest)."""
  entry = MANIFEST[MIXED]['qlora']
  quantized = sorted(entry['quantized'])
  return quantized, sorted(set(entry['targets']) - set(quantized))


def test_a_recipe_given_for_adapters_only_is_noted_as_the_callers_word():
  """int8 given for an int4 run: the merge does it, and says that the save cannot confirm
  it, not that it is what the run did."""
  plan = merge.plan_merge(DATA / ONLY, merge.MergeOptions.given(
      {'lora_alpha': ALPHA, 'base': DATA / 'hf_qwen3', 'base_qtype': 'int8'}, merging=True))
  (note,) = [n for n in plan.notes if 're-quantized with the recipe given' in n]
  assert 'recipe given (int8, per channel, absmax' in note and 'cannot confirm it' in note
  assert 'as the run did' not in note and 'as the run did' not in plan.describe()
  # ... and on which kind of device, which decides whether a float32 base is the run's.
  (device,) = [n for n in plan.notes if n.startswith('re-quantized on ')]
  assert device.startswith(
      f're-quantized on {jax.devices()[0].device_kind} with jax {jax.__version__}:'), device


def test_another_runs_qlora_save_as_base_is_not_called_the_runs():
  plan = merge.plan_merge(DATA / ONLY, merge.MergeOptions(alpha=ALPHA, base=DATA / MIXED))
  (note,) = [n for n in plan.notes if 'quantized' in n]
  assert 'cannot tell the base they were trained on' in note, note
  assert 'only if that base is the run\'s own save' in note, note


def test_peft_of_adapters_only_says_it_cannot_tell(tmp_path):
  plan = export.plan_peft_export(DATA / ONLY, tmp_path / 'adapter', model='qwen3', lora_alpha=ALPHA)
  assert any('cannot tell whether the run trained them on a quantized base' in n
             for n in plan.notes), plan.notes


def test_a_mixed_run_is_described_weight_by_weight(tmp_path):
  quantized, floats = _mixed()
  plan = export.plan_peft_export(DATA / MIXED, tmp_path / 'adapter', model='qwen3',
                                 lora_alpha=ALPHA)
  (note,) = [n for n in plan.notes if n.startswith('QLoRA:')]
  assert f'{len(quantized)} of these {len(quantized) + len(floats)} adapters' in note, note
  assert f'the other {len(floats)} (plain LoRA' in note, note
  merged = merge.plan_merge(DATA / MIXED, merge.MergeOptions(alpha=ALPHA))
  assert any(n.startswith(f'{len(quantized)} adapted weights have their base saved quantized')
             for n in merged.notes), merged.notes
  assert any(n.startswith(f'the other {len(floats)} adapted weights have their base saved in'
                          ' float') for n in merged.notes), merged.notes


# --- a recipe that does not fit: one message about the option --------------------------------


@pytest.mark.parametrize('base,keywords,match', [
    ('hf_qwen3', dict(base_qtype='int4', base_tile_size=16),
     r'`base_tile_size=16` does not fit 6 adapted weights:.*tile size 16 does not divide axis 0'
     r' of a weight of shape \(56, 40\)'),
    (MIXED, dict(base_qtype='int4'),
     r'`base_qtype` given, but the base holds 6 adapted weights quantized already'),
])
def test_a_recipe_that_does_not_fit_names_the_option(base, keywords, match, monkeypatch):
  reads = builders.spy_restores(monkeypatch)
  with pytest.raises(errors.LoraError) as raised:
    merge.plan_merge(DATA / ONLY, merge.MergeOptions.given(
        {'lora_alpha': ALPHA, 'base': DATA / base, **keywords}, merging=True))
  assert re.search(match, str(raised.value), re.S), str(raised.value)
  assert 'reproduce' not in str(raised.value) and not reads


# --- the config written is the model the tensors are -----------------------------------------


def test_a_pre_quantized_base_config_loses_its_quantization_config(tmp_path):
  """A Hub 4-bit copy's config.json (bitsandbytes' quantization_config) beside float tensors
  would be read as pre-quantized: it is dropped, with a note; the rest is the base's."""
  base = {'architectures': ['Qwen3ForCausalLM'], 'model_type': 'qwen3', 'vocab_size': 96,
          'hidden_size': 40, 'intermediate_size': 56, 'num_hidden_layers': 2,
          'num_attention_heads': 4, 'num_key_value_heads': 2, 'head_dim': 12,
          'tie_word_embeddings': False, 'torch_dtype': 'float32', 'rope_theta': 1000000}
  folder = tmp_path / 'hub_4bit'
  folder.mkdir()
  quantization = {'quant_method': 'bitsandbytes', 'load_in_4bit': True,
                  'bnb_4bit_quant_type': 'nf4', 'bnb_4bit_compute_dtype': 'bfloat16'}
  (folder / 'config.json').write_text(json.dumps({**base, 'quantization_config': quantization}))
  (folder / 'generation_config.json').write_text('{"do_sample": false}')
  out = tmp_path / 'out'
  plan = export.plan_export(DATA / 'hf_qwen3', out, model='qwen3', hf_config=folder)
  assert any("dropped quantization_config (quant_method 'bitsandbytes')" in n
             for n in plan.notes), plan.notes
  export.run_export(plan)
  written = json.loads((out / 'config.json').read_text())
  assert 'quantization_config' not in written
  assert {k: v for k, v in written.items() if k in base} == base
  assert (out / 'generation_config.json').read_text() == '{"do_sample": false}'
  shutil.rmtree(out)


# --- item 12: inspect's description of a scale ----------------------------------------------


@pytest.mark.parametrize(('shape', 'scale', 'want'), [
    # Gemma 3's attn_vec_einsum (N, H, D) tiled on H, N reduced whole: both said.
    ((4, 12, 40), (1, 3, 40), 'int8, tiles of 4 on axis 1, axis 0 reduced, absmax'),
    ((56, 40), (14, 40), 'int8, tiles of 4 on axis 0, absmax'),
    ((4, 40, 12), (4, 1, 12), 'int8, per channel, axis 1 reduced, absmax'),
    ((4, 12, 40), (1, 1, 40), 'int8, per channel, axes 0 and 1 reduced, absmax'),
    # A scale of qvalue's own shape reduces nothing: no empty list of axes.
    ((56, 40), (56, 40), 'int8, per element, absmax'),
])
def test_a_scheme_is_described_by_every_axis_it_reduces_or_tiles(shape, scale, want):
  from orbax_tunix.reading import quantized
  s = quantized.Scheme(shape, np.dtype('int8'), scale, np.dtype('float32'), False)
  assert s.describe() == want


def test_inspect_says_the_reduced_axis_beside_the_tiles():
  """The committed QLoRA run's attn_vec_einsum (MANIFEST: qvalue (4, 12, 40), scale (1, 3, 40))
  is described with its reduced axis 0, not as tiles on axis 1 alone."""
  report = inspection.inspect_checkpoint(DATA / FULL)
  schemes = report.quantized.schemes
  assert 'int8, tiles of 4 on axis 1, axis 0 reduced, minmax' in schemes, sorted(schemes)
  assert not [s for s in schemes if 'axes  reduced' in s], sorted(schemes)

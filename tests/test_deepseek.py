"""DeepSeek's structures as data, in process: MaxText's dense-then-MoE layer form
(`stacks.leading`), its routing bias stacked on axis 0, the bias a params-only step lacks
(`transforms.filled`, `huggingface.fill_absent`), the dense layers' count in config.json.

The trees are MaxText 0.2.5's DeepSeek V3 trees (names and shapes as `nnx.state` prints them of
a tiny model MaxText builds: tests/test_zoo_deepseek_clients.py checks them against MaxText
and transformers), written here with plain Orbax; expected arrays are numpy slices of the
arrays written.
"""

from __future__ import annotations

import json
import pathlib

import jax.numpy as jnp
import numpy as np
import pytest

import orbax_tunix as ot
from orbax_tunix import errors
from orbax_tunix.mapping import hf_deepseek, hf_deepseek4, huggingface, stacks
from orbax_tunix.mapping.transforms import TransformError, concat, filled
from orbax_tunix.tools import export
from tests.test_cli import run
from tests.test_export_maxtext import read_safetensors, save_maxtext_step, save_tunix_run

D, N, Q, C, NOPE, ROPE, VH, F, FE, E, V = 16, 4, 12, 10, 8, 4, 6, 40, 20, 4, 64
MOE = 'DeepSeekMoeBlock_0'
BIAS = f'{MOE}/MoeBlock_0/gate/bias'
BIAS4 = hf_deepseek4.ROUTER_BIAS  # V4's, in `mlp/`
ATTENTION = {
    'self_attention/wq_a/kernel': (D, Q), 'self_attention/q_norm/scale': (Q,),
    'self_attention/wq_b/kernel': (Q, N, NOPE + ROPE),
    'self_attention/wkv_a/kernel': (D, C + ROPE), 'self_attention/kv_norm/scale': (C,),
    'self_attention/wkv_b/kernel': (C, N, NOPE + VH), 'self_attention/out/kernel': (N, VH, D),
    'pre_self_attention_layer_norm/scale': (D,), 'post_self_attention_layer_norm/scale': (D,),
}
DENSE = {**ATTENTION, 'mlp/wi_0/kernel': (D, F), 'mlp/wi_1/kernel': (D, F),
         'mlp/wo/kernel': (F, D)}
MOE_LAYER = {
    **ATTENTION, f'{MOE}/MoeBlock_0/gate/kernel': (D, E), BIAS: (E,),
    f'{MOE}/MoeBlock_0/wi_0': (E, D, FE), f'{MOE}/MoeBlock_0/wi_1': (E, D, FE),
    f'{MOE}/MoeBlock_0/wo': (E, FE, D),
    **{f'{MOE}/shared_experts/{w}/kernel': s for w, s in (('wi_0', (D, FE)), ('wi_1', (D, FE)),
                                                           ('wo', (FE, D)))},
}
DENSE_LAYERS, MOE_LAYERS = 1, 2


def layers(seed: int = 0) -> tuple[dict, list[dict]]:
  rng = np.random.default_rng(seed)
  top = {'token_embedder/embedding': (V, D), 'decoder/decoder_norm/scale': (D,),
         'decoder/logits_dense/kernel': (D, V)}
  shapes = [DENSE] * DENSE_LAYERS + [MOE_LAYER] * MOE_LAYERS
  return ({k: rng.normal(size=s).astype(np.float32) for k, s in top.items()},
          [{k: rng.normal(size=s).astype(np.float32) for k, s in w.items()} for w in shapes])


def tree(form: str, bias: bool = True, seed: int = 0) -> dict[str, np.ndarray]:
  """MaxText's DeepSeek weights: scanned (layers on axis 1, the bias on axis 0) or unscanned
  (`dense_layers_{j}`, `moe_layers_{j}`); without the bias as a params-only step holds them."""
  top, per_layer = layers(seed)
  out = dict(top)
  dense, moe = per_layer[:DENSE_LAYERS], per_layer[DENSE_LAYERS:]
  for stack, group in (('dense_layers', dense), ('moe_layers', moe)):
    for w in group[0]:
      if w == BIAS and not bias:
        continue
      if form == 'unscanned':
        out.update({f'decoder/{stack}_{j}/{w}': x[w] for j, x in enumerate(group)})
      else:
        out[f'decoder/{stack}/{w}'] = np.stack([x[w] for x in group], 0 if w == BIAS else 1)
  return out


def config(folder: pathlib.Path, **fields) -> pathlib.Path:
  values = {'architectures': ['DeepseekV3ForCausalLM'], 'model_type': 'deepseek_v3',
            'vocab_size': V, 'hidden_size': D, 'num_hidden_layers': DENSE_LAYERS + MOE_LAYERS,
            'num_attention_heads': N, 'num_key_value_heads': N, 'q_lora_rank': Q,
            'kv_lora_rank': C, 'qk_nope_head_dim': NOPE, 'qk_rope_head_dim': ROPE,
            'v_head_dim': VH, 'intermediate_size': F, 'moe_intermediate_size': FE,
            'n_routed_experts': E, 'first_k_dense_replace': DENSE_LAYERS,
            'tie_word_embeddings': False, **fields}
  folder.mkdir(parents=True, exist_ok=True)
  (folder / 'config.json').write_text(json.dumps(values))
  return folder


@pytest.mark.parametrize('form', ['unscanned', 'scanned'])
def test_the_layer_form_takes_dense_then_moe_layers_apart(form):
  """Layer i is dense_layers' i (i < dense), else moe_layers' i - dense: each unstacked weight
  is that layer's array (the bias from its axis-0 stack), and the form counts them all."""
  flat = tree(form)
  shapes = {tuple(p.split('/')): v.shape for p, v in flat.items()}
  per_layer = hf_deepseek.DEEPSEEK_FORM.unstack(shapes, stacks.DEFAULT_AXIS)
  _, expected = layers()
  for i, weights in enumerate(expected):
    for w, x in weights.items():
      m = per_layer[('decoder', f'layers_{i}', *w.split('/'))]
      (source,) = m.sources
      got = m.transform.apply([flat['/'.join(source)]])
      np.testing.assert_array_equal(got, x, err_msg=f'layer {i} {w}')
  assert hf_deepseek.DEEPSEEK_FORM.count(shapes) == DENSE_LAYERS + MOE_LAYERS
  held = huggingface.layer_form(shapes)  # the form MaxText's conversions see
  assert (held.scanned, held.leading) == (form == 'scanned', True), held
  assert huggingface.describe_weights(shapes) == f'MaxText model ({form}, 3 layers)'
  assert held.count(shapes) == DENSE_LAYERS + MOE_LAYERS


def test_the_bias_on_axis_zero_leaves_the_layer_axis_told_by_the_shapes():
  """The routing bias (MoE layers, experts) is stacked on axis 0: the layer axis is still
  param_scan_axis 1 (read as a param, the bias would disagree there: 4 experts, 2 layers)."""
  shapes = {tuple(p.split('/')): v.shape for p, v in tree('scanned').items()}
  assert hf_deepseek.DEEPSEEK_FORM.axis(shapes) == 1
  plain = stacks.leading('plain', 'dense_layers', 'moe_layers')  # the bias not on axis 0
  with pytest.raises(errors.LayerScanMismatchError, match='gate/bias'):
    plain.axis(shapes)


def test_the_form_is_not_relaid_into_another():
  """Per-layer weights do not say where DeepSeek's dense layers end; and MaxText names its
  unscanned layers by kind: restacking, or re-laying into another form, is refused."""
  shapes = {tuple(p.split('/')): v.shape for p, v in tree('scanned').items()}
  with pytest.raises(errors.UnsupportedLayoutError, match='first_num_dense_layers'):
    hf_deepseek.DEEPSEEK_FORM.restack({('decoder', 'layers_0', 'w'): (2,)})
  with pytest.raises(errors.UnsupportedLayoutError, match='not supported'):
    stacks.relay(shapes, hf_deepseek.DEEPSEEK_FORM, stacks.UNSCANNED, 1)


def test_filled_is_a_vector_of_the_value_along_an_axis():
  t = filled(0.0, axis=1)
  assert t.check([(D, E)]) == (E,)
  x = np.ones((D, E), np.float32)
  for arr in (x, jnp.asarray(x)):
    out = t.apply([arr])
    assert out.shape == (E,) and out.dtype == np.float32 and not np.asarray(out).any()
  with pytest.raises(TransformError, match='no such axis'):
    t.check([(D,)])


@pytest.mark.parametrize('form', ['unscanned', 'scanned'])
@pytest.mark.parametrize('kind', ['tunix', 'maxtext'])
def test_the_routing_bias_is_exported_or_written_as_zeros_with_a_note(tmp_path, form, kind):
  """A Tunix run holds the bias: exported per MoE layer as stored. MaxText's params-only step
  has none: e_score_correction_bias is zeros (one per expert of the router), and a note says
  why and which layers."""
  flat = tree(form, bias=kind == 'tunix')
  save = save_tunix_run if kind == 'tunix' else save_maxtext_step
  src = save(tmp_path / 'run', flat)
  plan = export.plan_export(src, tmp_path / 'out', model='deepseek_v3',
                            hf_config=config(tmp_path / 'base'))
  export.run_export(plan)
  got = read_safetensors(tmp_path / 'out' / 'model.safetensors')
  _, expected = layers()
  notes = [n for n in plan.notes if 'absent in layers' in n]
  for i in range(DENSE_LAYERS, DENSE_LAYERS + MOE_LAYERS):
    bias = got[f'model.layers.{i}.mlp.gate.e_score_correction_bias']
    want = expected[i][BIAS] if kind == 'tunix' else np.zeros(E, np.float32)
    np.testing.assert_array_equal(bias, want)
    np.testing.assert_array_equal(got[f'model.layers.{i}.mlp.experts.3.down_proj.weight'],
                                  expected[i][f'{MOE}/MoeBlock_0/wo'][3].T)
  assert 'model.layers.0.mlp.gate.e_score_correction_bias' not in got
  assert len(notes) == (kind == 'maxtext'), plan.notes
  if notes:
    assert 'layers 1, 2' in notes[0] and 'MoEBiasVar' in notes[0], notes


def test_the_config_must_say_how_many_layers_are_dense(tmp_path):
  """first_k_dense_replace is the layers with a dense MLP (transformers builds the others as
  MoE): a base config that says otherwise is refused, naming both."""
  src = save_tunix_run(tmp_path / 'run', tree('unscanned'))
  with pytest.raises(errors.UnsupportedLayoutError,
                     match='first_k_dense_replace: config.json has 3, the weights have 1'):
    ot.export_to_hf(src, tmp_path / 'out', model='deepseek_v3',
                    hf_config=config(tmp_path / 'base', first_k_dense_replace=3))


@pytest.mark.parametrize('form', ['unscanned', 'scanned'])
def test_a_maxtext_convert_keeps_the_form_and_records_it(tmp_path, capsys, form):
  """`convert --layout maxtext` writes DeepSeek's layers as they are stored, recording whether
  they are scanned (MaxText's from_pretrained checks it: unscanned `dense_layers_{j}` are not
  scanned); re-laying them into the other form is refused (exit 2, no step written)."""
  src = save_tunix_run(tmp_path / 'run', tree(form))
  out = tmp_path / 'out'
  status, _, err = run(capsys, 'convert', src, out / 'a' / '0', '--layout', 'maxtext',
                       '--params-only')
  assert status == 0, err
  meta = json.loads((out / 'a' / '0' / '_CHECKPOINT_METADATA').read_text())['custom_metadata']
  assert meta['scan_layers'] is (form == 'scanned'), meta
  other = 'false' if form == 'scanned' else 'true'
  status, _, err = run(capsys, 'convert', src, out / 'b' / '0', '--layout', 'maxtext',
                       '--params-only', '--scan-layers', other)
  assert status == 2 and 'not supported' in err and "DeepSeek's dense then MoE" in err, err
  assert not (out / 'b').exists()


def test_concat_joins_parts_and_folds_a_scale_into_their_rows():
  """concat(axis) joins; with `scaled`, the last source multiplies each row, in float32: for
  a norm's scale s before a projection W, `(x * s) @ W == x @ (s[:, None] * W)`."""
  rng = np.random.default_rng(0)
  a, b, s = (rng.normal(size=shape).astype(np.float32) for shape in ((6, 2), (6, 4), (6,)))
  np.testing.assert_array_equal(concat(-1).apply([a, b]), np.concatenate([a, b], -1))
  folded = concat(-1, scaled=True)
  assert folded.check([(6, 2), (6, 4), (6,)]) == (6, 6)
  np.testing.assert_array_equal(folded.apply([a, b, s]), np.concatenate([a, b], -1) * s[:, None])
  x = rng.normal(size=(3, 6)).astype(np.float32)
  np.testing.assert_allclose(x @ folded.apply([a, b, s]), (x * s) @ np.concatenate([a, b], -1),
                             rtol=1e-5)
  with pytest.raises(TransformError, match='a scale'):
    folded.check([(6, 2), (6, 4), (5,)])
  with pytest.raises(TransformError, match='differ off axis'):
    concat(-1).check([(6, 2), (5, 4)])


def test_v4_scanned_form_numbers_its_blocks_after_the_hash_layers():
  """DeepSeek V4 scanned: decoder/layers_{0,1,2} (its hash layers) as they are, then blocks of
  two, `scanned_blocks/layers_{k}` (blocks on axis 1, the bias on axis 0): layer 3 + 2a + k."""
  hash_layers, blocks = 3, 2
  shapes = {('decoder', f'layers_{i}', 'mlp', 'w'): (4, 5) for i in range(hash_layers)}
  for k in range(2):
    shapes[('decoder', 'scanned_blocks', f'layers_{k}', 'mlp', 'w')] = (4, blocks, 5)
    shapes[('decoder', 'scanned_blocks', f'layers_{k}', *BIAS4.split('/'))] = (blocks, 4)
  form = hf_deepseek4.DEEPSEEK4_FORM
  per_layer = form.unstack(shapes, stacks.DEFAULT_AXIS)
  assert form.count(shapes) == hash_layers + 2 * blocks
  for i in range(hash_layers + 2 * blocks):
    m = per_layer[('decoder', f'layers_{i}', 'mlp', 'w')]
    if i < hash_layers:
      assert m.sources == (('decoder', f'layers_{i}', 'mlp', 'w'),), m
      continue
    a, k = divmod(i - hash_layers, 2)
    assert m.sources == (('decoder', 'scanned_blocks', f'layers_{k}', 'mlp', 'w'),), (i, m)
    assert m.transform.takes == ((1, a),) and m.shape == (4, 5), (i, m.transform)
    bias = per_layer[('decoder', f'layers_{i}', *BIAS4.split('/'))]
    assert bias.transform.takes == ((0, a),) and bias.shape == (4,), (i, bias.transform)

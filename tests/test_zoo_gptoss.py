"""gpt-oss from MaxText (issue 51), in process: the structures it brings, on synthetic trees.

The trees are MaxText 0.2.5's gpt-oss names and shapes (printed from `nnx.state` of a tiny
gpt-oss-20b built with MaxText; tests/maxtext_client.py's `family_case` writes the real ones,
tests/test_zoo_gptoss_clients.py checks those against MaxText's converter and transformers):
per layer `GptOssAttention/{query,key,value}/{kernel,bias}`, `out/{kernel,bias}`, `sinks`,
`GptOssMlp/gate/{kernel,bias}`, the experts `wi_0`, `wi_1` (E, D, F), their biases (E, F),
`wo` (E, F, D), `wo_bias` (E, D); scanned, blocks of two layers (sliding, full) as
`decoder/layers/layers_{0,1}/<w>`, the blocks on axis 1. Expected tensors are numpy formulas
written here from MaxText's converter's hooks (`GPT_OSS_TO_HF_PARAM_HOOK_FN`: `interleave`
sets `[..., ::2]` to `wi_0` and `[..., 1::2]` to `wi_1`).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

import orbax_tunix
from orbax_tunix.mapping import huggingface, stacks
from orbax_tunix.mapping.transforms import TransformError, deinterleave, interleave
from tests import test_export_maxtext as mt

D, N, K, H, E, F, V = mt.D, mt.N, mt.K, mt.H, mt.E, mt.FE, mt.V
LAYERS = 4  # two blocks of (sliding, full)
ATTN, MLP = 'GptOssAttention', 'GptOssMlp'
GPT_OSS_LAYER = {
    **{f'{ATTN}/{p}/kernel': (D, n, H) for p, n in (('query', N), ('key', K), ('value', K))},
    **{f'{ATTN}/{p}/bias': (n, H) for p, n in (('query', N), ('key', K), ('value', K))},
    f'{ATTN}/out/kernel': (N, H, D), f'{ATTN}/out/bias': (D,), f'{ATTN}/sinks': (N,),
    f'{MLP}/gate/kernel': (D, E), f'{MLP}/gate/bias': (E,),
    f'{MLP}/wi_0': (E, D, F), f'{MLP}/wi_1': (E, D, F), f'{MLP}/wi_0_bias': (E, F),
    f'{MLP}/wi_1_bias': (E, F), f'{MLP}/wo': (E, F, D), f'{MLP}/wo_bias': (E, D),
    'pre_self_attention_layer_norm/scale': (D,), 'post_self_attention_layer_norm/scale': (D,),
}
# What MaxText's MoE layers `sow` on every call (an nnx.Intermediate holds a tuple), which a
# Tunix run that has run saves beside the weights (tests/maxtext_client.py `lora_case`).
SOWN = 'GptOssMlp/moe_has_overflow/value/0'


def weights(seed: int = 0) -> tuple[dict, list[dict]]:
  rng = np.random.default_rng(seed)
  top = {'token_embedder/embedding': rng.normal(size=(V, D)).astype(np.float32),
         'decoder/decoder_norm/scale': rng.normal(size=(D,)).astype(np.float32),
         'decoder/logits_dense/kernel': rng.normal(size=(D, V)).astype(np.float32)}
  layers = [{k: rng.normal(size=s).astype(np.float32) for k, s in GPT_OSS_LAYER.items()}
            for _ in range(LAYERS)]
  return top, layers


def tree(form: str, seed: int = 0) -> dict[str, np.ndarray]:
  """MaxText's flat weight paths: unscanned, or scanned in blocks of two on axis 1."""
  top, layers = weights(seed)
  flat = dict(top)
  for i, w in enumerate(layers):
    if form == 'unscanned':
      flat.update({f'decoder/layers_{i}/{k}': v for k, v in w.items()})
  if form == 'scanned':
    for j in range(2):
      for k in layers[0]:
        flat[f'decoder/layers/layers_{j}/{k}'] = np.stack(
            [layers[2 * b + j][k] for b in range(LAYERS // 2)], axis=1)
  return flat


def expected(seed: int = 0) -> dict[str, np.ndarray]:
  top, layers = weights(seed)
  out = {'model.embed_tokens.weight': top['token_embedder/embedding'],
         'model.norm.weight': top['decoder/decoder_norm/scale'],
         'lm_head.weight': top['decoder/logits_dense/kernel'].T}
  for i, w in enumerate(layers):
    p = f'model.layers.{i}'
    for mt_name, hf in (('query', 'q'), ('key', 'k'), ('value', 'v')):
      kernel = w[f'{ATTN}/{mt_name}/kernel']
      out[f'{p}.self_attn.{hf}_proj.weight'] = kernel.reshape(D, -1).T
      out[f'{p}.self_attn.{hf}_proj.bias'] = w[f'{ATTN}/{mt_name}/bias'].reshape(-1)
    out[f'{p}.self_attn.o_proj.weight'] = w[f'{ATTN}/out/kernel'].reshape(-1, D).T
    out[f'{p}.self_attn.o_proj.bias'] = w[f'{ATTN}/out/bias']
    out[f'{p}.self_attn.sinks'] = w[f'{ATTN}/sinks']
    out[f'{p}.mlp.router.weight'] = w[f'{MLP}/gate/kernel'].T
    out[f'{p}.mlp.router.bias'] = w[f'{MLP}/gate/bias']
    for suffix, hf in (('', 'gate_up_proj'), ('_bias', 'gate_up_proj_bias')):
      gate, up = w[f'{MLP}/wi_0{suffix}'], w[f'{MLP}/wi_1{suffix}']
      fused = np.empty((*gate.shape[:-1], 2 * F), np.float32)
      fused[..., ::2], fused[..., 1::2] = gate, up
      out[f'{p}.mlp.experts.{hf}'] = fused
    out[f'{p}.mlp.experts.down_proj'] = w[f'{MLP}/wo']
    out[f'{p}.mlp.experts.down_proj_bias'] = w[f'{MLP}/wo_bias']
    out[f'{p}.input_layernorm.weight'] = w['pre_self_attention_layer_norm/scale']
    out[f'{p}.post_attention_layernorm.weight'] = w['post_self_attention_layer_norm/scale']
  return out


def sown_leaves(form: str) -> dict[str, np.ndarray]:
  """The sown `moe_has_overflow` of every MoE layer of a run that has run (Tunix's paths)."""
  layers = [f'layers/layers_{j}' for j in range(2)] if form == 'scanned' else [
      f'layers_{i}' for i in range(LAYERS)]
  return {f'base/decoder/{layer}/{SOWN}': np.zeros((1,), bool) for layer in layers}


def hub_config(folder, **fields) -> str:
  """openai/gpt-oss-20b's config.json as the Hub has it (MXFP4 experts: its
  `quantization_config`), fitted to the tiny model."""
  config = {
      'architectures': ['GptOssForCausalLM'], 'model_type': 'gpt_oss', 'attention_bias': True,
      'hidden_size': D, 'num_hidden_layers': LAYERS, 'num_attention_heads': N,
      'num_key_value_heads': K, 'head_dim': H, 'intermediate_size': F,
      'num_local_experts': E, 'num_experts_per_tok': 2, 'vocab_size': V,
      'layer_types': ['sliding_attention', 'full_attention'] * (LAYERS // 2),
      'sliding_window': 128, 'tie_word_embeddings': False,
      'quantization_config': {'quant_method': 'mxfp4', 'modules_to_not_convert': [
          'model.layers.*.self_attn', 'model.layers.*.mlp.router', 'model.embed_tokens',
          'lm_head']}, **fields}
  folder.mkdir()
  (folder / 'config.json').write_text(json.dumps(config))
  return str(folder)


@pytest.mark.parametrize('form', ['unscanned', 'scanned'])
@pytest.mark.parametrize('kind', ['tunix', 'maxtext'])
def test_gpt_oss_exports_its_experts_stacked_gate_and_up_interleaved(tmp_path, form, kind):
  """Every tensor as MaxText's converter makes it; the Hub's MXFP4 `quantization_config` is
  left out of config.json (the weights written are float); a Tunix run's sown values too."""
  if kind == 'tunix':
    src = mt.save_tunix_run(tmp_path / 'run', tree(form), extra=sown_leaves(form))
  else:
    src = mt.save_maxtext_step(tmp_path / 'run', tree(form))
  out = tmp_path / 'out'
  plan = orbax_tunix.tools.export.plan_export(src, out, model='gpt-oss',
                                              hf_config=hub_config(tmp_path / 'hub'))
  notes = '\n'.join(plan.notes)
  assert f'weights: MaxText model ({form}, {LAYERS} layers)' in notes
  assert any(n.startswith('config.json: dropped quantization_config') for n in plan.notes), notes
  orbax_tunix.tools.export.run_export(plan)
  got = mt.read_safetensors(out / 'model.safetensors')
  want = expected()
  assert sorted(got) == sorted(want)
  for name, value in want.items():
    np.testing.assert_array_equal(got[name], value, err_msg=name)
  config = json.loads((out / 'config.json').read_text())
  assert 'quantization_config' not in config
  assert (config['architectures'], config['model_type']) == (['GptOssForCausalLM'], 'gpt_oss')


def test_a_run_of_a_maxtext_moe_model_that_has_run_exports(tmp_path):
  """A Tunix run saves `nnx.state(model)` whole: what MaxText's MoE layers sow on every call
  (`moe_has_overflow`, an nnx.Intermediate: `value/0`) is no weight, and no reason to take
  the run for plain Orbax arrays (qwen3 MoE, a family that existed before gpt-oss)."""
  flat = mt.maxtext_tree('qwen3_moe', 'unscanned')
  sown = {f'base/decoder/layers_{i}/moe_block/moe_has_overflow/value/0': np.zeros((1,), bool)
          for i in range(mt.MODELS['qwen3_moe'][1])}
  src = mt.save_tunix_run(tmp_path / 'run', flat, extra=sown)
  orbax_tunix.export_to_hf(src, tmp_path / 'out', model='qwen3_moe')
  got = mt.read_safetensors(tmp_path / 'out' / 'model.safetensors')
  want = mt.expected('qwen3_moe')
  assert sorted(got) == sorted(want)
  for name, value in want.items():
    np.testing.assert_array_equal(got[name], value, err_msg=name)


def test_interleave_puts_the_first_at_even_positions_and_deinterleave_undoes_it():
  rng = np.random.default_rng(3)
  gate, up = rng.normal(size=(2, 3, 5)), rng.normal(size=(2, 3, 5))
  t = interleave(-1)
  fused = t.apply([gate, up])
  assert t.check([gate.shape, up.shape]) == fused.shape == (2, 3, 10)
  np.testing.assert_array_equal(fused[..., 0::2], gate)
  np.testing.assert_array_equal(fused[..., 1::2], up)
  np.testing.assert_array_equal(deinterleave(-1).apply([fused]),
                                np.concatenate([gate, up], axis=-1))
  np.testing.assert_array_equal(interleave(1).apply([gate, up])[:, 1::2], up)
  with pytest.raises(TransformError, match='two sources of one shape'):
    t.check([(2, 3, 5), (2, 3, 4)])


def test_gpt_oss_blocks_are_told_from_gemma3s():
  """gemma3's scanned blocks of six and gpt-oss's of two hold the same paths
  (`decoder/layers/layers_{j}/...`): the block positions the weights number tell them apart,
  so that each layer is the one MaxText stacked there (gpt-oss's layer 2 is block 1's first)."""
  gpt_oss = list(map(lambda p: tuple(p.split('/')), tree('scanned')))
  form = huggingface.layer_form(gpt_oss)
  assert form == stacks.cycles(2, 'gpt-oss')
  shapes = {p: v.shape for p, v in zip(gpt_oss, tree('scanned').values(), strict=True)}
  per_layer = form.unstack(shapes)
  assert per_layer[('decoder', 'layers_2', ATTN, 'sinks')].sources == (
      ('decoder', 'layers', 'layers_0', ATTN, 'sinks'),)
  gemma3 = [tuple(p.split('/')) for p in mt.maxtext_tree('gemma3', 'scanned')]
  assert huggingface.layer_form(gemma3) == stacks.blocks(6)
  twelve = [(*p[:2], f'layers_{j}', *p[3:]) for p in gemma3 if p[1] == 'layers'
            for j in range(6)]
  assert huggingface.layer_form(twelve) == stacks.blocks(6)


@pytest.mark.parametrize('kind', ['tunix', 'maxtext'])
def test_a_scanned_gpt_oss_relays_unscanned_and_back(tmp_path, kind):
  """`convert --layout maxtext --scan-layers false` numbers gpt-oss's layers as MaxText
  stacked them (block b, position j: layer 2b + j), and `--scan-layers true` stacks them so
  again (gpt-oss's form, found from its naming)."""
  save = mt.save_tunix_run if kind == 'tunix' else mt.save_maxtext_step
  src = save(tmp_path / 'run', tree('scanned'))
  p = mt.run_cli('convert', str(src), str(tmp_path / 'un' / '0'), '--layout', 'maxtext',
                 '--params-only', '--scan-layers', 'false')
  assert p.returncode == 0, p.stderr
  p = mt.run_cli('convert', str(tmp_path / 'un'), str(tmp_path / 're' / '0'), '--layout',
                 'maxtext', '--params-only', '--scan-layers', 'true')
  assert p.returncode == 0, p.stderr
  import orbax.checkpoint as ocp  # noqa: PLC0415

  with ocp.Checkpointer(ocp.PyTreeCheckpointHandler()) as ckptr:
    unscanned = ckptr.restore(tmp_path / 'un' / '0' / 'items')['params']['params']['decoder']
    rescanned = ckptr.restore(tmp_path / 're' / '0' / 'items')['params']['params']['decoder']
  _, layers = weights()
  for i, w in enumerate(layers):
    np.testing.assert_array_equal(unscanned[f'layers_{i}'][ATTN]['sinks'], w[f'{ATTN}/sinks'])
    np.testing.assert_array_equal(unscanned[f'layers_{i}'][MLP]['wi_1'], w[f'{MLP}/wi_1'])
  flat = tree('scanned')
  for j in range(2):
    np.testing.assert_array_equal(rescanned['layers'][f'layers_{j}'][MLP]['wo'],
                                  flat[f'decoder/layers/layers_{j}/{MLP}/wo'])


# --------------------------------------------------------------------------- #
# Qwen3-VL (issue 51): the text model under model.language_model., the vision tower carried
# --------------------------------------------------------------------------- #
VIT, VD, VH, VF = 'vision_encoder/Qwen3VLVisionEncoder_0', 8, 2, 32  # width, heads, MLP
VISION = {  # MaxText 0.2.5's tiny Qwen3-VL tower (2 blocks, one deepstack merger), by nnx.state
    f'{VIT}/patch_embed/proj/kernel': (2, 16, 16, 3, VD), f'{VIT}/patch_embed/proj/bias': (VD,),
    f'{VIT}/pos_embed_interpolate/pos_embed': (16, VD),
    **{f'{VIT}/blocks_{b}/{k}': s for b in range(2) for k, s in {
        'ln1/scale': (VD,), 'ln1/bias': (VD,), 'ln2/scale': (VD,), 'ln2/bias': (VD,),
        **{f'attn/attn/{p}/kernel': (VD, VH, VD // VH) for p in ('query', 'key', 'value')},
        **{f'attn/attn/{p}/bias': (VH, VD // VH) for p in ('query', 'key', 'value')},
        'attn/attn/out/kernel': (VH, VD // VH, VD), 'attn/attn/out/bias': (VD,),
        'mlp/kernel': (VD, VF), 'mlp/bias': (VF,), 'mlp_out/kernel': (VF, VD),
        'mlp_out/bias': (VD,)}.items()},
    **{f'{m}/{k}': s for m in (f'{VIT}/merger_0', 'vision_encoder/Qwen3VLVisionProjector_0/merger')
       for k, s in {'ln_q/scale': (4 * VD,), 'ln_q/bias': (4 * VD,), 'mlp_0/kernel': (4 * VD, 4 * VD),
                    'mlp_0/bias': (4 * VD,), 'mlp_2/kernel': (4 * VD, D), 'mlp_2/bias': (D,)}.items()},
}


def vision_tree(seed: int = 4) -> dict[str, np.ndarray]:
  rng = np.random.default_rng(seed)
  return {k: rng.normal(size=s).astype(np.float32) for k, s in VISION.items()}


def vision_expected(tower: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  """Hugging Face's tower, by the formulas of MaxText's converter's hooks (transpose(4, 3, 0,
  1, 2) of the patch convolution; q, k, v `reshape(D, D).T` then concatenated)."""
  out = {'model.visual.patch_embed.proj.weight':
         tower[f'{VIT}/patch_embed/proj/kernel'].transpose(4, 3, 0, 1, 2),
         'model.visual.patch_embed.proj.bias': tower[f'{VIT}/patch_embed/proj/bias'],
         'model.visual.pos_embed.weight': tower[f'{VIT}/pos_embed_interpolate/pos_embed']}
  for b in range(2):
    src, hf = f'{VIT}/blocks_{b}', f'model.visual.blocks.{b}'
    for n in '12':
      out[f'{hf}.norm{n}.weight'] = tower[f'{src}/ln{n}/scale']
      out[f'{hf}.norm{n}.bias'] = tower[f'{src}/ln{n}/bias']
    qkv = ('query', 'key', 'value')
    out[f'{hf}.attn.qkv.weight'] = np.concatenate(
        [tower[f'{src}/attn/attn/{p}/kernel'].reshape(VD, VD).T for p in qkv])
    out[f'{hf}.attn.qkv.bias'] = np.concatenate(
        [tower[f'{src}/attn/attn/{p}/bias'].reshape(VD) for p in qkv])
    out[f'{hf}.attn.proj.weight'] = tower[f'{src}/attn/attn/out/kernel'].reshape(VD, VD).T
    out[f'{hf}.attn.proj.bias'] = tower[f'{src}/attn/attn/out/bias']
    out[f'{hf}.mlp.linear_fc1.weight'] = tower[f'{src}/mlp/kernel'].T
    out[f'{hf}.mlp.linear_fc1.bias'] = tower[f'{src}/mlp/bias']
    out[f'{hf}.mlp.linear_fc2.weight'] = tower[f'{src}/mlp_out/kernel'].T
    out[f'{hf}.mlp.linear_fc2.bias'] = tower[f'{src}/mlp_out/bias']
  for src, hf in ((f'{VIT}/merger_0', 'model.visual.deepstack_merger_list.0'),
                  ('vision_encoder/Qwen3VLVisionProjector_0/merger', 'model.visual.merger')):
    out[f'{hf}.norm.weight'], out[f'{hf}.norm.bias'] = (tower[f'{src}/ln_q/scale'],
                                                        tower[f'{src}/ln_q/bias'])
    for mt_name, fc in (('mlp_0', 'linear_fc1'), ('mlp_2', 'linear_fc2')):
      out[f'{hf}.{fc}.weight'] = tower[f'{src}/{mt_name}/kernel'].T
      out[f'{hf}.{fc}.bias'] = tower[f'{src}/{mt_name}/bias']
  return out


def multimodal(text: dict[str, np.ndarray], moe: bool = False) -> dict[str, np.ndarray]:
  """The text model's expected tensors as Qwen3VL(Moe)ForConditionalGeneration names them:
  under `model.language_model.` (lm_head at the top); experts fused gate then up."""
  out = {}
  for name, value in text.items():
    if name.startswith('model.'):
      name = 'model.language_model.' + name[len('model.'):]
    out[name] = value
  if not moe:
    return out
  for i in range(mt.MODELS['qwen3_moe'][1]):
    p = f'model.language_model.layers.{i}.mlp.experts'
    gate = np.stack([out.pop(f'{p}.{e}.gate_proj.weight').T for e in range(E)])
    up = np.stack([out.pop(f'{p}.{e}.up_proj.weight').T for e in range(E)])
    out[f'{p}.gate_up_proj'] = np.concatenate([gate, up], axis=-1)  # (E, D, 2F)
    out[f'{p}.down_proj'] = np.stack([out.pop(f'{p}.{e}.down_proj.weight').T
                                      for e in range(E)])  # (E, F, D): MaxText's wo
  return out


@pytest.mark.parametrize('kind', ['tunix', 'maxtext'])
@pytest.mark.parametrize('model', ['qwen3_vl', 'qwen3_vl_moe'])
def test_qwen3_vl_exports_its_text_model_and_vision_tower(tmp_path, model, kind):
  text_model = 'qwen3_moe' if model == 'qwen3_vl_moe' else 'qwen3'
  tower = vision_tree()
  flat = {**mt.maxtext_tree(text_model, 'unscanned'), **tower}
  save = mt.save_tunix_run if kind == 'tunix' else mt.save_maxtext_step
  src = save(tmp_path / 'run', flat)
  orbax_tunix.export_to_hf(src, tmp_path / 'out', model=model)
  got = mt.read_safetensors(tmp_path / 'out' / 'model.safetensors')
  want = {**multimodal(mt.expected(text_model), moe=model == 'qwen3_vl_moe'),
          **vision_expected(tower)}
  assert sorted(got) == sorted(want)
  for name, value in want.items():
    np.testing.assert_array_equal(got[name], value, err_msg=name)


def qwen3_vl_config(folder, **text) -> str:
  """Qwen/Qwen3-VL-2B-Instruct's config.json as the Hub has it (its text model in
  `text_config`), fitted to the tiny text model."""
  _, n, untied = mt.MODELS['qwen3_tied']
  config = {'architectures': ['Qwen3VLForConditionalGeneration'], 'model_type': 'qwen3_vl',
            'tie_word_embeddings': True, 'image_token_id': 151655,
            'text_config': {'model_type': 'qwen3_vl_text', 'hidden_size': D, 'vocab_size': V,
                            'num_hidden_layers': n, 'num_attention_heads': N,
                            'num_key_value_heads': K, 'head_dim': H, 'intermediate_size': mt.F,
                            'tie_word_embeddings': not untied, 'rope_parameters': {
                                'rope_type': 'default', 'rope_theta': 5000000,
                                'mrope_section': [2, 1, 1], 'mrope_interleaved': True},
                            **text},
            'vision_config': {'model_type': 'qwen3_vl', 'depth': 2, 'hidden_size': VD}}
  folder.mkdir()
  (folder / 'config.json').write_text(json.dumps(config))
  return str(folder)


def test_a_qwen3_vl_trained_on_text_alone_is_its_qwen3(tmp_path):
  """MaxText's Qwen3-VL without its tower (`use_multimodal=False`) is its qwen3 decoder:
  `--model qwen3_vl` refuses it naming the tower it lacks; `--model qwen3` exports it as
  Qwen3ForCausalLM, the Qwen3-VL config's text_config written as a qwen3 config."""
  src = mt.save_maxtext_step(tmp_path / 'run', mt.maxtext_tree('qwen3_tied', 'unscanned'))
  hub = qwen3_vl_config(tmp_path / 'hub')
  with pytest.raises(orbax_tunix.errors.UnsupportedLayoutError,
                     match='Qwen3VLVisionEncoder_0/patch_embed/proj/kernel'):
    orbax_tunix.tools.export.plan_export(src, tmp_path / 'vl', model='qwen3_vl', hf_config=hub)
  orbax_tunix.export_to_hf(src, tmp_path / 'out', model='qwen3', hf_config=hub)
  written = json.loads((tmp_path / 'out' / 'config.json').read_text())
  assert (written['model_type'], written['architectures']) == ('qwen3', ['Qwen3ForCausalLM'])
  assert written['hidden_size'] == D and 'text_config' not in written
  got = mt.read_safetensors(tmp_path / 'out' / 'model.safetensors')
  assert sorted(got) == sorted(mt.expected('qwen3_tied'))


def test_concat_and_a_gather_over_words_keep_the_words_order():
  from orbax_tunix.mapping import patterns  # noqa: PLC0415
  from orbax_tunix.mapping.transforms import concat  # noqa: PLC0415

  rule = patterns.LayoutRule.of(('a', '{p:query|key|value}'), ('qkv',), concat(0))
  shapes = {('a', 'value'): (3, 2), ('a', 'query'): (1, 2), ('a', 'key'): (2, 2)}
  mapped = patterns.map_paths(shapes, [rule]).outputs[('qkv',)]
  assert mapped.sources == (('a', 'query'), ('a', 'key'), ('a', 'value'))
  assert mapped.shape == (6, 2)
  parts = [np.full((n, 2), n, np.float32) for n in (1, 2, 3)]
  np.testing.assert_array_equal(concat(0).apply(parts), np.concatenate(parts))
  with pytest.raises(TransformError, match='differ off axis'):
    concat(0).check([(1, 2), (1, 3)])
  with pytest.raises(orbax_tunix.errors.UnsupportedLayoutError, match='without gaps'):
    patterns.map_paths({('a', 'query'): (1, 2), ('a', 'value'): (3, 2)}, [rule])


def test_a_qwen3_omni_thinkers_text_model_is_its_qwen3_moe(tmp_path):
  """Qwen3-Omni's config holds its text model in its thinker's (`thinker_config.text_config`,
  beside the talker's): `--model qwen3_moe` writes that as the Qwen3MoeForCausalLM config of
  MaxText's Omni trained on text alone (its qwen3 MoE decoder)."""
  src = mt.save_maxtext_step(tmp_path / 'run', mt.maxtext_tree('qwen3_moe', 'unscanned'))
  text = {'model_type': 'qwen3_omni_moe_text', 'hidden_size': D, 'vocab_size': V,
          'num_hidden_layers': mt.MODELS['qwen3_moe'][1], 'num_attention_heads': N,
          'num_key_value_heads': K, 'head_dim': H, 'moe_intermediate_size': F,
          'num_experts': E}
  config = {'architectures': ['Qwen3OmniMoeForConditionalGeneration'],
            'model_type': 'qwen3_omni_moe', 'enable_audio_output': True,
            'thinker_config': {'model_type': 'qwen3_omni_moe_thinker', 'text_config': text,
                               'vision_config': {'depth': 27}},
            'talker_config': {'text_config': {'hidden_size': 1024}}}
  (tmp_path / 'hub').mkdir()
  (tmp_path / 'hub' / 'config.json').write_text(json.dumps(config))
  plan = orbax_tunix.tools.export.plan_export(src, tmp_path / 'out', model='qwen3_moe',
                                              hf_config=str(tmp_path / 'hub'))
  assert any('thinker_config.text_config as a Qwen3MoeForCausalLM config' in n
             for n in plan.notes), plan.notes
  orbax_tunix.tools.export.run_export(plan)
  written = json.loads((tmp_path / 'out' / 'config.json').read_text())
  assert (written['model_type'], written['architectures']) == ('qwen3_moe',
                                                              ['Qwen3MoeForCausalLM'])
  assert {k: written[k] for k in text if k != 'model_type'} == {
      k: v for k, v in text.items() if k != 'model_type'}
  assert 'thinker_config' not in written and 'talker_config' not in written

"""Exporting MaxText's hybrid decoders (Qwen3-Next, Qwen3.5 MoE: linear attention interleaved
with full attention, cycles of four) to Hugging Face, in process, on synthetic trees.

The checkpoints are written here with plain Orbax in MaxText 0.2.5's exact parameter trees
(names and shapes printed from `nnx.state` of tiny models MaxText builds; see
`orbax_tunix/mapping/hf_maxtext_hybrid.py`), as a Tunix run and as MaxText's own step,
unscanned and in each family's scanned form (stacked here by hand as MaxText stacks them:
Qwen3-Next's blocks on axis 1 with the three linear layers on axis 2, a full-attention
`global_layer` and a remainder; Qwen3.5's `layer_{j}` with blocks on axis 1). Expected
tensors are this module's own numpy, per Hugging Face name: transposes, the conv reversed,
and Qwen3.5's split per key head written as a loop over the heads (not the reshape the
export uses). The comparisons with MaxText's own converter and transformers' forward pass
are in tests/test_zoo_qwen_clients.py.
"""

from __future__ import annotations

import json
import math
import pathlib

import numpy as np
import orbax.checkpoint as ocp
import pytest

import orbax_tunix
from orbax_tunix.mapping import huggingface as hf
from orbax_tunix.mapping import stacks
from orbax_tunix.mapping.peft import ADAPTER_FILE
from orbax_tunix.mapping.transforms import TransformError, concat, regroup
from tests.test_export_maxtext import (
  assert_refused,
  nest,
  read_safetensors,
  run_cli,
  save_maxtext_step,
  save_tunix_run,
)

# Tiny dims, all distinct where a mix-up could pass: hidden, query heads, kv heads, head_dim,
# experts, expert width, key heads, key head dim, value heads, value head dim, conv, vocab.
D, N, K, H, E, F, HK, DK, HV, DV, KC, V = 16, 4, 2, 8, 3, 6, 2, 5, 6, 7, 3, 64
VP = HV // HK
CONV = 2 * HK * DK + HV * DV
LINEAR = {
    'attention/in_proj_qkvz/kernel': (D, HK * (2 * DK + 2 * VP * DV)),
    'attention/in_proj_ba/kernel': (D, HK * 2 * VP), 'attention/conv1d/kernel': (KC, 1, CONV),
    'attention/A_log': (HV,), 'attention/dt_bias': (HV,),
    'attention/norm/rms_norm/scale': (DV,), 'attention/out_proj/kernel': (HV * DV, D),
}
FULL = {
    'attention/attention/query/kernel': (D, N, 2 * H),
    'attention/attention/key/kernel': (D, K, H), 'attention/attention/value/kernel': (D, K, H),
    'attention/attention/out/kernel': (N * H, D), 'attention/attention/query_norm/scale': (H,),
    'attention/attention/key_norm/scale': (H,),
}
COMMON = {
    'input_layernorm/scale': (D,), 'post_attention_layernorm/scale': (D,),
    'mlp/routed_experts/gate/kernel': (D, E), 'mlp/routed_experts/wi_0': (E, D, F),
    'mlp/routed_experts/wi_1': (E, D, F), 'mlp/routed_experts/wo': (E, F, D),
    'mlp/shared_expert/wi_0/kernel': (D, F), 'mlp/shared_expert/wi_1/kernel': (D, F),
    'mlp/shared_expert/wo/kernel': (F, D), 'mlp/shared_expert_gate/kernel': (D, 1),
}
# family -> (its MaxText model's layers in these tests, the scanned form's name)
MODELS = {'qwen3_next': 9, 'qwen3_5_moe': 8}  # next: two blocks of four and a remainder
ARCHITECTURES = {'qwen3_next': 'Qwen3NextForCausalLM', 'qwen3_5_moe': 'Qwen3_5MoeForCausalLM'}


def full(i: int) -> bool:
  return (i + 1) % 4 == 0


def layers(n: int, seed: int = 0) -> tuple[dict, list[dict]]:
  """(the weights outside the layers, each layer's), random."""
  rng = np.random.default_rng(seed)

  def w(shape):
    return rng.normal(size=shape).astype(np.float32)

  top = {'token_embedder/embedding': w((V, D)), 'decoder/decoder_norm/scale': w((D,)),
         'decoder/logits_dense/kernel': w((D, V))}
  return top, [{k: w(s) for k, s in {**COMMON, **(FULL if full(i) else LINEAR)}.items()}
               for i in range(n)]


def tree(family: str, form: str, seed: int = 0) -> dict[str, np.ndarray]:
  """MaxText's flat weight paths, unscanned or in the family's scanned form."""
  top, per = layers(MODELS[family], seed)
  flat = dict(top)
  if form == 'unscanned':
    for i, ws in enumerate(per):
      flat.update({f'decoder/layers_{i}/{k}': v for k, v in ws.items()})
    return flat
  blocks = len(per) // 4
  if family == 'qwen3_5_moe':  # layer_{j}: the j-th layer of every block, blocks on axis 1
    for j in range(4):
      for k in per[j]:
        flat[f'decoder/layers/layer_{j}/{k}'] = np.stack([per[4 * b + j][k] for b in range(blocks)],
                                                         axis=1)
    return flat
  for k in per[0]:  # qwen3-next: blocks on axis 1, the three linear layers on axis 2
    flat[f'decoder/layers/local_layers/{k}'] = np.stack(
        [np.stack([per[4 * b + j][k] for j in range(3)], axis=1) for b in range(blocks)], axis=1)
    flat[f'decoder/layers_remainder/local_layers/{k}'] = np.stack(
        [per[i][k] for i in range(4 * blocks, len(per))], axis=1)
  for k in per[3]:
    flat[f'decoder/layers/global_layer/{k}'] = np.stack([per[4 * b + 3][k] for b in range(blocks)],
                                                        axis=1)
  return flat


def per_key_head(w: np.ndarray, parts: tuple[int, ...], take: tuple[int, ...]) -> np.ndarray:
  """Hugging Face's weight of the parts `take` of a kernel (D, Hk·sum(parts)) holding, per
  key head, the parts one after another: each part of every head, head after head."""
  starts = np.cumsum((0, *parts))
  block = sum(parts)
  cols = [w[:, h * block + starts[t]:h * block + starts[t + 1]] for t in take for h in range(HK)]
  return np.concatenate(cols, axis=1).T


def expected(family: str, seed: int = 0, per: list[dict] | None = None) -> dict[str, np.ndarray]:
  """The Hugging Face tensors of the model (`per`: its layers' weights, else `layers`')."""
  top, drawn = layers(MODELS[family], seed)
  per = drawn if per is None else per
  out = {'model.embed_tokens.weight': top['token_embedder/embedding'],
         'model.norm.weight': top['decoder/decoder_norm/scale'],
         'lm_head.weight': top['decoder/logits_dense/kernel'].T}
  for i, w in enumerate(per):
    p = f'model.layers.{i}'
    out[f'{p}.input_layernorm.weight'] = w['input_layernorm/scale']
    out[f'{p}.post_attention_layernorm.weight'] = w['post_attention_layernorm/scale']
    out[f'{p}.mlp.gate.weight'] = w['mlp/routed_experts/gate/kernel'].T
    for mt, name in (('wi_0', 'gate'), ('wi_1', 'up'), ('wo', 'down')):
      out[f'{p}.mlp.shared_expert.{name}_proj.weight'] = w[f'mlp/shared_expert/{mt}/kernel'].T
    out[f'{p}.mlp.shared_expert_gate.weight'] = w['mlp/shared_expert_gate/kernel'].T
    if family == 'qwen3_next':
      for e in range(E):
        for mt, name in (('wi_0', 'gate'), ('wi_1', 'up'), ('wo', 'down')):
          out[f'{p}.mlp.experts.{e}.{name}_proj.weight'] = w[f'mlp/routed_experts/{mt}'][e].T
    else:  # fused, gate then up: (E, 2F, D); down (E, D, F)
      gate_up = [np.concatenate([w['mlp/routed_experts/wi_0'][e].T, w['mlp/routed_experts/wi_1'][e].T])
                 for e in range(E)]
      out[f'{p}.mlp.experts.gate_up_proj'] = np.stack(gate_up)
      out[f'{p}.mlp.experts.down_proj'] = np.stack([w['mlp/routed_experts/wo'][e].T
                                                    for e in range(E)])
    if full(i):
      a = 'attention/attention'
      for mt, name in (('query', 'q'), ('key', 'k'), ('value', 'v')):
        x = w[f'{a}/{mt}/kernel']
        out[f'{p}.self_attn.{name}_proj.weight'] = x.reshape(D, -1).T
      out[f'{p}.self_attn.o_proj.weight'] = w[f'{a}/out/kernel'].T
      out[f'{p}.self_attn.q_norm.weight'] = w[f'{a}/query_norm/scale']
      out[f'{p}.self_attn.k_norm.weight'] = w[f'{a}/key_norm/scale']
      continue
    la = f'{p}.linear_attn'
    qkvz, ba = w['attention/in_proj_qkvz/kernel'], w['attention/in_proj_ba/kernel']
    if family == 'qwen3_next':
      out[f'{la}.in_proj_qkvz.weight'], out[f'{la}.in_proj_ba.weight'] = qkvz.T, ba.T
    else:
      parts = (DK, DK, VP * DV, VP * DV)
      out[f'{la}.in_proj_qkv.weight'] = per_key_head(qkvz, parts, (0, 1, 2))
      out[f'{la}.in_proj_z.weight'] = per_key_head(qkvz, parts, (3,))
      out[f'{la}.in_proj_b.weight'] = per_key_head(ba, (VP, VP), (0,))
      out[f'{la}.in_proj_a.weight'] = per_key_head(ba, (VP, VP), (1,))
    conv = w['attention/conv1d/kernel']  # (K, 1, C) -> PyTorch's (C, 1, K)
    out[f'{la}.conv1d.weight'] = np.stack([conv[:, 0, c] for c in range(CONV)])[:, None, :]
    out[f'{la}.A_log'], out[f'{la}.dt_bias'] = w['attention/A_log'], w['attention/dt_bias']
    out[f'{la}.norm.weight'] = w['attention/norm/rms_norm/scale']
    out[f'{la}.out_proj.weight'] = w['attention/out_proj/kernel'].T
  return out


def config(folder: pathlib.Path, family: str, **fields) -> pathlib.Path:
  n = MODELS[family]
  text = {'vocab_size': V, 'hidden_size': D, 'num_hidden_layers': n, 'num_attention_heads': N,
          'num_key_value_heads': K, 'head_dim': H, 'num_experts': E,
          'moe_intermediate_size': F, 'shared_expert_intermediate_size': F,
          'linear_num_key_heads': HK, 'linear_key_head_dim': DK, 'linear_num_value_heads': HV,
          'linear_value_head_dim': DV, 'linear_conv_kernel_dim': KC,
          'layer_types': ['full_attention' if full(i) else 'linear_attention' for i in range(n)],
          'tie_word_embeddings': False, **fields}
  values = text if family == 'qwen3_next' else {  # MaxText's: the multimodal model's
      'architectures': ['Qwen3_5MoeForConditionalGeneration'], 'model_type': 'qwen3_5_moe',
      'text_config': {**text, 'model_type': 'qwen3_5_moe_text'}, 'tie_word_embeddings': False}
  folder.mkdir(parents=True)
  (folder / 'config.json').write_text(json.dumps(values))
  return folder


CASES = [(f, form, kind) for f in MODELS for form in ('scanned', 'unscanned')
         for kind in ('tunix', 'maxtext')]


@pytest.mark.parametrize('family,form,kind', CASES)
def test_export_is_the_hf_class_layout(tmp_path, family, form, kind):
  save = save_tunix_run if kind == 'tunix' else save_maxtext_step
  src = save(tmp_path / 'run', tree(family, form))
  plan = orbax_tunix.tools.export.plan_export(src, tmp_path / 'out', model=family,
                                              hf_config=config(tmp_path / 'cfg', family))
  assert f'weights: MaxText model ({form}, {MODELS[family]} layers)' in '\n'.join(plan.notes)
  assert plan.architecture == ARCHITECTURES[family]
  orbax_tunix.tools.export.run_export(plan)
  got = read_safetensors(tmp_path / 'out' / 'model.safetensors')
  want = expected(family)
  assert sorted(got) == sorted(want)
  for name, value in want.items():
    np.testing.assert_array_equal(got[name], value, err_msg=name)
  written = json.loads((tmp_path / 'out' / 'config.json').read_text())
  assert written['architectures'] == [ARCHITECTURES[family]], written
  assert 'text_config' not in written and written['linear_num_key_heads'] == HK, written


def test_qwen3_5_without_the_config_sizes_is_refused(tmp_path):
  """The split per key head needs config.json's sizes: none given, or other ones, is refused
  before anything is written, naming the flag and the fields; a config whose layer kinds are
  not the weights' too."""
  src = save_tunix_run(tmp_path / 'run', tree('qwen3_5_moe', 'unscanned'))
  out = tmp_path / 'out'
  assert_refused(run_cli('export', str(src), str(out), '--model', 'qwen3_5_moe'), out,
                 '--hf-config', 'linear_num_key_heads', 'attention/in_proj_')
  cfg = config(tmp_path / 'three', 'qwen3_5_moe', linear_num_key_heads=3)
  assert_refused(run_cli('export', str(src), str(out), '--model', 'qwen3_5_moe',
                         '--hf-config', str(cfg)), out, 'in_proj_qkvz', 'regroup')
  kinds = ['full_attention' if i % 4 == 0 else 'linear_attention' for i in range(8)]
  cfg = config(tmp_path / 'kinds', 'qwen3_next', layer_types=kinds)
  src = save_tunix_run(tmp_path / 'next', tree('qwen3_next', 'unscanned'))
  assert_refused(run_cli('export', str(src), str(out), '--model', 'qwen3_next',
                         '--hf-config', str(cfg)), out, 'layer_types')


def test_regroup_and_concat():
  """`regroup` against a loop over the blocks; both refuse shapes that do not fit."""
  x = np.arange(2 * 3 * 10).reshape(3, 20).T.copy()  # (20, 3): two blocks of (1, 4, 5)
  t = regroup(0, 2, (1, 4, 5), (2, 0))
  want = np.concatenate([x[b * 10 + s:b * 10 + e] for s, e in ((5, 10), (0, 1)) for b in (0, 1)])
  assert t.check([x.shape]) == want.shape
  np.testing.assert_array_equal(t.apply([x]), want)
  with pytest.raises(TransformError, match='2 groups of 10'):
    t.check([(21, 3)])
  c = concat(-1)
  assert c.check([(2, 3, 4), (2, 3, 5)]) == (2, 3, 9)
  with pytest.raises(TransformError, match=r'concat\(axis=-1\)'):
    c.check([(2, 3, 4), (2, 4, 5)])


@pytest.mark.parametrize('family', MODELS)
def test_scanned_forms_place_every_layer(family):
  """Each form takes its stacks apart into the layers in order, and stacks them back; the
  scanned weights are told apart from the plain scanned form (`form_of`)."""
  flat = tree(family, 'scanned')
  shapes = {tuple(p.split('/')): v.shape for p, v in flat.items()}
  form = hf.get(family).namings[0].form
  assert stacks.form_of(shapes, hf.layer_forms()) == form
  per_layer = form.unstack(shapes)
  unscanned = tree(family, 'unscanned')
  for path, m in per_layer.items():
    value = m.transform.apply([flat['/'.join(m.sources[0])]])
    np.testing.assert_array_equal(value, unscanned['/'.join(path)], err_msg=str(path))
  back = form.restack({p: m.shape for p, m in per_layer.items()})
  assert sorted(back) == sorted(shapes)


RANK, ALPHA = 3, 6.0
# What the LoRA runs adapt (MaxText's lora_module_path in tests/test_zoo_qwen_clients.py).
LORA_TARGETS = ('attention/in_proj_qkvz/kernel', 'attention/in_proj_ba/kernel',
                'attention/out_proj/kernel', 'attention/attention/query/kernel',
                'attention/attention/out/kernel', 'mlp/shared_expert/wo/kernel')


def lora_tree(family: str, form: str, targets=LORA_TARGETS) -> tuple[dict, list[dict]]:
  """A LoRA run's weights (qwix's adapters as MaxText's LoRA writes them on these layers,
  printed from lora_utils.apply_lora_to_model on tiny MaxText models: a kernel's input
  dimension then the rank in `kernel_lora_a`, the rank then its other dimensions flattened in
  `kernel_lora_b`; stacked on axis 1 as the kernel's layers are), and each layer's weights
  merged by hand (W + alpha / rank · a·b)."""
  rng = np.random.default_rng(5)
  top, per = layers(MODELS[family])
  merged, adapters = [], []
  for w in per:
    merged.append(dict(w))
    adapters.append({})
    for k in targets:
      if k in w:
        a = rng.normal(size=(w[k].shape[0], RANK)).astype(np.float32)
        b = rng.normal(size=(RANK, math.prod(w[k].shape[1:]))).astype(np.float32)
        adapters[-1].update({f'{k}_lora_a': a, f'{k}_lora_b': b})
        merged[-1][k] = (w[k] + np.float32(ALPHA / RANK) * (a @ b).reshape(w[k].shape))
  if form == 'unscanned':
    flat = dict(top)
    for i, (w, ad) in enumerate(zip(per, adapters, strict=True)):
      flat.update({f'decoder/layers_{i}/{k}': v for k, v in {**w, **ad}.items()})
    return flat, merged
  flat = tree(family, 'scanned')  # qwen3.5's layer_{j}: adapters stacked as their kernels
  for j in range(4):
    for k in adapters[j]:
      flat[f'decoder/layers/layer_{j}/{k}'] = np.stack(
          [adapters[4 * b + j][k] for b in range(len(per) // 4)], axis=1)
  return flat, merged


@pytest.mark.parametrize('form', ['scanned', 'unscanned'])
def test_qwen3_5_lora_run_merged_and_as_peft_adapter(tmp_path, form):
  """A Qwen3.5 LoRA run: `--merge-lora` is the hand merge laid out as the class expects; the
  PEFT adapter on the `--base-only` export is that merge (in_proj_qkvz's adapter as
  in_proj_qkv's and in_proj_z's: one A, B regrouped per key head); the save of the adapters
  alone, onto the base export's config (the key heads), gives the same adapter."""
  flat, merged = lora_tree('qwen3_5_moe', form)
  src = save_tunix_run(tmp_path / 'run', flat)
  cfg = config(tmp_path / 'cfg', 'qwen3_5_moe')
  orbax_tunix.export_to_hf(src, tmp_path / 'merged', model='qwen3_5_moe', hf_config=cfg,
                           merge_lora=True, lora_alpha=ALPHA)
  got = read_safetensors(tmp_path / 'merged' / 'model.safetensors')
  for name, value in expected('qwen3_5_moe', per=merged).items():
    np.testing.assert_allclose(got[name], value, rtol=0, atol=2e-5, err_msg=name)
  orbax_tunix.export_to_hf(src, tmp_path / 'base', model='qwen3_5_moe', hf_config=cfg,
                           base_only=True)
  orbax_tunix.export_peft_adapter(src, tmp_path / 'a', model='qwen3_5_moe', lora_alpha=ALPHA,
                                  base_model=str(tmp_path / 'base'))
  base = read_safetensors(tmp_path / 'base' / 'model.safetensors')
  adapter = read_safetensors(tmp_path / 'a' / ADAPTER_FILE)
  modules = {k.removeprefix('base_model.model.').rsplit('.lora_', 1)[0] for k in adapter}
  assert {m.rsplit('.', 1)[-1] for m in modules} == {
      'in_proj_qkv', 'in_proj_z', 'in_proj_b', 'in_proj_a', 'out_proj', 'q_proj', 'o_proj',
      'down_proj'}, modules
  for m in modules:
    a = adapter[f'base_model.model.{m}.lora_A.weight']
    b = adapter[f'base_model.model.{m}.lora_B.weight']
    np.testing.assert_allclose(base[f'{m}.weight'] + ALPHA / RANK * (b @ a),
                               got[f'{m}.weight'], rtol=0, atol=2e-5, err_msg=m)
  only = {f'model_params/base/{p}/value': v for p, v in flat.items() if '_lora_' in p}
  with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckptr:
    ckptr.save(tmp_path / 'only' / '2', args=ocp.args.Composite(model_params=ocp.args.PyTreeSave(
        nest(only)['model_params'])))
  orbax_tunix.export_peft_adapter(tmp_path / 'only', tmp_path / 'a2', model='qwen3_5_moe',
                                  lora_alpha=ALPHA, base_model=str(tmp_path / 'base'))
  alone = read_safetensors(tmp_path / 'a2' / ADAPTER_FILE)
  assert sorted(alone) == sorted(adapter)
  for k, v in adapter.items():
    np.testing.assert_array_equal(alone[k], v, err_msg=k)


def test_qwen3_next_shared_expert_adapter_says_what_peft_does(tmp_path):
  """Qwen3-Next's adapter of a shared expert's kernel is written as it is and says that
  peft 0.21 loads it onto the routed experts instead (tests/test_zoo_qwen_clients.py's LoRA
  run adapts the attention alone, which peft loads as written)."""
  flat, _ = lora_tree('qwen3_next', 'unscanned')
  src = save_tunix_run(tmp_path / 'run', flat)
  plan = orbax_tunix.tools.export.plan_peft_export(src, tmp_path / 'a', model='qwen3_next',
                                                   lora_alpha=ALPHA)
  said = [n for n in plan.notes if 'peft 0.21' in n]
  assert len(said) == 1 and 'mlp.experts' in said[0], plan.notes
  assert 'model.layers.0.mlp.shared_expert.down_proj' in said[0], said
  flat, _ = lora_tree('qwen3_next', 'unscanned', LORA_TARGETS[:5])
  src = save_tunix_run(tmp_path / 'run2', flat)
  plan = orbax_tunix.tools.export.plan_peft_export(src, tmp_path / 'a2', model='qwen3_next',
                                                   lora_alpha=ALPHA)
  assert not [n for n in plan.notes if 'peft 0.21' in n], plan.notes


def test_adapters_alone_of_one_layer_kind_take_the_kinds_from_the_config(tmp_path):
  """A save of adapters on the linear-attention layers alone tells neither the layer count nor
  the layers' kinds (layer_types), so the base model's config gives them, unchecked."""
  flat, _ = lora_tree('qwen3_5_moe', 'unscanned', ('attention/in_proj_qkvz/kernel',))
  only = {f'base/{p}/value': v for p, v in flat.items() if '_lora_' in p}
  with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckptr:
    ckptr.save(tmp_path / 'only' / '2', args=ocp.args.Composite(
        model_params=ocp.args.PyTreeSave(nest(only))))
  cfg = config(tmp_path / 'cfg', 'qwen3_5_moe')
  orbax_tunix.export_peft_adapter(tmp_path / 'only', tmp_path / 'a', model='qwen3_5_moe',
                                  lora_alpha=ALPHA, base_model=str(cfg))
  adapter = read_safetensors(tmp_path / 'a' / ADAPTER_FILE)
  # The six linear layers' in_proj_qkv and in_proj_z: A and B each.
  assert len(adapter) == 2 * 2 * 6, sorted(adapter)

"""MaxText's namings of the Hugging Face families: its decoders' weights (a Tunix run of a
MaxText model, or MaxText's own step) onto `transformers` tensor names, as data
(`hf_naming.Naming`).

MaxText's naming is on the per-layer form `decoder/layers_{i}/<w>`: its stacked forms are
first taken apart by its layer form (`Naming.form`, a `mapping.stacks.LayerForm`); then the
rules apply what MaxText's own converter applies (checkpoint_conversion/utils/
param_mapping.py): kernels (in, heads, head_dim) merged and transposed to (out, in); gemma
norms `w - 1` (MaxText stores `1 + w`); gemma3's embedding divided by sqrt(hidden) rounded
to bfloat16 (gemma4: in float32), as MaxText stores it scaled.

MaxText 0.2.5's trees (tiny models built with MaxText, `nnx.state`):

  llama3.1, qwen3   token_embedder/embedding (V, D); decoder/decoder_norm/scale (D,);
                    decoder/logits_dense/kernel (D, V) (untied only: qwen3-0.6b has none);
                    per layer: self_attention/{query,key,value}/kernel (D, N, H),
                    self_attention/out/kernel (N, H, D), mlp/{wi_0,wi_1}/kernel (D, F),
                    mlp/wo/kernel (F, D), {pre,post}_self_attention_layer_norm/scale (D,);
                    qwen3 also self_attention/{query,key}_norm/scale (H,)
  gemma3            as above without logits_dense, norms {pre,post}_self_attention_norm,
                    {pre,post}_ffw_norm, query_norm, key_norm; scanned in blocks of six
  gemma4            gemma3's names plus layer_scalar (1,); global layers (every sixth)
                    have their own head_dim and no value kernel (k = v shared); gemma4-26b's
                    MLP is mlp/moe_block/{MoeBlock_0/{gate/kernel (D, E), per_expert_scale
                    (E,), wi_0, wi_1 (E, D, F), wo (E, F, D)}, shared_experts/...}, with
                    mlp/pre_forward_scale_2 (D,) and three more norms under mlp/
  gpt-oss           token_embedder/embedding, decoder/decoder_norm/scale,
                    decoder/logits_dense/kernel; per layer: GptOssAttention/{query,key,value}/
                    {kernel (D, N|K, H), bias (N|K, H)}, GptOssAttention/out/{kernel (N, H, D),
                    bias (D,)}, GptOssAttention/sinks (N,), GptOssMlp/gate/{kernel (D, E),
                    bias (E,)}, GptOssMlp/{wi_0,wi_1} (E, D, F), GptOssMlp/{wi_0,wi_1}_bias
                    (E, F), GptOssMlp/wo (E, F, D), GptOssMlp/wo_bias (E, D), the llama norms;
                    scanned in blocks of two (sliding, full): decoder/layers/layers_{0,1}/<w>
  qwen3-vl          qwen3's (or qwen3 MoE's) decoder, and with `use_multimodal` its tower:
                    vision_encoder/Qwen3VLVisionEncoder_0/{patch_embed/proj/{kernel
                    (T, P, P, C, D), bias}, pos_embed_interpolate/pos_embed, blocks_{b}/{ln1,
                    ln2}/{scale,bias}, blocks_{b}/attn/attn/{query,key,value}/{kernel (D, h, d),
                    bias (h, d)}, .../out/{kernel, bias}, blocks_{b}/{mlp,mlp_out}/{kernel,bias},
                    merger_{m}/...}, vision_encoder/Qwen3VLVisionProjector_0/merger/{ln_q,mlp_0,
                    mlp_2}/...; unscanned only (deepstack refuses scan_layers)
  qwen2 (2.5)       llama3.1's names plus self_attention/{query,key,value}/bias (N|K, H)
  mixtral           llama3.1's attention and norms; MoeBlock_0/{gate/kernel (D, E), wi_0,
                    wi_1 (E, D, F), wo (E, F, D)} for the MLP
  gemma2            each layer two: <m>_local/..., <m>_global/... for gemma3's <m> (no q/k
                    norms); MaxText's layer count is half Hugging Face's
  olmo3             attention/{query,key,value,out}/kernel, attention/{query,key}_norm/scale
                    (N·H,), (K·H,); mlp/...; post_self_attention_layer_norm, post_mlp_layer_norm;
                    scanned in blocks of four (decoder/layers/layers_{0..3})
"""

from __future__ import annotations

import dataclasses
import math

import ml_dtypes
import numpy as np

from orbax_tunix.mapping import stacks as stacks_lib
from orbax_tunix.mapping import trainers
from orbax_tunix.mapping.hf_naming import (
  HEAD_DIM_OF_HIDDEN,
  IN_PROJ,
  K_EQ_V_NOTE,
  LAYER,
  OUT_PROJ,
  EveryNth,
  LayerKinds,
  LayerType,
  LoraWeight,
  Naming,
  Vocab,
  per_expert,
  rule,
)
from orbax_tunix.mapping.patterns import LayoutRule, Pattern
from orbax_tunix.mapping.transforms import (
  IDENTITY,
  chain,
  concat,
  deinterleave,
  divide,
  interleave,
  merge_axes,
  multiply,
  per_input,
  shift,
  stack,
  transpose,
)

# The vocabulary axes of MaxText's embedding and logits kernel, padded for sharding.
MT_VOCAB = Vocab({'token_embedder/embedding': 0, 'decoder/logits_dense/kernel': 1}, any=True,
                 why='MaxText pads the vocabulary for sharding')

# The per-layer form the layer forms take stacked layers apart into (`LayerForm.unstack`).
MT_LAYER = '/'.join(stacks_lib.LAYER)

def _mt_attention(norm=None, query=IN_PROJ, key=IN_PROJ) -> list[LayoutRule]:
  """MaxText's attention (D, N, H) / (N, H, D) kernels, and its q/k norms through `norm`."""
  rules = [
      rule(f'{MT_LAYER}/self_attention/{mt}/kernel', f'{LAYER}.self_attn.{hf}_proj.weight', t)
      for mt, hf, t in (('query', 'q', query), ('key', 'k', key), ('value', 'v', IN_PROJ))
  ]
  rules.append(rule(f'{MT_LAYER}/self_attention/out/kernel', f'{LAYER}.self_attn.o_proj.weight',
                     OUT_PROJ))
  if norm is not None:
    rules += [rule(f'{MT_LAYER}/self_attention/{mt}_norm/scale',
                    f'{LAYER}.self_attn.{hf}_norm.weight', norm)
              for mt, hf in (('query', 'q'), ('key', 'k'))]
  return rules


def _mt_mlp() -> list[LayoutRule]:
  return [rule(f'{MT_LAYER}/mlp/{mt}/kernel', f'{LAYER}.mlp.{hf}_proj.weight', transpose())
          for mt, hf in (('wi_0', 'gate'), ('wi_1', 'up'), ('wo', 'down'))]


def _mt_dims() -> dict[str, tuple[tuple[str, int], ...]]:
  first = MT_LAYER.replace('{i}', '0')
  return {
      'vocab_size': (('token_embedder/embedding', 0),),
      'hidden_size': (('token_embedder/embedding', 1),),
      'num_attention_heads': ((f'{first}/self_attention/query/kernel', 1),),
      'head_dim': ((f'{first}/self_attention/query/kernel', 2),),
      'num_key_value_heads': ((f'{first}/self_attention/key/kernel', 1),),
      'intermediate_size': ((f'{first}/mlp/wi_0/kernel', 1),),
  }


# The config.json field of each axis of MaxText's per-layer kernels (`_mt_dims` read the other
# way, for every axis): (D, N, H), (D, K, H), (N, H, D); the MLP's (D, F), (F, D).
_MT_AXES = {
    f'{MT_LAYER}/self_attention/query/kernel': ('hidden_size', 'num_attention_heads', 'head_dim'),
    **{f'{MT_LAYER}/self_attention/{p}/kernel': ('hidden_size', 'num_key_value_heads', 'head_dim')
       for p in ('key', 'value')},
    f'{MT_LAYER}/self_attention/out/kernel': ('num_attention_heads', 'head_dim', 'hidden_size'),
    **{f'{MT_LAYER}/mlp/{p}/kernel': ('hidden_size', 'intermediate_size')
       for p in ('wi_0', 'wi_1')},
    f'{MT_LAYER}/mlp/wo/kernel': ('intermediate_size', 'hidden_size'),
}


# MaxText's llama (llama2, llama3.1) keeps the query kernel divided by sqrt(head_dim)
# (no scaling in its attention) and q/k's rotary pairs interleaved; Hugging Face's Llama
# scales in attention and rotates halves. As MaxText's converter (`scale_query_layer`,
# `adjust_rope`): the product in float32, rounded once.
_LLAMA_QUERY = chain(multiply('sqrt(head_dim)', math.sqrt, axis=2), deinterleave(-1),
                     IN_PROJ)
_LLAMA_KEY = chain(deinterleave(-1), IN_PROJ)


def _maxtext_qwen3_style(norms: bool, query=IN_PROJ, key=IN_PROJ, config_defaults=None
                         ) -> Naming:
  """MaxText's llama3.1 and qwen3 (dense) decoders: qwen3 adds q/k norms, llama's q/k
  are laid out as `_LLAMA_QUERY` / `_LLAMA_KEY` undo."""
  rules = [
      rule('token_embedder/embedding', 'model.embed_tokens.weight'),
      rule('decoder/decoder_norm/scale', 'model.norm.weight'),
      rule('decoder/logits_dense/kernel', 'lm_head.weight', transpose()),  # Only when not tied.
      *_mt_attention(norm=IDENTITY if norms else None, query=query, key=key),
      *_mt_mlp(),
      rule(f'{MT_LAYER}/pre_self_attention_layer_norm/scale', f'{LAYER}.input_layernorm.weight'),
      rule(f'{MT_LAYER}/post_self_attention_layer_norm/scale',
            f'{LAYER}.post_attention_layernorm.weight'),
  ]
  required = [(
      'token_embedder/embedding', 'decoder/decoder_norm/scale',
      f'{MT_LAYER}/self_attention/{{p:query|key|value|out}}/kernel',
      f'{MT_LAYER}/mlp/{{p:wi_0|wi_1|wo}}/kernel',
      f'{MT_LAYER}/{{n:pre|post}}_self_attention_layer_norm/scale',
  )]
  if norms:
    required.append((f'{MT_LAYER}/self_attention/{{n:query|key}}_norm/scale',))
  return Naming(
      trainers.MAXTEXT, tuple(rules), tuple((r,) for r in required), _mt_dims(),
      tied=lambda paths: ('decoder', 'logits_dense', 'kernel') not in paths,
      layer=stacks_lib.LAYER, vocab=MT_VOCAB,
      form=stacks_lib.SCANNED_FORM, axes=_MT_AXES, config_defaults=config_defaults or {},
      lora_flattened=True,
  )


QWEN3 = _maxtext_qwen3_style(norms=True)
LLAMA3 = _maxtext_qwen3_style(norms=False, query=_LLAMA_QUERY, key=_LLAMA_KEY,
                              config_defaults=HEAD_DIM_OF_HIDDEN)


# MaxText stores gemma's norms as `1 + w` (HF: `w`), and gemma's embedding
# multiplied by sqrt(hidden): gemma3's converter divides by that number rounded
# to bfloat16 (`np.dtype('bfloat16').type(hidden ** 0.5)`), gemma4's by it in float32.
GEMMA_NORM = shift(-1)
_MT_GEMMA_NORMS = {
    'pre_self_attention_norm': 'input_layernorm',
    'post_self_attention_norm': 'post_attention_layernorm',
    'pre_ffw_norm': 'pre_feedforward_layernorm',
    'post_ffw_norm': 'post_feedforward_layernorm',
}


def _bf16_sqrt(hidden: int) -> float:
  return float(np.asarray(math.sqrt(hidden), dtype=ml_dtypes.bfloat16))


def _maxtext_gemma(embedding, norm, kernels: str, *own: str) -> Naming:
  """MaxText's gemma3 text decoder, and gemma4's base (tied embedding; in blocks of six): the
  embedding through `embedding`, every norm through `norm`; each layer holds the attention
  `kernels` and `own`, weights Hugging Face names as MaxText does (gemma4's layer_scalar)."""
  rules = (
      rule('token_embedder/embedding', 'model.embed_tokens.weight', embedding),
      rule('decoder/decoder_norm/scale', 'model.norm.weight', norm),
      *_mt_attention(norm=norm),
      *_mt_mlp(),
      *(rule(f'{MT_LAYER}/{mt}/scale', f'{LAYER}.{hf}.weight', norm)
        for mt, hf in _MT_GEMMA_NORMS.items()),
      *(rule(f'{MT_LAYER}/{w}', f'{LAYER}.{w}') for w in own),
  )
  required = (
      'token_embedder/embedding', 'decoder/decoder_norm/scale',
      f'{MT_LAYER}/self_attention/{{p:{kernels}}}/kernel',
      f'{MT_LAYER}/self_attention/{{n:query|key}}_norm/scale',
      f'{MT_LAYER}/mlp/{{p:wi_0|wi_1|wo}}/kernel', *(f'{MT_LAYER}/{w}' for w in own),
      *(f'{MT_LAYER}/{mt}/scale' for mt in _MT_GEMMA_NORMS),
  )
  return Naming(trainers.MAXTEXT, rules, ((required,),), _mt_dims(),
                layer=stacks_lib.LAYER, vocab=MT_VOCAB,
                form=stacks_lib.blocks(6), axes=_MT_AXES, lora_flattened=True)


GEMMA3 = _maxtext_gemma(divide('sqrt(hidden) as bfloat16', _bf16_sqrt, axis=1), GEMMA_NORM,
                        'query|key|value|out')


def _f32_sqrt(hidden: int) -> float:
  return float(np.float32(math.sqrt(hidden)))


# Gemma 4's global layers (transformers' `per_layer_config`): their own head_dim and kv heads,
# and no value kernel (their keys are their values: the k_eq_v note holds there only).
_MT_VALUE = f'{MT_LAYER}/self_attention/value/kernel'
_GEMMA4_GLOBAL = LayerType({'head_dim': 'global_head_dim',
                            'num_key_value_heads': 'num_global_key_value_heads'},
                           without=(_MT_VALUE,))


# transformers' Gemma4TextConfig without `layer_types`: every sixth layer global, the rest local.
_GEMMA4_LAYER_TYPES = EveryNth(6, 'full_attention', 'sliding_attention')
_MT_MOE = f'{MT_LAYER}/mlp/moe_block'
# MaxText's gemma4-26b experts, as its converter's `moe_gate_up_hook`: wi_0, wi_1 (E, D, F)
# side by side on F, then (E, 2F, D): stacked (E, D, 2, F) and merged.
_GATE_UP = chain(stack(2), merge_axes(2, 4), transpose((0, 2, 1)))


def _gemma4_moe_block(dense: Naming) -> Naming:
  """Gemma 4's dense naming, with the MoE layers of gemma4-26b (Hugging Face's
  `enable_moe_block`) as the alternative to the dense MLP: under `mlp/`, the router
  `moe_block/MoeBlock_0/gate/kernel` (D, E) and its scales (`router.proj`, `.scale`,
  `.per_expert_scale`), the experts fused as `experts.gate_up_proj` (`_GATE_UP`) and
  `experts.down_proj` (E, D, F), the shared expert as the dense MLP's `mlp.*_proj`, and the
  block's three norms."""
  moe = f'{_MT_MOE}/MoeBlock_0'
  rules = (
      rule(f'{moe}/gate/kernel', f'{LAYER}.router.proj.weight', transpose()),
      rule(f'{moe}/per_expert_scale', f'{LAYER}.router.per_expert_scale'),
      rule(f'{MT_LAYER}/mlp/pre_forward_scale_2', f'{LAYER}.router.scale'),
      rule(f'{moe}/wi_{{k}}', f'{LAYER}.experts.gate_up_proj', _GATE_UP),
      rule(f'{moe}/wo', f'{LAYER}.experts.down_proj', transpose((0, 2, 1))),
      *(rule(f'{_MT_MOE}/shared_experts/{mt}/kernel', f'{LAYER}.mlp.{hf}_proj.weight',
             transpose()) for mt, hf in (('wi_0', 'gate'), ('wi_1', 'up'), ('wo', 'down'))),
      *(rule(f'{MT_LAYER}/mlp/{n}/scale', f'{LAYER}.{n}.weight')
        for n in ('pre_feedforward_layernorm_2', 'post_feedforward_layernorm_1',
                  'post_feedforward_layernorm_2')),
  )
  dense_mlp = f'{MT_LAYER}/mlp/{{p:wi_0|wi_1|wo}}/kernel'
  moe_mlp = (f'{moe}/gate/kernel', f'{moe}/{{p:per_expert_scale|wi_0|wi_1|wo}}',
             f'{_MT_MOE}/shared_experts/{{p:wi_0|wi_1|wo}}/kernel',
             f'{MT_LAYER}/mlp/pre_forward_scale_2',
             f'{MT_LAYER}/mlp/{{n:pre_feedforward_layernorm_2|post_feedforward_layernorm_1|'
             'post_feedforward_layernorm_2}/scale')
  required = tuple(tuple(tuple(p for p in alt if p != dense_mlp) for alt in alts)
                   for alts in dense.required) + (((dense_mlp,), moe_mlp),)
  first = MT_LAYER.replace('{i}', '0')
  dims = {**dense.dims,
          'intermediate_size': (*dense.dims['intermediate_size'],
                                (f'{first}/mlp/moe_block/shared_experts/wi_0/kernel', 1)),
          'num_experts': ((f'{first}/mlp/moe_block/MoeBlock_0/gate/kernel', 1),),
          'moe_intermediate_size': ((f'{first}/mlp/moe_block/MoeBlock_0/wi_0', 2),)}
  return dataclasses.replace(dense, rules=dense.rules + rules, required=required, dims=dims)


def _maxtext_gemma4() -> Naming:
  """MaxText's gemma4 (31b) text decoder: local and global layers, norms stored as they are;
  a global layer (every sixth: `_GEMMA4_GLOBAL`) has no value kernel (`share_kv_projections`;
  Hugging Face's `attention_k_eq_v`), so `value` is not required of every layer. gemma4-26b's
  MoE layers: `_gemma4_moe_block`."""
  dims = {
      **_mt_dims(),
      # Layer 5 is the first global one (five local, one global).
      'global_head_dim': (('decoder/layers_5/self_attention/query/kernel', 2),),
      'num_global_key_value_heads': (('decoder/layers_5/self_attention/key/kernel', 1),),
  }
  return _gemma4_moe_block(dataclasses.replace(
      _maxtext_gemma(divide('sqrt(hidden) as float32', _f32_sqrt, axis=1), IDENTITY,
                     'query|key|out', 'layer_scalar'),
      dims=dims, form=stacks_lib.local_global(6, 'gemma4'),
      architecture='Gemma4ForCausalLM', model_type='gemma4_text',
      lora={f'{MT_LAYER}/self_attention/key/kernel': LoraWeight(
          note=K_EQ_V_NOTE, without=_MT_VALUE)},
      # transformers' Gemma4TextConfig without `layer_types`: every sixth is global
      # (it also makes the last layer global; MaxText's remainder layers are local).
      kinds=LayerKinds({'full_attention': _GEMMA4_GLOBAL}, _GEMMA4_LAYER_TYPES)))


def _maxtext_qwen3_moe() -> Naming:
  """MaxText's qwen3 MoE decoder (qwen3-30b-a3b): the MLP is `moe_block`.

  The router `gate/kernel` (D, E) is Hugging Face's `mlp.gate.weight` (E, D);
  the experts `wi_0`, `wi_1` (E, D, F) and `wo` (E, F, D), one array each
  for all experts, become one (out, in) tensor per expert.
  """
  dense = _maxtext_qwen3_style(norms=True)
  rules = (
      *(r for r in dense.rules if 'mlp' not in [k.text for k in r.source.keys]),
      rule(f'{MT_LAYER}/moe_block/gate/kernel', f'{LAYER}.mlp.gate.weight', transpose()),
      *(per_expert(f'{MT_LAYER}/moe_block/{mt}', f'{LAYER}.mlp.experts.{{e}}.{hf}_proj.weight',
                    0, transpose())
        for mt, hf in (('wi_0', 'gate'), ('wi_1', 'up'), ('wo', 'down'))),
  )
  required = ((
      'token_embedder/embedding', 'decoder/decoder_norm/scale',
      f'{MT_LAYER}/self_attention/{{p:query|key|value|out}}/kernel',
      f'{MT_LAYER}/self_attention/{{n:query|key}}_norm/scale',
      f'{MT_LAYER}/moe_block/{{p:wi_0|wi_1|wo}}', f'{MT_LAYER}/moe_block/gate/kernel',
      f'{MT_LAYER}/{{n:pre|post}}_self_attention_layer_norm/scale',
  ),)
  dims = {k: v for k, v in _mt_dims().items() if k != 'intermediate_size'}
  dims['moe_intermediate_size'] = ((f'{MT_LAYER.replace("{i}", "0")}/moe_block/wi_0', 2),)
  dims['num_experts'] = ((f'{MT_LAYER.replace("{i}", "0")}/moe_block/wi_0', 0),)
  axes = {p: f for p, f in _MT_AXES.items() if '/mlp/' not in p}
  axes[f'{MT_LAYER}/moe_block/gate/kernel'] = ('hidden_size', 'num_experts')
  return dataclasses.replace(dense, rules=rules, required=tuple((r,) for r in required),
                             dims=dims, axes=axes)


GEMMA4 = _maxtext_gemma4()
QWEN3_MOE = _maxtext_qwen3_moe()


# MaxText's gpt-oss attention and MLP modules (models/gpt_oss.py), and Hugging Face's.
_GPT_OSS_ATTN = f'{MT_LAYER}/GptOssAttention'
_GPT_OSS_MLP = f'{MT_LAYER}/GptOssMlp'


def _maxtext_gpt_oss() -> Naming:
  """MaxText's gpt-oss decoder (gpt-oss-20b, -120b): biased attention with a sink per head,
  a biased router, and experts kept stacked as Hugging Face's GptOssExperts holds them.

  As MaxText's converter (`GPT_OSS_TO_HF_PARAM_HOOK_FN`): q/k/v/o kernels as every MaxText
  attention's, their (heads, head_dim) biases flattened; the router kernel transposed; the
  experts' `wi_0` (gate) and `wi_1` (up) (E, D, F) interleaved along F into `gate_up_proj`
  (E, D, 2F) (transformers' GptOssExperts reads the gate at `::2`, the up at `1::2`), their
  biases likewise; `wo` (E, F, D) is `down_proj` as it is. The gather `wi_{k}` takes the two
  in MaxText's order (0: gate, 1: up).
  """
  attn, mlp = _GPT_OSS_ATTN, _GPT_OSS_MLP
  hf = f'{LAYER}.self_attn'
  rules = [
      rule('token_embedder/embedding', 'model.embed_tokens.weight'),
      rule('decoder/decoder_norm/scale', 'model.norm.weight'),
      rule('decoder/logits_dense/kernel', 'lm_head.weight', transpose()),
      *(rule(f'{attn}/{mt}/kernel', f'{hf}.{p}_proj.weight', IN_PROJ)
        for mt, p in (('query', 'q'), ('key', 'k'), ('value', 'v'))),
      *(rule(f'{attn}/{mt}/bias', f'{hf}.{p}_proj.bias', merge_axes(0, 2))
        for mt, p in (('query', 'q'), ('key', 'k'), ('value', 'v'))),
      rule(f'{attn}/out/kernel', f'{hf}.o_proj.weight', OUT_PROJ),
      rule(f'{attn}/out/bias', f'{hf}.o_proj.bias'),
      rule(f'{attn}/sinks', f'{hf}.sinks'),
      rule(f'{mlp}/gate/kernel', f'{LAYER}.mlp.router.weight', transpose()),
      rule(f'{mlp}/gate/bias', f'{LAYER}.mlp.router.bias'),
      rule(f'{mlp}/wi_{{k}}', f'{LAYER}.mlp.experts.gate_up_proj', interleave(-1)),
      rule(f'{mlp}/wi_{{k}}_bias', f'{LAYER}.mlp.experts.gate_up_proj_bias', interleave(-1)),
      rule(f'{mlp}/wo', f'{LAYER}.mlp.experts.down_proj'),
      rule(f'{mlp}/wo_bias', f'{LAYER}.mlp.experts.down_proj_bias'),
      rule(f'{MT_LAYER}/pre_self_attention_layer_norm/scale', f'{LAYER}.input_layernorm.weight'),
      rule(f'{MT_LAYER}/post_self_attention_layer_norm/scale',
            f'{LAYER}.post_attention_layernorm.weight'),
  ]
  required = ((
      'token_embedder/embedding', 'decoder/decoder_norm/scale',
      f'{attn}/{{p:query|key|value|out}}/{{w:kernel|bias}}', f'{attn}/sinks',
      f'{mlp}/gate/{{w:kernel|bias}}', f'{mlp}/{{p:wi_0|wi_1|wo}}',
      f'{mlp}/{{p:wi_0|wi_1|wo}}_bias',
      f'{MT_LAYER}/{{n:pre|post}}_self_attention_layer_norm/scale',
  ),)
  first = MT_LAYER.replace('{i}', '0')
  dims = {
      'vocab_size': (('token_embedder/embedding', 0),),
      'hidden_size': (('token_embedder/embedding', 1),),
      'num_attention_heads': ((f'{first}/GptOssAttention/query/kernel', 1),),
      'head_dim': ((f'{first}/GptOssAttention/query/kernel', 2),),
      'num_key_value_heads': ((f'{first}/GptOssAttention/key/kernel', 1),),
      'intermediate_size': ((f'{first}/GptOssMlp/wi_0', 2),),
      'num_local_experts': ((f'{first}/GptOssMlp/wi_0', 0),),
  }
  axes = {
      f'{attn}/query/kernel': ('hidden_size', 'num_attention_heads', 'head_dim'),
      **{f'{attn}/{p}/kernel': ('hidden_size', 'num_key_value_heads', 'head_dim')
         for p in ('key', 'value')},
      f'{attn}/out/kernel': ('num_attention_heads', 'head_dim', 'hidden_size'),
  }
  return Naming(
      trainers.MAXTEXT, tuple(rules), tuple((r,) for r in required), dims,
      tied=lambda paths: ('decoder', 'logits_dense', 'kernel') not in paths,
      layer=stacks_lib.LAYER, vocab=MT_VOCAB,
      form=stacks_lib.cycles(2, 'gpt-oss'), axes=axes, lora_flattened=True)


GPT_OSS = _maxtext_gpt_oss()


def _under(rules, into: str) -> tuple[LayoutRule, ...]:
  """The rules with every destination's `model.` put under `into` (a multimodal class holds its
  text model deeper: Qwen3-VL's `model.language_model.`); `lm_head` stays where it is."""
  def moved(dest: Pattern) -> Pattern:
    (key,) = dest.keys
    spec = key.spec
    return Pattern.parse((into + spec[len('model.'):] if spec.startswith('model.') else spec,))

  return tuple(dataclasses.replace(r, dests=tuple((moved(d), t) for d, t in r.dests))
               for r in rules)


# MaxText's Qwen3-VL vision tower (models/qwen3_vl_vision.py; `use_multimodal`) and its
# projector, as MaxText's converter names and lays them out (QWEN3_VL_MAXTEXT_TO_HF_PARAM_HOOK_FN):
# the patch embedding's 3-d convolution (T, P, P, C, D) -> (D, C, T, P, P); each block's query,
# key and value (D, heads, head_dim) as one `qkv` (3D, D), their biases as one (3D,); the rest
# Hugging Face's linear (out, in) layers and LayerNorms.
_VIT = 'vision_encoder/Qwen3VLVisionEncoder_0'
_VIT_PROJECTOR = 'vision_encoder/Qwen3VLVisionProjector_0'
_QKV = per_input((IN_PROJ,) * 3, concat(0))
_QKV_BIAS = per_input((merge_axes(0, 2),) * 3, concat(0))


def _merger(source: str, dest: str) -> list[LayoutRule]:
  """A patch merger: its LayerNorm (`ln_q`), then two linear layers (`mlp_0`, `mlp_2`)."""
  return [
      *(rule(f'{source}/ln_q/{w}', f'{dest}.norm.{hf}') for w, hf in (('scale', 'weight'),
                                                                     ('bias', 'bias'))),
      *(rule(f'{source}/mlp_{mt}/kernel', f'{dest}.linear_fc{hf}.weight', transpose())
        for mt, hf in (('0', '1'), ('2', '2'))),
      *(rule(f'{source}/mlp_{mt}/bias', f'{dest}.linear_fc{hf}.bias')
        for mt, hf in (('0', '1'), ('2', '2'))),
  ]


def _qwen3_vl_vision(into: str) -> list[LayoutRule]:
  """Qwen3-VL's vision tower onto Hugging Face's `<into>.*` (`model.visual.`)."""
  block, hf = f'{_VIT}/blocks_{{b}}', f'{into}blocks.{{b}}'
  return [
      rule(f'{_VIT}/patch_embed/proj/kernel', f'{into}patch_embed.proj.weight',
           transpose((4, 3, 0, 1, 2))),
      rule(f'{_VIT}/patch_embed/proj/bias', f'{into}patch_embed.proj.bias'),
      rule(f'{_VIT}/pos_embed_interpolate/pos_embed', f'{into}pos_embed.weight'),
      rule(f'{block}/ln{{n:1|2}}/scale', f'{hf}.norm{{n}}.weight'),
      rule(f'{block}/ln{{n:1|2}}/bias', f'{hf}.norm{{n}}.bias'),
      # A gather over the words, in the order listed: query, key, value.
      rule(f'{block}/attn/attn/{{p:query|key|value}}/kernel', f'{hf}.attn.qkv.weight', _QKV),
      rule(f'{block}/attn/attn/{{p:query|key|value}}/bias', f'{hf}.attn.qkv.bias', _QKV_BIAS),
      rule(f'{block}/attn/attn/out/kernel', f'{hf}.attn.proj.weight', OUT_PROJ),
      rule(f'{block}/attn/attn/out/bias', f'{hf}.attn.proj.bias'),
      rule(f'{block}/mlp/kernel', f'{hf}.mlp.linear_fc1.weight', transpose()),
      rule(f'{block}/mlp/bias', f'{hf}.mlp.linear_fc1.bias'),
      rule(f'{block}/mlp_out/kernel', f'{hf}.mlp.linear_fc2.weight', transpose()),
      rule(f'{block}/mlp_out/bias', f'{hf}.mlp.linear_fc2.bias'),
      *_merger(f'{_VIT}/merger_{{m}}', f'{into}deepstack_merger_list.{{m}}'),
      *_merger(f'{_VIT_PROJECTOR}/merger', f'{into}merger'),
  ]


# What every Qwen3-VL with its vision tower holds of it (its blocks are numbered: not listed).
_QWEN3_VL_VISION_REQUIRED = (
    f'{_VIT}/patch_embed/proj/{{w:kernel|bias}}', f'{_VIT}/pos_embed_interpolate/pos_embed',
    f'{_VIT_PROJECTOR}/merger/mlp_{{k:0|2}}/kernel')


def _maxtext_qwen3_vl(text: Naming, experts=()) -> Naming:
  """MaxText's Qwen3-VL (qwen3-vl-2b, -4b: its qwen3 decoder; `experts`: the 30b-a3b's MoE
  rules) with its vision tower, as Qwen3VL(Moe)ForConditionalGeneration holds them: the text
  model under `model.language_model.`, the tower under `model.visual.`, `lm_head` (when untied)
  at the top, as MaxText's converter writes them. The tower is required: a MaxText Qwen3-VL
  trained on text alone (`use_multimodal=False`) has none, and its text model is a qwen3
  (`--model qwen3`, `qwen3_moe`)."""
  rules = (*_under(experts or text.rules, 'model.language_model.'),
           *_qwen3_vl_vision('model.visual.'))
  return dataclasses.replace(text, rules=rules,
                             required=(*text.required, (_QWEN3_VL_VISION_REQUIRED,)))


QWEN3_VL = _maxtext_qwen3_vl(QWEN3)


def _qwen3_vl_moe_text() -> tuple[LayoutRule, ...]:
  """MaxText's qwen3 MoE decoder as Qwen3-VL-MoE's text model holds it: the experts fused, as
  the Hub's checkpoints store them and MaxText's converter writes them
  (`process_wi_0_wi_1_fused`): `gate_up_proj` (E, D, 2F) the gate then the up (not
  interleaved: transformers splits it in halves), `down_proj` (E, F, D) as MaxText's `wo`."""
  moe = f'{MT_LAYER}/moe_block'
  return (*(r for r in QWEN3_MOE.rules if r.fan_out is None),
          rule(f'{moe}/wi_{{k}}', f'{LAYER}.mlp.experts.gate_up_proj', concat(-1)),
          rule(f'{moe}/wo', f'{LAYER}.mlp.experts.down_proj'))


QWEN3_VL_MOE = _maxtext_qwen3_vl(QWEN3_MOE, _qwen3_vl_moe_text())


# --- Qwen2.5, Mixtral (issue 51) -----------------------------------------------------------

_MT_BIAS = f'{MT_LAYER}/self_attention/{{p:query|key|value}}/bias'


def _maxtext_qwen2() -> Naming:
  """MaxText's qwen2 decoder (qwen2.5-1.5b/7b/14b): llama3.1's names without its query
  scaling and interleaved rotary pairs (MaxText's qwen2 scales by head_dim**-0.5 in its
  attention, and rotates halves), plus q/k/v biases (heads, head_dim), flattened as Hugging
  Face's (heads·head_dim,)."""
  base = _maxtext_qwen3_style(norms=False, config_defaults=HEAD_DIM_OF_HIDDEN)
  biases = tuple(rule(f'{MT_LAYER}/self_attention/{mt}/bias', f'{LAYER}.self_attn.{hf}_proj.bias',
                      merge_axes(0, 2))
                 for mt, hf in (('query', 'q'), ('key', 'k'), ('value', 'v')))
  return dataclasses.replace(
      base, rules=base.rules + biases, required=base.required + (((_MT_BIAS,),),),
      axes={**base.axes,
            f'{MT_LAYER}/self_attention/query/bias': ('num_attention_heads', 'head_dim'),
            **{f'{MT_LAYER}/self_attention/{p}/bias': ('num_key_value_heads', 'head_dim')
               for p in ('key', 'value')}})


QWEN2 = _maxtext_qwen2()

# MaxText's models whose attention does not scale (no `query_pre_attn_scalar`, no q/k norms)
# keep the query kernel divided by sqrt(head_dim) (`init_query_w`'s depth scaling, then
# trained so): Hugging Face's scales in attention. As MaxText's converter (`scale_query_layer`
# of mixtral and gemma2): times sqrt(head_dim) in float32, rounded once.
_SCALED_QUERY = chain(multiply('sqrt(head_dim)', math.sqrt, axis=2), IN_PROJ)
_MIXTRAL_MOE = f'{MT_LAYER}/MoeBlock_0'


def _maxtext_mixtral() -> Naming:
  """MaxText's mixtral decoder (mixtral-8x7b, 8x22b): llama's attention and norms with the
  query scaled back (`_SCALED_QUERY`; rotary pairs in halves), every layer's MLP a sparse
  `MoeBlock_0`: the router `gate/kernel` (D, E) is Hugging Face's
  `block_sparse_moe.gate.weight` (E, D); the stacked experts `wi_0`, `wi_1` (E, D, F) and
  `wo` (E, F, D) one (out, in) tensor per expert, `w1` (gate), `w3` (up), `w2` (down), the
  names of the Hub's files (transformers 5 fuses them on load)."""
  dense = _maxtext_qwen3_style(norms=False, query=_SCALED_QUERY,
                               config_defaults=HEAD_DIM_OF_HIDDEN)
  moe = f'{LAYER}.block_sparse_moe'
  rules = (
      *(r for r in dense.rules if 'mlp' not in [k.text for k in r.source.keys]),
      rule(f'{_MIXTRAL_MOE}/gate/kernel', f'{moe}.gate.weight', transpose()),
      *(per_expert(f'{_MIXTRAL_MOE}/{mt}', f'{moe}.experts.{{e}}.{hf}.weight', 0, transpose())
        for mt, hf in (('wi_0', 'w1'), ('wi_1', 'w3'), ('wo', 'w2'))),
  )
  required = ((
      'token_embedder/embedding', 'decoder/decoder_norm/scale',
      f'{MT_LAYER}/self_attention/{{p:query|key|value|out}}/kernel',
      f'{_MIXTRAL_MOE}/{{p:wi_0|wi_1|wo}}', f'{_MIXTRAL_MOE}/gate/kernel',
      f'{MT_LAYER}/{{n:pre|post}}_self_attention_layer_norm/scale',
  ),)
  first = f'{MT_LAYER.replace("{i}", "0")}/MoeBlock_0'
  dims = {k: v for k, v in _mt_dims().items() if k != 'intermediate_size'}
  dims['intermediate_size'] = ((f'{first}/wi_0', 2),)
  dims['num_local_experts'] = ((f'{first}/wi_0', 0),)
  axes = {p: f for p, f in _MT_AXES.items() if '/mlp/' not in p}
  axes[f'{_MIXTRAL_MOE}/gate/kernel'] = ('hidden_size', 'num_local_experts')
  return dataclasses.replace(dense, rules=rules, required=tuple((r,) for r in required),
                             dims=dims, axes=axes)


MIXTRAL = _maxtext_mixtral()


# --- Gemma 2 ---------------------------------------------------------------------------------


def _maxtext_gemma2() -> Naming:
  """MaxText's gemma2 decoder (gemma2-2b/9b/27b): each MaxText layer is two of Hugging Face's,
  local (sliding) then global, their modules `<m>_local` and `<m>_global` (the form
  `stacks.paired` takes apart: layers 2i and 2i + 1); per layer gemma3's names without q/k
  norms. As MaxText's converter: norms `w - 1`, the (tied) embedding divided by sqrt(hidden)
  in float32, the query kernel times sqrt(head_dim) (`_SCALED_QUERY`: MaxText's gemma2 does
  not scale in attention; transformers scales by query_pre_attn_scalar**-0.5, so a config of
  query_pre_attn_scalar = head_dim computes MaxText's model)."""
  rules = (
      rule('token_embedder/embedding', 'model.embed_tokens.weight',
           divide('sqrt(hidden) as float32', _f32_sqrt, axis=1)),
      rule('decoder/decoder_norm/scale', 'model.norm.weight', GEMMA_NORM),
      *_mt_attention(query=_SCALED_QUERY),
      *_mt_mlp(),
      *(rule(f'{MT_LAYER}/{mt}/scale', f'{LAYER}.{hf}.weight', GEMMA_NORM)
        for mt, hf in _MT_GEMMA_NORMS.items()),
  )
  required = (
      'token_embedder/embedding', 'decoder/decoder_norm/scale',
      f'{MT_LAYER}/self_attention/{{p:query|key|value|out}}/kernel',
      f'{MT_LAYER}/mlp/{{p:wi_0|wi_1|wo}}/kernel',
      *(f'{MT_LAYER}/{mt}/scale' for mt in _MT_GEMMA_NORMS),
  )
  return Naming(trainers.MAXTEXT, rules, ((required,),), _mt_dims(),
                layer=stacks_lib.LAYER, vocab=MT_VOCAB,
                form=stacks_lib.paired('_local', '_global'), axes=_MT_AXES,
                lora_flattened=True)


GEMMA2 = _maxtext_gemma2()


# --- OLMo 3 ----------------------------------------------------------------------------------

_OLMO3_NORMS = {'post_self_attention_layer_norm': 'post_attention_layernorm',
                'post_mlp_layer_norm': 'post_feedforward_layernorm'}


def _maxtext_olmo3() -> Naming:
  """MaxText's olmo3 decoder (olmo3-7b, olmo3-32b): its attention under `attention/`, q/k
  norms over all heads ((heads·head_dim,): Hugging Face's Olmo3 normalises the projections
  whole), norms after the attention and after the MLP only (no input norm), stored as Hugging
  Face stores them; untied. Scanned, MaxText stacks it in blocks of four (three sliding-window
  layers, one global: `inhomogeneous_layer_cycle_interval`), `decoder/layers/layers_{j}`.
  MaxText 0.2.5's own converter has its parameter map, not its shape map (`hf_shape.py`)."""
  attention = f'{MT_LAYER}/attention'
  rules = (
      rule('token_embedder/embedding', 'model.embed_tokens.weight'),
      rule('decoder/decoder_norm/scale', 'model.norm.weight'),
      rule('decoder/logits_dense/kernel', 'lm_head.weight', transpose()),  # Only when not tied.
      *(rule(f'{attention}/{mt}/kernel', f'{LAYER}.self_attn.{hf}_proj.weight', IN_PROJ)
        for mt, hf in (('query', 'q'), ('key', 'k'), ('value', 'v'))),
      rule(f'{attention}/out/kernel', f'{LAYER}.self_attn.o_proj.weight', OUT_PROJ),
      *(rule(f'{attention}/{mt}_norm/scale', f'{LAYER}.self_attn.{hf}_norm.weight')
        for mt, hf in (('query', 'q'), ('key', 'k'))),
      *_mt_mlp(),
      *(rule(f'{MT_LAYER}/{mt}/scale', f'{LAYER}.{hf}.weight') for mt, hf in _OLMO3_NORMS.items()),
  )
  required = (
      'token_embedder/embedding', 'decoder/decoder_norm/scale',
      f'{attention}/{{p:query|key|value|out}}/kernel', f'{attention}/{{n:query|key}}_norm/scale',
      f'{MT_LAYER}/mlp/{{p:wi_0|wi_1|wo}}/kernel', *(f'{MT_LAYER}/{mt}/scale' for mt in _OLMO3_NORMS),
  )
  first = f'{MT_LAYER.replace("{i}", "0")}/attention'
  dims = {**_mt_dims(),
          'num_attention_heads': ((f'{first}/query/kernel', 1),),
          'head_dim': ((f'{first}/query/kernel', 2),),
          'num_key_value_heads': ((f'{first}/key/kernel', 1),)}
  axes = {p.replace('/self_attention/', '/attention/'): f for p, f in _MT_AXES.items()}
  return Naming(trainers.MAXTEXT, rules, ((required,),), dims,
                tied=lambda paths: ('decoder', 'logits_dense', 'kernel') not in paths,
                layer=stacks_lib.LAYER, vocab=MT_VOCAB,
                form=dataclasses.replace(stacks_lib.blocks(4),
                                         name="olmo3's scanned blocks of 4"),
                axes=axes, config_defaults=HEAD_DIM_OF_HIDDEN, lora_flattened=True)


OLMO3 = _maxtext_olmo3()

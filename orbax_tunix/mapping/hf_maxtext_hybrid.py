"""MaxText's hybrid decoders, linear attention interleaved with full attention, onto
`transformers` names, as data (`hf_naming.Naming`): Qwen3-Next (qwen3-next-80b-a3b) and
Qwen3.5 MoE (qwen3.5-35b-a3b, qwen3.5-397b-a17b).

Both are MaxText 0.2.5's `Qwen3NextDecoderLayer` (Qwen3.5's layers are its subclasses): in
every cycle of four layers, three gated-delta-net (linear attention) layers and one gated
full-attention layer, each with a sparse MoE block (routed experts, a shared expert and its
sigmoid gate). Per layer (`decoder/layers_{i}/...`, from `nnx.state` of tiny models MaxText
builds):

  both        input_layernorm/scale, post_attention_layernorm/scale (D,) (stored as HF's:
              both scale by `1 + w`); mlp/routed_experts/gate/kernel (D, E);
              mlp/routed_experts/{wi_0,wi_1} (E, D, F), wo (E, F, D);
              mlp/shared_expert/{wi_0,wi_1}/kernel (D, F), wo/kernel (F, D);
              mlp/shared_expert_gate/kernel (D, 1)
  linear      attention/in_proj_qkvz/kernel (D, Hk·(2Dk + 2Vp·Dv)): per key head [q k v z]
              (Vp = Hv / Hk value heads per key head); attention/in_proj_ba/kernel
              (D, Hk·2Vp): per key head [b a]; attention/conv1d/kernel (K, 1, C) over the
              channels [q of every head, k, v] (C = 2Hk·Dk + Hv·Dv); attention/A_log,
              attention/dt_bias (Hv,); attention/norm/rms_norm/scale (Dv,);
              attention/out_proj/kernel (Hv·Dv, D)
  full        attention/attention/query/kernel (D, N, 2H): per head [query gate];
              attention/attention/{key,value}/kernel (D, K, H);
              attention/attention/out/kernel (N·H, D); attention/attention/{query,key}_norm

What MaxText 0.2.5's converter (`param_mapping.py`'s QWEN3_NEXT_* and QWEN3_5_*) writes,
and so the export: kernels transposed to (out, in), the conv kernel (K, 1, C) reversed to
PyTorch's (C, 1, K), the query kept with its gate (Hugging Face's `q_proj` is per head
[query gate] too). Qwen3-Next's Hugging Face class keeps MaxText's fused `in_proj_qkvz` and
`in_proj_ba` and one tensor per expert (as its Hub checkpoints; transformers fuses them on
load); Qwen3.5's splits them, per key head, into `in_proj_qkv` ([q k v], every head's
part after another: the conv's channel order) and `in_proj_z`, `in_proj_b` and
`in_proj_a` (`regroup`, whose sizes config.json gives: `Sized`), and fuses each layer's
experts, gate then up (`gate_up_proj` (E, 2F, D), `down_proj` (E, D, F)).

Qwen3.5 is a multimodal model; MaxText's converter names its text model as
Qwen3_5MoeForConditionalGeneration holds it (`model.language_model.*`), whose vision tower a
MaxText text model lacks (a load then misses every `model.visual.*` weight): the export is
the text class, Qwen3_5MoeForCausalLM (`model.*`, config `qwen3_5_moe_text`), which loads it
whole.
"""

from __future__ import annotations

from orbax_tunix.mapping import stacks as stacks_lib
from orbax_tunix.mapping import trainers
from orbax_tunix.mapping.hf_maxtext import MT_LAYER, MT_VOCAB
from orbax_tunix.mapping.hf_naming import (
  IN_PROJ,
  LAYER,
  LayerKinds,
  LoraWeight,
  Naming,
  Sized,
  per_expert,
  rule,
)
from orbax_tunix.mapping.patterns import LayoutRule
from orbax_tunix.mapping.transforms import chain, concat, regroup, transpose

# The cycle of MaxText's `inhomogeneous_layer_cycle_interval` (4 in every released model):
# layer i is full attention when (i + 1) % 4 == 0.
CYCLE = 4
_FIRST = MT_LAYER.replace('{i}', '0')  # a linear-attention layer
_FIRST_FULL = MT_LAYER.replace('{i}', str(CYCLE - 1))
_LINEAR = f'{MT_LAYER}/attention'
_FULL = f'{MT_LAYER}/attention/attention'
# Hugging Face's (out, in) transposes of a MaxText (in, out) kernel; conv (K, 1, C) -> (C, 1, K).
_T = transpose()
_CONV = transpose((2, 1, 0))
# qwen3.5-35b-a3b's sizes, for the table of maps in docs/huggingface.md.
_QWEN3_5_SIZES = {'linear_num_key_heads': 16, 'linear_key_head_dim': 128,
                  'linear_num_value_heads': 32, 'linear_value_head_dim': 128}


def _common() -> list[LayoutRule]:
  """What every layer (and the model around them) holds: embedding, norms, the router and
  the shared expert with its gate."""
  mlp = f'{MT_LAYER}/mlp'
  return [
      rule('token_embedder/embedding', 'model.embed_tokens.weight'),
      rule('decoder/decoder_norm/scale', 'model.norm.weight'),
      rule('decoder/logits_dense/kernel', 'lm_head.weight', _T),
      *(rule(f'{MT_LAYER}/{n}/scale', f'{LAYER}.{n}.weight')
        for n in ('input_layernorm', 'post_attention_layernorm')),
      rule(f'{mlp}/routed_experts/gate/kernel', f'{LAYER}.mlp.gate.weight', _T),
      *(rule(f'{mlp}/shared_expert/{mt}/kernel', f'{LAYER}.mlp.shared_expert.{hf}_proj.weight',
             _T) for mt, hf in (('wi_0', 'gate'), ('wi_1', 'up'), ('wo', 'down'))),
      rule(f'{mlp}/shared_expert_gate/kernel', f'{LAYER}.mlp.shared_expert_gate.weight', _T),
  ]


def _full_attention() -> list[LayoutRule]:
  """The gated full attention: the query kernel (D, N, 2H) holds per head [query gate], as
  Hugging Face's q_proj does; the output kernel is stored flat (N·H, D)."""
  return [
      *(rule(f'{_FULL}/{mt}/kernel', f'{LAYER}.self_attn.{hf}_proj.weight', IN_PROJ)
        for mt, hf in (('query', 'q'), ('key', 'k'), ('value', 'v'))),
      rule(f'{_FULL}/out/kernel', f'{LAYER}.self_attn.o_proj.weight', _T),
      *(rule(f'{_FULL}/{mt}_norm/scale', f'{LAYER}.self_attn.{hf}_norm.weight')
        for mt, hf in (('query', 'q'), ('key', 'k'))),
  ]


def _linear_attention() -> list[LayoutRule]:
  """The gated delta net's weights both families name alike (the conv, the decay's A_log
  and dt_bias, the gated norm, the output projection)."""
  return [
      rule(f'{_LINEAR}/conv1d/kernel', f'{LAYER}.linear_attn.conv1d.weight', _CONV),
      *(rule(f'{_LINEAR}/{w}', f'{LAYER}.linear_attn.{w}') for w in ('A_log', 'dt_bias')),
      rule(f'{_LINEAR}/norm/rms_norm/scale', f'{LAYER}.linear_attn.norm.weight'),
      rule(f'{_LINEAR}/out_proj/kernel', f'{LAYER}.linear_attn.out_proj.weight', _T),
  ]


_EXPERTS = (('wi_0', 'gate'), ('wi_1', 'up'), ('wo', 'down'))
_COMMON_REQUIRED = (
    'token_embedder/embedding', 'decoder/decoder_norm/scale',
    f'{MT_LAYER}/{{n:input_layernorm|post_attention_layernorm}}/scale',
    f'{MT_LAYER}/mlp/routed_experts/{{p:wi_0|wi_1|wo}}',
    f'{MT_LAYER}/mlp/routed_experts/gate/kernel',
    f'{MT_LAYER}/mlp/shared_expert/{{p:wi_0|wi_1|wo}}/kernel',
    f'{MT_LAYER}/mlp/shared_expert_gate/kernel',
)
# Per layer, one kind or the other (`Naming.missing` meets alternatives layer by layer).
_KINDS_REQUIRED = (
    (f'{_LINEAR}/{{p:in_proj_qkvz|in_proj_ba|conv1d|out_proj}}/kernel',
     f'{_LINEAR}/{{p:A_log|dt_bias}}', f'{_LINEAR}/norm/rms_norm/scale'),
    (f'{_FULL}/{{p:query|key|value|out}}/kernel', f'{_FULL}/{{n:query|key}}_norm/scale'),
)
# The weight only a layer of each kind (config.json's `layer_types` entry) holds.
_TYPED_BY = {'linear_attention': f'{_LINEAR}/in_proj_qkvz/kernel',
             'full_attention': f'{_FULL}/query/kernel'}
_DIMS = {
    'vocab_size': (('token_embedder/embedding', 0),),
    'hidden_size': (('token_embedder/embedding', 1),),
    'num_attention_heads': ((f'{_FIRST_FULL}/attention/attention/query/kernel', 1),),
    'num_key_value_heads': ((f'{_FIRST_FULL}/attention/attention/key/kernel', 1),),
    'head_dim': ((f'{_FIRST_FULL}/attention/attention/key/kernel', 2),),
    'linear_num_value_heads': ((f'{_FIRST}/attention/A_log', 0),),
    'linear_value_head_dim': ((f'{_FIRST}/attention/norm/rms_norm/scale', 0),),
    'linear_conv_kernel_dim': ((f'{_FIRST}/attention/conv1d/kernel', 0),),
    'num_experts': ((f'{_FIRST}/mlp/routed_experts/wi_0', 0),),
    'moe_intermediate_size': ((f'{_FIRST}/mlp/routed_experts/wi_0', 2),),
    'shared_expert_intermediate_size': ((f'{_FIRST}/mlp/shared_expert/wi_0/kernel', 1),),
}
# Derived sizes no config.json names (`Naming.config_defaults`), for `axes`.
_QKVZ = ('2 x (linear_num_key_heads x linear_key_head_dim + linear_num_value_heads x'
         ' linear_value_head_dim)')
_BA = '2 x linear_num_value_heads'
_LINEAR_V = 'linear_num_value_heads x linear_value_head_dim'
_Q_GATED = '2 x head_dim'  # the query kernel's last axis: query and gate
_Q_OUT = 'num_attention_heads x head_dim'


def _sizes(c) -> dict:
  return {
      _QKVZ: 2 * (c['linear_num_key_heads'] * c['linear_key_head_dim']
                  + c['linear_num_value_heads'] * c['linear_value_head_dim']),
      _BA: 2 * c['linear_num_value_heads'],
      _LINEAR_V: c['linear_num_value_heads'] * c['linear_value_head_dim'],
      _Q_OUT: c['num_attention_heads'] * c['head_dim'],
  }


# The config.json field of each axis of the kernels a LoRA run adapts (a save of adapters
# alone takes the weights' shapes from them: qwix flattens MaxText's kernels).
_AXES = {
    f'{_LINEAR}/in_proj_qkvz/kernel': ('hidden_size', _QKVZ),
    f'{_LINEAR}/in_proj_ba/kernel': ('hidden_size', _BA),
    f'{_LINEAR}/out_proj/kernel': (_LINEAR_V, 'hidden_size'),
    f'{_FULL}/query/kernel': ('hidden_size', 'num_attention_heads', _Q_GATED),
    **{f'{_FULL}/{p}/kernel': ('hidden_size', 'num_key_value_heads', 'head_dim')
       for p in ('key', 'value')},
    f'{_FULL}/out/kernel': (_Q_OUT, 'hidden_size'),
    **{f'{MT_LAYER}/mlp/shared_expert/{p}/kernel': ('hidden_size',
                                                    'shared_expert_intermediate_size')
       for p in ('wi_0', 'wi_1')},
    f'{MT_LAYER}/mlp/shared_expert/wo/kernel': ('shared_expert_intermediate_size',
                                                 'hidden_size'),
    f'{MT_LAYER}/mlp/shared_expert_gate/kernel': ('hidden_size', None),
    f'{MT_LAYER}/mlp/routed_experts/gate/kernel': ('hidden_size', 'num_experts'),
}
_CONFIG_DEFAULTS = {
    **{name: (lambda c, name=name: _sizes(c)[name]) for name in (_QKVZ, _BA, _LINEAR_V, _Q_OUT)},
    _Q_GATED: lambda c: 2 * c['head_dim'],
}


def _hybrid(rules, sized=(), form=stacks_lib.UNSCANNED, **kwargs) -> Naming:
  """A hybrid decoder's naming: its `rules` (and `sized` ones), its layers stored in `form`;
  what both families share (requirements, dims, axes, layer kinds) as they are."""
  return Naming(
      trainers.MAXTEXT, tuple(rules), ((_COMMON_REQUIRED,), _KINDS_REQUIRED), _DIMS,
      tied=lambda paths: ('decoder', 'logits_dense', 'kernel') not in paths,
      layer=stacks_lib.LAYER, vocab=MT_VOCAB, form=form, axes=_AXES,
      config_defaults=_CONFIG_DEFAULTS,
      lora_flattened=True, sized=tuple(sized), kinds=LayerKinds(typed_by=_TYPED_BY), **kwargs)


# peft 0.21.2 on transformers 5 converts a Qwen3-Next adapter's config as if trained on
# transformers 4's per-expert modules (`convert_peft_config_for_transformers`, qwen2_moe's
# map): every target named gate_proj, up_proj or down_proj becomes the routed experts' fused
# parameter, the shared expert's too (measured: it wraps `mlp.experts`, target_parameters
# {'down_proj'}, and reports the shared expert's tensors unexpected).
_PEFT_SHARED_EXPERT_NOTE = (
    '{module}: peft 0.21 with transformers 5 loads a Qwen3-Next adapter\'s gate_proj, up_proj'
    ' and down_proj targets as the routed experts\' fused weights (its conversion of adapters'
    ' trained on transformers 4), so it adapts mlp.experts instead of these shared-expert'
    ' modules and leaves their tensors unused; vLLM, and any reader of the adapter as written,'
    ' apply them where they are. To serve them with peft, export the merged model'
    ' (`merge_lora`)')


def _maxtext_qwen3_next() -> Naming:
  """MaxText's qwen3-next: Hugging Face's Qwen3NextForCausalLM keeps the fused projections
  and (as its Hub checkpoints) one tensor per expert."""
  return _hybrid([
      *_common(), *_full_attention(), *_linear_attention(),
      *(rule(f'{_LINEAR}/{p}/kernel', f'{LAYER}.linear_attn.{p}.weight', _T)
        for p in ('in_proj_qkvz', 'in_proj_ba')),
      *(per_expert(f'{MT_LAYER}/mlp/routed_experts/{mt}',
                   f'{LAYER}.mlp.experts.{{e}}.{hf}_proj.weight', 0, _T) for mt, hf in _EXPERTS),
  ], form=stacks_lib.linear_full(CYCLE), lora={
      f'{MT_LAYER}/mlp/shared_expert/{{p:wi_0|wi_1|wo}}/kernel': LoraWeight(
          note=_PEFT_SHARED_EXPERT_NOTE)})


def _split_per_key_head(sizes) -> tuple[LayoutRule, ...]:
  """Qwen3.5's fused projections split per key head, with `sizes` config.json's: qkvz (per
  key head [q k v z]) into in_proj_qkv ([q k v], each part of every head after another) and
  in_proj_z; ba (per key head [b a]) into in_proj_b and in_proj_a."""
  hk, dk = sizes['linear_num_key_heads'], sizes['linear_key_head_dim']
  vp = sizes['linear_num_value_heads'] // hk  # value heads per key head
  qkvz = (dk, dk, vp * sizes['linear_value_head_dim'], vp * sizes['linear_value_head_dim'])
  return (
      LayoutRule.split(
          tuple(f'{_LINEAR}/in_proj_qkvz/kernel'.split('/')),
          ((f'{LAYER}.linear_attn.in_proj_qkv.weight',), chain(regroup(1, hk, qkvz, (0, 1, 2)),
                                                               _T)),
          ((f'{LAYER}.linear_attn.in_proj_z.weight',), chain(regroup(1, hk, qkvz, (3,)), _T))),
      LayoutRule.split(
          tuple(f'{_LINEAR}/in_proj_ba/kernel'.split('/')),
          *(((f'{LAYER}.linear_attn.in_proj_{hf}.weight',),
             chain(regroup(1, hk, (vp, vp), (part,)), _T)) for part, hf in ((0, 'b'), (1, 'a')))),
  )


_PER_KEY_HEAD = Sized(
    (f'{_LINEAR}/in_proj_qkvz/kernel', f'{_LINEAR}/in_proj_ba/kernel'),
    tuple(_QWEN3_5_SIZES), _split_per_key_head,
    "Qwen3.5's linear attention holds q, k, v, z (and b, a) per key head in one kernel, which"
    ' Hugging Face splits, and no weight\'s shape tells how many key heads there are',
    _QWEN3_5_SIZES)


def _maxtext_qwen3_5_moe() -> Naming:
  """MaxText's qwen3.5 MoE text decoder: the fused projections split per key head
  (`_PER_KEY_HEAD`), each layer's experts fused, gate then up (not interleaved)."""
  experts = f'{MT_LAYER}/mlp/routed_experts'
  return _hybrid([
      *_common(), *_full_attention(), *_linear_attention(),
      # wi_0 then wi_1 (gathered in the order of their number): (E, D, 2F) -> (E, 2F, D).
      rule(f'{experts}/wi_{{k}}', f'{LAYER}.mlp.experts.gate_up_proj',
           chain(concat(-1), transpose((0, 2, 1)))),
      rule(f'{experts}/wo', f'{LAYER}.mlp.experts.down_proj', transpose((0, 2, 1))),
  ], sized=(_PER_KEY_HEAD,), form=stacks_lib.layer_cycles(CYCLE))


QWEN3_NEXT = _maxtext_qwen3_next()
QWEN3_5_MOE = _maxtext_qwen3_5_moe()

"""MaxText's namings of DeepSeek V2, V3 and V3.2 (`hf_naming.Naming` values): multi-head latent
attention, dense then MoE layers, shared experts and a router with a score-correction bias.

MaxText 0.2.5's DeepSeek decoder (`decoder_block: deepseek`; printed from `nnx.state` of tiny
models built with MaxText itself) keeps its first `first_num_dense_layers` layers apart from
the MoE ones: `decoder/dense_layers_{j}` and `decoder/moe_layers_{j}` unscanned, two stacks
`decoder/dense_layers` and `decoder/moe_layers` scanned (`DEEPSEEK_FORM`, a
`stacks.leading` form). Per layer:

  self_attention/wkv_a/kernel (D, kv_lora + rope)     kv_a_proj_with_mqa (the order kept)
  self_attention/kv_norm/scale (kv_lora,)             kv_a_layernorm
  self_attention/wkv_b/kernel (kv_lora, N, nope + v)  kv_b_proj (N·(nope + v), kv_lora):
                                                      per head [k_nope | v], as stored
  self_attention/query/kernel (D, N, nope + rope)     q_proj (V2-Lite: q_lora_rank 0)
  self_attention/wq_a/kernel (D, q_lora)              q_a_proj (V2, V3: the query's LoRA)
  self_attention/q_norm/scale (q_lora,)               q_a_layernorm
  self_attention/wq_b/kernel (q_lora, N, nope + rope) q_b_proj
  self_attention/out/kernel (N, v, D)                 o_proj
  self_attention/indexer/...                          indexer.{wq_b,wk,weights_proj,k_norm}
                                                      (V3.2's sparse attention's indexer)
  mlp/{wi_0,wi_1,wo}/kernel                           mlp.{gate,up,down}_proj (dense layers)
  DeepSeekMoeBlock_0/shared_experts/{wi_0,wi_1,wo}    mlp.shared_experts.*
  DeepSeekMoeBlock_0/MoeBlock_0/gate/kernel (D, E)    mlp.gate.weight (E, D)
  DeepSeekMoeBlock_0/MoeBlock_0/gate/bias (E,)        mlp.gate.e_score_correction_bias
  DeepSeekMoeBlock_0/MoeBlock_0/{wi_0,wi_1,wo}        mlp.experts.{e}.*: one tensor per expert

Every kernel is what MaxText's converter makes of it (`reshape(flip(hf_shape)).T`: the
(in, heads, head_dim) axes merged, then transposed); no rotary permutation (transformers'
DeepSeek classes rotate MaxText's interleaved pairs themselves, `rope_interleave`). The routing
bias is an `MoEBiasVar`, no nnx.Param: a Tunix run (all of `nnx.state`) and MaxText's own
conversion from Hugging Face (`to_maxtext`, under `params`) hold it, a params-only step of an
NNX model does not (`BIAS_FILL`: then V3's and V3.2's classes get zeros, said in a note);
scanned, nnx stacks it on axis 0, not on `param_scan_axis` (`DEEPSEEK_FORM.axis_zero`).
"""

from __future__ import annotations

from orbax_tunix.mapping import stacks as stacks_lib
from orbax_tunix.mapping import trainers
from orbax_tunix.mapping.hf_maxtext import MT_LAYER, MT_VOCAB
from orbax_tunix.mapping.hf_naming import (
  IN_PROJ,
  LAYER,
  OUT_PROJ,
  Fill,
  Naming,
  per_expert,
  rule,
)
from orbax_tunix.mapping.patterns import LayoutRule
from orbax_tunix.mapping.transforms import filled, transpose

# The MoE block's names within a layer, and its router's bias (an MoEBiasVar).
MOE = 'DeepSeekMoeBlock_0'
ROUTER_BIAS = f'{MOE}/MoeBlock_0/gate/bias'
DEEPSEEK_FORM = stacks_lib.leading("DeepSeek's dense then MoE layers", 'dense_layers',
                                   'moe_layers', axis_zero=(ROUTER_BIAS,))
# How many MaxText layers `dims` looks through for the first MoE (and dense) layer.
_SEARCHED = 64
_ATTN = f'{MT_LAYER}/self_attention'
# A step without the routing bias: V3's and V3.2's classes hold it (transformers starts it at
# zeros and reports it missing; vLLM's DeepSeek makes it `torch.empty` and reads whatever is
# there), so the export writes zeros, one per expert of the router's kernel (D, E).
BIAS_FILL = Fill(
    f'{MT_LAYER}/{MOE}/MoeBlock_0/gate/kernel', filled(0.0, axis=1),
    "the routing bias is an MoEBiasVar, not an nnx.Param, and MaxText's params-only step of an"
    ' NNX model leaves it out; zeros are what MaxText\'s own model restored from this step'
    ' routes with, not what the trained one did (a Tunix run of the model, or MaxText\'s'
    ' full-state step, holds the trained bias)')


def _attention(indexer: bool) -> list[LayoutRule]:
  """Multi-head latent attention: the kv LoRA, the query (plain or its LoRA), the output; and
  V3.2's indexer."""
  rules = [
      rule(f'{_ATTN}/wkv_a/kernel', f'{LAYER}.self_attn.kv_a_proj_with_mqa.weight', transpose()),
      rule(f'{_ATTN}/kv_norm/scale', f'{LAYER}.self_attn.kv_a_layernorm.weight'),
      rule(f'{_ATTN}/wkv_b/kernel', f'{LAYER}.self_attn.kv_b_proj.weight', IN_PROJ),
      rule(f'{_ATTN}/query/kernel', f'{LAYER}.self_attn.q_proj.weight', IN_PROJ),
      rule(f'{_ATTN}/wq_a/kernel', f'{LAYER}.self_attn.q_a_proj.weight', transpose()),
      rule(f'{_ATTN}/q_norm/scale', f'{LAYER}.self_attn.q_a_layernorm.weight'),
      rule(f'{_ATTN}/wq_b/kernel', f'{LAYER}.self_attn.q_b_proj.weight', IN_PROJ),
      rule(f'{_ATTN}/out/kernel', f'{LAYER}.self_attn.o_proj.weight', OUT_PROJ),
  ]
  if indexer:
    index = f'{LAYER}.self_attn.indexer'
    rules += [
        rule(f'{_ATTN}/indexer/wq_b/kernel', f'{index}.wq_b.weight', IN_PROJ),
        rule(f'{_ATTN}/indexer/wk/kernel', f'{index}.wk.weight', transpose()),
        rule(f'{_ATTN}/indexer/weights_proj/kernel', f'{index}.weights_proj.weight',
             transpose()),
        rule(f'{_ATTN}/indexer/k_norm/scale', f'{index}.k_norm.weight'),
        rule(f'{_ATTN}/indexer/k_norm/bias', f'{index}.k_norm.bias'),
    ]
  return rules


def _mlps(bias: bool) -> list[LayoutRule]:
  """A dense layer's MLP, or an MoE layer's shared experts, router (and, with `bias`, its
  score-correction bias) and experts, one tensor per expert."""
  moe = f'{MT_LAYER}/{MOE}'
  bias_rules = [rule(f'{MT_LAYER}/{ROUTER_BIAS}', f'{LAYER}.mlp.gate.e_score_correction_bias')]
  return [
      *(rule(f'{MT_LAYER}/mlp/{mt}/kernel', f'{LAYER}.mlp.{hf}_proj.weight', transpose())
        for mt, hf in (('wi_0', 'gate'), ('wi_1', 'up'), ('wo', 'down'))),
      *(rule(f'{moe}/shared_experts/{mt}/kernel', f'{LAYER}.mlp.shared_experts.{hf}_proj.weight',
             transpose()) for mt, hf in (('wi_0', 'gate'), ('wi_1', 'up'), ('wo', 'down'))),
      rule(f'{moe}/MoeBlock_0/gate/kernel', f'{LAYER}.mlp.gate.weight', transpose()),
      *(bias_rules if bias else []),
      *(per_expert(f'{moe}/MoeBlock_0/{mt}', f'{LAYER}.mlp.experts.{{e}}.{hf}_proj.weight', 0,
                   transpose())
        for mt, hf in (('wi_0', 'gate'), ('wi_1', 'up'), ('wo', 'down'))),
  ]


def _in_layers(weight: str, axis: int) -> tuple[tuple[str, int], ...]:
  """`dims` alternatives: a weight of the first layers that hold it (DeepSeek's dense and MoE
  layers hold different MLPs)."""
  return tuple((f'{MT_LAYER.replace("{i}", str(i))}/{weight}', axis) for i in range(_SEARCHED))


def _dims(indexer: bool) -> dict[str, tuple[tuple[str, int], ...]]:
  moe = f'{MOE}/MoeBlock_0'
  dims = {
      'vocab_size': (('token_embedder/embedding', 0),),
      'hidden_size': (('token_embedder/embedding', 1),),
      'num_attention_heads': _in_layers('self_attention/out/kernel', 0),
      'v_head_dim': _in_layers('self_attention/out/kernel', 1),
      'kv_lora_rank': _in_layers('self_attention/kv_norm/scale', 0),
      'q_lora_rank': _in_layers('self_attention/q_norm/scale', 0),
      'intermediate_size': _in_layers('mlp/wi_0/kernel', 1),
      'moe_intermediate_size': _in_layers(f'{moe}/wi_0', 2),
      'n_routed_experts': _in_layers(f'{moe}/wi_0', 0),
  }
  if indexer:
    dims['index_n_heads'] = _in_layers('self_attention/indexer/weights_proj/kernel', 1)
    dims['index_head_dim'] = _in_layers('self_attention/indexer/wk/kernel', 1)
  return dims


def _axes(indexer: bool) -> dict[str, tuple[str, ...]]:
  """The config field of each axis of the kernels qwix adapts (`Naming.axes`)."""
  moe = f'{MT_LAYER}/{MOE}'
  axes = {
      f'{_ATTN}/wq_a/kernel': ('hidden_size', 'q_lora_rank'),
      f'{_ATTN}/wkv_a/kernel': ('hidden_size', None),
      f'{_ATTN}/wkv_b/kernel': ('kv_lora_rank', 'num_attention_heads', None),
      f'{_ATTN}/wq_b/kernel': ('q_lora_rank', 'num_attention_heads', None),
      f'{_ATTN}/query/kernel': ('hidden_size', 'num_attention_heads', None),
      f'{_ATTN}/out/kernel': ('num_attention_heads', 'v_head_dim', 'hidden_size'),
      **{f'{MT_LAYER}/mlp/{p}/kernel': ('hidden_size', 'intermediate_size')
         for p in ('wi_0', 'wi_1')},
      f'{MT_LAYER}/mlp/wo/kernel': ('intermediate_size', 'hidden_size'),
      **{f'{moe}/shared_experts/{p}/kernel': ('hidden_size', None) for p in ('wi_0', 'wi_1')},
      f'{moe}/shared_experts/wo/kernel': (None, 'hidden_size'),
      f'{moe}/MoeBlock_0/gate/kernel': ('hidden_size', 'n_routed_experts'),
  }
  if indexer:
    axes[f'{_ATTN}/indexer/wq_b/kernel'] = ('q_lora_rank', 'index_n_heads', 'index_head_dim')
  return axes


def maxtext_deepseek(indexer: bool = False, bias: bool = True) -> Naming:
  """MaxText's DeepSeek decoder (V2, V3; with `indexer`, V3.2's); `bias`: the family's class
  holds the router's score-correction bias (V3, V3.2: made when absent, `BIAS_FILL`; V2's has
  none, and a checkpoint holding one is no V2 model).

  Requirements per layer: one of the query's forms (plain, or its LoRA) and one of the MLPs
  (dense, or MoE: its router bias is not required, see the module docstring).
  """
  rules = (
      rule('token_embedder/embedding', 'model.embed_tokens.weight'),
      rule('decoder/decoder_norm/scale', 'model.norm.weight'),
      rule('decoder/logits_dense/kernel', 'lm_head.weight', transpose()),
      rule(f'{MT_LAYER}/pre_self_attention_layer_norm/scale', f'{LAYER}.input_layernorm.weight'),
      rule(f'{MT_LAYER}/post_self_attention_layer_norm/scale',
           f'{LAYER}.post_attention_layernorm.weight'),
      *_attention(indexer),
      *_mlps(bias),
  )
  moe = f'{MT_LAYER}/{MOE}'
  required = (
      (('token_embedder/embedding', 'decoder/decoder_norm/scale', 'decoder/logits_dense/kernel',
        f'{MT_LAYER}/{{n:pre|post}}_self_attention_layer_norm/scale',
        f'{_ATTN}/{{p:wkv_a|wkv_b|out}}/kernel', f'{_ATTN}/kv_norm/scale'),),
      ((f'{_ATTN}/{{p:wq_a|wq_b}}/kernel', f'{_ATTN}/q_norm/scale'),
       (f'{_ATTN}/query/kernel',)),
      ((f'{MT_LAYER}/mlp/{{p:wi_0|wi_1|wo}}/kernel',),
       (f'{moe}/shared_experts/{{p:wi_0|wi_1|wo}}/kernel', f'{moe}/MoeBlock_0/gate/kernel',
        f'{moe}/MoeBlock_0/{{p:wi_0|wi_1|wo}}')),
  )
  if indexer:
    required += ((f'{_ATTN}/indexer/{{p:wq_b|wk|weights_proj}}/kernel',
                  f'{_ATTN}/indexer/k_norm/{{n:scale|bias}}'),),
  return Naming(
      trainers.MAXTEXT, rules, required, _dims(indexer),
      tied=lambda paths: ('decoder', 'logits_dense', 'kernel') not in paths,
      layer=stacks_lib.LAYER, vocab=MT_VOCAB, form=DEEPSEEK_FORM,
      axes=_axes(indexer), lora_flattened=True,
      layer_counts={'first_k_dense_replace': f'{MT_LAYER}/mlp/wi_0/kernel'},
      fills={f'{MT_LAYER}/{ROUTER_BIAS}': BIAS_FILL} if bias else {})


DEEPSEEK_V2 = maxtext_deepseek(bias=False)  # softmax routing, no bias (MaxText: routed_bias)
DEEPSEEK_V3 = maxtext_deepseek()
DEEPSEEK_V32 = maxtext_deepseek(indexer=True)

"""MaxText's naming of DeepSeek V4 (`hf_naming.Naming`): compressed sparse attention, hash-routed
and bias-routed MoE layers, manifold-constrained hyper-connections (mHC), as data.

MaxText 0.2.5's V4 decoder (`decoder_block: deepseek4`; printed from `nnx.state` of a tiny
model MaxText builds) holds every layer as `decoder/layers_{i}` unscanned; scanned, its first
`first_num_hash_layers` layers stay so and the rest are blocks of two, `decoder/scanned_blocks/
layers_{0,1}` (a heavily compressed layer, then a compressed one; `DEEPSEEK4_FORM`). MaxText's
converter writes DeepSeek's own checkpoint names (`layers.{i}.attn.wq_a.weight`, `embed.weight`,
`head.weight`, ...), which transformers' DeepseekV4ForCausalLM renames as it loads them; so does
this naming. Per layer:

  self_attention/{wq_a,wq_b,wkv,o_b_proj}/kernel    attn.{wq_a,wq_b,wkv,wo_b}.weight
  self_attention/o_a_proj/kernel (G, N·H / G, R)    attn.wo_a.weight (G·R, N·H / G)
  self_attention/{q,kv}_norm/scale, sinks           attn.{q,kv}_norm.weight, attn.attn_sink
  self_attention/{csa,hca}_compressor/...           attn.compressor.{wgate,wkv,norm,ape}
  self_attention/csa_compressor/indexer/...         attn.indexer.{compressor.*,wq_b,weights_proj}
  mlp/MoeBlock_0/{gate/kernel,gate/bias,tid2eid}    ffn.gate.{weight,bias,tid2eid}
  mlp/MoeBlock_0/{wi_0,wi_1,wo}, shared_experts     ffn.experts.{e}.{w1,w3,w2}, ffn.shared_experts
  mhc_{attention,mlp}/{pre,post,res}_alpha, mhc_norm/scale   hc_{attn,ffn}_fn (`derived`)
  mhc_{attention,mlp}/{pre,post,res}_beta            hc_{attn,ffn}_base
  mhc_{attention,mlp}/{pre,post,res}_alpha_scale     hc_{attn,ffn}_scale

The hyper-connection's norm: MaxText scales the normalised streams by `mhc_norm/scale` before its
alphas; transformers' is unweighted (`DeepseekV4UnweightedRMSNorm`), and MaxText's converter
drops the scale (maps it to None). Here it is folded into the projection it feeds:
`hc_fn = (scale[:, None] * [pre | post | res]).T`, which computes what MaxText's model computes
for any trained scale (MaxText's output only where the scale is all ones, its init).
The hash layers' routing table `tid2eid` and the other layers' routing bias are no nnx.Param
(`Tid2EidVar`, `MoEBiasVar`): a Tunix run holds them, MaxText's params-only step does not.
"""

from __future__ import annotations

from orbax_tunix.mapping import stacks as stacks_lib
from orbax_tunix.mapping import trainers
from orbax_tunix.mapping.hf_maxtext import MT_LAYER, MT_VOCAB
from orbax_tunix.mapping.hf_naming import IN_PROJ, Derived, Naming, per_expert, rule
from orbax_tunix.mapping.patterns import LayoutRule
from orbax_tunix.mapping.transforms import (
  IDENTITY,
  chain,
  concat,
  merge_axes,
  per_input,
  transpose,
)

LAYER4 = 'layers.{i}'  # DeepSeek's own names: no `model.` prefix
_ATTN = f'{MT_LAYER}/self_attention'
_MOE = f'{MT_LAYER}/mlp/MoeBlock_0'
ROUTER_BIAS = 'mlp/MoeBlock_0/gate/bias'
HASH_TABLE = 'mlp/MoeBlock_0/tid2eid'
DEEPSEEK4_FORM = stacks_lib.after_per_layer(
    "DeepSeek V4's hash layers, then scanned blocks of 2", ('decoder', 'scanned_blocks'), 2,
    axis_zero=(ROUTER_BIAS,))
# MaxText's o_a_proj (groups, in, rank) -> wo_a (groups·rank, in).
_WO_A = chain(transpose((0, 2, 1)), merge_axes(0, 2))
_PARTS = ('pre', 'post', 'res')
_HC = {'mhc_attention': 'hc_attn', 'mhc_mlp': 'hc_ffn'}


def _derived() -> dict[str, Derived]:
  """Each hyper-connection's three tensors of DeepSeek's, from MaxText's parts."""
  out = {}
  for mt in _HC:
    at = f'{MT_LAYER}/{mt}'
    out[f'{at}/fn'] = Derived((*(f'{at}/{p}_alpha' for p in _PARTS), f'{at}/mhc_norm/scale'),
                              concat(-1, scaled=True))
    out[f'{at}/base'] = Derived(tuple(f'{at}/{p}_beta' for p in _PARTS),
                                per_input((IDENTITY, IDENTITY, merge_axes(0, 2)), concat(0)))
    out[f'{at}/scale'] = Derived(tuple(f'{at}/{p}_alpha_scale' for p in _PARTS), concat(0))
  return out


def _compressor(mt: str, hf: str) -> list[LayoutRule]:
  return [
      *(rule(f'{mt}/{m}/kernel', f'{hf}.{h}.weight', transpose())
        for m, h in (('gate_proj', 'wgate'), ('kv_proj', 'wkv'))),
      rule(f'{mt}/kv_norm/scale', f'{hf}.norm.weight'),
      rule(f'{mt}/position_bias', f'{hf}.ape'),
  ]


def _rules() -> tuple[LayoutRule, ...]:
  attn = f'{LAYER4}.attn'
  return (
      rule('token_embedder/embedding', 'embed.weight'),
      rule('decoder/decoder_norm/scale', 'norm.weight'),
      rule('decoder/logits_dense/kernel', 'head.weight', transpose()),
      rule('decoder/hc_head/hc_fn', 'hc_head_fn', transpose()),
      rule('decoder/hc_head/hc_base', 'hc_head_base'),
      rule('decoder/hc_head/hc_scale', 'hc_head_scale'),
      rule(f'{MT_LAYER}/pre_self_attention_layer_norm/scale', f'{LAYER4}.attn_norm.weight'),
      rule(f'{MT_LAYER}/post_self_attention_layer_norm/scale', f'{LAYER4}.ffn_norm.weight'),
      *(rule(f'{MT_LAYER}/{mt}/{part}', f'{LAYER4}.{hf}_{part}', t)
        for mt, hf in _HC.items()
        for part, t in (('fn', transpose()), ('base', IDENTITY), ('scale', IDENTITY))),
      rule(f'{_ATTN}/wq_a/kernel', f'{attn}.wq_a.weight', transpose()),
      rule(f'{_ATTN}/wq_b/kernel', f'{attn}.wq_b.weight', IN_PROJ),
      rule(f'{_ATTN}/wkv/kernel', f'{attn}.wkv.weight', IN_PROJ),
      rule(f'{_ATTN}/o_a_proj/kernel', f'{attn}.wo_a.weight', _WO_A),
      rule(f'{_ATTN}/o_b_proj/kernel', f'{attn}.wo_b.weight', transpose()),
      rule(f'{_ATTN}/q_norm/scale', f'{attn}.q_norm.weight'),
      rule(f'{_ATTN}/kv_norm/scale', f'{attn}.kv_norm.weight'),
      rule(f'{_ATTN}/sinks', f'{attn}.attn_sink'),
      *_compressor(f'{_ATTN}/csa_compressor/indexer', f'{attn}.indexer.compressor'),
      rule(f'{_ATTN}/csa_compressor/indexer/weights_proj/kernel',
           f'{attn}.indexer.weights_proj.weight', transpose()),
      rule(f'{_ATTN}/csa_compressor/indexer/q_proj/kernel', f'{attn}.indexer.wq_b.weight',
           transpose()),
      *_compressor(f'{_ATTN}/csa_compressor', f'{attn}.compressor'),
      *_compressor(f'{_ATTN}/hca_compressor', f'{attn}.compressor'),
      rule(f'{_MOE}/gate/kernel', f'{LAYER4}.ffn.gate.weight', transpose()),
      rule(f'{MT_LAYER}/{ROUTER_BIAS}', f'{LAYER4}.ffn.gate.bias'),
      rule(f'{MT_LAYER}/{HASH_TABLE}', f'{LAYER4}.ffn.gate.tid2eid'),
      *(rule(f'{MT_LAYER}/mlp/shared_experts/{mt}/kernel',
             f'{LAYER4}.ffn.shared_experts.{hf}.weight', transpose())
        for mt, hf in (('wi_0', 'w1'), ('wi_1', 'w3'), ('wo', 'w2'))),
      *(per_expert(f'{_MOE}/{mt}', f'{LAYER4}.ffn.experts.{{e}}.{hf}.weight', 0, transpose())
        for mt, hf in (('wi_0', 'w1'), ('wi_1', 'w3'), ('wo', 'w2'))),
  )


def _in_layers(weight: str, axis: int, searched: int = 64) -> tuple[tuple[str, int], ...]:
  return tuple((f'{MT_LAYER.replace("{i}", str(i))}/{weight}', axis) for i in range(searched))


def _maxtext_deepseek4() -> Naming:
  """MaxText's DeepSeek V4 decoder (deepseek4-284b, deepseek4-tiny)."""
  required = ((
      'token_embedder/embedding', 'decoder/decoder_norm/scale', 'decoder/logits_dense/kernel',
      'decoder/hc_head/{p:hc_fn|hc_base|hc_scale}',
      f'{MT_LAYER}/{{n:pre|post}}_self_attention_layer_norm/scale',
      f'{MT_LAYER}/{{m:mhc_attention|mhc_mlp}}/{{p:fn|base|scale}}',  # `derived`
      f'{_ATTN}/{{p:wq_a|wq_b|wkv|o_a_proj|o_b_proj}}/kernel', f'{_ATTN}/sinks',
      f'{_ATTN}/{{n:q_norm|kv_norm}}/scale', f'{_MOE}/gate/kernel', f'{_MOE}/{{p:wi_0|wi_1|wo}}',
      f'{MT_LAYER}/mlp/shared_experts/{{p:wi_0|wi_1|wo}}/kernel'),),
  dims = {
      'vocab_size': (('token_embedder/embedding', 0),),
      'hidden_size': (('token_embedder/embedding', 1),),
      'hc_mult': (('decoder/hc_head/hc_base', 0),),
      'num_attention_heads': _in_layers('self_attention/wq_b/kernel', 1),
      'head_dim': _in_layers('self_attention/wq_b/kernel', 2),
      'q_lora_rank': _in_layers('self_attention/q_norm/scale', 0),
      'o_groups': _in_layers('self_attention/o_a_proj/kernel', 0),
      'o_lora_rank': _in_layers('self_attention/o_a_proj/kernel', 2),
      'n_routed_experts': _in_layers('mlp/MoeBlock_0/wi_0', 0),
      'moe_intermediate_size': _in_layers('mlp/MoeBlock_0/wi_0', 2),
      'index_n_heads': _in_layers('self_attention/csa_compressor/indexer/weights_proj/kernel', 1),
  }
  return Naming(
      trainers.MAXTEXT, _rules(), required, dims,
      tied=lambda paths: ('decoder', 'logits_dense', 'kernel') not in paths,
      layer=stacks_lib.LAYER, vocab=MT_VOCAB, form=DEEPSEEK4_FORM, lora_flattened=True,
      layer_counts={'num_hash_layers': f'{MT_LAYER}/{HASH_TABLE}'}, derived=_derived())


DEEPSEEK4 = _maxtext_deepseek4()

"""Tunix's namings of the Hugging Face families: its own model classes' weights (`tunix.models`)
onto `transformers` tensor names, as data (`hf_naming.Naming`).

Each is the exact inverse of the map google-tunix's own loader applies
(`tunix/models/{qwen3,llama3,qwen2}/params.py`, `tunix/models/{gemma,gemma3,gemma4}/
params_safetensors.py`); where Tunix's map disagrees with `transformers`, as for Gemma 1's norms,
`transformers` decides. The canonical view's paths are the rules' sources (no nnx `value` level).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

from orbax_tunix.mapping import trainers
from orbax_tunix.mapping.as_trained import AsTrained
from orbax_tunix.mapping.hf_naming import (
  HEAD_DIM_OF_HIDDEN,
  HEADS_FIRST,
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
from orbax_tunix.mapping.patterns import LayoutRule
from orbax_tunix.mapping.transforms import chain, merge_axes, take, transpose

# The vocabulary axes of Tunix's embedding and lm_head (see `Naming.vocab`): its rows are
# the model's own.
VOCAB = Vocab({'embedder/input_embedding': 0, 'lm_head/w': 1})
# Gemma 1 and 2's own checkpoints (Kaggle's, which Tunix's `gemma` models load) hold 256128
# rows for the tokenizer's 256000 (Hugging Face's `vocab_size`).
GEMMA_VOCAB = dataclasses.replace(VOCAB, known=((256128, 256000),),
                                  why="Gemma's checkpoints pad 256000 tokens to 256128 rows")


# Measured with `transformers` (tests/test_hf_clients.py): Tunix's Llama3 and Qwen3 (its MoE
# too) call `apply_rope` without the ModelConfig's rope_theta, so they rotate with its
# default base; Llama 3's Hub config says 500000 (Qwen2's model passes its config's).
ROPE_BASE_1E6 = AsTrained(
    what='rope_theta', field='rope_theta', value=1_000_000,
    trained='attention rotates with RoPE base 1000000 whatever its ModelConfig says'
            " (`apply_rope`'s default; the config's rope_theta is never passed to it)",
    consequence="the attention, and so every output, differs from the trained model's",
    brief='rotate with base 1000000 whatever the config says')


# The config.json field of each axis of Tunix's weights (`dims` read the other way, for every
# axis; None: an axis no field gives, a fused einsum's parts): what a base config is checked
# against for a save of adapters alone (the adapters tell the weights' shapes).
_LINEAR_AXES = {
    'embedder/input_embedding': ('vocab_size', 'hidden_size'),
    'lm_head/w': ('hidden_size', 'vocab_size'),
    'layers/{i}/mlp/{p:gate|up}_proj/kernel': ('hidden_size', 'intermediate_size'),
    'layers/{i}/mlp/down_proj/kernel': ('intermediate_size', 'hidden_size'),
}
_QWEN3_AXES = {
    **_LINEAR_AXES,
    'layers/{i}/attn/q_proj/w': ('hidden_size', 'num_attention_heads', 'head_dim'),
    'layers/{i}/attn/{p:k|v}_proj/w': ('hidden_size', 'num_key_value_heads', 'head_dim'),
    'layers/{i}/attn/o_proj/w': ('num_attention_heads', 'head_dim', 'hidden_size'),
}


def _qwen3_style(norms: bool, config_defaults: Mapping[str, Callable] | None = None) -> Naming:
  """Qwen3 and Llama3 share Tunix's layout; Qwen3 adds q/k norms."""
  rules = [
      rule('embedder/input_embedding', 'model.embed_tokens.weight'),
      rule('final_norm/w', 'model.norm.weight'),
      rule('lm_head/w', 'lm_head.weight', transpose()),  # Only when not tied.
      rule('layers/{i}/attn/{p:q|k|v}_proj/w', f'{LAYER}.self_attn.{{p}}_proj.weight', IN_PROJ),
      rule('layers/{i}/attn/o_proj/w', f'{LAYER}.self_attn.o_proj.weight', OUT_PROJ),
      rule('layers/{i}/mlp/{p:gate|up|down}_proj/kernel', f'{LAYER}.mlp.{{p}}_proj.weight',
           transpose()),
      rule('layers/{i}/{n:input|post_attention}_layernorm/w', f'{LAYER}.{{n}}_layernorm.weight'),
  ]
  required = [
      ('embedder/input_embedding', 'final_norm/w', 'layers/{i}/attn/{p:q|k|v|o}_proj/w',
       'layers/{i}/mlp/{p:gate|up|down}_proj/kernel',
       'layers/{i}/{n:input|post_attention}_layernorm/w'),
  ]
  if norms:
    rules.append(rule('layers/{i}/attn/{n:q|k}_norm/w', f'{LAYER}.self_attn.{{n}}_norm.weight'))
    required.append(('layers/{i}/attn/{n:q|k}_norm/w',))
  return Naming(
      trainers.TUNIX,
      rules=tuple(rules),
      required=tuple((r,) for r in required),
      dims={
          'vocab_size': (('embedder/input_embedding', 0),),
          'hidden_size': (('embedder/input_embedding', 1),),
          'num_attention_heads': (('layers/0/attn/q_proj/w', 1),),
          'head_dim': (('layers/0/attn/q_proj/w', 2),),
          'num_key_value_heads': (('layers/0/attn/k_proj/w', 1),),
          'intermediate_size': (('layers/0/mlp/gate_proj/kernel', 1),),
      },
      tied=lambda paths: ('lm_head', 'w') not in paths,
      vocab=VOCAB,
      as_trained=(ROPE_BASE_1E6,),
      axes=_QWEN3_AXES,
      config_defaults=config_defaults or {},
  )


QWEN3 = _qwen3_style(norms=True)
LLAMA3 = _qwen3_style(norms=False, config_defaults=HEAD_DIM_OF_HIDDEN)


def _extended(base: Naming, rules=(), required=(), dims=None, optional=(),
              as_trained: tuple[AsTrained, ...] = (), axes=None) -> Naming:
  """`base` plus some weights (and their `axes`), the patterns in `optional` no longer
  required (and only `as_trained`'s facts: the model class is another one)."""
  return dataclasses.replace(
      base, as_trained=as_trained, axes={**base.axes, **(axes or {})},
      rules=base.rules + tuple(rules),
      required=tuple(tuple(tuple(p for p in alt if p not in optional) for alt in alts)
                     for alts in base.required) + tuple(required),
      dims=base.dims if dims is None else dims)


# Qwen2 / Qwen2.5 (and the DeepSeek-R1 distills on it): Llama's layout plus q/k/v biases, which
# Tunix keeps flat (heads·H,) as Hugging Face does (`tunix/models/qwen2/params.py`).
QWEN2 = _extended(
    LLAMA3,
    rules=(rule('layers/{i}/attn/{p:q|k|v}_bias', f'{LAYER}.self_attn.{{p}}_proj.bias'),),
    required=((('layers/{i}/attn/{p:q|k|v}_bias',),),),
)

# Qwen3's mixture of experts (Qwen3MoeForCausalLM): Tunix stacks the experts, (E, D, F) for
# gate/up and (E, F, D) for down, and keeps the router as a linear (D, E); Hugging Face has one
# (out, in) tensor per expert and the router as `mlp.gate` (`_stack_experts` in
# `tunix/models/qwen3/params.py` is the inverse). Tunix makes every layer sparse; a dense
# layer (Hugging Face's `mlp_only_layers`) keeps Qwen3's MLP names.
_MOE_MLP = 'layers/{i}/mlp/{p:gate|up|down}_proj'
QWEN3_MOE = _extended(
    QWEN3,
    rules=(
        rule('layers/{i}/mlp/router/kernel', f'{LAYER}.mlp.gate.weight', transpose()),
        per_expert(_MOE_MLP, f'{LAYER}.mlp.experts.{{e}}.{{p}}_proj.weight', 0, transpose()),
    ),
    required=((('layers/{i}/mlp/router/kernel', _MOE_MLP),),),
    dims={
        **{k: v for k, v in QWEN3.dims.items() if k != 'intermediate_size'},
        'num_experts': (('layers/0/mlp/router/kernel', 1),),
        'moe_intermediate_size': (('layers/0/mlp/gate_proj', 2),),
    },
    optional=('layers/{i}/mlp/{p:gate|up|down}_proj/kernel',),
    as_trained=QWEN3.as_trained,  # Tunix's Qwen3 class, with experts.
    axes={'layers/{i}/mlp/router/kernel': ('hidden_size', 'num_experts')},
)


_GEMMA_NORMS = {
    'pre_attention_norm': 'input_layernorm',
    'post_attention_norm': 'post_attention_layernorm',
    'pre_ffw_norm': 'pre_feedforward_layernorm',
    'post_ffw_norm': 'post_feedforward_layernorm',
}


def _gemma_attention(layer: str, fused: bool = True) -> tuple[LayoutRule, ...]:
  """Tunix Gemma's attention einsums: q (N, D, H), kv (2, K, D, H) or fused qkv, out (N, H, D)."""
  rules = (
      rule('layers/{i}/attn/q_einsum/w', f'{layer}.self_attn.q_proj.weight', HEADS_FIRST),
      LayoutRule.split(
          ('layers', '{i}', 'attn', 'kv_einsum', 'w'),
          *(((f'{layer}.self_attn.{p}_proj.weight',), chain(take(0, n), HEADS_FIRST))
            for n, p in enumerate('kv'))),
      LayoutRule.split(  # Heads == kv heads: one fused einsum.
          ('layers', '{i}', 'attn', 'qkv_einsum', 'w'),
          *(((f'{layer}.self_attn.{p}_proj.weight',), chain(take(0, n), HEADS_FIRST))
            for n, p in enumerate('qkv'))),
      rule('layers/{i}/attn/attn_vec_einsum/w', f'{layer}.self_attn.o_proj.weight', OUT_PROJ),
      rule('layers/{i}/mlp/{p:gate|up|down}_proj/kernel', f'{layer}.mlp.{{p}}_proj.weight',
           transpose()),
  )
  return tuple(r for r in rules if fused or r.source.keys[3].text != 'qkv_einsum')


# qwix's adapters of Tunix Gemma's attention einsums: `a` holds D (the input contracts it), `b`
# the rest; the weights hold D between them ('BTD,NDH->BTNH', 'BSD,CKDH->CBSKH').
GEMMA_LORA = {
    'layers/{i}/attn/q_einsum/w': LoraWeight('dr,rnh->ndh'),
    'layers/{i}/attn/kv_einsum/w': LoraWeight('dr,rckh->ckdh'),
    'layers/{i}/attn/qkv_einsum/w': LoraWeight('dr,rcnh->cndh'),
}


_GEMMA_AXES = {  # (N, D, H), (2, K, D, H), (3, N, D, H), (N, H, D): see `_LINEAR_AXES`.
    **_LINEAR_AXES,
    'layers/{i}/attn/q_einsum/w': ('num_attention_heads', 'hidden_size', 'head_dim'),
    'layers/{i}/attn/kv_einsum/w': (None, 'num_key_value_heads', 'hidden_size', 'head_dim'),
    'layers/{i}/attn/qkv_einsum/w': (None, 'num_attention_heads', 'hidden_size', 'head_dim'),
    'layers/{i}/attn/attn_vec_einsum/w': ('num_attention_heads', 'head_dim', 'hidden_size'),
}


_GEMMA_DIMS = {
    'vocab_size': (('embedder/input_embedding', 0),),
    'hidden_size': (('embedder/input_embedding', 1),),
    'num_attention_heads': (('layers/0/attn/q_einsum/w', 0), ('layers/0/attn/qkv_einsum/w', 1)),
    'head_dim': (('layers/0/attn/q_einsum/w', 2), ('layers/0/attn/qkv_einsum/w', 3)),
    'num_key_value_heads': (('layers/0/attn/kv_einsum/w', 1), ('layers/0/attn/qkv_einsum/w', 1)),
    'intermediate_size': (('layers/0/mlp/gate_proj/kernel', 1),),
}


def _gemma(norms: Mapping[str, str], qk_norms: bool = False,
           vocab: Vocab = GEMMA_VOCAB) -> Naming:
  """Gemma 1 and 2 (`tunix/models/gemma`: one model class, its norms set by the config) and
  Gemma 3 (q/k norms too).

  They scale embeddings by sqrt(D), tie them (no lm_head) and compute `1 + scale` in
  every norm on both sides, so every value is copied as it is.
  """
  qk = ('layers/{i}/attn/{n:_query|_key}_norm/scale',) if qk_norms else ()
  return Naming(
      trainers.TUNIX,
      rules=(
          rule('embedder/input_embedding', 'model.embed_tokens.weight'),
          rule('final_norm/scale', 'model.norm.weight'),
          *_gemma_attention(LAYER),
          *(rule(f'layers/{{i}}/attn/_{t}_norm/scale', f'{LAYER}.self_attn.{hf}_norm.weight')
            for t, hf in (('query', 'q'), ('key', 'k')) if qk_norms),
          *(rule(f'layers/{{i}}/{tunix}/scale', f'{LAYER}.{hf}.weight')
            for tunix, hf in norms.items()),
      ),
      required=(
          (('embedder/input_embedding', 'final_norm/scale'),),
          (('layers/{i}/attn/q_einsum/w', 'layers/{i}/attn/kv_einsum/w'),
           ('layers/{i}/attn/qkv_einsum/w',)),
          (('layers/{i}/attn/attn_vec_einsum/w', *qk, 'layers/{i}/mlp/{p:gate|up|down}_proj/kernel',
            *(f'layers/{{i}}/{t}/scale' for t in norms)),),
      ),
      dims=_GEMMA_DIMS,
      vocab=vocab,
      lora=GEMMA_LORA,
      axes=_GEMMA_AXES,
  )


GEMMA3 = _gemma(_GEMMA_NORMS, qk_norms=True, vocab=VOCAB)
# Gemma 2 (Gemma2ForCausalLM): norms around both blocks, as Tunix's safetensors loader maps
# them (`tunix/models/gemma/params_safetensors.py`).
GEMMA2 = _gemma({
    'pre_attention_norm': 'input_layernorm',
    'post_attn_norm': 'post_attention_layernorm',
    'pre_ffw_norm': 'pre_feedforward_layernorm',
    'post_ffw_norm': 'post_feedforward_layernorm',
})
# Gemma 1 (GemmaForCausalLM: `use_post_attn_norm`, `use_post_ffw_norm` off): Hugging Face's
# `post_attention_layernorm` is the norm before the MLP (transformers' GemmaDecoderLayer), that
# is Tunix's `pre_ffw_norm`. Tunix 0.1.7's loader maps that name to Gemma 2's `post_attn_norm`
# for both versions, so it cannot load a Gemma 1 folder (the Hub's or this one).
GEMMA = _gemma({
    'pre_attention_norm': 'input_layernorm',
    'pre_ffw_norm': 'post_attention_layernorm',
})

# Gemma 4 (`tunix/models/gemma4/params_safetensors.py`): the text model of
# Gemma4ForConditionalGeneration, under `model.language_model.` (the only prefix Tunix's loader
# reads besides none, and the names of every Gemma 4 on the Hub; the vision and audio towers are
# not in a Tunix checkpoint). Local and global layers differ in shapes only (global head dim and
# kv heads), and a global layer with `k_eq_v_global` has one key einsum that is also the value
# (Hugging Face: `k_proj`, no `v_proj`). Layers that reuse another's kv cache keep their own
# k/v weights in Tunix and in the Hub's files (transformers ignores them), so they are written.
# Optional per model: per-layer inputs (PLE: E2B, E4B) and MoE blocks (26B-A4B).
GEMMA4_PREFIX = 'model.language_model'
_G4 = f'{GEMMA4_PREFIX}.layers.{{i}}'
_GEMMA4_NORMS = {
    **_GEMMA_NORMS,
    'dense_post_ffw_norm': 'post_feedforward_layernorm_1',
    'moe_pre_ffw_norm': 'pre_feedforward_layernorm_2',
    'moe_post_ffw_norm': 'post_feedforward_layernorm_2',
    'post_per_layer_input_norm': 'post_per_layer_input_norm',
}
# transformers' Gemma4TextConfig without `layer_types`: every sixth layer global, the rest local.
_GEMMA4_LAYER_TYPES = EveryNth(6, 'full_attention', 'sliding_attention')
# A kv-shared layer's MLP width with `use_double_wide_mlp` (transformers' Gemma4TextMLP).
_DOUBLE_MLP = '2 x intermediate_size'


def _double_wide_mlp(i: int, config: Mapping[str, object]) -> bool:
  """Whether Gemma 4's layer `i` has a double-wide MLP: with `use_double_wide_mlp`, the last
  `num_kv_shared_layers` layers (those that reuse an earlier layer's keys and values)."""
  layers, shared = config.get('num_hidden_layers'), config.get('num_kv_shared_layers') or 0
  return (bool(config.get('use_double_wide_mlp')) and isinstance(layers, int)
          and isinstance(shared, int) and i >= layers - shared)


GEMMA4 = Naming(
    trainers.TUNIX,
    rules=(
        rule('embedder/input_embedding', f'{GEMMA4_PREFIX}.embed_tokens.weight'),
        # (V, L, P) -> (V, L·P), and (D, L, P) -> (L·P, D): every layer's inputs packed.
        rule('embedder/per_layer_input_embedding', f'{GEMMA4_PREFIX}.embed_tokens_per_layer.weight',
             merge_axes(1, 3)),
        rule('embedder/per_layer_model_projection/w',
             f'{GEMMA4_PREFIX}.per_layer_model_projection.weight', IN_PROJ),
        rule('embedder/per_layer_projection_norm/scale',
             f'{GEMMA4_PREFIX}.per_layer_projection_norm.weight'),
        rule('final_norm/scale', f'{GEMMA4_PREFIX}.norm.weight'),
        *_gemma_attention(_G4, fused=False),  # Gemma 4 has no fused qkv einsum.
        rule('layers/{i}/attn/k_einsum/w', f'{_G4}.self_attn.k_proj.weight', HEADS_FIRST),
        rule('layers/{i}/attn/_query_norm/scale', f'{_G4}.self_attn.q_norm.weight'),
        rule('layers/{i}/attn/_key_norm/scale', f'{_G4}.self_attn.k_norm.weight'),
        *(rule(f'layers/{{i}}/{tunix}/scale', f'{_G4}.{hf}.weight')
          for tunix, hf in _GEMMA4_NORMS.items()),
        rule('layers/{i}/skip_scale', f'{_G4}.layer_scalar'),
        rule('layers/{i}/per_layer_input_gate/w', f'{_G4}.per_layer_input_gate.weight',
             transpose()),
        rule('layers/{i}/per_layer_projection/w', f'{_G4}.per_layer_projection.weight',
             transpose()),
        rule('layers/{i}/moe/router_logits', f'{_G4}.router.proj.weight', transpose()),
        rule('layers/{i}/moe/router_scale', f'{_G4}.router.scale'),
        rule('layers/{i}/moe/per_expert_scale', f'{_G4}.router.per_expert_scale'),
        # (E, 2, F, D) -> (E, 2·F, D); (E, F, D) -> (E, D, F).
        rule('layers/{i}/moe/gating_einsum', f'{_G4}.experts.gate_up_proj', merge_axes(1, 3)),
        rule('layers/{i}/moe/linear', f'{_G4}.experts.down_proj', transpose((0, 2, 1))),
    ),
    required=(
        (('embedder/input_embedding', 'final_norm/scale'),),
        # Per layer: a key and value einsum, or (global, k_eq_v) a key einsum alone.
        (('layers/{i}/attn/kv_einsum/w',), ('layers/{i}/attn/k_einsum/w',)),
        (('layers/{i}/attn/q_einsum/w', 'layers/{i}/attn/attn_vec_einsum/w',
          'layers/{i}/attn/{n:_query|_key}_norm/scale',
          'layers/{i}/mlp/{p:gate|up|down}_proj/kernel', 'layers/{i}/skip_scale',
          *(f'layers/{{i}}/{t}/scale' for t in _GEMMA_NORMS)),),
    ),
    dims={
        'vocab_size': (('embedder/input_embedding', 0),),
        'hidden_size': (('embedder/input_embedding', 1),),
        'num_attention_heads': (('layers/0/attn/q_einsum/w', 0),),
        'head_dim': (('layers/0/attn/q_einsum/w', 2),),  # Layer 0 is local in every Gemma 4.
        'num_key_value_heads': (('layers/0/attn/kv_einsum/w', 1),),
        'intermediate_size': (('layers/0/mlp/gate_proj/kernel', 1),),
        'vocab_size_per_layer_input': (('embedder/per_layer_input_embedding', 0),),
        'hidden_size_per_layer_input': (('embedder/per_layer_input_embedding', 2),),
        'num_experts': (('layers/0/moe/router_logits', 1),),
        'moe_intermediate_size': (('layers/0/moe/gating_einsum', 2),),
    },
    vocab=VOCAB,
    lora={**GEMMA_LORA, 'layers/{i}/attn/k_einsum/w': LoraWeight('dr,rkh->kdh', K_EQ_V_NOTE)},
    # transformers' Gemma4TextConfig: a global layer's head_dim (512 when the config has
    # none), its kv heads where its keys are its values (k_einsum: num_global_key_value_heads),
    # and a kv-shared layer's MLP twice as wide with use_double_wide_mlp.
    axes={**{p: f for p, f in _GEMMA_AXES.items() if 'qkv_einsum' not in p},
          'layers/{i}/attn/k_einsum/w': ('num_global_key_value_heads', 'hidden_size',
                                         'head_dim')},
    kinds=LayerKinds({'full_attention': LayerType({'head_dim': 'global_head_dim'}),
                      'double_wide_mlp': LayerType({'intermediate_size': _DOUBLE_MLP})},
                     _GEMMA4_LAYER_TYPES, {'double_wide_mlp': _double_wide_mlp}),
    config_defaults={'global_head_dim': lambda c: 512,
                     _DOUBLE_MLP: lambda c: 2 * c['intermediate_size']},
    # Measured with `transformers` (tests/test_hf_clients.py): fed what Tunix's is, its router
    # gives the Tunix model back.
    as_trained=(AsTrained(
        what='router', when=('layers/{i}/moe/router_logits',),
        trained="MoE router reads moe_pre_ffw_norm(x), the experts' input",
        served='reads x (pre_feedforward_layernorm_2 normalises the experts\' input only)',
        consequence='served, tokens go to other experts, with other weights, than in training'),),
)

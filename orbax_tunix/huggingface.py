"""Hugging Face model families as data: Tunix weights onto `transformers` tensor names.

A `Family` is a value: layout rules from Tunix's canonical weight paths to the
tensor names and layouts Hugging Face uses (the exact inverse of the maps
google-tunix's own loaders apply, `tunix/models/{qwen3,llama3,qwen2}/params.py` and
`tunix/models/{gemma,gemma3,gemma4}/params_safetensors.py`; where Tunix's map
disagrees with `transformers`, as for Gemma 1's norms, `transformers` decides),
the weights every checkpoint of
the family holds, and where each `config.json` dimension is read from the
shapes. Families are found by name (`get`, `names`); a new family is one more
registered value. Nothing here reads an array.

Tunix lays attention weights out as einsums: q/k/v (D, heads, H), the output
(heads, H, D); Hugging Face as linear layers (out, in): q/k/v (heads·H, D),
o (D, heads·H), so the heads axes are merged and the result transposed; MLP
kernels (in, out) are transposed; norms and embeddings are copied.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Mapping, Sequence

from orbax_tunix import catalog, errors
from orbax_tunix.keypaths import Path, fmt
from orbax_tunix.patterns import LayoutRule, Pattern
from orbax_tunix.transforms import Shape, chain, merge_axes, take, transpose

LAYER = 'model.layers.{i}'
# (D, X, H) -> (X·H, D): an input projection as Hugging Face's linear weight.
IN_PROJ = chain(merge_axes(1, 3), transpose())
# (N, H, D) -> (D, N·H): the output projection.
OUT_PROJ = chain(merge_axes(0, 2), transpose())
# Gemma's (X, D, H) einsums -> (X·H, D).
HEADS_FIRST = chain(transpose((1, 0, 2)), IN_PROJ)


def _rule(source: str, dest: str, transform=None) -> LayoutRule:
  return LayoutRule.of(tuple(source.split('/')), (dest,), *(() if transform is None else (transform,)))


@dataclasses.dataclass(frozen=True)
class Family:
  """One Hugging Face model family.

  Attributes:
    name: what `--model` calls it.
    architecture: the `transformers` class (config.json's `architectures`).
    rules: Tunix canonical weight pattern -> tensor name and transform.
    required: what every checkpoint of the family holds: per requirement,
      alternatives, each a set of weight patterns (`{i}` over every layer).
    dims: config.json field -> (weight pattern, axis) alternatives its value
      is read from (`num_hidden_layers` is the layer count).
    tied: config.json's `tie_word_embeddings` from the weights' paths.
  """

  name: str
  architecture: str
  rules: tuple[LayoutRule, ...]
  required: tuple[tuple[tuple[str, ...], ...], ...]
  dims: Mapping[str, tuple[tuple[str, int], ...]]
  tied: Callable[[Collection[Path]], bool] | None = None

  def layers(self, paths) -> list[str]:
    return sorted({p[1] for p in paths if len(p) > 2 and p[0] == 'layers' and p[1].isdigit()},
                  key=int)

  def missing(self, paths) -> list[str]:
    """The first alternative of each requirement the weights do not meet, as paths."""
    have, layers = set(paths), self.layers(paths)
    out = []
    for alternatives in self.required:
      # Alternatives over layers are met layer by layer (Gemma 4's global layers may have a
      # key einsum where its local ones have key and value).
      per_layer = len(alternatives) > 1 and all('{i}' in p for alt in alternatives for p in alt)
      for numbers in ([{'i': [n]} for n in layers] if per_layer else [{'i': layers}]):
        gaps = [
            [fmt(p) for pattern in alt for p in Pattern.parse(pattern.split('/')).expand(numbers)
             if p not in have]
            for alt in alternatives
        ]
        if all(gaps):
          out += gaps[0]
    return out

  def config(self, shapes: Mapping[Path, Shape]) -> dict[str, object]:
    """The config.json dimensions these weights imply."""
    out: dict[str, object] = {'num_hidden_layers': len(self.layers(shapes))}
    for field, alternatives in self.dims.items():
      for pattern, axis in alternatives:
        path = tuple(pattern.split('/'))
        if path in shapes:
          out[field] = shapes[path][axis]
          break
    if self.tied is not None:
      out['tie_word_embeddings'] = self.tied(shapes)
    return out


def _qwen3_style(name: str, architecture: str, norms: bool) -> Family:
  """Qwen3 and Llama3 share Tunix's layout; Qwen3 adds q/k norms."""
  rules = [
      _rule('embedder/input_embedding', 'model.embed_tokens.weight'),
      _rule('final_norm/w', 'model.norm.weight'),
      _rule('lm_head/w', 'lm_head.weight', transpose()),  # Only when not tied.
      _rule('layers/{i}/attn/{p:q|k|v}_proj/w', f'{LAYER}.self_attn.{{p}}_proj.weight', IN_PROJ),
      _rule('layers/{i}/attn/o_proj/w', f'{LAYER}.self_attn.o_proj.weight', OUT_PROJ),
      _rule('layers/{i}/mlp/{p:gate|up|down}_proj/kernel', f'{LAYER}.mlp.{{p}}_proj.weight',
            transpose()),
      _rule('layers/{i}/{n:input|post_attention}_layernorm/w', f'{LAYER}.{{n}}_layernorm.weight'),
  ]
  required = [
      ('embedder/input_embedding', 'final_norm/w', 'layers/{i}/attn/{p:q|k|v|o}_proj/w',
       'layers/{i}/mlp/{p:gate|up|down}_proj/kernel',
       'layers/{i}/{n:input|post_attention}_layernorm/w'),
  ]
  if norms:
    rules.append(_rule('layers/{i}/attn/{n:q|k}_norm/w', f'{LAYER}.self_attn.{{n}}_norm.weight'))
    required.append(('layers/{i}/attn/{n:q|k}_norm/w',))
  return Family(
      name=name,
      architecture=architecture,
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
  )


QWEN3 = _qwen3_style('qwen3', 'Qwen3ForCausalLM', norms=True)
LLAMA3 = _qwen3_style('llama3', 'LlamaForCausalLM', norms=False)

_GEMMA_NORMS = {
    'pre_attention_norm': 'input_layernorm',
    'post_attention_norm': 'post_attention_layernorm',
    'pre_ffw_norm': 'pre_feedforward_layernorm',
    'post_ffw_norm': 'post_feedforward_layernorm',
}
GEMMA3 = Family(
    name='gemma3',
    architecture='Gemma3ForCausalLM',
    rules=(
        _rule('embedder/input_embedding', 'model.embed_tokens.weight'),  # Tied: no lm_head.
        _rule('final_norm/scale', 'model.norm.weight'),
        _rule('layers/{i}/attn/q_einsum/w', f'{LAYER}.self_attn.q_proj.weight', HEADS_FIRST),
        LayoutRule.split(
            ('layers', '{i}', 'attn', 'kv_einsum', 'w'),
            *(((f'{LAYER}.self_attn.{p}_proj.weight',), chain(take(0, n), HEADS_FIRST))
              for n, p in enumerate('kv'))),
        LayoutRule.split(  # Heads == kv heads: one fused einsum.
            ('layers', '{i}', 'attn', 'qkv_einsum', 'w'),
            *(((f'{LAYER}.self_attn.{p}_proj.weight',), chain(take(0, n), HEADS_FIRST))
              for n, p in enumerate('qkv'))),
        _rule('layers/{i}/attn/attn_vec_einsum/w', f'{LAYER}.self_attn.o_proj.weight', OUT_PROJ),
        _rule('layers/{i}/attn/_query_norm/scale', f'{LAYER}.self_attn.q_norm.weight'),
        _rule('layers/{i}/attn/_key_norm/scale', f'{LAYER}.self_attn.k_norm.weight'),
        _rule('layers/{i}/mlp/{p:gate|up|down}_proj/kernel', f'{LAYER}.mlp.{{p}}_proj.weight',
              transpose()),
        *(_rule(f'layers/{{i}}/{tunix}/scale', f'{LAYER}.{hf}.weight')
          for tunix, hf in _GEMMA_NORMS.items()),
    ),
    required=(
        (('embedder/input_embedding', 'final_norm/scale'),),
        (('layers/{i}/attn/q_einsum/w', 'layers/{i}/attn/kv_einsum/w'),
         ('layers/{i}/attn/qkv_einsum/w',)),
        (('layers/{i}/attn/attn_vec_einsum/w', 'layers/{i}/attn/{n:_query|_key}_norm/scale',
          'layers/{i}/mlp/{p:gate|up|down}_proj/kernel',
          *(f'layers/{{i}}/{t}/scale' for t in _GEMMA_NORMS)),),
    ),
    dims={
        'vocab_size': (('embedder/input_embedding', 0),),
        'hidden_size': (('embedder/input_embedding', 1),),
        'num_attention_heads': (('layers/0/attn/q_einsum/w', 0), ('layers/0/attn/qkv_einsum/w', 1)),
        'head_dim': (('layers/0/attn/q_einsum/w', 2), ('layers/0/attn/qkv_einsum/w', 3)),
        'num_key_value_heads': (('layers/0/attn/kv_einsum/w', 1), ('layers/0/attn/qkv_einsum/w', 1)),
        'intermediate_size': (('layers/0/mlp/gate_proj/kernel', 1),),
    },
)


def _per_expert(source: str, dest: str, axis: int, then) -> LayoutRule:
  """One stacked expert weight (experts along `axis`) onto one tensor per expert `{e}`."""
  shown = dataclasses.replace(chain(take(axis, 0), then),
                              name=f'take(axis={axis}, index={{e}}) -> {then.name}')
  return LayoutRule.of(tuple(source.split('/')), (dest,), shown, fan_out=('e', axis),
                       transform_for=lambda e: chain(take(axis, e), then))


def _extended(base: Family, name: str, architecture: str, rules=(), required=(), dims=None,
              optional=()) -> Family:
  """`base` plus some weights, the patterns in `optional` no longer required."""
  return dataclasses.replace(
      base, name=name, architecture=architecture, rules=base.rules + tuple(rules),
      required=tuple(tuple(tuple(p for p in alt if p not in optional) for alt in alts)
                     for alts in base.required) + tuple(required),
      dims=base.dims if dims is None else dims)


# Qwen2 / Qwen2.5 (and the DeepSeek-R1 distills on it): Llama's layout plus q/k/v biases, which
# Tunix keeps flat (heads·H,) as Hugging Face does (`tunix/models/qwen2/params.py`).
QWEN2 = _extended(
    LLAMA3, 'qwen2', 'Qwen2ForCausalLM',
    rules=(_rule('layers/{i}/attn/{p:q|k|v}_bias', f'{LAYER}.self_attn.{{p}}_proj.bias'),),
    required=((('layers/{i}/attn/{p:q|k|v}_bias',),),),
)

# Qwen3's mixture of experts (Qwen3MoeForCausalLM): Tunix stacks the experts, (E, D, F) for
# gate/up and (E, F, D) for down, and keeps the router as a linear (D, E); Hugging Face has one
# (out, in) tensor per expert and the router as `mlp.gate` (`_stack_experts` in
# `tunix/models/qwen3/params.py` is the inverse). Tunix makes every layer sparse; a dense
# layer (Hugging Face's `mlp_only_layers`) keeps Qwen3's MLP names.
_MOE_MLP = 'layers/{i}/mlp/{p:gate|up|down}_proj'
QWEN3_MOE = _extended(
    QWEN3, 'qwen3_moe', 'Qwen3MoeForCausalLM',
    rules=(
        _rule('layers/{i}/mlp/router/kernel', f'{LAYER}.mlp.gate.weight', transpose()),
        _per_expert(_MOE_MLP, f'{LAYER}.mlp.experts.{{e}}.{{p}}_proj.weight', 0, transpose()),
    ),
    required=((('layers/{i}/mlp/router/kernel', _MOE_MLP),),),
    dims={
        **{k: v for k, v in QWEN3.dims.items() if k != 'intermediate_size'},
        'num_experts': (('layers/0/mlp/router/kernel', 1),),
        'moe_intermediate_size': (('layers/0/mlp/gate_proj', 2),),
    },
    optional=('layers/{i}/mlp/{p:gate|up|down}_proj/kernel',),
)


def _gemma_attention(layer: str, fused: bool = True) -> tuple[LayoutRule, ...]:
  """Tunix Gemma's attention einsums: q (N, D, H), kv (2, K, D, H) or fused qkv, out (N, H, D)."""
  rules = (
      _rule('layers/{i}/attn/q_einsum/w', f'{layer}.self_attn.q_proj.weight', HEADS_FIRST),
      LayoutRule.split(
          ('layers', '{i}', 'attn', 'kv_einsum', 'w'),
          *(((f'{layer}.self_attn.{p}_proj.weight',), chain(take(0, n), HEADS_FIRST))
            for n, p in enumerate('kv'))),
      LayoutRule.split(  # Heads == kv heads: one fused einsum.
          ('layers', '{i}', 'attn', 'qkv_einsum', 'w'),
          *(((f'{layer}.self_attn.{p}_proj.weight',), chain(take(0, n), HEADS_FIRST))
            for n, p in enumerate('qkv'))),
      _rule('layers/{i}/attn/attn_vec_einsum/w', f'{layer}.self_attn.o_proj.weight', OUT_PROJ),
      _rule('layers/{i}/mlp/{p:gate|up|down}_proj/kernel', f'{layer}.mlp.{{p}}_proj.weight',
            transpose()),
  )
  return tuple(r for r in rules if fused or r.source.keys[3].text != 'qkv_einsum')


_GEMMA_QKV = (('layers/{i}/attn/q_einsum/w', 'layers/{i}/attn/kv_einsum/w'),
              ('layers/{i}/attn/qkv_einsum/w',))


def _gemma(name: str, architecture: str, norms: Mapping[str, str]) -> Family:
  """Gemma 1 and 2 (`tunix/models/gemma`): one model class, its norms set by the config.

  Both scale embeddings by sqrt(D), tie them (no lm_head) and compute `1 + scale` in
  every norm on both sides, so every value is copied as it is.
  """
  return Family(
      name=name,
      architecture=architecture,
      rules=(
          _rule('embedder/input_embedding', 'model.embed_tokens.weight'),
          _rule('final_norm/scale', 'model.norm.weight'),
          *_gemma_attention(LAYER),
          *(_rule(f'layers/{{i}}/{tunix}/scale', f'{LAYER}.{hf}.weight')
            for tunix, hf in norms.items()),
      ),
      required=(
          (('embedder/input_embedding', 'final_norm/scale'),),
          _GEMMA_QKV,
          (('layers/{i}/attn/attn_vec_einsum/w', 'layers/{i}/mlp/{p:gate|up|down}_proj/kernel',
            *(f'layers/{{i}}/{t}/scale' for t in norms)),),
      ),
      dims=GEMMA3.dims,
      tied=lambda paths: True,
  )


# Gemma 2 (Gemma2ForCausalLM): norms around both blocks, as Tunix's safetensors loader maps
# them (`tunix/models/gemma/params_safetensors.py`).
GEMMA2 = _gemma('gemma2', 'Gemma2ForCausalLM', {
    'pre_attention_norm': 'input_layernorm',
    'post_attn_norm': 'post_attention_layernorm',
    'pre_ffw_norm': 'pre_feedforward_layernorm',
    'post_ffw_norm': 'post_feedforward_layernorm',
})
# Gemma 1 (GemmaForCausalLM: `use_post_attn_norm`, `use_post_ffw_norm` off): Hugging Face's
# `post_attention_layernorm` is the norm before the MLP (transformers' GemmaDecoderLayer), that
# is Tunix's `pre_ffw_norm`. Tunix 0.1.7's loader maps that name to Gemma 2's `post_attn_norm`
# for both versions, so it cannot load a Gemma 1 folder (the Hub's or this one).
GEMMA = _gemma('gemma', 'GemmaForCausalLM', {
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
GEMMA4 = Family(
    name='gemma4',
    architecture='Gemma4ForConditionalGeneration',
    rules=(
        _rule('embedder/input_embedding', f'{GEMMA4_PREFIX}.embed_tokens.weight'),
        # (V, L, P) -> (V, L·P), and (D, L, P) -> (L·P, D): every layer's inputs packed.
        _rule('embedder/per_layer_input_embedding', f'{GEMMA4_PREFIX}.embed_tokens_per_layer.weight',
              merge_axes(1, 3)),
        _rule('embedder/per_layer_model_projection/w',
              f'{GEMMA4_PREFIX}.per_layer_model_projection.weight', IN_PROJ),
        _rule('embedder/per_layer_projection_norm/scale',
              f'{GEMMA4_PREFIX}.per_layer_projection_norm.weight'),
        _rule('final_norm/scale', f'{GEMMA4_PREFIX}.norm.weight'),
        *_gemma_attention(_G4, fused=False),  # Gemma 4 has no fused qkv einsum.
        _rule('layers/{i}/attn/k_einsum/w', f'{_G4}.self_attn.k_proj.weight', HEADS_FIRST),
        _rule('layers/{i}/attn/_query_norm/scale', f'{_G4}.self_attn.q_norm.weight'),
        _rule('layers/{i}/attn/_key_norm/scale', f'{_G4}.self_attn.k_norm.weight'),
        *(_rule(f'layers/{{i}}/{tunix}/scale', f'{_G4}.{hf}.weight')
          for tunix, hf in _GEMMA4_NORMS.items()),
        _rule('layers/{i}/skip_scale', f'{_G4}.layer_scalar'),
        _rule('layers/{i}/per_layer_input_gate/w', f'{_G4}.per_layer_input_gate.weight',
              transpose()),
        _rule('layers/{i}/per_layer_projection/w', f'{_G4}.per_layer_projection.weight',
              transpose()),
        _rule('layers/{i}/moe/router_logits', f'{_G4}.router.proj.weight', transpose()),
        _rule('layers/{i}/moe/router_scale', f'{_G4}.router.scale'),
        _rule('layers/{i}/moe/per_expert_scale', f'{_G4}.router.per_expert_scale'),
        # (E, 2, F, D) -> (E, 2·F, D); (E, F, D) -> (E, D, F).
        _rule('layers/{i}/moe/gating_einsum', f'{_G4}.experts.gate_up_proj', merge_axes(1, 3)),
        _rule('layers/{i}/moe/linear', f'{_G4}.experts.down_proj', transpose((0, 2, 1))),
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
    tied=lambda paths: True,
)

FAMILIES: catalog.Catalog[Family] = catalog.Catalog('model')
for _family in (QWEN3, LLAMA3, GEMMA3):
  FAMILIES.register(_family)
for _family in (QWEN2, QWEN3_MOE, GEMMA, GEMMA2, GEMMA4):
  FAMILIES.register(_family)
register, get, names = FAMILIES.register, FAMILIES.get, FAMILIES.names


def table(family: Family) -> list[tuple[str, str, str]]:
  """(Tunix path, Hugging Face name, transform) per rule, as the README shows them."""
  rows = []
  for rule in family.rules:
    source = '/'.join(k.spec for k in rule.source.keys)
    for dest, transform in rule.dests:
      rows.append((source, '/'.join(k.spec for k in dest.keys), transform.name))
  return rows


def markdown(families: Sequence[Family] | None = None) -> str:
  """The README's table of maps: each `table` row once, with the families that have it."""
  families = [get(n) for n in names()] if families is None else list(families)
  rows: dict[tuple[str, str, str], list[str]] = {}
  for family in families:
    for row in table(family):
      rows.setdefault(row, []).append(family.name)

  def cell(text: str) -> str:
    return '`' + text.replace('|', '\\|') + '`'

  lines = ['| Tunix (canonical) | Hugging Face | layout | families |', '|---|---|---|---|']
  lines += [f'| {cell(s)} | {cell(d)} | {t} | {", ".join(f)} |' for (s, d, t), f in rows.items()]
  return '\n'.join(lines) + '\n'


def check_config(
    family: Family, config: Mapping[str, object], shapes: Mapping[Path, Shape], where: str
) -> None:
  """Checks a Hugging Face config.json against the weights' dimensions.

  Raises:
    UnsupportedLayoutError: naming each field that differs, with both values.
  """
  config = config.get('text_config', config) if isinstance(config, Mapping) else {}
  implied = family.config(shapes)
  wrong = [
      f'{field}: config.json has {config[field]}, the weights have {value}'
      for field, value in implied.items()
      if field in config and config[field] != value
      and not (field == 'tie_word_embeddings' and config[field] is None)
  ]
  if wrong:
    raise errors.UnsupportedLayoutError(
        f'{where}: config.json does not describe these weights ({family.name}):\n'
        f'{errors.list_paths(wrong)}\nPass the --hf-config of the model this run was'
        ' trained from.'
    )


def fits(family: Family, shapes: Mapping[Path, Shape], unmatched: Sequence[Path], where: str) -> None:
  """Checks that the weights are the family's: none left unmapped, none missing.

  Raises:
    UnsupportedLayoutError: naming the first unmapped and missing weights.
  """
  missing = family.missing(shapes)
  if unmatched or missing:
    parts = [f'{where}: these weights are not a {family.name} model\'s'
             f' ({family.architecture}):']
    if unmatched:
      parts.append(f'{len(unmatched)} weights have no {family.name} tensor:\n'
                   + errors.list_paths([fmt(p) for p in unmatched]))
    if missing:
      parts.append(f'{len(missing)} {family.name} weights are missing:\n'
                   + errors.list_paths(missing))
    parts.append(f'Pick the family the model is (`model`: {", ".join(names())}).')
    raise errors.UnsupportedLayoutError('\n'.join(parts))

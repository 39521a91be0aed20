"""Hugging Face model families as data: Tunix weights onto `transformers` tensor names.

A `Family` is a value: layout rules from Tunix's canonical weight paths to the
tensor names and layouts Hugging Face uses (the exact inverse of the maps
google-tunix's own loaders apply, `tunix/models/{qwen3,llama3}/params.py` and
`tunix/models/gemma3/params_safetensors.py`), the weights every checkpoint of
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
    have, numbers = set(paths), {'i': self.layers(paths)}
    out = []
    for alternatives in self.required:
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

FAMILIES: catalog.Catalog[Family] = catalog.Catalog('model')
for _family in (QWEN3, LLAMA3, GEMMA3):
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

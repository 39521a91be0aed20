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
import json
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
    architecture: the `transformers` class of the text model these weights
      are (config.json's `architectures`).
    model_type: its config's `model_type` (`transformers`' config class).
    rules: Tunix canonical weight pattern -> tensor name and transform.
    required: what every checkpoint of the family holds: per requirement,
      alternatives, each a set of weight patterns (`{i}` over every layer).
    dims: config.json field -> (weight pattern, axis) alternatives its value
      is read from (`num_hidden_layers` is the layer count).
    tied: config.json's `tie_word_embeddings` from the weights' paths (None:
      always tied).
    fixed: config.json fields every model of the family has, whatever the
      base config says (e.g. Gemma's tanh-approximated GELU).
  """

  name: str
  architecture: str
  model_type: str
  rules: tuple[LayoutRule, ...]
  required: tuple[tuple[tuple[str, ...], ...], ...]
  dims: Mapping[str, tuple[tuple[str, int], ...]]
  tied: Callable[[Collection[Path]], bool] | None = None
  fixed: Mapping[str, object] = dataclasses.field(default_factory=dict)

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
    out['tie_word_embeddings'] = True if self.tied is None else self.tied(shapes)
    return out


def _qwen3_style(name: str, architecture: str, model_type: str, norms: bool) -> Family:
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
      model_type=model_type,
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


QWEN3 = _qwen3_style('qwen3', 'Qwen3ForCausalLM', 'qwen3', norms=True)
LLAMA3 = _qwen3_style('llama3', 'LlamaForCausalLM', 'llama', norms=False)

_GEMMA_NORMS = {
    'pre_attention_norm': 'input_layernorm',
    'post_attention_norm': 'post_attention_layernorm',
    'pre_ffw_norm': 'pre_feedforward_layernorm',
    'post_ffw_norm': 'post_feedforward_layernorm',
}
GEMMA3 = Family(
    name='gemma3',
    architecture='Gemma3ForCausalLM',
    model_type='gemma3_text',  # Gemma3ForConditionalGeneration's text_config.
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
    # Gemma's MLP uses the tanh approximation; MaxText's converter writes "gelu",
    # which transformers takes as the exact GELU and vLLM refuses.
    fixed={'hidden_activation': 'gelu_pytorch_tanh'},
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


# Fields of a multimodal config (outside its `text_config`) that the text model
# takes too: the dtype, the tying, the special tokens, the writer's version.
CARRIED_TO_TEXT = ('torch_dtype', 'dtype', 'tie_word_embeddings', 'bos_token_id', 'eos_token_id',
                   'pad_token_id', 'transformers_version')


@dataclasses.dataclass(frozen=True)
class Config:
  """The config.json an export writes, and what was changed from the base's.

  Attributes:
    values: the config, as written (when `notes` is empty: the base's own).
    notes: one line per change, for people.
  """

  values: Mapping[str, object]
  notes: tuple[str, ...] = ()


_JSON_TYPES = {list: 'array', str: 'string', int: 'number', float: 'number', bool: 'boolean',
               type(None): 'null'}


def _bad_config(where: str, found: str) -> errors.InvalidOptionError:
  return errors.InvalidOptionError(
      f'{where}: expected a Hugging Face config.json (a JSON object with the model\'s'
      f' fields), found {found}. Pass as `hf_config` the folder of the model this run was'
      ' trained from.'
  )


def _split(family: Family, config: Mapping[str, object], where: str
           ) -> tuple[dict[str, object], dict[str, object] | None, list[str]]:
  """(the config's top level, the text model's fields when they stay in its `text_config`,
  notes). A config with a `text_config` and of another architecture than the family's (a
  multimodal model whose text model the export holds) becomes its text model's: the
  `text_config` at the top with the outer fields it lacks (`CARRIED_TO_TEXT`). A config of the
  family's own architecture keeps its `text_config` (the family names the multimodal model)."""
  text = config.get('text_config')
  if text is None:
    return dict(config), None, []
  if not isinstance(text, Mapping):
    raise _bad_config(where, f'"text_config": {json.dumps(text)[:60]} (expected an object: the'
                             ' text model\'s fields)')
  if (config.get('architectures') == [family.architecture]
      or config.get('model_type') == family.model_type):
    return dict(config), dict(text), []
  top = {k: config[k] for k in CARRIED_TO_TEXT if k in config and config[k] is not None}
  top.update(text)
  return top, None, [
      f'config.json is {config.get("architectures") or config.get("model_type")!r}, a'
      ' multimodal model; the export holds its text model\'s weights only: wrote its'
      f' text_config as a {family.architecture} config (model_type {family.model_type})'
  ]


def _shown(value: object) -> str:
  return repr(value) if not isinstance(value, (int, float)) or isinstance(value, bool) else str(
      value)


def check_config(
    family: Family, config: object, shapes: Mapping[Path, Shape], where: str
) -> Config:
  """Checks a Hugging Face config.json against the weights; returns the one to write.

  The rules (the tensor names and `architectures` always agree):
    * a multimodal config of another architecture (a `text_config`) becomes
      its text model's config (see `_split`);
    * `architectures` and `model_type` must be the family's (written when absent);
    * every dimension the weights imply must match, as an int, and
      `tie_word_embeddings` must say what the weights are (a tied model has
      no lm_head: a loader told otherwise starts a random one); those the
      config omits are written (the config class's default may differ);
    * the family's `fixed` fields are written.

  Args:
    family: the family.
    config: config.json as parsed.
    shapes: the weights' shapes (Tunix paths).
    where: the file, for messages.

  Returns:
    The `Config` to write.

  Raises:
    InvalidOptionError: not a JSON object, or a `text_config` that is not one.
    UnsupportedLayoutError: another family's config, or fields that differ
      from the weights (each named, with both values).
  """
  if not isinstance(config, Mapping):
    raise _bad_config(where, f'a JSON {_JSON_TYPES.get(type(config), "value")}'
                             f' ({json.dumps(config)[:60]})')
  top, inner, notes = _split(family, config, where)
  fields = top if inner is None else inner
  wrong = []
  archs = top.get('architectures')
  if archs is not None and archs != [family.architecture]:
    wrong.append(f'architectures: config.json has {_shown(archs)}, the weights are'
                 f' [{family.architecture!r}]')
  if top.get('model_type', family.model_type) != family.model_type:
    wrong.append(f'model_type: config.json has {_shown(top["model_type"])}, the weights are'
                 f' {family.model_type!r}')
  implied = family.config(shapes)
  for field, value in implied.items():
    have = fields.get(field)
    if have is None:
      continue
    if type(have) is not type(value):
      wrong.append(f'{field}: config.json has {have!r} ({type(have).__name__}), the weights'
                   f' have {value!r} ({type(value).__name__})')
    elif have != value:
      wrong.append(f'{field}: config.json has {have}, the weights have {value}'
                   + (' (no lm_head: the loader would start a random one)'
                      if field == 'tie_word_embeddings' and value else ''))
  if wrong:
    raise errors.UnsupportedLayoutError(
        f'{where}: config.json does not describe these weights ({family.name}):\n'
        f'{errors.list_paths(wrong)}\nPass the --hf-config of the model this run was'
        ' trained from.'
    )
  named = {f: v for f, v in (('architectures', [family.architecture]),
                             ('model_type', family.model_type)) if top.get(f) is None}
  added = {f: v for f, v in implied.items() if fields.get(f) is None}
  fixed = {f: v for f, v in family.fixed.items() if fields.get(f) != v}
  if named or added:
    notes.append('config.json: wrote what the base config left to its class\'s defaults: '
                 + ', '.join(f'{f}={_shown(v)}' for f, v in {**named, **added}.items()))
  if fixed:
    notes.append(f'config.json: {family.name} has '
                 + ', '.join(f'{f}={v!r} (the base config has {_shown(fields.get(f))})'
                             for f, v in fixed.items()))
  if not notes:
    return Config(top)
  fields = {**fields, **added, **fixed}
  top = {**named, **(top if inner is None else {**top, 'text_config': fields})}
  return Config(top if inner is not None else {**top, **fields}, tuple(notes))


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

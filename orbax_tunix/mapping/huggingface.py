"""Hugging Face model families as data: Tunix weights onto `transformers` tensor names.

A `Family` is a value: layout rules from Tunix's canonical weight paths to the
tensor names and layouts Hugging Face uses (the exact inverse of the maps
google-tunix's own loaders apply, `tunix/models/{qwen3,llama3,qwen2}/params.py` and
`tunix/models/{gemma,gemma3,gemma4}/params_safetensors.py`; where Tunix's map
disagrees with `transformers`, as for Gemma 1's norms, `transformers` decides),
the weights every checkpoint of the family holds, and where each `config.json`
dimension is read from the shapes. Families are found by name (`get`, `names`);
a new family is one more registered value. Nothing here reads an array.

Tunix lays attention weights out as einsums: q/k/v (D, heads, H), the output
(heads, H, D); Hugging Face as linear layers (out, in): q/k/v (heads·H, D),
o (D, heads·H), so the heads axes are merged and the result transposed; MLP
kernels (in, out) are transposed; norms and embeddings are copied.

A family names each kind of source it takes (`Naming`): Tunix's own model
classes (`tunix.models`: `rules`, `required`, `dims`, `tied` on the family
itself) and, where MaxText has the model, MaxText's (`maxtext`: a Tunix run
of a MaxText model, or MaxText's own step). Which one applies comes from the
weights' names (`source_kind`). MaxText's naming is on the per-layer form
`decoder/layers_{i}/<w>`: its stacked layers are first taken apart by its layer
form (`Naming.form`, a `mapping.stacks.LayerForm`); then the rules apply what
MaxText's own converter applies (checkpoint_conversion/utils/param_mapping.py):
kernels (in, heads, head_dim) merged and transposed to (out, in); gemma norms
`w - 1` (MaxText stores `1 + w`); gemma3's embedding divided by sqrt(hidden)
rounded to bfloat16 (gemma4: in float32), as MaxText stores it scaled.

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
                    have their own head_dim and no value kernel (k = v shared)
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Collection, Mapping, Sequence

import ml_dtypes
import numpy as np

from orbax_tunix import catalog, errors
from orbax_tunix.keypaths import Path, fmt
from orbax_tunix.mapping import lora
from orbax_tunix.mapping import stacks as stacks_lib
from orbax_tunix.mapping.as_trained import AsTrained
from orbax_tunix.mapping.patterns import LayoutRule, Mapped, Pattern
from orbax_tunix.mapping.transforms import (
  IDENTITY,
  Shape,
  chain,
  deinterleave,
  divide,
  head,
  merge_axes,
  multiply,
  shift,
  take,
  transpose,
)

# The models whose weight names a family maps (`Naming.source`); not checkpoint kinds
# (those are `view.source_kinds`: a Tunix run may hold either model).
TUNIX_MODEL = 'tunix'
MAXTEXT_MODEL = 'maxtext'
# How a source kind is told from its weights: the top-level keys of MaxText's
# decoder model (Tunix's model classes have `embedder`, `layers`, ...).
_MAXTEXT_ROOTS = frozenset({'decoder', 'token_embedder'})
SOURCE_NAMES = {TUNIX_MODEL: 'Tunix model (tunix.models)', MAXTEXT_MODEL: 'MaxText model'}
# What `describe_source` calls weights of no family's model, and a LoRA save without them.
NO_MODEL = 'Orbax arrays (no known model)'
ADAPTERS_ONLY = 'LoRA adapters only (no base weights)'


@dataclasses.dataclass(frozen=True)
class VocabPadding:
  """Which rows past a config's `vocab_size` a source kind holds as padding (never trained),
  so that an export may cut them; rows of any other source are the model's own.

  Attributes:
    any: every cut is padding (MaxText pads the vocabulary to a multiple of its sharding).
    known: (stored rows, real vocabulary) pairs that are padding.
    why: who pads, for notes.
  """

  any: bool = False
  known: tuple[tuple[int, int], ...] = ()
  why: str = ''

  def allows(self, rows: int, vocab_size: int) -> bool:
    return self.any or (rows, vocab_size) in self.known


NO_PADDING = VocabPadding()
MAXTEXT_PADDING = VocabPadding(any=True, why='MaxText pads the vocabulary for sharding')
# Gemma 1 and 2's own checkpoints (Kaggle's, which Tunix's `gemma` models load) hold 256128
# rows for the tokenizer's 256000 (Hugging Face's `vocab_size`).
GEMMA_PADDING = VocabPadding(known=((256128, 256000),),
                             why="Gemma's checkpoints pad 256000 tokens to 256128 rows")

LAYER = 'model.layers.{i}'
# (D, X, H) -> (X·H, D): an input projection as Hugging Face's linear weight.
IN_PROJ = chain(merge_axes(1, 3), transpose())
# (N, H, D) -> (D, N·H): the output projection.
OUT_PROJ = chain(merge_axes(0, 2), transpose())
# Gemma's (X, D, H) einsums -> (X·H, D).
HEADS_FIRST = chain(transpose((1, 0, 2)), IN_PROJ)


def _rule(source: str, dest: str, transform=None) -> LayoutRule:
  return LayoutRule.of(tuple(source.split('/')), (dest,), *(() if transform is None else (transform,)))


def source_kind(paths: Collection[Path]) -> str:
  """MAXTEXT_MODEL for MaxText's model (a Tunix run of one, or MaxText's own step), else
  TUNIX_MODEL."""
  return MAXTEXT_MODEL if any(p and p[0] in _MAXTEXT_ROOTS for p in paths) else TUNIX_MODEL


def describe_source(shapes: Mapping[Path, Shape], axis: int | None = stacks_lib.DEFAULT_AXIS
                    ) -> str:
  """What kind of model the weights are, for notes and `inspect`: e.g.
  'MaxText model (scanned, 34 layers)', 'Tunix model (tunix.models)' (only
  when they hold every weight one of the families' Tunix models has), else
  `ADAPTERS_ONLY` or `NO_MODEL`.

  Args:
    shapes: the weights.
    axis: the layer axis of stacked weights (`param_scan_axis`); None: not
      known (the count is shown as '?').
  """
  kind = source_kind(shapes)
  if kind != MAXTEXT_MODEL:
    paths = [p for p in shapes if not lora.is_adapter(p)]
    if not paths and shapes:
      return ADAPTERS_ONLY
    tunix = [f.tunix for f in map(get, names()) if f.rules]
    known = any(n.layers(paths) and not n.missing(paths) for n in tunix)
    return SOURCE_NAMES[kind] if known else NO_MODEL
  form = layer_form(shapes) or stacks_lib.UNSCANNED
  count = form.count(shapes, stacks_lib.DEFAULT_AXIS if axis is None else axis)
  shown = '?' if (axis is None and form.scanned) or count is None else count
  return f'{SOURCE_NAMES[kind]} ({form.kind}, {shown} layers)'


@dataclasses.dataclass(frozen=True)
class LoraWeight:
  """How qwix lays out the LoRA adapter of one weight: data beside the weight's rule (a PEFT
  adapter export reads it; `mapping/peft.py`).

  Attributes:
    einsum: `a, b -> weight` as qwix arranges them (e.g. 'dr,rnh->ndh': `a` (D, r), `b`
      (r, N, H), the weight (N, D, H)): where `a`'s dimensions sit among the weight's, for
      a save without the weight (adapters only). None: `a`'s dimensions then `b`'s, in order
      (qwix's `dot_general` adapters, and every einsum whose contracted dimensions lead).
    note: what a person serving the adapter should know, said when the weight is adapted.
    without: a weight pattern (`{i}`: the layer's number): the note holds only in layers
      without that weight (MaxText gemma4's global layers have no value kernel: their keys
      are the values).
  """

  einsum: str | None = None
  note: str | None = None
  without: str | None = None

  def note_for(self, number: int | None, has: Callable[[Path], bool] | None) -> str | None:
    """The note, where it holds for a weight of layer `number` (None: of no layer) of a model
    that `has` the weights it has (None: not known, and a conditional note is not said)."""
    if self.without is None or self.note is None:
      return self.note
    if has is None or number is None:
      return None
    without = Pattern.parse(self.without.split('/')).expand({'i': [str(number)]})
    return None if any(has(p) for p in without) else self.note


@dataclasses.dataclass(frozen=True)
class LayerType:
  """How a layer of one kind (a config's `layer_types` entry, or a `Naming.layer_kinds` one)
  reads the config otherwise.

  Attributes:
    fields: config.json field -> the field such a layer reads instead (gemma4's global
      layers: `head_dim` -> `global_head_dim`), or a value the config class computes from
      others, named as `Naming.config_defaults` computes it (`2 x intermediate_size`).
    without: weight patterns (`{i}`: the layer's number) such a layer has not (MaxText
      gemma4's global layers: no value kernel).
  """

  fields: Mapping[str, str]
  without: tuple[str, ...] = ()


_ANY_LAYER = LayerType({})


@dataclasses.dataclass(frozen=True)
class Naming:
  """One kind of source's names for a family (see the module docstring).

  Attributes:
    source: TUNIX_MODEL or MAXTEXT_MODEL.
    rules: weight pattern -> tensor name and transform (MAXTEXT_MODEL: on the
      per-layer form).
    required, dims, tied: as the `Family`'s.
    layer: the pattern of one layer's prefix (`{i}` its number).
    vocab: weight pattern -> its vocabulary axis (cut to the config's
      `vocab_size` when the checkpoint's is padded).
    vocab_padding: which cuts of those axes are padding (`VocabPadding`).
    form: the layer form MaxText stores the family's layers in, scanned
      (`stacks.LayerForm`; unscanned, they are the per-layer form its rules name).
    architecture: the `transformers` class the names are, when not the
      family's (gemma4: MaxText's text decoder is Gemma4ForCausalLM's
      `model.*`, where the Hub's and Tunix's are Gemma4ForConditionalGeneration's
      `model.language_model.*`).
    model_type: that architecture's config `model_type`, with `architecture`.
    lora: weight pattern -> `LoraWeight`, for weights whose adapters are not laid out as
      `a`'s dimensions then `b`'s, or that a person should know of.
    axes: weight pattern -> the config.json field giving each of its axes (`dims` read the
      other way): the shape a base model's config gives a weight that a save of adapters
      alone lacks (qwix flattens a MaxText kernel's dimensions into its adapters).
    layer_types: config `layer_types` entry -> `LayerType`, for layers that read other
      fields (a layer's entry: `layer_types[i]`, else `default_layer_type(i)`).
    default_layer_type: a layer's kind when the config has no `layer_types`.
    layer_kinds: other kinds a layer may be of besides its `layer_types` entry -> whether
      layer `i` of a config is (Gemma 4's kv-shared layers with a double-wide MLP); their
      `layer_types` entries apply too.
    config_defaults: config field -> its value when config.json leaves it out, as the
      `transformers` config class computes it (Llama's `head_dim`: hidden_size //
      num_attention_heads; the Hub's Llama 3 configs have no `head_dim`); also values
      computed from fields, under names no config.json has (`2 x intermediate_size`).
    lora_flattened: qwix flattens this naming's kernels' dimensions into their adapters
      (MaxText's `dot_general` layers): a save of adapters alone takes the weights' shapes
      from the base config (`axes`); elsewhere the adapters tell them, and the base config is
      checked against them (`check_sizes`).
  """

  source: str
  rules: tuple[LayoutRule, ...]
  required: tuple[tuple[tuple[str, ...], ...], ...]
  dims: Mapping[str, tuple[tuple[str, int], ...]]
  tied: Callable[[Collection[Path]], bool] | None = None
  layer: tuple[str, ...] = ('layers', '{i}')
  vocab: Mapping[str, int] = dataclasses.field(default_factory=dict)
  vocab_padding: VocabPadding = NO_PADDING
  form: stacks_lib.LayerForm = stacks_lib.UNSCANNED
  architecture: str | None = None
  model_type: str | None = None
  lora: Mapping[str, LoraWeight] = dataclasses.field(default_factory=dict)
  axes: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
  layer_types: Mapping[str, LayerType] = dataclasses.field(default_factory=dict)
  default_layer_type: Callable[[int], str] | None = None
  layer_kinds: Mapping[str, Callable[[int, Mapping[str, object]], bool]] = dataclasses.field(
      default_factory=dict)
  config_defaults: Mapping[str, Callable[[Mapping[str, object]], object]] = dataclasses.field(
      default_factory=dict)
  lora_flattened: bool = False

  def config_value(self, config: Mapping[str, object], field: str) -> object:
    """`config[field]`, else the `transformers` default (`config_defaults`), else None."""
    if field in config or field not in self.config_defaults:
      return config.get(field)
    try:
      return self.config_defaults[field](config)
    except (KeyError, TypeError, ZeroDivisionError):
      return None

  def axis_fields(self, path: Path, config: Mapping[str, object]
                  ) -> tuple[str | None, ...] | None:
    """The config.json field giving each axis of the weight at `path` (per-layer form) in a
    model of this `config` (its text model's fields; None for an axis no field gives), or
    None: `axes` does not say."""
    fields = next((fields for pattern, fields in self.axes.items()
                   if Pattern.parse(pattern.split('/')).match(path) is not None), None)
    if fields is None:
      return None
    kind = self.layer_type(path, config).fields
    return tuple(None if f is None else kind.get(f, f) for f in fields)

  def layer_number(self, path: Path) -> int | None:
    """The number of the layer the weight at `path` (per-layer form) is in, or None."""
    match = Pattern.parse((*self.layer, '...')).match(path)
    return int(match[0]['i']) if match else None

  def layer_type(self, path: Path, config: Mapping[str, object]) -> LayerType:
    """How the layer of the weight at `path` reads `config`: its `layer_types` entry's
    `LayerType`, with those of the `layer_kinds` it is of."""
    i, kinds, kind = self.layer_number(path), config.get('layer_types'), None
    if i is None:
      return _ANY_LAYER
    if isinstance(kinds, list) and i < len(kinds):
      kind = kinds[i]
    elif self.default_layer_type is not None:
      kind = self.default_layer_type(i)
    found = [self.layer_types[k] for k in (kind, *self.layer_kinds)
             if isinstance(k, str) and k in self.layer_types
             and (k == kind or self.layer_kinds[k](i, config))]
    if len(found) <= 1:
      return found[0] if found else _ANY_LAYER
    return LayerType({f: v for t in found for f, v in t.fields.items()},
                     tuple(w for t in found for w in t.without))

  def has(self, path: Path, config: Mapping[str, object]) -> bool:
    """Whether a model of `config` has the weight at `path` as far as its layer's kind says
    (a save of adapters alone tells no other weight)."""
    number = self.layer_number(path)  # None: in no layer, whose type lacks nothing.
    return not any(path in Pattern.parse(w.split('/')).expand({'i': [str(number)]})
                   for w in self.layer_type(path, config).without)

  def lora_weight(self, path: Path) -> LoraWeight:
    """How the adapter of the weight at `path` is laid out (see `LoraWeight`)."""
    return next((value for pattern, value in self.lora.items()
                 if Pattern.parse(pattern.split('/')).match(path) is not None), LoraWeight())

  def layers(self, paths) -> list[str]:
    pattern = Pattern.parse((*self.layer, '...'))
    return sorted({m[0]['i'] for p in paths if (m := pattern.match(p))}, key=int)

  def missing(self, paths) -> list[str]:
    """The first alternative of each requirement the weights do not meet, as paths."""
    have, layers = set(paths), self.layers(paths)
    out = []
    for alternatives in self.required:
      # Alternatives over layers are met layer by layer (a layer may hold one alternative,
      # another layer another: gemma4's global and local layers).
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
    out['tie_word_embeddings'] = True if self.tied is None else self.tied(shapes)
    return out


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
    vocab: the Tunix weights' vocabulary axes (see `Naming.vocab`).
    vocab_padding: which cuts of them are padding (`Naming.vocab_padding`).
    maxtext: MaxText's naming of the family, if MaxText has the model.
    lora: see `Naming.lora` (Tunix's naming).
    as_trained: where Tunix's model class computes otherwise than `transformers` does from
      the family's config.json (`mapping/as_trained.py`; Tunix's naming only).
    text_prefixes: `transformers` class -> where it holds the text model's modules, for
      the classes a base model of the family may be (a multimodal one holds them deeper).
    aliases: other names `model` takes for it: MaxText's model names whose Hugging Face
      names and layouts are this family's (llama2 and llama3.1 are LlamaForCausalLM).
    embeddings: the Hugging Face modules whose weight is 2-D but that are no linear layer
      (PEFT adapts an embedding as a lookup, with lora_embedding_A/B; qwix adapts a product
      with its weight, e.g. a tied output projection).
    axes, layer_types, default_layer_type, layer_kinds, config_defaults: see `Naming`
      (Tunix's naming: the base config a save of adapters alone is checked against).
  """

  name: str
  architecture: str
  model_type: str
  rules: tuple[LayoutRule, ...]
  required: tuple[tuple[tuple[str, ...], ...], ...]
  dims: Mapping[str, tuple[tuple[str, int], ...]]
  tied: Callable[[Collection[Path]], bool] | None = None
  fixed: Mapping[str, object] = dataclasses.field(default_factory=dict)
  vocab: Mapping[str, int] = dataclasses.field(
      default_factory=lambda: {'embedder/input_embedding': 0, 'lm_head/w': 1})
  vocab_padding: VocabPadding = NO_PADDING
  maxtext: Naming | None = None
  lora: Mapping[str, LoraWeight] = dataclasses.field(default_factory=dict)
  as_trained: tuple[AsTrained, ...] = ()
  text_prefixes: Mapping[str, str] = dataclasses.field(default_factory=dict)
  aliases: tuple[str, ...] = ()
  embeddings: tuple[str, ...] = ('embed_tokens',)
  axes: Mapping[str, tuple[str | None, ...]] = dataclasses.field(default_factory=dict)
  layer_types: Mapping[str, LayerType] = dataclasses.field(default_factory=dict)
  default_layer_type: Callable[[int], str] | None = None
  layer_kinds: Mapping[str, Callable[[int, Mapping[str, object]], bool]] = dataclasses.field(
      default_factory=dict)
  config_defaults: Mapping[str, Callable[[Mapping[str, object]], object]] = dataclasses.field(
      default_factory=dict)

  @property
  def tunix(self) -> Naming:
    """The naming of Tunix's own model class (the family's own fields)."""
    return Naming(TUNIX_MODEL, self.rules, self.required, self.dims, self.tied, vocab=self.vocab,
                  vocab_padding=self.vocab_padding, lora=self.lora, axes=self.axes,
                  layer_types=self.layer_types, default_layer_type=self.default_layer_type,
                  layer_kinds=self.layer_kinds, config_defaults=self.config_defaults)

  @property
  def namings(self) -> tuple[Naming, ...]:
    """The kinds of source the family names (no Tunix naming when `rules` is empty)."""
    return ((self.tunix,) if self.rules else ()) + ((self.maxtext,) if self.maxtext else ())

  def naming(self, paths: Collection[Path], where: str = '') -> Naming:
    """The naming of the kind of source these weights are (`source_kind`).

    Raises:
      UnsupportedLayoutError: the family does not name that kind.
    """
    kind = source_kind(paths)
    found = next((n for n in self.namings if n.source == kind), None)
    if found is None:
      takers = [f.name for f in map(get, names()) if any(n.source == kind for n in f.namings)]
      kinds = ' or a '.join(SOURCE_NAMES[n.source] for n in self.namings)
      raise errors.UnsupportedLayoutError(
          f'{where}: these weights are a {SOURCE_NAMES[kind]}\'s; the {self.name} family'
          f' ({self.architecture}) takes only a {kinds}\'s. Pick a family that takes this'
          f' kind (`model`: {", ".join(takers)}).'
      )
    return found

  def target_of(self, naming: Naming) -> tuple[str, str]:
    """(architecture, model_type) of the model a naming's tensor names are: the naming's own
    where it has one (see `Naming.architecture`), else the family's."""
    return (naming.architecture or self.architecture, naming.model_type or self.model_type)


MT_LAYER = 'decoder/layers_{i}'
_MT_VOCAB = {'token_embedder/embedding': 0, 'decoder/logits_dense/kernel': 1}


def _mt_attention(norm=None, query=IN_PROJ, key=IN_PROJ) -> list[LayoutRule]:
  """MaxText's attention (D, N, H) / (N, H, D) kernels, and its q/k norms through `norm`."""
  rules = [
      _rule(f'{MT_LAYER}/self_attention/{mt}/kernel', f'{LAYER}.self_attn.{hf}_proj.weight', t)
      for mt, hf, t in (('query', 'q', query), ('key', 'k', key), ('value', 'v', IN_PROJ))
  ]
  rules.append(_rule(f'{MT_LAYER}/self_attention/out/kernel', f'{LAYER}.self_attn.o_proj.weight',
                     OUT_PROJ))
  if norm is not None:
    rules += [_rule(f'{MT_LAYER}/self_attention/{mt}_norm/scale',
                    f'{LAYER}.self_attn.{hf}_norm.weight', norm)
              for mt, hf in (('query', 'q'), ('key', 'k'))]
  return rules


def _mt_mlp() -> list[LayoutRule]:
  return [_rule(f'{MT_LAYER}/mlp/{mt}/kernel', f'{LAYER}.mlp.{hf}_proj.weight', transpose())
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
      _rule('token_embedder/embedding', 'model.embed_tokens.weight'),
      _rule('decoder/decoder_norm/scale', 'model.norm.weight'),
      _rule('decoder/logits_dense/kernel', 'lm_head.weight', transpose()),  # Only when not tied.
      *_mt_attention(norm=IDENTITY if norms else None, query=query, key=key),
      *_mt_mlp(),
      _rule(f'{MT_LAYER}/pre_self_attention_layer_norm/scale', f'{LAYER}.input_layernorm.weight'),
      _rule(f'{MT_LAYER}/post_self_attention_layer_norm/scale',
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
      MAXTEXT_MODEL, tuple(rules), tuple((r,) for r in required), _mt_dims(),
      tied=lambda paths: ('decoder', 'logits_dense', 'kernel') not in paths,
      layer=tuple(MT_LAYER.split('/')), vocab=_MT_VOCAB, vocab_padding=MAXTEXT_PADDING,
      form=stacks_lib.SCANNED_FORM, axes=_MT_AXES, config_defaults=config_defaults or {},
      lora_flattened=True,
  )


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
# LlamaConfig and Qwen2's attention without `head_dim` (the Hub's Llama 3 and Qwen2 configs).
_HEAD_DIM_OF_HIDDEN = {'head_dim': lambda c: c['hidden_size'] // c['num_attention_heads']}


def _qwen3_style(name: str, architecture: str, model_type: str, norms: bool,
                 maxtext: Naming, aliases: tuple[str, ...] = (),
                 config_defaults: Mapping[str, Callable] | None = None) -> Family:
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
      maxtext=maxtext,
      as_trained=(ROPE_BASE_1E6,),
      aliases=aliases,
      axes=_QWEN3_AXES,
      config_defaults=config_defaults or {},
  )


QWEN3 = _qwen3_style('qwen3', 'Qwen3ForCausalLM', 'qwen3', norms=True,
                     maxtext=_maxtext_qwen3_style(norms=True))
LLAMA3 = _qwen3_style('llama3', 'LlamaForCausalLM', 'llama', norms=False,
                      maxtext=_maxtext_qwen3_style(
                          norms=False, query=_LLAMA_QUERY, key=_LLAMA_KEY,
                          config_defaults=_HEAD_DIM_OF_HIDDEN),
                      aliases=('llama3.1', 'llama2'),  # MaxText's names of the model.
                      config_defaults=_HEAD_DIM_OF_HIDDEN)

# Gemma's MLP uses the tanh approximation of GELU; MaxText's converter writes "gelu",
# which transformers takes as the exact GELU and vLLM refuses (maxtext#2867).
GEMMA_GELU = {'hidden_activation': 'gelu_pytorch_tanh'}
_GEMMA_NORMS = {
    'pre_attention_norm': 'input_layernorm',
    'post_attention_norm': 'post_attention_layernorm',
    'pre_ffw_norm': 'pre_feedforward_layernorm',
    'post_ffw_norm': 'post_feedforward_layernorm',
}
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


def _gemma(name: str, architecture: str, model_type: str, norms: Mapping[str, str],
           fixed: Mapping[str, object], qk_norms: bool = False,
           vocab_padding: VocabPadding = GEMMA_PADDING, **fields) -> Family:
  """Gemma 1 and 2 (`tunix/models/gemma`: one model class, its norms set by the config) and
  Gemma 3 (q/k norms too); `fields`: other `Family` fields.

  They scale embeddings by sqrt(D), tie them (no lm_head) and compute `1 + scale` in
  every norm on both sides, so every value is copied as it is.
  """
  qk = ('layers/{i}/attn/{n:_query|_key}_norm/scale',) if qk_norms else ()
  return Family(
      name=name,
      architecture=architecture,
      model_type=model_type,
      rules=(
          _rule('embedder/input_embedding', 'model.embed_tokens.weight'),
          _rule('final_norm/scale', 'model.norm.weight'),
          *_gemma_attention(LAYER),
          *(_rule(f'layers/{{i}}/attn/_{t}_norm/scale', f'{LAYER}.self_attn.{hf}_norm.weight')
            for t, hf in (('query', 'q'), ('key', 'k')) if qk_norms),
          *(_rule(f'layers/{{i}}/{tunix}/scale', f'{LAYER}.{hf}.weight')
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
      fixed=fixed,
      lora=GEMMA_LORA,
      vocab_padding=vocab_padding,
      axes=_GEMMA_AXES,
      **fields,
  )


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
      _rule('token_embedder/embedding', 'model.embed_tokens.weight', embedding),
      _rule('decoder/decoder_norm/scale', 'model.norm.weight', norm),
      *_mt_attention(norm=norm),
      *_mt_mlp(),
      *(_rule(f'{MT_LAYER}/{mt}/scale', f'{LAYER}.{hf}.weight', norm)
        for mt, hf in _MT_GEMMA_NORMS.items()),
      *(_rule(f'{MT_LAYER}/{w}', f'{LAYER}.{w}') for w in own),
  )
  required = (
      'token_embedder/embedding', 'decoder/decoder_norm/scale',
      f'{MT_LAYER}/self_attention/{{p:{kernels}}}/kernel',
      f'{MT_LAYER}/self_attention/{{n:query|key}}_norm/scale',
      f'{MT_LAYER}/mlp/{{p:wi_0|wi_1|wo}}/kernel', *(f'{MT_LAYER}/{w}' for w in own),
      *(f'{MT_LAYER}/{mt}/scale' for mt in _MT_GEMMA_NORMS),
  )
  return Naming(MAXTEXT_MODEL, rules, ((required,),), _mt_dims(),
                layer=tuple(MT_LAYER.split('/')), vocab=_MT_VOCAB, vocab_padding=MAXTEXT_PADDING,
                form=stacks_lib.blocks(6), axes=_MT_AXES, lora_flattened=True)


GEMMA3 = _gemma(
    'gemma3', 'Gemma3ForCausalLM', 'gemma3_text',  # Gemma3ForConditionalGeneration's text_config.
    _GEMMA_NORMS, GEMMA_GELU, qk_norms=True, vocab_padding=NO_PADDING,
    text_prefixes={'Gemma3ForCausalLM': 'model.', 'Gemma3ForConditionalGeneration':
                   'model.language_model.'},
    maxtext=_maxtext_gemma(divide('sqrt(hidden) as bfloat16', _bf16_sqrt, axis=1), GEMMA_NORM,
                           'query|key|value|out'),
)


def _f32_sqrt(hidden: int) -> float:
  return float(np.float32(math.sqrt(hidden)))


# Gemma 4's global layers (transformers' `per_layer_config`): their own head_dim and kv heads,
# and no value kernel (their keys are their values: the k_eq_v note holds there only).
_MT_VALUE = f'{MT_LAYER}/self_attention/value/kernel'
_GEMMA4_GLOBAL = LayerType({'head_dim': 'global_head_dim',
                            'num_key_value_heads': 'num_global_key_value_heads'},
                           without=(_MT_VALUE,))


def _maxtext_gemma4() -> Naming:
  """MaxText's gemma4 (31b) text decoder: local and global layers, norms stored as they are;
  a global layer (every sixth: `_GEMMA4_GLOBAL`) has no value kernel (`share_kv_projections`;
  Hugging Face's `attention_k_eq_v`), so `value` is not required of every layer."""
  dims = {
      **_mt_dims(),
      # Layer 5 is the first global one (five local, one global).
      'global_head_dim': (('decoder/layers_5/self_attention/query/kernel', 2),),
      'num_global_key_value_heads': (('decoder/layers_5/self_attention/key/kernel', 1),),
  }
  return dataclasses.replace(
      _maxtext_gemma(divide('sqrt(hidden) as float32', _f32_sqrt, axis=1), IDENTITY,
                     'query|key|out', 'layer_scalar'),
      dims=dims, form=stacks_lib.local_global(6),
      architecture='Gemma4ForCausalLM', model_type='gemma4_text',
      lora={f'{MT_LAYER}/self_attention/key/kernel': LoraWeight(
          note=K_EQ_V_NOTE, without=_MT_VALUE)},
      layer_types={'full_attention': _GEMMA4_GLOBAL},
      # transformers' Gemma4TextConfig without `layer_types`: every sixth is global
      # (it also makes the last layer global; MaxText's remainder layers are local).
      default_layer_type=lambda i: ('full_attention' if (i + 1) % 6 == 0
                                    else 'sliding_attention'))


def _per_expert(source: str, dest: str, axis: int, then) -> LayoutRule:
  """One stacked expert weight (experts along `axis`) onto one tensor per expert `{e}`."""
  return LayoutRule.of(tuple(source.split('/')), (dest,), fan_out=('e', axis),
                       transform_for=lambda e: chain(take(axis, e), then))


def _maxtext_qwen3_moe() -> Naming:
  """MaxText's qwen3 MoE decoder (qwen3-30b-a3b): the MLP is `moe_block`.

  The router `gate/kernel` (D, E) is Hugging Face's `mlp.gate.weight` (E, D);
  the experts `wi_0`, `wi_1` (E, D, F) and `wo` (E, F, D), one array each
  for all experts, become one (out, in) tensor per expert.
  """
  dense = _maxtext_qwen3_style(norms=True)
  rules = (
      *(r for r in dense.rules if 'mlp' not in [k.text for k in r.source.keys]),
      _rule(f'{MT_LAYER}/moe_block/gate/kernel', f'{LAYER}.mlp.gate.weight', transpose()),
      *(_per_expert(f'{MT_LAYER}/moe_block/{mt}', f'{LAYER}.mlp.experts.{{e}}.{hf}_proj.weight',
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


def _extended(base: Family, name: str, architecture: str, model_type: str, rules=(), required=(),
              dims=None, optional=(), maxtext: Naming | None = None,
              as_trained: tuple[AsTrained, ...] = (), axes=None) -> Family:
  """`base` plus some weights (and their `axes`), the patterns in `optional` no longer
  required (and only `as_trained`'s facts: the model class is another one; none of `base`'s
  aliases: they name `base`)."""
  return dataclasses.replace(
      base, name=name, architecture=architecture, model_type=model_type, maxtext=maxtext,
      as_trained=as_trained, aliases=(), axes={**base.axes, **(axes or {})},
      rules=base.rules + tuple(rules),
      required=tuple(tuple(tuple(p for p in alt if p not in optional) for alt in alts)
                     for alts in base.required) + tuple(required),
      dims=base.dims if dims is None else dims)


# Qwen2 / Qwen2.5 (and the DeepSeek-R1 distills on it): Llama's layout plus q/k/v biases, which
# Tunix keeps flat (heads·H,) as Hugging Face does (`tunix/models/qwen2/params.py`).
QWEN2 = _extended(
    LLAMA3, 'qwen2', 'Qwen2ForCausalLM', 'qwen2',
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
    QWEN3, 'qwen3_moe', 'Qwen3MoeForCausalLM', 'qwen3_moe',
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
    maxtext=_maxtext_qwen3_moe(),
    as_trained=QWEN3.as_trained,  # Tunix's Qwen3 class, with experts.
    axes={'layers/{i}/mlp/router/kernel': ('hidden_size', 'num_experts')},
)


# Gemma 2 (Gemma2ForCausalLM): norms around both blocks, as Tunix's safetensors loader maps
# them (`tunix/models/gemma/params_safetensors.py`).
GEMMA2 = _gemma('gemma2', 'Gemma2ForCausalLM', 'gemma2', fixed=GEMMA_GELU, norms={
    'pre_attention_norm': 'input_layernorm',
    'post_attn_norm': 'post_attention_layernorm',
    'pre_ffw_norm': 'pre_feedforward_layernorm',
    'post_ffw_norm': 'post_feedforward_layernorm',
})
# Gemma 1 (GemmaForCausalLM: `use_post_attn_norm`, `use_post_ffw_norm` off): Hugging Face's
# `post_attention_layernorm` is the norm before the MLP (transformers' GemmaDecoderLayer), that
# is Tunix's `pre_ffw_norm`. Tunix 0.1.7's loader maps that name to Gemma 2's `post_attn_norm`
# for both versions, so it cannot load a Gemma 1 folder (the Hub's or this one).
GEMMA = _gemma('gemma', 'GemmaForCausalLM', 'gemma', fixed={'hidden_act': 'gelu_pytorch_tanh'},
               norms={
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
K_EQ_V_NOTE = (
    "{module}: Gemma 4's layer reuses its keys as values (k_eq_v): transformers and peft have"
    ' no v_proj there and apply this adapter to the keys, which are the values too (as the'
    ' run computed); vLLM loads the key weights into separate K and V slots and applies a'
    ' k_proj adapter to K alone, so served by vLLM the values of these layers stay the'
    " base's"
)
# A kv-shared layer's MLP width with `use_double_wide_mlp` (transformers' Gemma4TextMLP).
_DOUBLE_MLP = '2 x intermediate_size'


def _double_wide_mlp(i: int, config: Mapping[str, object]) -> bool:
  """Whether Gemma 4's layer `i` has a double-wide MLP: with `use_double_wide_mlp`, the last
  `num_kv_shared_layers` layers (those that reuse an earlier layer's keys and values)."""
  layers, shared = config.get('num_hidden_layers'), config.get('num_kv_shared_layers') or 0
  return (bool(config.get('use_double_wide_mlp')) and isinstance(layers, int)
          and isinstance(shared, int) and i >= layers - shared)

GEMMA4 = Family(
    name='gemma4',
    architecture='Gemma4ForConditionalGeneration',
    model_type='gemma4',
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
    fixed=GEMMA_GELU,
    lora={**GEMMA_LORA, 'layers/{i}/attn/k_einsum/w': LoraWeight('dr,rkh->kdh', K_EQ_V_NOTE)},
    text_prefixes={'Gemma4ForCausalLM': 'model.', 'Gemma4ForConditionalGeneration':
                   'model.language_model.'},
    embeddings=('embed_tokens', 'embed_tokens_per_layer'),
    # transformers' Gemma4TextConfig: a global layer's head_dim (512 when the config has
    # none), its kv heads where its keys are its values (k_einsum: num_global_key_value_heads),
    # and a kv-shared layer's MLP twice as wide with use_double_wide_mlp.
    axes={**{p: f for p, f in _GEMMA_AXES.items() if 'qkv_einsum' not in p},
          'layers/{i}/attn/k_einsum/w': ('num_global_key_value_heads', 'hidden_size',
                                         'head_dim')},
    layer_types={'full_attention': LayerType({'head_dim': 'global_head_dim'}),
                 'double_wide_mlp': LayerType({'intermediate_size': _DOUBLE_MLP})},
    default_layer_type=lambda i: 'full_attention' if (i + 1) % 6 == 0 else 'sliding_attention',
    layer_kinds={'double_wide_mlp': _double_wide_mlp},
    config_defaults={'global_head_dim': lambda c: 512,
                     _DOUBLE_MLP: lambda c: 2 * c['intermediate_size']},
    maxtext=_maxtext_gemma4(),
    # Measured with `transformers` (tests/test_hf_clients.py): fed what Tunix's is, its router
    # gives the Tunix model back.
    as_trained=(AsTrained(
        what='router', when=('layers/{i}/moe/router_logits',),
        trained="MoE router reads moe_pre_ffw_norm(x), the experts' input",
        served='reads x (pre_feedforward_layernorm_2 normalises the experts\' input only)',
        consequence='served, tokens go to other experts, with other weights, than in training'),),
)

FAMILIES: catalog.Catalog[Family] = catalog.Catalog('model')
for _family in (QWEN3, LLAMA3, GEMMA3, QWEN2, QWEN3_MOE, GEMMA, GEMMA2, GEMMA4):
  FAMILIES.register(_family)
register, names = FAMILIES.register, FAMILIES.names


def aliases() -> dict[str, str]:
  """Every family's other names (`Family.aliases`) -> its name, in the order registered.

  Raises:
    ValueError: an alias that is a family's name or another family's alias.
  """
  out: dict[str, str] = {}
  for family in map(FAMILIES.get, names()):
    for alias in family.aliases:
      if alias in out or alias in names():
        raise ValueError(f'the {family.name} family\'s alias {alias!r} names another family'
                         f' already ({out.get(alias, alias)}); give it another alias.')
      out[alias] = family.name
  return out


def written_as_trained() -> dict[AsTrained, tuple[str, ...]]:
  """Each `as_trained` fact a config.json value reproduces (it has a `field`) -> the families
  it holds for, by name in alphabetical order (for the help of `as_trained.OPTION`)."""
  out: dict[AsTrained, list[str]] = {}
  for family in map(FAMILIES.get, names()):
    for fact in family.as_trained:
      if fact.field is not None:
        out.setdefault(fact, []).append(family.name)
  return {fact: tuple(sorted(families)) for fact, families in out.items()}


def get(name: str) -> Family:
  """The family `name` (or an alias of it) names.

  Raises:
    UnsupportedLayoutError: no such family (the message lists them).
  """
  return FAMILIES.get(aliases().get(name, name))


def choices() -> tuple[str, ...]:
  """Every name `model` takes: the families', then their aliases."""
  return (*names(), *aliases())


# --- layer forms: the families' ---------------------------------------------------------


def layer_forms() -> tuple[stacks_lib.LayerForm, ...]:
  """Every stacked form a family's naming holds its layers in, each once, in the order the
  families are registered."""
  return tuple(dict.fromkeys(
      n.form for f in map(FAMILIES.get, names()) for n in f.namings if n.form.scanned))


def layer_form(paths: Collection[Path]) -> stacks_lib.LayerForm | None:
  """The layer form of MaxText weights (`stacks.form_of` among the families' forms):
  stacked, UNSCANNED, or None (no decoder layers)."""
  return stacks_lib.form_of(paths, layer_forms())


def scanned_form(paths: Collection[Path], where: str = '') -> stacks_lib.LayerForm:
  """The stacked form of per-layer MaxText weights: that of the families whose MaxText
  naming they meet (every weight it requires), else MaxText's plain scanned form.

  Raises:
    UnsupportedLayoutError: they meet families of different forms.
  """
  found = {n.form: f.name for f in map(FAMILIES.get, names()) for n in f.namings
           if n.form.scanned and n.source == MAXTEXT_MODEL and n.layers(paths)
           and not n.missing(paths)}
  if len(found) > 1:
    raise errors.UnsupportedLayoutError(
        f'{where}: the weights are those of {" and ".join(sorted(found.values()))}, whose'
        f' layers MaxText stacks otherwise ({", ".join(f.name for f in found)}): expected'
        ' one. Convert the layers as they are stored.')
  return next(iter(found), stacks_lib.SCANNED_FORM)


def table(family: Family, source: str = TUNIX_MODEL) -> list[tuple[str, str, str]]:
  """(source path, Hugging Face name, transform) per rule of one naming, as the README
  shows them."""
  naming = next((n for n in family.namings if n.source == source), None)
  rows = []
  for rule in naming.rules if naming is not None else ():
    source = '/'.join(k.spec for k in rule.source.keys)
    for dest, transform in rule.dests:
      shown = transform.name
      if rule.fan_out is not None:  # One transform per value of the placeholder `fan_out[0]`.
        shown = rule.transform_for(0).name.replace('index=0', f'index={{{rule.fan_out[0]}}}')
      rows.append((source, '/'.join(k.spec for k in dest.keys), shown))
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


# config.json fields holding one entry per layer: transformers (`PreTrainedConfig.
# validate_layer_type`) refuses a config whose list has another length than its layers, and a
# loader builds each layer as its entry says (Gemma's sliding or full attention).
PER_LAYER_FIELDS = ('layer_types', 'mlp_layer_types')

_JSON_TYPES = {list: 'array', str: 'string', int: 'number', float: 'number', bool: 'boolean',
               type(None): 'null'}


# The option a base model's config.json comes from, by default (a model export's); a PEFT
# adapter's is `base_model`. Messages name it, so that each command names its own flag.
CONFIG_OPTION = 'hf_config'


def _bad_config(where: str, found: str, option: str) -> errors.InvalidOptionError:
  return errors.InvalidOptionError(
      f'{where}: expected a Hugging Face config.json (a JSON object with the model\'s'
      f' fields), found {found}. Pass as `{option}` the folder of the model this run was'
      ' trained from.'
  )


def _split(target: tuple[str, str], config: Mapping[str, object], where: str, option: str
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
                             ' text model\'s fields)', option)
  architecture, model_type = target
  if config.get('architectures') == [architecture] or config.get('model_type') == model_type:
    return dict(config), dict(text), []
  top = {k: config[k] for k in CARRIED_TO_TEXT if k in config and config[k] is not None}
  top.update(text)
  return top, None, [
      f'config.json is {config.get("architectures") or config.get("model_type")!r}, a'
      ' multimodal model; the export holds its text model\'s weights only: wrote its'
      f' text_config as a {architecture} config (model_type {model_type})'
  ]


def _shown(value: object) -> str:
  return repr(value) if not isinstance(value, (int, float)) or isinstance(value, bool) else str(
      value)


def markdown(source: str = TUNIX_MODEL) -> str:
  """The README's table of one kind of source's maps: each `table` row once, with the
  families that have it (`scripts/readme_hf_maps.py` writes it into README.md)."""
  rows: dict[tuple[str, str, str], list[str]] = {}
  for family in map(get, names()):
    for row in table(family, source):
      rows.setdefault(row, []).append(family.name)

  def cell(text: str) -> str:
    return '`' + text.replace('|', '\\|') + '`'

  first = {TUNIX_MODEL: 'Tunix (canonical)', MAXTEXT_MODEL: 'MaxText (per layer)'}[source]
  lines = [f'| {first} | Hugging Face | layout | families |', '|---|---|---|---|']
  lines += [f'| {cell(s)} | {cell(d)} | {t} | {", ".join(f)} |' for (s, d, t), f in rows.items()]
  return '\n'.join(lines) + '\n'

def check_config(
    family: Family, config: object, shapes: Mapping[Path, Shape], where: str,
    skip: Collection[str] = (), option: str = CONFIG_OPTION,
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
    * the family's `fixed` fields are written;
    * a per-layer list (`PER_LAYER_FIELDS`: `layer_types`) must have one
      entry per layer of the weights (transformers refuses the folder else).

  Args:
    family: the family.
    config: config.json as parsed.
    shapes: the weights' shapes (Tunix paths).
    where: the file, for messages.
    skip: fields the weights cannot tell (a LoRA save's adapted weights alone).
    option: the option the config came from (`hf_config`, `base_model`), for messages.

  Returns:
    The `Config` to write.

  Raises:
    InvalidOptionError: not a JSON object, or a `text_config` that is not one.
    UnsupportedLayoutError: another family's config, or fields that differ
      from the weights (each named, with both values).
  """
  if not isinstance(config, Mapping):
    raise _bad_config(where, f'a JSON {_JSON_TYPES.get(type(config), "value")}'
                             f' ({json.dumps(config)[:60]})', option)
  naming = family.naming(shapes)
  architecture, model_type = family.target_of(naming)
  top, inner, notes = _split((architecture, model_type), config, where, option)
  fields = top if inner is None else inner
  wrong = []
  archs = top.get('architectures')
  if archs is not None and archs != [architecture]:
    wrong.append(f'architectures: config.json has {_shown(archs)}, the weights are'
                 f' [{architecture!r}]')
  if top.get('model_type', model_type) != model_type:
    wrong.append(f'model_type: config.json has {_shown(top["model_type"])}, the weights are'
                 f' {model_type!r}')
  # `skip`: fields these weights cannot tell (a LoRA save's adapted weights alone).
  implied = {f: v for f, v in naming.config(shapes).items() if f not in skip}
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
  # Weights that cannot tell their layer count (adapters alone) leave it to the config's.
  layers = implied.get('num_hidden_layers', fields.get('num_hidden_layers'))
  for field in PER_LAYER_FIELDS:
    have = fields.get(field)
    if isinstance(have, list) and isinstance(layers, int) and len(have) != layers:
      wrong.append(f'{field}: config.json has {len(have)} entries, the weights have {layers}'
                   ' layers (one entry per layer: transformers refuses another count)')
  if wrong:
    raise errors.UnsupportedLayoutError(
        f'{where}: config.json does not describe these weights ({family.name}):\n'
        f'{errors.list_paths(wrong)}\nPass as `{option}` the folder of the model this run'
        ' was trained from.'
    )
  named = {f: v for f, v in (('architectures', [architecture]),
                             ('model_type', model_type)) if top.get(f) is None}
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
  out = {**top, **fields} if inner is None else {**top, 'text_config': fields}
  # `named` first, and over the base's nulls (a text_config's `architectures: null`).
  return Config({**named, **{k: v for k, v in out.items() if k not in named}}, tuple(notes))


def check_sizes(naming: Naming, shapes: Mapping[Path, Shape], config: Mapping[str, object]
                ) -> list[str]:
  """Every axis of the weights against the config field that gives it (`Naming.axes`, per
  layer as its kind reads the config): where the adapters of a save without its base
  weights tell the weights' shapes, every size they imply is checked, not only those
  `check_config` reads off layer 0 and the embedding.

  Args:
    naming: the weights' naming.
    shapes: the weights (per-layer form) -> shapes.
    config: the text model's config fields.

  Returns:
    One line per field and pair of values that differ, with the first weight that shows it
    (a field the config leaves to its class's default is not checked).
  """
  found: dict[tuple[str, int, int], tuple[Path, Shape]] = {}
  for path, shape in sorted(shapes.items()):
    fields = naming.axis_fields(path, config)
    if fields is None or len(fields) != len(shape):
      continue
    for field, size in zip(fields, shape, strict=True):
      value = None if field is None else naming.config_value(config, field)
      if isinstance(value, int) and not isinstance(value, bool) and value != size:
        found.setdefault((field, value, size), (path, tuple(shape)))
  return [f'{field}: config.json {"has" if field in config else "gives"} {value}, the weights'
          f' have {size} ({fmt(path)} {shape})'
          for (field, value, size), (path, shape) in found.items()]


def fits(family: Family, shapes: Mapping[Path, Shape], unmatched: Sequence[Path], where: str) -> None:
  """Checks that the weights are the family's: none left unmapped, none missing.

  Raises:
    UnsupportedLayoutError: naming the first unmapped and missing weights.
  """
  missing = family.naming(shapes).missing(shapes)
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


def cut_vocab(
    naming: Naming, mapped: Mapping[Path, Mapped], vocab_size: int | None, where: str
) -> tuple[dict[Path, Mapped], list[str]]:
  """The weights with a padded vocabulary cut to the config's `vocab_size`.

  Rows past it are dropped, as MaxText's converter does, where they are padding
  (`Naming.vocab_padding`); elsewhere they are trained, and a smaller `vocab_size` is refused.

  Args:
    naming: the weights' naming (its `vocab` axes).
    mapped: weight -> how it is made (`LayerForm.unstack`).
    vocab_size: the config's, or None (no config: nothing is cut).
    where: the config.json, for messages.

  Returns:
    (the weights, notes).

  Raises:
    UnsupportedLayoutError: the config's vocabulary is larger than the weights', or
      smaller where the rows past it are not padding.
  """
  out, notes = dict(mapped), []
  if vocab_size is None:
    return out, notes
  for pattern, axis in naming.vocab.items():
    path = tuple(pattern.split('/'))
    if path not in out:
      continue
    m = out[path]
    rows = m.shape[axis]
    if vocab_size > rows:
      raise errors.UnsupportedLayoutError(
          f'{where}: vocab_size {vocab_size} is larger than the weights\' vocabulary'
          f' ({fmt(path)} {m.shape} has {rows} along axis {axis}): the config is not this'
          ' model\'s. Pass as `hf_config` the folder of the model this run was trained from.'
      )
    if vocab_size < rows and not naming.vocab_padding.allows(rows, vocab_size):
      raise errors.UnsupportedLayoutError(
          f'{where}: vocab_size {vocab_size} is smaller than the weights\' vocabulary'
          f' ({fmt(path)} {m.shape} has {rows} along axis {axis}), and a'
          f' {SOURCE_NAMES[naming.source]}\'s rows are its own (only a source known to pad'
          ' its vocabulary, as MaxText does, is cut): cutting them would drop trained'
          ' tokens. Pass as `hf_config` the folder of the model this run was trained from'
          f' (vocab_size {rows}).'
      )
    if vocab_size < rows:
      cut = head(axis, vocab_size)
      out[path] = Mapped(m.sources, chain(m.transform, cut), cut.check([m.shape]))
      notes.append(f'{fmt(path)}: vocabulary padding cut, {rows} -> {vocab_size} (the'
                   f' config\'s vocab_size; {naming.vocab_padding.why})')
  return out, notes

"""What a Hugging Face model family is, as values: a family, and its naming by each trainer.

A `Family` is the Hugging Face side of a model (its `transformers` architecture, the config
fields every model of it has, where a multimodal class holds the text model) and one `Naming`
per trainer whose model code it is (`trainers`: Tunix's own model classes, MaxText's models):
layout rules from that trainer's weight paths to the tensor names and layouts Hugging Face
uses, the weights every checkpoint of it holds, where each `config.json` dimension is read from
the shapes, its adapters' arrangement, its stacked forms. Which naming applies comes from the
weights' names (`trainers.of`). The values live here; the families' data in `hf_tunix.py`,
`hf_maxtext.py` (each trainer's namings) and `hf_families.py` (the families), the catalog and
what reads it in `huggingface.py`, the config checks in `hf_config.py`. Nothing here reads an
array.

Tunix lays attention weights out as einsums: q/k/v (D, heads, H), the output
(heads, H, D); Hugging Face as linear layers (out, in): q/k/v (heads·H, D),
o (D, heads·H), so the heads axes are merged and the result transposed; MLP
kernels (in, out) are transposed; norms and embeddings are copied. The transforms every
trainer's naming shares to make Hugging Face's linear weights are here (`IN_PROJ`, ...).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Mapping, Sequence

from orbax_tunix import errors
from orbax_tunix.keypaths import Path, fmt
from orbax_tunix.mapping import stacks as stacks_lib
from orbax_tunix.mapping import trainers
from orbax_tunix.mapping.as_trained import AsTrained
from orbax_tunix.mapping.patterns import LayoutRule, Pattern
from orbax_tunix.mapping.transforms import Shape, Transform, chain, merge_axes, take, transpose


@dataclasses.dataclass(frozen=True)
class Vocab:
  """A naming's vocabulary: the weights' axes along it, and which of their rows past a
  config's `vocab_size` are padding (never trained), so that an export may cut them; rows
  of any other naming are the model's own.

  Attributes:
    axes: weight pattern -> its vocabulary axis (cut to the config's `vocab_size` when the
      checkpoint's is padded).
    any: every cut is padding (MaxText pads the vocabulary to a multiple of its sharding).
    known: (stored rows, real vocabulary) pairs that are padding.
    why: who pads, for notes.
  """

  axes: Mapping[str, int] = dataclasses.field(default_factory=dict)
  any: bool = False
  known: tuple[tuple[int, int], ...] = ()
  why: str = ''

  def allows(self, rows: int, vocab_size: int) -> bool:
    """Whether the rows past `vocab_size` of a weight holding `rows` are padding."""
    return self.any or (rows, vocab_size) in self.known

# --- Hugging Face's side, shared by every trainer's namings ---------------------------------

LAYER = 'model.layers.{i}'
# (D, X, H) -> (X·H, D): an input projection as Hugging Face's linear weight.
IN_PROJ = chain(merge_axes(1, 3), transpose())
# (N, H, D) -> (D, N·H): the output projection.
OUT_PROJ = chain(merge_axes(0, 2), transpose())
# Gemma's (X, D, H) einsums -> (X·H, D).
HEADS_FIRST = chain(transpose((1, 0, 2)), IN_PROJ)

# LlamaConfig and Qwen2's attention without `head_dim` (the Hub's Llama 3 and Qwen2 configs).
HEAD_DIM_OF_HIDDEN = {'head_dim': lambda c: c['hidden_size'] // c['num_attention_heads']}


@dataclasses.dataclass(frozen=True)
class EveryNth:
  """A config's layer kinds where it has no `layer_types` (a `LayerKinds.default`):
  every `n`-th layer `kind` (layers n-1, 2n-1, ...), the others `other`."""

  n: int
  kind: str
  other: str

  def __call__(self, i: int) -> str:
    return self.kind if (i + 1) % self.n == 0 else self.other


def rule(source: str, dest: str, transform=None) -> LayoutRule:
  """One weight pattern (`/`-separated, `{i}` the layer) onto one tensor name, through
  `transform` (None: copied)."""
  return LayoutRule.of(tuple(source.split('/')), (dest,),
                       *(() if transform is None else (transform,)))


def per_expert(source: str, dest: str, axis: int, then) -> LayoutRule:
  """One stacked expert weight (experts along `axis`) onto one tensor per expert `{e}`."""
  return LayoutRule.of(tuple(source.split('/')), (dest,), fan_out=('e', axis),
                       transform_for=lambda e: chain(take(axis, e), then))


# What a person serving an adapter of a layer whose keys are its values should know (a
# `LoraWeight.note` of every trainer's naming of a family with such layers).
K_EQ_V_NOTE = (
    "{module}: the layer reuses its keys as values (k_eq_v): transformers and peft have"
    ' no v_proj there and apply this adapter to the keys, which are the values too (as the'
    ' run computed); vLLM loads the key weights into separate K and V slots and applies a'
    ' k_proj adapter to K alone, so served by vLLM the values of these layers stay the'
    " base's"
)


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
      without that weight (global layers with no value kernel: their keys are the
      values).
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
class Fill:
  """A weight a checkpoint of the family may lack though the family's class holds its tensor:
  made from a sibling weight of its layer instead, said in a note (DeepSeek's routing bias, an
  `MoEBiasVar` MaxText's params-only step leaves out, where the class's serving code reads
  uninitialised memory without it).

  Attributes:
    source: the weight (per-layer pattern, `{i}` the layer) it is made from.
    transform: how (e.g. `filled(0, axis)`: zeros as long as one of its axes).
    why: for the note: why the weight may be absent, and what the value made means.
  """

  source: str
  transform: Transform
  why: str


@dataclasses.dataclass(frozen=True)
class Derived:
  """A weight the family's class holds as one tensor that the trainer keeps as several: made
  from them (each layer's, `{i}`), which it replaces (DeepSeek V4's hyper-connections: MaxText's
  pre/post/res alphas and the norm scale before them are one `hc_*_fn`).

  Attributes:
    sources: the weights (per-layer patterns) it is made of, in the transform's order.
    transform: how (several sources: e.g. `concat(-1, scaled=True)`).
  """

  sources: tuple[str, ...]
  transform: Transform


@dataclasses.dataclass(frozen=True)
class LayerType:
  """How a layer of one kind (a config's `layer_types` entry, or a `LayerKinds.extra` one)
  reads the config otherwise.

  Attributes:
    fields: config.json field -> the field such a layer reads instead (a global layer's:
      `head_dim` -> `global_head_dim`), or a value the config class computes from
      others, named as `Naming.config_defaults` computes it (`2 x intermediate_size`).
    without: weight patterns (`{i}`: the layer's number) such a layer has not (a global
      layer without a value kernel).
  """

  fields: Mapping[str, str]
  without: tuple[str, ...] = ()


_ANY_LAYER = LayerType({})


@dataclasses.dataclass(frozen=True)
class LayerKinds:
  """How a decoder's layers of different kinds are told apart, where they are (Gemma 4's
  global and local layers, a hybrid decoder's linear and full attention).

  Attributes:
    types: config `layer_types` entry -> `LayerType`, for layers that read other fields (a
      layer's entry: `layer_types[i]`, else `default(i)`).
    default: a layer's kind when the config has no `layer_types`.
    extra: other kinds a layer may be of besides its `layer_types` entry -> whether layer `i`
      of a config is (kv-shared layers with a double-wide MLP); their `types` apply too.
    typed_by: config `layer_types` entry -> a weight pattern (`{i}` the layer) only a layer
      of that kind holds: the weights then imply `layer_types` (every layer holding one),
      which a config.json must agree with.
  """

  types: Mapping[str, LayerType] = dataclasses.field(default_factory=dict)
  default: Callable[[int], str] | None = None
  extra: Mapping[str, Callable[[int, Mapping[str, object]], bool]] = dataclasses.field(
      default_factory=dict)
  typed_by: Mapping[str, str] = dataclasses.field(default_factory=dict)

  def of(self, i: int, config: Mapping[str, object]) -> LayerType:
    """How layer `i` of a model of `config` reads it: its `layer_types` entry's (else its
    default kind's) `LayerType`, with those of the `extra` kinds it is of."""
    kinds, kind = config.get('layer_types'), None
    if isinstance(kinds, list) and i < len(kinds):
      kind = kinds[i]
    elif self.default is not None:
      kind = self.default(i)
    found = [self.types[k] for k in (kind, *self.extra)
             if isinstance(k, str) and k in self.types
             and (k == kind or self.extra[k](i, config))]
    if len(found) <= 1:
      return found[0] if found else _ANY_LAYER
    return LayerType({f: v for t in found for f, v in t.fields.items()},
                     tuple(w for t in found for w in t.without))

  def implied(self, shapes: Collection[Path], layers: Sequence[str]) -> list[str] | None:
    """The `layer_types` the weights imply (`typed_by`: each layer holds the weight of
    exactly one kind), or None where they do not."""
    kinds = [[kind for kind, pattern in self.typed_by.items()
              if tuple(pattern.replace('{i}', i).split('/')) in shapes] for i in layers]
    return [k[0] for k in kinds] if kinds and all(len(k) == 1 for k in kinds) else None


@dataclasses.dataclass(frozen=True)
class Sized:
  """Rules whose transforms need sizes the weights' shapes do not tell, taken from the base
  model's config.json (Qwen3.5's fused linear-attention kernel holds its rows per key head,
  and no shape says how many key heads there are).

  Attributes:
    sources: the weight patterns (per-layer form) the rules take: weights holding one of
      them need the fields.
    fields: the config.json fields (the text model's) the rules read, positive integers.
    rules: the fields' values, by name -> the rules.
    why: what the sizes are for, for messages.
    example: values of the fields for the table of families (the family's released model's).
  """

  sources: tuple[str, ...]
  fields: tuple[str, ...]
  rules: Callable[[Mapping[str, int]], tuple[LayoutRule, ...]]
  why: str
  example: Mapping[str, int]

  def needed(self, paths: Collection[Path]) -> Path | None:
    """A weight among `paths` the rules take (None: none, and no field is needed)."""
    patterns = [Pattern.parse(s.split('/')) for s in self.sources]
    return next((p for p in sorted(paths) if any(x.match(p) for x in patterns)), None)


@dataclasses.dataclass(frozen=True)
class Naming:
  """One trainer's names for a family: its weights onto the family's tensors.

  Attributes:
    trainer: the trainer whose model code the names are (`trainers`).
    rules: weight pattern -> tensor name and transform (a trainer that stacks layers: on
      the per-layer form).
    required: what every checkpoint of the family holds: per requirement,
      alternatives, each a set of weight patterns (`{i}` over every layer).
    dims: config.json field -> (weight pattern, axis) alternatives its value
      is read from (`num_hidden_layers` is the layer count).
    tied: config.json's `tie_word_embeddings` from the weights' paths (None:
      always tied).
    layer: the pattern of one layer's prefix (`{i}` its number).
    vocab: its vocabulary axes, and which rows past a config's `vocab_size` are padding
      (`Vocab`).
    form: the layer form the trainer stores the family's layers in, scanned
      (`stacks.LayerForm`; unscanned, they are the per-layer form its rules name).
    architecture: the `transformers` class the names are, when not the
      family's (a multimodal family's: MaxText's text decoder is the causal LM's
      `model.*`, where the Hub's and Tunix's are the conditional generation model's
      `model.language_model.*`).
    model_type: that architecture's config `model_type`, with `architecture`.
    lora: weight pattern -> `LoraWeight`, for weights whose adapters are not laid out as
      `a`'s dimensions then `b`'s, or that a person should know of.
    axes: weight pattern -> the config.json field giving each of its axes (`dims` read the
      other way): the shape a base model's config gives a weight that a save of adapters
      alone lacks (qwix flattens a MaxText kernel's dimensions into its adapters).
    kinds: how its layers of different kinds are told apart (`LayerKinds`; none: all alike).
    config_defaults: config field -> its value when config.json leaves it out, as the
      `transformers` config class computes it (Llama's `head_dim`: hidden_size //
      num_attention_heads; the Hub's Llama 3 configs have no `head_dim`); also values
      computed from fields, under names no config.json has (`2 x intermediate_size`).
    lora_flattened: qwix flattens this naming's kernels' dimensions into their adapters
      (MaxText's `dot_general` layers): a save of adapters alone takes the weights' shapes
      from the base config (`axes`); elsewhere the adapters tell them, and the base config is
      checked against them (`check_sizes`).
    as_trained: where the trainer's model class computes otherwise than `transformers` does
      from the family's config.json (`mapping/as_trained.py`).
    layer_counts: config.json field -> a weight pattern (`{i}`: the layer): the field is the
      number of layers holding that weight (DeepSeek's `first_k_dense_replace`: the layers
      with a dense MLP, which come first).
    fills: weight pattern (per layer) -> the `Fill` that makes it in a layer that lacks it but
      holds its `source` (`huggingface.fill_absent`).
    derived: weight pattern (per layer, a name the trainer has not) -> the `Derived` that makes
      it of the weights it replaces, in each layer holding them all (`huggingface.derive`).
    sized: rules made from config.json's sizes (`Sized`), beside `rules`: see `rules_for`.
  """

  trainer: trainers.Trainer
  rules: tuple[LayoutRule, ...]
  required: tuple[tuple[tuple[str, ...], ...], ...]
  dims: Mapping[str, tuple[tuple[str, int], ...]]
  tied: Callable[[Collection[Path]], bool] | None = None
  layer: tuple[str, ...] = ('layers', '{i}')
  vocab: Vocab = Vocab()
  form: stacks_lib.LayerForm = stacks_lib.UNSCANNED
  architecture: str | None = None
  model_type: str | None = None
  lora: Mapping[str, LoraWeight] = dataclasses.field(default_factory=dict)
  axes: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
  kinds: LayerKinds = LayerKinds()
  config_defaults: Mapping[str, Callable[[Mapping[str, object]], object]] = dataclasses.field(
      default_factory=dict)
  lora_flattened: bool = False
  as_trained: tuple[AsTrained, ...] = ()
  layer_counts: Mapping[str, str] = dataclasses.field(default_factory=dict)
  fills: Mapping[str, Fill] = dataclasses.field(default_factory=dict)
  derived: Mapping[str, Derived] = dataclasses.field(default_factory=dict)
  sized: tuple[Sized, ...] = ()

  def rules_for(self, config: Mapping[str, object] | None, paths: Collection[Path],
                where: str = '', option: str = 'hf_config') -> tuple[LayoutRule, ...]:
    """The rules, with the `sized` ones the weights at `paths` need made from `config` (the
    text model's fields of the base model's config.json; None: no config given).

    Raises:
      InvalidOptionError: the weights need sizes the config does not give (naming the
        fields, and `option`, the parameter the config comes from).
    """
    made: list[LayoutRule] = []
    for sized in self.sized:
      weight = sized.needed(paths)
      if weight is None:
        continue
      values = {f: (config or {}).get(f) for f in sized.fields}
      bad = [f for f, v in values.items()
             if isinstance(v, bool) or not isinstance(v, int) or v < 1]
      if bad:
        given = (f'`{option}` is not given' if config is None else
                 'config.json has ' + ', '.join(f'{f}={values[f]!r}' for f in bad))
        raise errors.InvalidOptionError(
            f'{where}: {fmt(weight)}: {sized.why}; these sizes come from the base model\'s'
            f' config.json ({", ".join(sized.fields)}: positive integers), and {given}. Pass'
            f' as `{option}` the folder of the model this run was trained from.')
      made += sized.rules(values)
    return self.rules + tuple(made)

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
    """How the layer of the weight at `path` reads `config` (`LayerKinds.of`; a weight in
    no layer: as every layer does)."""
    i = self.layer_number(path)
    return _ANY_LAYER if i is None else self.kinds.of(i, config)

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
      # another layer another: global and local layers).
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
    for field, pattern in self.layer_counts.items():
      held = Pattern.parse(pattern.split('/')).expand({'i': self.layers(shapes)})
      out[field] = sum(p in shapes for p in held)
    out['tie_word_embeddings'] = True if self.tied is None else self.tied(shapes)
    implied = self.kinds.implied(shapes, self.layers(shapes))
    if implied is not None:
      out['layer_types'] = implied
    return out


@dataclasses.dataclass(frozen=True)
class Family:
  """One Hugging Face model family, named by each trainer that has the model.

  Attributes:
    name: what `--model` calls it.
    architecture: the `transformers` class of the text model these weights
      are (config.json's `architectures`).
    model_type: its config's `model_type` (`transformers`' config class).
    namings: one per trainer whose model code the family is (`Naming.trainer`), the
      names its weights have there.
    fixed: config.json fields every model of the family has, whatever the
      base config says (e.g. Gemma's tanh-approximated GELU).
    text_prefixes: `transformers` class -> where it holds the text model's modules, for
      the classes a base model of the family may be (a multimodal one holds them deeper).
    aliases: other names `model` takes for it: MaxText's model names whose Hugging Face
      names and layouts are this family's (llama2 and llama3.1 are LlamaForCausalLM).
    embeddings: the Hugging Face modules whose weight is 2-D but that are no linear layer
      (PEFT adapts an embedding as a lookup, with lora_embedding_A/B; qwix adapts a product
      with its weight, e.g. a tied output projection).
    text_of: the model types of multimodal models' text configs that describe this family's
      model (Qwen3-VL's `qwen3_vl_text` is a qwen3's: MaxText's text-only Qwen3-VL is its qwen3
      decoder): such a config's `text_config` is written as the family's.

  Raises:
    ValueError: two namings of one trainer.
  """

  name: str
  architecture: str
  model_type: str
  namings: tuple[Naming, ...]
  fixed: Mapping[str, object] = dataclasses.field(default_factory=dict)
  text_prefixes: Mapping[str, str] = dataclasses.field(default_factory=dict)
  aliases: tuple[str, ...] = ()
  embeddings: tuple[str, ...] = ('embed_tokens',)
  text_of: tuple[str, ...] = ()

  def __post_init__(self):
    named = [n.trainer.name for n in self.namings]
    if len(set(named)) != len(named):
      raise ValueError(f'the {self.name} family has two namings of one trainer ({named});'
                       ' give each trainer one.')

  def naming_of(self, trainer: trainers.Trainer) -> Naming | None:
    """The trainer's naming of the family (None: the trainer has no such model)."""
    return next((n for n in self.namings if n.trainer == trainer), None)

  def target_of(self, naming: Naming) -> tuple[str, str]:
    """(architecture, model_type) of the model a naming's tensor names are: the naming's own
    where it has one (see `Naming.architecture`), else the family's."""
    return (naming.architecture or self.architecture, naming.model_type or self.model_type)

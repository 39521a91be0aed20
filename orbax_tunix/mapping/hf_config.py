"""A base model's config.json against the weights a family's naming maps: read, checked,
completed, and the vocabulary cut to it (`check_config`, `check_sizes`, `cut_vocab`).

What an export writes as config.json is the base model's own where it describes the weights
(every dimension they imply, their tying, their layer count), completed where it leaves a
value to its class's default, and refused, every difference named, where it does not.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Collection, Mapping

from etils import epath

from orbax_tunix import errors
from orbax_tunix.keypaths import Path, fmt
from orbax_tunix.mapping import huggingface
from orbax_tunix.mapping.hf_naming import Family, Naming
from orbax_tunix.mapping.patterns import Mapped
from orbax_tunix.mapping.transforms import Shape, chain, head
from orbax_tunix.store import fileio

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


def read(folder: epath.Path | None, option: str = CONFIG_OPTION) -> object:
  """A base model folder's config.json, parsed (read once per export); None without a folder.

  Args:
    folder: the folder (`hf_config`, or a PEFT adapter's `base_model`).
    option: the option that gave it, for messages.

  Raises:
    InvalidOptionError: not a folder holding a config.json file, or one that does not parse.
  """
  if folder is None:
    return None
  config = folder / 'config.json'
  where, found = ((config, fileio.what_is_at(config)) if folder.is_dir()
                  else (folder, fileio.what_is_at(folder)))
  if found != 'a file' or where != config:
    raise errors.InvalidOptionError(
        f'{where}: `{option}` must be a Hugging Face model folder holding config.json (a'
        f' file), or that config.json, found {found}. Pass the base model\'s folder.'
    )
  return fileio.read_json(config, 'a Hugging Face config.json',
                          f'Fix the file, or pass as `{option}` the folder of the model this'
                          ' run was trained from.')


# Where a multimodal config.json holds its text model's fields: its `text_config`, or its
# thinker's (Qwen3-Omni: `thinker_config.text_config`, beside the talker's).
TEXT_CONFIG_AT = (('text_config',), ('thinker_config', 'text_config'))


def _text_config(values: Mapping[str, object]) -> tuple[tuple[str, ...], object]:
  """(where, the text model's config) of a multimodal config (`TEXT_CONFIG_AT`), else
  ((), None)."""
  for at in TEXT_CONFIG_AT:
    node: object = values
    for key in at:
      node = node.get(key) if isinstance(node, Mapping) else None
    if node is not None:
      return at, node
  return (), None


def text_fields(values: object) -> dict | None:
  """The text model's fields of a parsed config.json (a multimodal one's `text_config`, or
  its thinker's), or None where they are no JSON object."""
  if not isinstance(values, dict):
    return None
  text = _text_config(values)[1]
  text = values if text is None else text
  return text if isinstance(text, dict) else None


def _bad_config(where: str, found: str, option: str) -> errors.InvalidOptionError:
  return errors.InvalidOptionError(
      f'{where}: expected a Hugging Face config.json (a JSON object with the model\'s'
      f' fields), found {found}. Pass as `{option}` the folder of the model this run was'
      ' trained from.'
  )


def _split(target: tuple[str, str], config: Mapping[str, object], where: str, option: str,
           text_of: tuple[str, ...] = ()
           ) -> tuple[dict[str, object], dict[str, object] | None, list[str]]:
  """(the config's top level, the text model's fields when they stay in its `text_config`,
  notes). A config with a `text_config` (`TEXT_CONFIG_AT`) and of another architecture than the
  family's (a multimodal model whose text model the export holds) becomes its text model's: the
  `text_config` at the top with the outer fields it lacks (`CARRIED_TO_TEXT`), and the family's
  model type where the text model's is one the family takes (`text_of`). A config of the
  family's own architecture keeps its `text_config` (the family names the multimodal model)."""
  at, text = _text_config(config)
  if text is None:
    return dict(config), None, []
  if not isinstance(text, Mapping):
    raise _bad_config(where, f'"{".".join(at)}": {json.dumps(text)[:60]} (expected an object:'
                             ' the text model\'s fields)', option)
  architecture, model_type = target
  if len(at) == 1 and (config.get('architectures') == [architecture]
                       or config.get('model_type') == model_type):
    return dict(config), dict(text), []
  top = {k: config[k] for k in CARRIED_TO_TEXT if k in config and config[k] is not None}
  top.update(text)
  if text.get('model_type') in text_of:  # A text model the family's (`Family.text_of`).
    top['model_type'] = model_type
  return top, None, [
      f'config.json is {config.get("architectures") or config.get("model_type")!r}, a'
      ' multimodal model; the export holds its text model\'s weights only: wrote its'
      f' {".".join(at)} as a {architecture} config (model_type {model_type})'
  ]


def _shown(value: object) -> str:
  return repr(value) if not isinstance(value, (int, float)) or isinstance(value, bool) else str(
      value)



def _disagreements(top: Mapping[str, object], fields: Mapping[str, object],
                   implied: Mapping[str, object], architecture: str, model_type: str
                   ) -> list[str]:
  """Where a config (its top level, and the text model's `fields`) does not describe the
  weights: another architecture or model type, a dimension that differs from the one they
  `implied`, a per-layer list of another length than their layers. One line each."""
  wrong = []
  archs = top.get('architectures')
  if archs is not None and archs != [architecture]:
    wrong.append(f'architectures: config.json has {_shown(archs)}, the weights are'
                 f' [{architecture!r}]')
  if top.get('model_type', model_type) != model_type:
    wrong.append(f'model_type: config.json has {_shown(top["model_type"])}, the weights are'
                 f' {model_type!r}')
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
  return wrong


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
      entry per layer of the weights (transformers refuses the folder else);
    * a `quantization_config` (a pre-quantized copy's) is dropped: the tensors
      written are not quantized.

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
  naming = huggingface.naming(family, shapes)
  architecture, model_type = family.target_of(naming)
  top, inner, notes = _split((architecture, model_type), config, where, option, family.text_of)
  fields = top if inner is None else inner
  # `skip`: fields these weights cannot tell (a LoRA save's adapted weights alone).
  implied = {f: v for f, v in naming.config(shapes).items() if f not in skip}
  wrong = _disagreements(top, fields, implied, architecture, model_type)
  if wrong:
    raise errors.UnsupportedLayoutError(
        f'{where}: config.json does not describe these weights ({family.name}):\n'
        f'{errors.list_paths(wrong)}\nPass as `{option}` the folder of the model this run'
        ' was trained from.'
    )
  notes += _drop_quantization(top, inner, where)
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


# What says a Hugging Face config's weights are stored quantized (a pre-quantized Hub copy:
# bitsandbytes, GPTQ, AWQ; gpt-oss's MXFP4 experts, DeepSeek's FP8 blocks); transformers and
# vLLM then read the tensors as such (or look for `*_blocks`, `*_scales` and load none).
QUANTIZATION_FIELD = 'quantization_config'


def _drop_quantization(top: dict[str, object], inner: dict[str, object] | None, where: str
                       ) -> list[str]:
  """Drops a pre-quantized copy's `quantization_config` (in place): the tensors an export
  writes are float, and a loader told otherwise reads them as quantized ones. A note if so."""
  found = [d.pop(QUANTIZATION_FIELD) for d in (top, inner) if d and QUANTIZATION_FIELD in d]
  if not found:
    return []
  how = next((q.get('quant_method') for q in found if isinstance(q, Mapping)), None)
  return [f'config.json: dropped {QUANTIZATION_FIELD}'
          f'{"" if how is None else f" (quant_method {how!r})"}: {where} describes a'
          ' pre-quantized copy, and the tensors written are not quantized (transformers and'
          ' vLLM would load them as if they were)']


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



def cut_vocab(
    naming: Naming, mapped: Mapping[Path, Mapped], vocab_size: int | None, where: str
) -> tuple[dict[Path, Mapped], list[str]]:
  """The weights with a padded vocabulary cut to the config's `vocab_size`.

  Rows past it are dropped, as MaxText's converter does, where they are padding
  (`Naming.vocab`); elsewhere they are trained, and a smaller `vocab_size` is refused.

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
  for pattern, axis in naming.vocab.axes.items():
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
    if vocab_size < rows and not naming.vocab.allows(rows, vocab_size):
      raise errors.UnsupportedLayoutError(
          f'{where}: vocab_size {vocab_size} is smaller than the weights\' vocabulary'
          f' ({fmt(path)} {m.shape} has {rows} along axis {axis}), and a'
          f' {naming.trainer.title}\'s rows are its own (only a source known to pad'
          ' its vocabulary, as MaxText does, is cut): cutting them would drop trained'
          ' tokens. Pass as `hf_config` the folder of the model this run was trained from'
          f' (vocab_size {rows}).'
      )
    if vocab_size < rows:
      cut = head(axis, vocab_size)
      out[path] = Mapped(m.sources, chain(m.transform, cut), cut.check([m.shape]))
      notes.append(f'{fmt(path)}: vocabulary padding cut, {rows} -> {vocab_size} (the'
                   f' config\'s vocab_size; {naming.vocab.why})')
  return out, notes

"""The Hugging Face layouts: one per family (`mapping/huggingface.py`), each a safetensors folder
(the folder destination: `layouts/folder.py`).

A family's layout lays out the model's weights (merged for a LoRA merge) under
the family's tensor names and layouts: MaxText's stacked layers taken apart
first, a vocabulary cut to the base config's, each tensor read as stored and
cast once after its arithmetic. With `hf_config` it also checks the base
model's config.json against the weights and names the files the folder gets
(config, generation config, tokenizer), every one a regular file decided
before any read. The family is the only thing that differs between them:
a new family is one value in `mapping/hf_families.py`, registered here by the
loop at the end.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from collections.abc import Collection, Mapping

from etils import epath

from orbax_tunix import errors
from orbax_tunix.keypaths import Path, fmt
from orbax_tunix.layouts.base import (
  LaidOut,
  Layout,
  Option,
  Request,
  register,
  weights,
)
from orbax_tunix.layouts.canonical import rng_note
from orbax_tunix.layouts.folder import FOLDER
from orbax_tunix.mapping import as_trained, huggingface, lora, step_layers
from orbax_tunix.mapping import hf_config as config_lib
from orbax_tunix.mapping import merge as merge_lib
from orbax_tunix.mapping.hf_naming import Family
from orbax_tunix.mapping.outputs import Input, ItemOutput, Output, compose, copied, read_sliced
from orbax_tunix.mapping.transforms import per_input
from orbax_tunix.reading import reader
from orbax_tunix.sizes import parse_size, parse_size_text
from orbax_tunix.store import fileio

# The one item a folder layout lays out: its outputs are the folder's tensors.
ITEM = 'model'
# What `hf_config` copies from the base model's folder (never its weights).
CONFIG_FILES = ('config.json', 'generation_config.json')
TOKENIZER_FILES = (
    'tokenizer.json', 'tokenizer_config.json', 'tokenizer.model', 'special_tokens_map.json',
    'added_tokens.json', 'vocab.json', 'merges.txt', 'chat_template.jinja', 'chat_template.json',
)


def lay_out(family: Family, request: Request) -> LaidOut:
  """The weights of `request.source` as `family`'s tensors, and the folder's other files.

  Raises:
    UnsupportedLayoutError: weights that do not fit the family; a config.json
      that disagrees with them.
    LoraOnlyCheckpointError, LoraError: adapters without a merge.
    InvalidOptionError: an `hf_config` that is not a readable model folder.
  """
  source, merged = request.source, request.merge
  base_only, given_axis, hf_config, config_as_trained = (  # The options, read once.
      request.option(BASE_ONLY), request.option(PARAM_SCAN_AXIS), request.option(HF_CONFIG),
      request.option(CONFIG_AS_TRAINED))
  found = base_weights(request) if base_only else weights(request)
  where = str(source.step_dir)
  if merged is None and not base_only:
    _refuse_adapters(where, found)
  model, left_out = huggingface.model_weights(found)
  naming = step_layers.naming(source, family)
  stored = {p: o.shape for p, o in model.items()}
  axis = step_layers.resolve(source, naming.form, stored, given_axis)
  # MaxText's stacked layers taken apart first, then the family's names.
  per_layer = naming.form.unstack(stored, axis, where=where)
  per_layer, fill_notes = huggingface.fill_absent(naming, huggingface.derive(naming, per_layer))
  base_config = config_lib.read(hf_config)
  per_layer, vocab_notes = config_lib.cut_vocab(
      naming, per_layer, _config_vocab(base_config), f'{hf_config}/config.json')
  shapes = {p: m.shape for p, m in per_layer.items()}
  mapped = huggingface.map_weights(family, naming, shapes, where,
                                   config=config_lib.text_fields(base_config))
  staged = {o.path: o for o in compose(model, per_layer)}
  if merged is not None:
    staged.update(_merged_per_layer(merged, model, per_layer, naming, axis))
  # A stacked weight's layers (and a fused weight's parts) are read one by one,
  # not the stack whole for each batch: memory within the budget and one layer.
  outputs = tuple(read_sliced(_read_as_stored(o)) for o in compose(staged, mapped.outputs))
  trained = functools.partial(as_trained.apply, naming.as_trained, family.name, shapes,
                              naming.layers(shapes), write=config_as_trained)
  files, notes = _config_files(family, hf_config, base_config, shapes,
                               {o.dtype.name for o in outputs if o.dtype is not None}, trained)
  notes = [*rng_note(source), *left_out, *fill_notes, *vocab_notes, *notes,
           f'weights: {huggingface.describe_weights(stored, axis)}']
  return LaidOut(
      items=(ItemOutput(ITEM, outputs),), notes=tuple(notes), files=files,
      summary={'model': family.name, 'architecture': family.target_of(naming)[0],
               'config': None if hf_config is None else os.fspath(hf_config / 'config.json')},
  )


def base_weights(request: Request) -> dict:
  """A full LoRA save's base weights alone, under the plain model's paths (an
  `nnx.LoRA(base_module=...)`'s layer in its place), the adapters left out, not merged.

  Raises:
    InvalidOptionError: with a merge.
    LoraError: a save without adapters (nothing to leave out).
    LoraOnlyCheckpointError: a save of adapters only (no base weights).
  """
  source = request.source
  if request.merge is not None:
    raise errors.InvalidOptionError(
        f'{source.step_dir}: `base_only` exports the base weights without the adapters,'
        ' `merge_lora` with them merged: pass one of them.')
  leaves = {p: leaf for leaf, p in reader.weights(source)}
  adapters = lora.find_adapters({p: leaf.shape for p, leaf in leaves.items()})
  if not adapters:
    raise errors.LoraError(
        f'{source.step_dir}: `base_only` leaves out LoRA adapters, and these weights have'
        ' none: export them without `base_only`.')
  plain = merge_lib.plain_weights(leaves, adapters)
  if not plain:
    raise errors.LoraOnlyCheckpointError(
        f'{source.step_dir}: expected base weights beside the LoRA adapters, found adapters'
        ' only (the run saved no base weights): the base is the checkpoint the run started'
        ' from; export that one.')
  return {path: copied(Input(source, leaf), path, request.dtype) for path, leaf in plain.items()}


def _merged_per_layer(merged, model, per_layer, naming, axis: int) -> dict:
  """A scanned layer's LoRA merge, one layer at a time.

  Relaid as any weight, a merged stacked weight would be merged whole for
  each of its layers; here each layer is taken from the weight and from its
  adapters (stacked on the same axes: `lora.Contraction.stacked`), then
  merged. Adapters named otherwise than qwix's `<w>_lora_a` keep the whole merge.
  """
  adapters = {path: leaf.shape for m in merged.merges.values()
              for path, leaf in ((m.adapter.a, m.a), (m.adapter.b, m.b))}
  layers = naming.form.unstack(adapters, axis)
  out = {}
  for dest, m in per_layer.items():
    (source,) = m.sources
    merge = merged.merges.get(source)
    if merge is None or not merge.contraction.stacked or m.transform.is_identity:
      continue
    a, b = (layers.get((*dest[:-1], p[-1])) for p in (merge.adapter.a, merge.adapter.b))
    if a is None or b is None or a.sources != (merge.adapter.a,) or b.sources != (merge.adapter.b,):
      continue
    one = dataclasses.replace(merge, contraction=dataclasses.replace(
        merge.contraction, weight=m.shape, stacked=()))
    whole = model[source]
    out[dest] = dataclasses.replace(
        whole, path=dest, shape=m.shape,
        transform=per_input((m.transform, a.transform, b.transform), merge_lib.as_transform(one)))
  return out


def _read_as_stored(output: Output) -> Output:
  """A computed output (a norm's shift, a division) reads its sources in their own dtype:
  the arithmetic is in float32 and the cast to the written dtype comes once, after it."""
  if output.transform.moves_only or output.read_dtypes is not None:
    return output
  return dataclasses.replace(output, read_dtypes=tuple(i.leaf.dtype for i in output.inputs))


def _config_vocab(values: object) -> int | None:
  """The `vocab_size` of a parsed config.json (its text model's), if it names one."""
  vocab = (config_lib.text_fields(values) or {}).get('vocab_size')
  return vocab if isinstance(vocab, int) and not isinstance(vocab, bool) else None


def _refuse_adapters(where: str, found: Collection[Path]) -> None:
  """Refuses weights (`found`: their canonical paths) holding LoRA adapters, unmerged."""
  adapters = [fmt(p) for p in found if lora.is_adapter(p)]
  if not adapters:
    return
  what = 'only LoRA adapters' if len(adapters) == len(found) else 'LoRA adapters'
  base = ' and `base` (the checkpoint the run started from)' if len(adapters) == len(found) else ''
  base_only = '' if len(adapters) == len(found) else ' (and its base: `base_only=True`)'
  error = errors.LoraOnlyCheckpointError if len(adapters) == len(found) else errors.LoraError
  raise error(
      f'{where}: expected a model\'s weights, found {what} ({len(adapters)} leaves,'
      f' e.g. {adapters[0]}): a Hugging Face model has no adapter tensors. Export the'
      f' weights with the adapters merged: `merge_lora=True`, `lora_alpha`{base}; or the'
      ' adapters as a PEFT adapter to serve on the base model: `export_peft_adapter`'
      f' with `lora_alpha`{base_only}.'
  )


def _config_files(
    family: Family, hf_config: epath.Path | None, values: object, shapes,
    dtypes: set[str], trained,
) -> tuple[tuple[tuple[str, epath.Path | str], ...], list[str]]:
  """The folder's other files: the base model's config (`values`, as `_base_config` read it;
  checked against the weights, and written anew where the checks complete it or `trained`, the
  family's `as_trained.apply`, changes it) and the files to copy, every one a regular file
  (decided before any read); and notes.

  Raises:
    InvalidOptionError: `config_as_trained` without `hf_config` (no config.json to write to).
  """
  if hf_config is None:
    if trained.keywords['write']:
      raise errors.InvalidOptionError(
          '`config_as_trained` writes the values the trainer used into the config.json that'
          ' `hf_config` gives, and no `hf_config` was given. Pass `hf_config` (the base'
          " model's folder) too, or leave `config_as_trained` out.")
    return (), [
        'no config.json written: add the base model\'s (--hf-config DIR copies it and its'
        ' tokenizer) before loading the folder with transformers or vLLM',
        *trained(None)[1],
    ]
  config = hf_config / 'config.json'
  checked = config_lib.check_config(family, values, shapes, str(config))
  checked = _with_dtype(checked, dtypes)
  written, trained_notes = trained(dict(checked.values))
  files: list[tuple[str, epath.Path | str]] = [
      ('config.json', json.dumps(written, indent=2, sort_keys=False) + '\n'
       if checked.notes or written != dict(checked.values) else config)]
  notes = [*checked.notes, *trained_notes]
  for name in (*CONFIG_FILES[1:], *TOKENIZER_FILES):
    path = hf_config / name
    usable, note = _copyable(path)
    if usable:
      files.append((name, path))
    elif note:
      notes.append(note)
  return tuple(files), notes


# config.json's names for the weights' dtype (`transformers` 4: torch_dtype; 5: dtype).
_DTYPE_FIELDS = ('torch_dtype', 'dtype')


def _with_dtype(checked: config_lib.Config, dtypes: set[str]) -> config_lib.Config:
  """The config with the dtype it names set to the one the export writes, when they differ
  (a loader's `dtype='auto'` takes the config's: float32 weights would be loaded as bfloat16)."""
  if len(dtypes) != 1:
    return checked
  (written,) = dtypes
  values = dict(checked.values)
  texts = [values] + ([dict(values['text_config'])] if isinstance(
      values.get('text_config'), Mapping) else [])
  changed = [(d, f, d[f]) for d in texts for f in _DTYPE_FIELDS
             if isinstance(d.get(f), str) and d[f] != written]
  if not changed:
    return checked
  for d, f, _ in changed:
    d[f] = written
  if len(texts) > 1:
    values['text_config'] = texts[1]
  note = ('config.json: ' + ', '.join(f'{f}={written!r} (the base config has {old!r})'
                                      for _, f, old in changed) + ': the dtype the weights are')
  return config_lib.Config(values, (*checked.notes, note))


def _copyable(path: epath.Path) -> tuple[bool, str | None]:
  """Whether a base model's file is copied: a readable regular file (links to one
  too), decided from `stat` alone (a device or a pipe is never read).

  Returns:
    (copied, a note when it is skipped for a reason a person should know).

  Raises:
    InvalidOptionError: it is not a regular file, or cannot be read.
  """
  if not fileio.is_local(path):
    return path.is_file(), None
  found = fileio.what_is_at(path)
  if found == 'nothing':
    return False, None
  if found == 'a broken link':
    return False, (f'{path} is a link to nothing ({os.readlink(path)}): not copied; the'
                   ' export has no ' + path.name)
  if found != 'a file':
    raise errors.InvalidOptionError(
        f'{path}: expected a regular file to copy from `hf_config`, found {found}. Replace'
        ' it with the file (or remove it) and run again.'
    )
  if not os.access(path, os.R_OK):
    raise errors.InvalidOptionError(
        f'{path}: expected a readable file to copy from `hf_config`, found one this user'
        ' cannot read. Fix its permissions (or remove it) and run again.'
    )
  return True, None


def _hf_folder(value: object) -> epath.Path:
  """The `hf_config` folder: as given, or the folder of the config.json file given (its
  tokenizer and generation config are that folder's)."""
  path = fileio.as_path(value)
  if path.name == CONFIG_FILES[0] and fileio.what_is_at(path) == 'a file':
    return path.parent
  return path


HF_CONFIG = Option(
    'hf_config', _hf_folder, 'DIR',
    "the base model's Hugging Face folder (or its config.json): its config.json (checked"
    ' against the weights), generation_config.json and tokenizer files are copied; without it'
    ' the export has no config.json', coerce=_hf_folder, folder=True)
MAX_SHARD_SIZE = Option(
    'max_shard_size', parse_size_text, 'SIZE',
    "bytes per file, e.g. 500MB or 5GB (powers of 1000, as transformers' max_shard_size;"
    ' GiB, MiB or G, M for powers of 1024; default 5GB)',
    coerce=functools.partial(parse_size, name='max_shard_size'))
PARAM_SCAN_AXIS = Option(
    'param_scan_axis', int, 'AXIS',
    "a scanned MaxText model's param_scan_axis, the layer axis of its stacked weights"
    " (default: the step's own, recorded or told by its shapes; 1, MaxText's, where several"
    ' fit; an axis that does not fit is refused)')

BASE_ONLY = Option(
    'base_only', bool, None, "a full LoRA save's base weights alone (the adapters left out, not"
    ' merged): the base a PEFT adapter of the run applies to')
CONFIG_AS_TRAINED = Option(
    as_trained.OPTION, bool, None, 'write into config.json the values google-tunix trained with'
    " where its model class ignores the base config's ("
    + '; '.join(f'{fact.field}: {", ".join(families)} {fact.brief}'
                for fact, families in huggingface.written_as_trained().items())
    + '); without it the export notes the difference. Needs --hf-config')

for _family in map(huggingface.get, huggingface.names()):
  register(Layout(
      name=_family.name,
      description=f'a Hugging Face safetensors folder of {_family.architecture}',
      lay_out=functools.partial(lay_out, _family),
      options=(PARAM_SCAN_AXIS, MAX_SHARD_SIZE, HF_CONFIG, BASE_ONLY, CONFIG_AS_TRAINED),
      destination=FOLDER,
      weights_only=True,
      adapters=True,  # `lay_out` refuses them unmerged itself, saying what to do.
      family=_family.name,
  ))

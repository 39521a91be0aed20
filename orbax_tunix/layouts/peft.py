"""The PEFT adapter layouts: one per family, a LoRA run's adapters as a Hugging Face PEFT adapter.

A family's adapter layout writes `adapter_model.safetensors` (PEFT's names:
`base_model.model.<module>.lora_A.weight` (r, in) and `.lora_B.weight`
(out, r)) and `adapter_config.json`, from the adapter arrays alone (the base
weights are never read, and need not be saved). Each adapted weight's Hugging
Face modules are the family's own naming's rules (`mapping/huggingface.py`) applied to
it; how `a` and `b` become each module's `lora_A` and `lora_B` is that rule's
transform applied to the weight's positions (`mapping/peft.py`), and where a
save without the weight cannot say how qwix arranged `a ⊗ b`, the family's
`lora` data says it. Whatever an adapter cannot express (a weight with no
Hugging Face module, MoE experts held as bare parameters, a module whose
weight is not `B·A`) is refused, every one named, before anything is read.

Its destination (`ADAPTER`, chosen by `export --peft`) is a folder of one
`adapter_model.safetensors` (vLLM reads no other name, and no index), written as the folder
destination writes its files (`layouts/folder.py`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from etils import epath

from orbax_tunix import errors
from orbax_tunix.keypaths import Path, fmt
from orbax_tunix.layouts import folder
from orbax_tunix.layouts import huggingface as hf_layouts
from orbax_tunix.layouts.base import (
  LaidOut,
  Layout,
  Option,
  Request,
  Switch,
  register,
)
from orbax_tunix.mapping import hf_config as config_lib
from orbax_tunix.mapping import huggingface, lora, merge_options, patterns, peft, step_layers
from orbax_tunix.mapping import merge as merge_lib
from orbax_tunix.mapping.hf_naming import Family, Naming
from orbax_tunix.mapping.merge_options import BASE, BASE_QTYPE, MERGE_LORA
from orbax_tunix.mapping.outputs import Input, ItemOutput, Output
from orbax_tunix.mapping.transforms import chain
from orbax_tunix.reading import reader
from orbax_tunix.store import fileio
from orbax_tunix.writing import commit, writer

SUFFIX = '.peft'


def layout_name(family: str) -> str:
  """The adapter layout of a family (`huggingface.get(...).name`)."""
  return family + SUFFIX


def _arrangement(naming: Naming, weight: Path, adapter: lora.Adapter,
                 leaves: Mapping[Path, reader.LeafInfo], base: Mapping[Path, reader.LeafInfo],
                 told: Mapping[Path, tuple[int, ...]]) -> lora.Contraction | str:
  """How `a ⊗ b` makes the weight: from the weight's shape where the save holds it or the
  base model's config tells it (`told`), else from the family's `lora` data (else `a`'s
  dimensions then `b`'s); or why it cannot be."""
  a, b = leaves[adapter.a].shape, leaves[adapter.b].shape
  shape = base[weight].shape if weight in base else told.get(weight)
  if shape is not None:
    arranged = lora.contraction(shape, a, b)
    return arranged if arranged is not None else (
        f'{fmt(adapter.a)} {a} ⊗ {fmt(adapter.b)} {b} does not reproduce the weight'
        f' {tuple(shape)} (or more than one arrangement does)')
  einsum = naming.lora_weight(weight).einsum
  if einsum is None:
    if not a or not b or a[-1] != b[0]:
      return f'{fmt(adapter.a)} {a} and {fmt(adapter.b)} {b}: ranks disagree'
    product = (*a[:-1], *b[1:])
    return lora.Contraction(product, False, tuple(range(len(product))))
  arranged = peft.einsum_contraction(einsum, a, b)
  return arranged if arranged is not None else (
      f'{fmt(adapter.a)} {a} and {fmt(adapter.b)} {b} do not fit qwix\'s {einsum!r}')


def _config_fix(shape: tuple[int, ...], fields: tuple[str, ...], rows: int, columns: int
                ) -> list[str]:
  """The single config fields whose other value would make a weight of `shape` (one value
  per field) a `rows` x `columns` product flattened as qwix flattens it, as 'field N (found
  M)'."""
  fixes = []
  for k in range(1, len(shape)):
    for j, field in enumerate(fields):
      part, need, other, want = ((shape[:k], rows, shape[k:], columns) if j < k
                                 else (shape[k:], columns, shape[:k], rows))
      rest = math.prod(part) // shape[j]
      if math.prod(other) == want and need % rest == 0 and need // rest != shape[j]:
        fixes.append(f'{field} {need // rest} (found {shape[j]})')
  return sorted(set(fixes))


def _told_shape(naming: Naming, weight: Path, a: tuple[int, ...],
                b: tuple[int, ...], text: Mapping[str, object], axis: int, where: str
                ) -> tuple[int, ...] | str | None:
  """The stored shape the config's fields (`text`, the text model's) give the weight at
  `weight`: per layer the naming's `axes`, with the layer axes its adapters hold (a scanned
  layer's adapters are stacked as its weight is). A str: why the config does not fit the
  adapters; None: `axes` does not name the weight."""
  layer_axes = naming.form.layer_axes(weight, axis)
  per_layer = naming.form.unstack({weight: a}, axis, where=where)
  shapes: dict[tuple[int, ...], tuple[Path, tuple[str, ...]]] = {}
  for path in per_layer:
    fields = naming.axis_fields(path, text)
    if fields is None:
      return None
    values = [naming.config_value(text, f) for f in fields]
    bad = next((f for f, v in zip(fields, values, strict=True)
                if isinstance(v, bool) or not isinstance(v, int) or v < 1), None)
    if bad is not None:
      return (f'{fmt(path)}: expected {bad} (a positive integer, an axis of'
              f' {" x ".join(fields)}), found {json.dumps(text.get(bad))}')
    shapes.setdefault(tuple(values), (path, fields))
  if len(shapes) != 1:
    return (f'{fmt(weight)}: expected one shape for the layers it stacks, found'
            f' {", ".join(f"{fmt(p)} {s}" for s, (p, _) in shapes.items())}')
  ((shape, (path, fields)),) = shapes.items()
  stored = list(shape)
  for k in layer_axes:
    stored.insert(k, a[k])
  if lora.contraction(tuple(stored), a, b) is not None:
    return tuple(stored)
  rows = math.prod(n for k, n in enumerate(a[:-1]) if k not in layer_axes)
  columns = math.prod(n for k, n in enumerate(b[1:], 1) if k not in layer_axes)
  fixes = _config_fix(shape, fields, rows, columns)
  return (f'{fmt(path)}: {" x ".join(fields)} = {shape}, its adapters hold {rows} x'
          f' {columns} (lora_a {a}, lora_b {b}): expected '
          + (' or '.join(fixes) if fixes else f'a shape whose leading axes make {rows} and'
             f' the rest {columns}'))


def _base_folder(base_model: str | None) -> tuple[epath.Path, object] | None:
  """The `base_model` folder and its config.json as read (once for the whole layout), or
  None: no base model, or a Hub name (`_name_or_path` told them apart)."""
  if base_model is None:
    return None
  folder = fileio.as_path(base_model)
  return (folder, config_lib.read(folder, BASE_MODEL.name)) if folder.is_dir() else None


def _text_config(base_folder: tuple[epath.Path, object] | None) -> Mapping[str, object] | None:
  """The text model's config fields of the `base_model` folder's config.json (a multimodal
  one's `text_config`), or None: no folder, or no JSON object (`_names_for_base` refuses it,
  naming what it is)."""
  return None if base_folder is None else config_lib.text_fields(base_folder[1])


def _told_shapes(family: Family, naming: Naming,
                 adapters: Mapping[Path, lora.Adapter], leaves: Mapping[Path, reader.LeafInfo],
                 base_folder: tuple[epath.Path, object] | None, axis: int, where: str
                 ) -> dict[Path, tuple[int, ...]]:
  """For a save of adapters alone whose adapters do not tell their weights' shapes (qwix
  flattened them: `Naming.lora_flattened`): each adapted weight's stored shape, as the
  `base_model` folder's config.json gives it (the naming's `axes`); {} without a folder.

  Raises:
    UnsupportedLayoutError: a config whose fields do not fit the adapters (every weight
      named, with the field, what the adapters expect and what the config has).
  """
  text = _text_config(base_folder)
  if not naming.lora_flattened or text is None:
    return {}
  folder = base_folder[0]
  found = {w: _told_shape(naming, w, leaves[a.a].shape, leaves[a.b].shape, text, axis, where)
           for w, a in sorted(adapters.items())}
  problems = [f for f in found.values() if isinstance(f, str)]
  told = {w: f for w, f in found.items() if f is not None and not isinstance(f, str)}
  if problems:
    raise errors.UnsupportedLayoutError(
        f'{folder / "config.json"}: config.json does not describe these adapters'
        f' ({family.name}; the save holds no base weight, so their shapes come from it):\n'
        f'{errors.list_paths(problems)}\nPass as `base_model` the folder of the model this run'
        ' was trained from.')
  return told


def _not_a_module(family: Family, naming: Naming, path: Path, name: str
                  ) -> str | None:
  """Why the Hugging Face tensor `name` made from the weight at `path` is no module PEFT
  adapts as a linear layer, or None."""
  rule = next((r for r in naming.rules if r.source.match(path) is not None), None)
  if rule is not None and rule.fan_out is not None:
    return 'MoE experts held as bare parameters (no module PEFT can adapt)'
  if not name.endswith(peft.WEIGHT):
    return 'a bare parameter, not a module\'s weight'
  if name[:-len(peft.WEIGHT)].rsplit('.', 1)[-1] in family.embeddings:
    return 'an embedding (PEFT adapts its lookup, qwix adapted a product with its weight)'
  return None


def _names_for_base(family: Family, naming: Naming,
                    base_model: str | None, base_folder: tuple[epath.Path, object] | None,
                    shapes: Mapping[Path, tuple[int, ...]], full: bool, where: str
                    ) -> tuple[Callable[[str], str], list[str]]:
  """The modules' names as the base model's class holds them, and notes.

  A `base_model` folder's config.json is checked against the weights as a model export
  checks it; a save of adapters alone by the same rules, for what its adapters tell: every
  size of every adapted weight (`hf_config.check_sizes`), a layer count that holds them,
  and an lm_head of its own (an adapted lm_head: a tied base is refused, as for the full
  save). A multimodal class (Gemma3ForConditionalGeneration) holds the text model's modules
  deeper (`Family.text_prefixes`). A Hub name is not checked.

  Raises:
    InvalidOptionError, UnsupportedLayoutError: a folder whose config.json is not one, or
      does not describe these weights.
  """
  def same(name: str) -> str:
    return name

  if base_model is None:
    return same, []
  if base_folder is None:
    return same, [f'base model {base_model!r} is no folder here: its config is not checked']
  folder, values = base_folder
  config = str(folder / 'config.json')
  # What adapters alone cannot tell: the layer count and kinds; whether the model ties its
  # lm_head to the embedding, unless they adapt an lm_head of its own (the model has one).
  untold = () if full else ('num_hidden_layers', 'layer_types') + (
      () if naming.tied is not None and not naming.tied(shapes) else ('tie_word_embeddings',))
  config_lib.check_config(family, values, shapes, config, skip=untold, option=BASE_MODEL.name)
  text = _text_config(base_folder) or {}
  layers = [int(i) for i in naming.layers(shapes)]
  count = text.get('num_hidden_layers')
  wrong = [] if full else config_lib.check_sizes(naming, shapes, text)
  if not full and isinstance(count, int) and layers and max(layers) >= count:
    wrong.append(f'num_hidden_layers: config.json has {count}, the adapters are on layer'
                 f' {max(layers)}')
  if wrong:
    raise errors.UnsupportedLayoutError(
        f'{config}: config.json does not describe these adapters ({family.name}; the save'
        f' holds no base weight, the adapters tell these sizes):\n{errors.list_paths(wrong)}'
        '\nPass as `base_model` the folder of the model this run was trained from.')
  archs = values.get('architectures') if isinstance(values, dict) else None
  own = family.target_of(naming)[0]
  have, want = family.text_prefixes.get(own), family.text_prefixes.get(
      archs[0] if isinstance(archs, list) and archs else own)
  if have is None or want is None or have == want:
    return same, []
  return (lambda name: want + name[len(have):] if name.startswith(have) else name), [
      f'{config} is {archs[0]}: the adapter names its text model\'s modules as that class'
      f' holds them ({want}...)']


def _adapters(request: Request, where: str
              ) -> tuple[dict[Path, reader.LeafInfo], list[str], dict[Path, lora.Adapter],
                         float | None, dict[Path, float]]:
  """The save's weights (no AQT state; notes of what was left out), their adapters, the
  alpha the caller gave (None: a scale, or none) and each adapter's scale.

  Raises:
    LoraError: a merge asked for; no adapters; no alpha or scale for qwix adapters, or one
      for flax's alone (which have none).
  """
  if request.merge is not None:
    raise errors.LoraError(
        f'{where}: a PEFT adapter holds the adapters unmerged; {MERGE_LORA.named()} writes a'
        f' model. Leave out {MERGE_LORA.named()}, or export the merged model (export_to_hf).')
  alpha, scale = (request.option(o) for o in merge_options.SCALING)
  merge_options.check_scaling(alpha, scale)
  leaves, left_out = huggingface.model_weights(
      {p: leaf for leaf, p in reader.weights(request.source)})
  adapters = lora.find_adapters({p: leaf.shape for p, leaf in leaves.items()})
  if not adapters:
    raise errors.LoraError(
        f'{where}: expected LoRA adapters (<w>_lora_a/<w>_lora_b from qwix, or lora_a/lora_b'
        ' from flax), found none among its weights: the run is no LoRA run. Export its'
        ' weights as a model instead (export_to_hf, not `export_peft_adapter`).')
  # The merge's rules (`plan_merge`): flax's adapters have no alpha (an alpha or scale given
  # for them would be served, by PEFT's lora_alpha / r, where the run added a·b unscaled).
  lora.check_scaling_applies(adapters, alpha, scale)
  scales = {w: lora.scale_of(a, alpha, scale) for w, a in adapters.items()}
  return leaves, left_out, adapters, alpha, scales


def _mapped(family: Family, naming: Naming, shapes: Mapping[Path, tuple[int, ...]],
            full: bool, base_model: str | None, where: str,
            text: Mapping[str, object] | None = None) -> patterns.PathMap:
  """The family's rules applied to the adapted weights (per layer); `text`: the base model's
  config fields (its text model's), for the naming's `sized` rules.

  Raises:
    UnsupportedLayoutError: a full save's weights that are none of the family's modules.
    LoraError: the same for a save of adapters alone, saying where their shapes come from.
  """
  try:
    return huggingface.map_weights(family, naming, shapes, where, whole=False, config=text,
                                   option=BASE_MODEL.name)
  except errors.UnsupportedLayoutError as e:
    if full:
      raise
    given = '' if base_model is None else (
        f' (`base_model` {base_model} is no folder here, or its config does not'
        ' give their shapes)')
    raise errors.LoraError(
        f'{e}\nThe save holds the adapters alone, and their shapes do not tell these weights\''
        ' (qwix flattens a dot_general weight\'s dimensions into lora_a and lora_b). Pass as'
        f' `base_model` the base model\'s folder, whose config.json gives them{given}; or'
        ' export the adapter from a save with the base weights beside them, or the merged'
        f' model: {MERGE_LORA.named(True)}, {merge_options.LORA_ALPHA.named()} and'
        f' {BASE.named()}.') from e


@dataclasses.dataclass
class _Modules:
  """The PEFT modules made so far (`_modules`).

  Attributes:
    planned: module -> its factors and the adapter they come from.
    ranks: module -> (its rank, its trained scale).
    said: a note -> the modules it holds for.
    problems: what cannot be written, one line each.
  """

  planned: dict[str, tuple[peft.Factors, lora.Adapter]] = dataclasses.field(default_factory=dict)
  ranks: dict[str, tuple[int, float]] = dataclasses.field(default_factory=dict)
  said: dict[str, list[str]] = dataclasses.field(default_factory=dict)
  problems: list[str] = dataclasses.field(default_factory=list)


def _modules(family: Family, naming: Naming, mapped: patterns.PathMap, per_layer: Mapping,
             arranged: Mapping[Path, lora.Contraction], adapters: Mapping[Path, lora.Adapter],
             leaves: Mapping[Path, reader.LeafInfo], scales: Mapping[Path, float],
             rename: Callable[[str], str], has: Callable[[Path], bool] | None) -> _Modules:
  """Each Hugging Face module the adapted weights make: its `lora_A`/`lora_B` factors, its
  rank and scale, the notes that hold for it; or why it cannot be one."""
  out = _Modules()
  for dest, m in sorted(mapped.outputs.items()):
    (layer_path,) = m.sources
    layer = per_layer[layer_path]
    (weight,) = layer.sources
    adapter = adapters[weight]
    name = dest[0]
    factors = _not_a_module(family, naming, layer_path, name) or peft.Factors.of(
        arranged[weight], chain(layer.transform, m.transform), leaves[adapter.a].shape,
        leaves[adapter.b].shape)
    if isinstance(factors, str):
      out.problems.append(f'{fmt(weight)} -> {name}: {factors}')
      continue
    module = rename(name[:-len(peft.WEIGHT)])
    out.planned[module] = (factors, adapter)
    out.ranks[module] = (adapter.rank, scales[weight])
    note = naming.lora_weight(layer_path).note_for(naming.layer_number(layer_path), has)
    if note:
      out.said.setdefault(note, []).append(module)
  return out


def _outputs(made: _Modules, one: peft.Scaling, leaves: Mapping[Path, reader.LeafInfo],
             request: Request) -> list[Output]:
  """Each module's `lora_A` and `lora_B` tensors, from its adapter's arrays alone."""
  outputs: list[Output] = []
  for module, (factors, adapter) in made.planned.items():
    a_leaf, b_leaf = leaves[adapter.a], leaves[adapter.b]
    a_name, b_name = peft.tensor_names(module)
    a_transform = peft.lora_a(factors, adapter.rank, one.r)
    b_transform = peft.lora_b(factors, adapter.rank, one.r, one.folds[module])
    outputs += [
        Output((a_name,), (Input(request.source, a_leaf),), a_transform,
               a_transform.check([a_leaf.shape]), reader.cast_dtype(a_leaf, request.dtype)),
        Output((b_name,), (Input(request.source, b_leaf),), b_transform,
               b_transform.check([b_leaf.shape]), reader.cast_dtype(b_leaf, request.dtype),
               # Scaled: read as stored, the product in float32, one cast after it.
               read_dtypes=None if b_transform.moves_only else (b_leaf.dtype,)),
    ]
  return outputs


def lay_out(family: Family, request: Request) -> LaidOut:
  """A LoRA run's adapters as `family`'s PEFT adapter: the tensors and adapter_config.json.

  Raises:
    LoraError: no adapters; a merge asked for; no alpha or scale for qwix
      adapters, or one for flax's alone (which have none); adapters no PEFT adapter
      expresses (each named).
    UnsupportedLayoutError: adapted weights that are not the family's.
  """
  where = str(request.source.step_dir)
  leaves, left_out, adapters, alpha, scales = _adapters(request, where)
  naming = step_layers.naming(request.source, family)
  base = merge_lib.plain_weights(leaves, adapters)
  # The layer axis as the model export resolves it (given, recorded, or told by the shapes;
  # refused where it does not fit, or where nothing is stacked), from the model's weights (a
  # save of adapters alone: the adapters, stacked as their weights are).
  axis = step_layers.resolve(request.source, naming.form, {p: leaf.shape for p, leaf in (
      base or leaves).items()}, request.option(hf_layouts.PARAM_SCAN_AXIS))
  if base:  # A full save: the family must take the whole model, as a model export checks.
    model_shapes = {p: m.shape for p, m in naming.form.unstack(
        {p: leaf.shape for p, leaf in base.items()}, axis, where=where).items()}
  base_model = request.option(BASE_MODEL)
  base_folder = _base_folder(base_model)
  text = _text_config(base_folder)
  if base:
    huggingface.map_weights(family, naming, model_shapes, where, config=text,
                            option=BASE_MODEL.name)
  told = {} if base else _told_shapes(family, naming, adapters, leaves, base_folder, axis, where)
  found = {w: _arrangement(naming, w, a, leaves, base, told)
           for w, a in sorted(adapters.items())}
  arranged = {w: f for w, f in found.items() if not isinstance(f, str)}
  per_layer = naming.form.unstack({w: c.weight for w, c in arranged.items()}, axis,
                                  where=where)
  layer_shapes = {p: m.shape for p, m in per_layer.items()}
  mapped = _mapped(family, naming, layer_shapes, bool(base), base_model, where, text)
  rename, config_notes = _names_for_base(
      family, naming, base_model, base_folder,
      model_shapes if base else layer_shapes, bool(base), where)
  # Which weights the model has, for notes that hold in some layers only: a full save's own,
  # else as far as the base model's config says.
  has = ((lambda p: p in model_shapes) if base else
         None if text is None else functools.partial(naming.has, config=text))
  made = _modules(family, naming, mapped, per_layer, arranged, adapters, leaves, scales, rename,
                  has)
  problems = [*(f'{fmt(w)}: {f}' for w, f in found.items() if isinstance(f, str)),
              *(f'{fmt(p)}: no {family.name} module (no Hugging Face tensor is made from it)'
                for p in mapped.unmatched), *made.problems]
  if problems:
    raise errors.LoraError(
        f'{where}: {len(problems)} adapted weights cannot be written as a PEFT adapter:\n'
        f'{errors.list_paths(problems)}\nAn adapter without them would serve another model'
        ' than the run trained. Export the weights with the adapters merged instead:'
        f' {MERGE_LORA.named(True)} and {merge_options.LORA_ALPHA.named()} (an adapters-only'
        f' save also {BASE.named()}).')
  one = peft.Scaling.of(made.ranks, alpha)
  config = peft.config(made.ranks, one, base_model)
  # What whoever serves the adapter should know: said here and in the folder's README.md.
  readme = [*_scaling_notes(made.ranks, one), *filter(None, [_qlora_note(adapters, base)])]
  notes = [*left_out, *config_notes,
           *(note.format(module=', '.join(names)) for note, names in made.said.items()),
           *readme, *filter(None, [_cannot_tell_note(adapters, base)]),
           *_summary_notes(config, made, arranged, adapters, leaves, base_model)]
  return LaidOut(
      items=(ItemOutput(hf_layouts.ITEM, tuple(_outputs(made, one, leaves, request))),),
      notes=tuple(notes),
      files=((peft.CONFIG_FILE, json.dumps(config, indent=2) + '\n'),
             *((peft.README_FILE, peft.readme(readme)),) * bool(readme)),
      summary={'model': family.name, 'architecture': family.target_of(naming)[0],
               'config': None,
               'adapter': {'r': config['r'], 'lora_alpha': config['lora_alpha'],
                           'target_modules': config['target_modules'],
                           'modules': len(made.ranks)}},
  )


def _summary_notes(config: Mapping[str, Any], made: _Modules,
                   arranged: Mapping[Path, lora.Contraction],
                   adapters: Mapping[Path, lora.Adapter], leaves: Mapping[Path, reader.LeafInfo],
                   base_model: str | None) -> list[str]:
  """What the adapter holds and what was read; the weights' kind; a missing base model."""
  kinds = sorted({m.rsplit('.', 1)[-1] for m in made.ranks})
  notes = [
      f'adapters of {len(arranged)} weights as {len(made.ranks)} PEFT modules'
      f' ({", ".join(kinds)}; r={config["r"]}, lora_alpha={config["lora_alpha"]};'
      ' target_modules names each module in full: PEFT adapts those alone); read:'
      f' {2 * len(adapters)} adapter arrays,'
      f' {sum(leaves[x].nbytes for a in adapters.values() for x in (a.a, a.b))} bytes, no'
      ' base weight',
      f'weights: {huggingface.describe_weights({p: leaf.shape for p, leaf in leaves.items()})}',
  ]
  if base_model is None:
    notes.append('no base_model_name_or_path in adapter_config.json: pass the base model'
                 ' (`base_model`) or load the adapter onto it by name')
  return notes


def _qlora_note(adapters: Mapping[Path, lora.Adapter], base: Mapping[Path, reader.LeafInfo]
                ) -> str | None:
  """What a QLoRA run's adapter is (trained on a quantized base), weight by weight, where its
  save says so (a full save's bases)."""
  quantized = sorted(w for w in adapters if w in base and base[w].quantized is not None)
  if not quantized:
    return None
  how = '; '.join(sorted({base[w].quantized.describe() for w in quantized}))
  floats = sorted(w for w in adapters if w in base and base[w].quantized is None)
  which = 'these adapters were' if not floats else (
      f'{len(quantized)} of these {len(adapters)} adapters (e.g. {fmt(quantized[0])}) were')
  others = '' if not floats else (
      f'; the other {len(floats)} (plain LoRA, e.g. {fmt(floats[0])}) against its float base,'
      ' as saved, which the original model holds')
  return (f'QLoRA: {which} trained against a quantized base ({how}), the run\'s frozen base'
          f'{others}. Served on the original full-precision model, as QLoRA adapters are,'
          f' {"they" if not floats else "the quantized ones"} compute close to but not exactly'
          ' the trained model; on the dequantized base (`export --base-only` of the run)'
          ' exactly it.')


def _cannot_tell_note(adapters: Mapping[Path, lora.Adapter], base: Mapping[Path, reader.LeafInfo]
                      ) -> str | None:
  """What an adapters-only save cannot tell (as the merge and `inspect` say): whether the run
  quantized its base, which would make the adapter a QLoRA one (flax's: no qwix run)."""
  if base or all(a.style == lora.FLAX for a in adapters.values()):
    return None
  return ('adapters only: a save cannot tell whether the run trained them on a quantized base'
          ' (QLoRA: qwix\'s weight_qtype). If it did, served on the original full-precision'
          ' model they compute close to but not exactly the trained model, as QLoRA adapters'
          ' do; the merge with the run\'s recipe'
          f' ({", ".join(o.named() for o in (MERGE_LORA, BASE, BASE_QTYPE))}) gives the trained'
          ' model.')


def _scaling_notes(modules: Mapping[str, tuple[int, float]], one: peft.Scaling) -> list[str]:
  """What `peft.Scaling` did, where it did anything: lower ranks padded to `r`, trained
  scales carried by `B` (every module's, by module count)."""
  notes = []
  low = sorted({rank for rank, _ in modules.values() if rank < one.r})
  if low:
    count = sum(rank < one.r for rank, _ in modules.values())
    notes.append(
        f'ranks differ ({", ".join(map(str, low))} and {one.r}): every module is written at'
        f' r={one.r}, the {count} of lower rank with zeros appended to lora_A and lora_B (B·A'
        ' unchanged; zero rows and columns stay zero if trained on), so that vLLM, which'
        ' reads r alone (not rank_pattern), checks --max-lora-rank against the largest')
  folded: dict[float, list[str]] = {}
  for module, fold in one.folds.items():
    if fold != 1.0:
      folded.setdefault(fold, []).append(module)
  if folded:
    scale = one.alpha / one.r
    notes.append(
        f'trained scales differ: every module is served at lora_alpha / r = {scale:g} (vLLM'
        ' reads no alpha_pattern), so lora_B carries the rest: '
        + '; '.join(f'x{fold:g} in {len(names)} modules (scale {fold * scale:g}; e.g.'
                    f' {names[0]})' for fold, names in sorted(folded.items()))
        + ': peft and vLLM serve each module the update the run trained')
  return notes


# A Hugging Face Hub repository id as huggingface_hub validates one: `name` or `org/name`, of
# letters, digits, '-', '_' and '.', neither starting nor ending with '-' or '.', without
# '--' or '..', at most 96 characters.
_HUB_NAME = re.compile(r'(?!.*(--|\.\.))[A-Za-z0-9_]([\w.-]*\w)?(/[A-Za-z0-9_]([\w.-]*\w)?)?')


def _name_or_path(value: object) -> str:
  """A base model as its adapter_config.json names it: a folder here (a path to one, or to
  its config.json: the folder, absolute), else a Hub name (as transformers takes it: a folder
  first).

  Raises:
    InvalidOptionError: not a string or path; a path to anything but such a folder or its
      config.json, or to nothing when it cannot be a Hub name (`./x`, `/x`, `a/b/c`,
      `x/config.json`).
  """
  if not isinstance(value, str | os.PathLike):
    raise errors.InvalidOptionError(
        f'`base_model` {value!r}: expected a Hugging Face Hub name or a folder (a string or a'
        ' path).')
  text = os.fspath(value)
  path = fileio.as_path(text)
  found = fileio.what_is_at(path)
  if (found == 'nothing' and fileio.is_local(path) and len(text) <= 96
      and _HUB_NAME.fullmatch(text) and path.name != hf_layouts.CONFIG_FILES[0]):
    return text
  if found == 'a file' and path.name == hf_layouts.CONFIG_FILES[0]:
    path, found = path.parent, 'a directory'
  if found != 'a directory':
    raise errors.InvalidOptionError(
        f'`base_model` {text}: expected the base model\'s folder holding config.json (or that'
        f' config.json), or a Hugging Face Hub name (org/name), found {found} at {path}. Pass'
        ' the folder of the model the run was trained from, or its Hub name.')
  return os.fspath(path)


BASE_MODEL = Option('base_model', str, 'NAME_OR_PATH',
                    "the base model (a Hub name or a folder), the adapter config's"
                    ' base_model_name_or_path', coerce=_name_or_path)

# An exported PEFT adapter (what `force` may replace): its tensors, whose header records
# the files the export wrote (the tensors and adapter_config.json), as a model export's do.
ADAPTER_EXPORT = commit.Kind(
    'a PEFT adapter export', (peft.ADAPTER_FILE,),
    record=lambda path: writer.recorded_files(path, peft.ADAPTER_FILE), commit_file=None,
    in_place=False,
)


def _adapter_file(items: Sequence[ItemOutput], given: Mapping[str, Any]
                  ) -> tuple[list[ItemOutput], list[writer.Shard]]:
  """The adapter's tensors in write order, all in the one file vLLM reads
  (`adapter_model.safetensors`: it reads no other name, and no index)."""
  del given
  (item,) = items
  outputs = tuple(writer.in_write_order(item.outputs))
  return [dataclasses.replace(item, outputs=outputs)], [writer.Shard(
      peft.ADAPTER_FILE, tuple((o.path[0], o.dtype.name, tuple(o.shape)) for o in outputs))]


# `export --peft`: the model export's flags that an adapter export does not take, and why.
PEFT = Switch(
    Option('peft', bool, None, "export a LoRA run's adapters as a PEFT adapter folder"
           ' (adapter_config.json, adapter_model.safetensors), with --lora-alpha or'
           ' --lora-scale; reads the adapters only (a save with or without its base)'),
    refuses={
        MERGE_LORA.name: 'the adapter holds the adapters unmerged; --merge-lora writes a model',
        BASE.name: 'the adapter is read from SRC alone (--base is the base weights of a merge)',
        hf_layouts.HF_CONFIG.name: 'an adapter folder holds no config.json or tokenizer of the'
                                   ' model',
        hf_layouts.MAX_SHARD_SIZE.name: 'the adapter is one file (vLLM reads'
                                        ' adapter_model.safetensors only)',
        hf_layouts.BASE_ONLY.name: 'the adapter holds the adapters; --base-only writes the base'
                                   ' model',
        hf_layouts.CONFIG_AS_TRAINED.name: 'an adapter folder holds no config.json of the model',
        **dict.fromkeys((o.name for o in merge_options.RECIPE),
                        'it says how a merge\'s --base was quantized (the adapter is read from'
                        ' SRC alone)'),
    },
    instead='export a model without --peft',
    alone={BASE_MODEL.name: 'it names the base model of a PEFT adapter; add --peft (with'
                            ' --lora-alpha)'},
)
@dataclasses.dataclass(frozen=True)
class AdapterDestination(folder.FolderDestination):
  """A PEFT adapter folder: a Hugging Face folder whose tensors are all in one file."""

  def shard(self, items: Sequence[ItemOutput], given: Mapping[str, Any]
            ) -> tuple[list[ItemOutput], list[writer.Shard]]:
    return _adapter_file(items, given)


ADAPTER = AdapterDestination(
    name='adapter', kind=ADAPTER_EXPORT, unit='tensor', run='export',
    doing='exporting the adapter to', command='export', switch=PEFT, merges=False,
    safetensors=True,
)

for _family in map(huggingface.get, huggingface.names()):
  register(Layout(
      name=layout_name(_family.name),
      description=f'a PEFT LoRA adapter for {_family.architecture}',
      lay_out=functools.partial(lay_out, _family),
      options=(hf_layouts.PARAM_SCAN_AXIS, *merge_options.SCALING, BASE_MODEL),
      destination=ADAPTER,
      weights_only=True,
      adapters=True,
      family=_family.name,
  ))

"""Export: a Tunix run's weights as a Hugging Face safetensors folder, streamed and atomic.

`plan_export` decides everything from metadata before any array is read: the
weights (merged for a LoRA run), the family's tensor names and layouts
(`huggingface.py`, each family a value), the files they go to (as
`transformers` shards them), and the config checks. `run_export` streams them
through the one writer (`writer.py`) into `SafetensorsSink`, a batch within the
memory budget at a time, and commits the folder as `convert` commits a step
(`commit.Staging`): written beside OUT_DIR and renamed (on a bucket: copied
over) once complete, so a failure leaves nothing half-written. `--hf-config`
copies the base model's config and tokenizer files after checking the config
against the weights.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import time
from collections.abc import Mapping
from typing import Any

import numpy as np
from etils import epath

from orbax_tunix import conventions, errors, layouts, sizes
from orbax_tunix.keypaths import fmt
from orbax_tunix.layouts.canonical import rng_note
from orbax_tunix.mapping import huggingface, lora, patterns, stacks
from orbax_tunix.mapping import merge as merge_lib
from orbax_tunix.mapping.outputs import Output, read_sliced, relay
from orbax_tunix.mapping.transforms import per_input
from orbax_tunix.reading import reader
from orbax_tunix.store import fileio
from orbax_tunix.writing import commit, distributed, writer

# transformers' default `max_shard_size`.
DEFAULT_MAX_SHARD_SIZE = 5 * 10**9
# What `--hf-config` copies from the base model's folder (never its weights).
CONFIG_FILES = ('config.json', 'generation_config.json')
TOKENIZER_FILES = (
    'tokenizer.json', 'tokenizer_config.json', 'tokenizer.model', 'special_tokens_map.json',
    'added_tokens.json', 'vocab.json', 'merges.txt', 'chat_template.jinja', 'chat_template.json',
)
_SHARD = re.compile(r'^model(-\d+-of-\d+)?\.safetensors$')


def _in_export(entry: epath.Path) -> bool:
  """Whether an entry of an export folder is one an export writes."""
  name = entry.name
  return not entry.is_dir() and (
      bool(_SHARD.match(name)) or name in (writer.INDEX_FILE, *CONFIG_FILES, *TOKENIZER_FILES))


# An exported folder (what `force` may replace): it holds a model's weights, as
# every export does (a config.json alone is no sign: many projects have one),
# and nothing an export does not write (a `.git`, notes: never deleted).
EXPORT = commit.Kind(
    'a Hugging Face export', (writer.SINGLE_FILE, writer.INDEX_FILE),
    commit_file=None, in_place=False, owns=_in_export,
)


@dataclasses.dataclass(frozen=True)
class ExportPlan:
  """Everything an export does, decided from metadata before any read.

  Attributes:
    source: the step whose weights are exported.
    out_dir: the folder to create.
    family: the Hugging Face family.
    outputs: the tensors, in write order (`path` is the tensor's name).
    files: the safetensors files and what each holds.
    config: the base's config.json (checked), or None.
    config_values: the config.json to write instead of copying `config`
      (a multimodal config's text model, fields the weights imply), or None.
    copied: the other files to copy from `hf_config` (tokenizer, generation).
    memory_budget: bytes the streaming may hold.
    force: replace an existing export folder.
    notes: what a person should know.
    merge: the LoRA merge, if any.
    naming: the family's naming of this kind of source (Tunix's model
      classes, or MaxText's models).
  """

  source: reader.CanonicalCheckpoint
  out_dir: epath.Path
  family: huggingface.Family
  outputs: tuple[Output, ...]
  files: tuple[writer.Shard, ...]
  config: epath.Path | None
  config_values: Mapping[str, Any] | None
  copied: tuple[epath.Path, ...]
  memory_budget: int
  force: bool
  notes: tuple[str, ...] = ()
  merge: merge_lib.MergePlan | None = None
  naming: huggingface.Naming | None = None

  @property
  def architecture(self) -> str:
    """The `transformers` class the tensor names are (config.json's `architectures`)."""
    if self.naming is None:
      return self.family.architecture
    return self.family.target_of(self.naming)[0]

  @property
  def total_bytes(self) -> int:
    """Bytes of the tensors written."""
    return sum(o.nbytes for o in self.outputs)

  @property
  def batch_bytes(self) -> int:
    return writer.batch_bytes(self.memory_budget)


@dataclasses.dataclass(frozen=True)
class ExportResult:
  """What an export wrote."""

  out_dir: epath.Path
  files: tuple[str, ...]
  tensors: int
  total_size: int
  seconds: float
  replaced: bool


def _dtype(dtype: Any) -> np.dtype | None:
  if dtype is None:
    return None
  dtype = np.dtype(dtype) if not isinstance(dtype, np.dtype) else dtype
  if dtype.name not in ('bfloat16', 'float32', 'float16'):
    raise errors.InvalidOptionError(
        f'`dtype` {dtype.name}: expected bfloat16, float16 or float32 (the floating'
        ' dtypes Hugging Face loaders take).'
    )
  return dtype


def plan_export(
    src: epath.PathLike,
    out_dir: epath.PathLike,
    *,
    model: str,
    step: int | None = None,
    dtype: Any = None,
    merge_lora: bool = False,
    lora_alpha: float | None = None,
    lora_scale: float | None = None,
    base: epath.PathLike | None = None,
    max_shard_size: int | float | str = DEFAULT_MAX_SHARD_SIZE,
    hf_config: epath.PathLike | None = None,
    memory_budget: int | float | str = reader.DEFAULT_MEMORY_BUDGET,
    force: bool = False,
    param_scan_axis: int = stacks.DEFAULT_AXIS,
) -> ExportPlan:
  """Plans an export from metadata only; nothing is read or written.

  Args:
    src: the Tunix run (a root: its latest committed step, or `step`; a step;
      a model item).
    out_dir: the folder to create.
    model: the Hugging Face family (`huggingface.choices()`: qwen3, llama3, gemma3, qwen2,
      qwen3_moe, gemma, gemma2, gemma4, or an alias: llama3.1, llama2), for Tunix's own
      model classes or MaxText's models (a Tunix run of one, or MaxText's own step).
    step: the step under a root.
    dtype: cast floating weights to this dtype (bfloat16, float16, float32);
      None: as stored.
    merge_lora: export the LoRA adapters merged into the weights (no adapter
      tensors); an adapters-only save also needs `base`.
    lora_alpha, lora_scale, base: the merge's (see `restore_merged_lora`).
    max_shard_size: bytes per file: an int, or a size as `transformers` writes it
      ('5GB' is 5*10**9 bytes, '2GiB' 2*2**30; `sizes.parse_size`).
    hf_config: the base model's Hugging Face folder: its config.json (checked
      against the weights), generation_config.json and tokenizer files are
      copied; its weights never.
    memory_budget: bytes the streaming may hold at once (a size, as above).
    force: replace an existing export folder at `out_dir`.
    param_scan_axis: a scanned MaxText model's layer axis (MaxText's
      `param_scan_axis`); the source kind and layer form come from the
      weights' names.

  Returns:
    An `ExportPlan`.

  Raises:
    UnsupportedLayoutError: an unknown family; weights that do not fit it; a
      config.json that disagrees with them.
    LoraOnlyCheckpointError: an adapters-only save without `merge_lora`.
    InvalidDestinationError: `out_dir` overlaps a source's run, or is (or
      holds) the `hf_config` folder; or cannot be reached.
    LoraError, DestinationExistsError, TunixCheckpointError subclasses: see
      their docstrings.
  """
  family = huggingface.get(model)
  dtype = _dtype(dtype)
  max_shard_size = sizes.parse_size(max_shard_size, 'max_shard_size')
  memory_budget = sizes.parse_size(memory_budget, 'memory_budget')
  merging = merge_lib.Options.given(merge_lora, lora_alpha, lora_scale, base)
  source = reader.open_weights(src, step)
  merged = merging.plan(source) if merging else None
  out_dir = fileio.as_path(out_dir)
  if hf_config is not None:  # First: the more specific refusal.
    commit.check_not_over(out_dir, fileio.as_path(hf_config), 'the `hf_config` folder')
  commit.check_destination(
      [c.step_dir for c in merge_lib.checkpoints_read(source, merged)], out_dir, force, EXPORT)
  if merged is None:
    _refuse_adapters(source)
  weights = layouts.weights(layouts.Request(source, params_only=True, dtype=dtype, merge=merged))
  where = str(source.step_dir)
  weights, left_out = _model_weights(weights)
  naming = family.naming(weights, where)
  # MaxText's stacked layers taken apart first, then the family's names.
  per_layer = stacks.unstack({p: o.shape for p, o in weights.items()}, naming.stacks,
                             param_scan_axis, where=where)
  base_config = _base_config(hf_config)
  per_layer, vocab_notes = huggingface.cut_vocab(
      naming, per_layer, _config_vocab(base_config), f'{hf_config}/config.json')
  shapes = {p: m.shape for p, m in per_layer.items()}
  try:
    mapped = patterns.map_paths(shapes, naming.rules, where=where)
  except errors.UnsupportedLayoutError as e:
    raise errors.UnsupportedLayoutError(
        f"{e}\nThe weights have {family.name}'s names but not its shapes. Pick the family"
        f' the model is (`model`: {", ".join(huggingface.names())}).'
    ) from e
  huggingface.fits(family, shapes, mapped.unmatched, where)
  staged = {o.path: o for o in relay(weights, per_layer)}
  if merged is not None:
    staged.update(_merged_per_layer(merged, weights, per_layer, naming, param_scan_axis))
  # A stacked weight's layers (and a fused weight's parts) are read one by one,
  # not the stack whole for each batch: memory within the budget and one layer.
  outputs = tuple(writer.in_write_order(
      read_sliced(_read_as_stored(o)) for o in relay(staged, mapped.outputs)))
  config, checked, copied, notes = _config_files(family, hf_config, base_config, shapes)
  if checked is not None:
    before = len(checked.notes)
    checked = _with_dtype(checked, {o.dtype.name for o in outputs if o.dtype is not None})
    notes += checked.notes[before:]
  notes = [*source.detection.notes, *rng_note(source), *left_out, *vocab_notes, *notes,
           f'weights: {huggingface.describe_source({p: o.shape for p, o in weights.items()})}',
           *_leftover_notes(out_dir)]
  if merged is not None:
    notes.append(f'merging LoRA adapters into {len(merged.merges)} of {len(merged.weights)}'
                 ' weights')
  notes.extend(filter(None, [
      writer.budget_note(memory_budget, max(o.nbytes for o in outputs), 'tensor')]))
  return ExportPlan(
      source=source, out_dir=out_dir, family=family, outputs=outputs,
      files=tuple(writer.shards(outputs, max_shard_size)), config=config,
      config_values=None if checked is None or not checked.notes else checked.values,
      copied=copied, memory_budget=memory_budget, force=force, notes=tuple(notes),
      merge=merged, naming=naming,
  )


def _leftover_notes(out_dir: epath.Path) -> list[str]:
  return [f'{p} is left from an interrupted export to {out_dir} (never a finished one);'
          ' remove it when no export is running' for p in commit.leftovers(out_dir)]


def _model_weights(weights: dict) -> tuple[dict, list[str]]:
  """The weights without AQT's quantization state (no tensor of the model), and a note."""
  aqt = [p for p in weights if conventions.is_quantization_state(p)]
  if not aqt:
    return weights, []
  kept = {p: o for p, o in weights.items() if p not in set(aqt)}
  return kept, [f'left out {len(aqt)} AQT quantization leaves (e.g. {fmt(aqt[0])}): not'
                ' weights of the model']


def _merged_per_layer(merged, weights, per_layer, naming, axis: int) -> dict:
  """A scanned layer's LoRA merge, one layer at a time.

  Relaid as any weight, a merged stacked weight would be merged whole for
  each of its layers; here each layer is taken from the weight and from its
  adapters (stacked on the same axes: `lora.Contraction.stacked`), then
  merged. Adapters named otherwise than qwix's `<w>_lora_a` keep the whole merge.
  """
  adapters = {}
  for merge in merged.merges.values():
    adapters[merge.adapter.a] = merge.a.shape
    adapters[merge.adapter.b] = merge.b.shape
  layers = stacks.unstack(adapters, naming.stacks, axis)
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
    whole = weights[source]
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
  values = values.get('text_config', values) if isinstance(values, dict) else {}
  vocab = values.get('vocab_size') if isinstance(values, dict) else None
  return vocab if isinstance(vocab, int) and not isinstance(vocab, bool) else None


def _refuse_adapters(source: reader.CanonicalCheckpoint) -> None:
  found = [path for _, path in reader.weights(source)]
  adapters = [fmt(p) for p in found if lora.is_adapter(p)]
  if not adapters:
    return
  what = 'only LoRA adapters' if len(adapters) == len(found) else 'LoRA adapters'
  base = ' and `base` (the checkpoint the run started from)' if len(adapters) == len(found) else ''
  error = errors.LoraOnlyCheckpointError if len(adapters) == len(found) else errors.LoraError
  raise error(
      f'{source.step_dir}: expected a model\'s weights, found {what} ({len(adapters)} leaves,'
      f' e.g. {adapters[0]}): a Hugging Face model has no adapter tensors. Export the'
      f' weights with the adapters merged: `merge_lora=True`, `lora_alpha`{base}.'
  )


_CONFIG_REMEDY = ('Fix the file, or pass as `hf_config` the folder of the model this run was'
                  ' trained from.')


def _base_config(hf_config: epath.PathLike | None) -> object:
  """The `hf_config` folder's config.json, parsed (read once per export); None without one.

  Raises:
    InvalidOptionError: not a folder holding a config.json file, or one that does not parse.
  """
  if hf_config is None:
    return None
  folder = fileio.as_path(hf_config)
  config = folder / 'config.json'
  found = fileio.what_is_at(config) if folder.is_dir() else fileio.what_is_at(folder)
  if found != 'a file':
    raise errors.InvalidOptionError(
        f'{config if folder.is_dir() else folder}: `hf_config` must be a Hugging Face model'
        f' folder holding config.json (a file), found {found}.'
    )
  return fileio.read_json(config, 'a Hugging Face config.json', _CONFIG_REMEDY)


def _config_files(
    family: huggingface.Family, hf_config: epath.PathLike | None, values: object, shapes
) -> tuple[epath.Path | None, huggingface.Config | None, tuple[epath.Path, ...], list[str]]:
  """The base model's config (`values`, as `_base_config` read it; checked against the
  weights, as it is to be written) and the other files to copy, every one a regular file
  (decided before any read)."""
  if hf_config is None:
    return None, None, (), [
        'no config.json written: add the base model\'s (--hf-config DIR copies it and its'
        ' tokenizer) before loading the folder with transformers or vLLM'
    ]
  folder = fileio.as_path(hf_config)
  config = folder / 'config.json'
  checked = huggingface.check_config(family, values, shapes, str(config))
  copied, notes = [], list(checked.notes)
  for name in (*CONFIG_FILES[1:], *TOKENIZER_FILES):
    path = folder / name
    usable, note = _copyable(path)
    if usable:
      copied.append(path)
    elif note:
      notes.append(note)
  return config, checked, tuple(copied), notes


# config.json's names for the weights' dtype (`transformers` 4: torch_dtype; 5: dtype).
_DTYPE_FIELDS = ('torch_dtype', 'dtype')


def _with_dtype(checked: huggingface.Config, dtypes: set[str]) -> huggingface.Config:
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
  return huggingface.Config(values, (*checked.notes, note))


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


def run_export(plan: ExportPlan, progress: reader.Progress | None = None) -> ExportResult:
  """Executes a plan: streams every tensor into its file, then commits the folder.

  Raises:
    DestinationExistsError: OUT_DIR appeared meanwhile and not `force`.
    InvalidDestinationError: it cannot be written, or overlaps a source's
      run (checked again before the first write).
    InvalidOptionError: a value leaves the range of `dtype`
      (`writer.check_range`). In every case (and on KeyboardInterrupt) what
      was written is removed and an existing folder is untouched (see
      `commit.staged`).
  """
  progress = progress or reader.NullProgress()
  start = time.monotonic()
  files, outputs = _share(plan)
  sources = [c.step_dir for c in merge_lib.checkpoints_read(plan.source, plan.merge)]
  # Across hosts (see `distributed`): each process writes its share of the
  # files, process 0 the index and config, and the folder is committed once.
  with writer.streamed(plan.out_dir, plan.force, EXPORT, plan.total_bytes, sources, progress,
                       f'exporting to {plan.out_dir}', sum(o.nbytes for o in outputs)) as staging:
    sink = writer.SafetensorsSink(staging.work, files, plan.files,
                                  write_index=distributed.is_primary())
    record = writer.write(outputs, sink, plan.batch_bytes, progress, on_host=True)
    for path in (plan.config, *plan.copied) if distributed.is_primary() else ():
      if path is not None:
        (staging.work / path.name).write_bytes(_read_copied(path))
    if plan.config_values is not None and distributed.is_primary():
      (staging.work / 'config.json').write_text(
          json.dumps(plan.config_values, indent=2, sort_keys=False) + '\n')
  replaced = staging.replaced
  return ExportResult(plan.out_dir, tuple(record['files']), len(plan.outputs),
                      record['total_size'], time.monotonic() - start, replaced)


def _share(plan: ExportPlan) -> tuple[list[writer.Shard], list[Output]]:
  """The files this process writes (all of them on one process), and their tensors."""
  files = [plan.files[i] for i in distributed.mine([f.nbytes for f in plan.files])]
  names = {name for f in files for name, _, _ in f.tensors}
  return files, [o for o in plan.outputs if o.path[0] in names]


def _read_copied(path: epath.Path) -> bytes:
  """A base model's file, read to be copied; a failure names it (not the destination)."""
  try:
    return path.read_bytes()
  except OSError as e:
    raise errors.InvalidOptionError(
        f'{path}: cannot read this `hf_config` file ({e}); it was readable when the export'
        ' was planned. Fix it and run again.'
    ) from e


def export_to_hf(src: epath.PathLike, out_dir: epath.PathLike, **kwargs: Any) -> ExportResult:
  """Exports a Tunix run's weights as a Hugging Face safetensors folder.

  Example::

    orbax_tunix.export_to_hf('/ckpts/run', '/models/qwen3-sft', model='qwen3',
                             dtype='bfloat16', hf_config='/models/Qwen3-0.6B')

  Args:
    src, out_dir: as `plan_export`.
    **kwargs: `plan_export`'s keyword arguments (`model` is required).

  Returns:
    An `ExportResult` (the files written, their bytes).

  Raises:
    As `plan_export` and `run_export`; every check is made before any read.
  """
  return run_export(plan_export(src, out_dir, **kwargs))


def describe(plan: ExportPlan) -> dict[str, Any]:
  """The plan for people and `--json`: files, tensors per file, bytes."""
  return {
      'source': os.fspath(plan.source.step_dir),
      'out_dir': os.fspath(plan.out_dir),
      'model': plan.family.name,
      'architecture': plan.architecture,
      'files': {f.name: len(f.tensors) for f in plan.files},
      'total_size': sum(f.nbytes for f in plan.files),
      'config': None if plan.config is None else os.fspath(plan.config),
      'notes': list(plan.notes),
  }


"""The one plan and run of every output: a layout applied to a source, streamed into its sink.

`plan` decides everything from metadata before any array is read: the source
(opened once, as far as the layout needs it: `reader.open_source`), the LoRA merge, the destination checks
(`commit.check_destination`, by the sink's kind), the layout's outputs
(`layouts`: an Orbax step, or a Hugging Face folder per family), the files a
folder is sharded into, and the notes. `run` streams the outputs through the
one writer (`writer.write`) into the sink the layout names, a batch within the
memory budget at a time, inside one staged commit (`writer.streamed`): nothing
is seen at the destination until all of it is written. `convert` and `export`
are this pipeline with a step layout and a folder layout.

Sinks (`SINKS`, by `Layout.sink`, a `layouts.Destination`):

  STEP     every item a plain `PyTreeCheckpointHandler` item (JSON items copied),
           `_CHECKPOINT_METADATA` naming that handler, and the step's custom
           metadata recording the source and a CRC-32 of every array
  FOLDER   safetensors files as `transformers` shards them, their index, and the
           layout's other files (config.json, tokenizer)
  ADAPTER  one adapter_model.safetensors (no index) and adapter_config.json

Across hosts (`distributed`): a step is written by every process (its shards of
every item; process 0 the JSON items and the metadata), a folder's files are
dealt out among the processes (process 0 the index and the other files), and
either is committed once.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from orbax_tunix import errors, layouts, sizes
from orbax_tunix.keypaths import fmt
from orbax_tunix.layouts import huggingface as hf_layouts
from orbax_tunix.mapping import lora, peft
from orbax_tunix.mapping import merge as merge_lib
from orbax_tunix.mapping.outputs import ItemOutput, Output
from orbax_tunix.reading import hyperparams, memory, reader
from orbax_tunix.store import _orbax
from orbax_tunix.store._orbax import CHECKPOINT_METADATA
from orbax_tunix.store.fileio import as_path
from orbax_tunix.tools import agreement
from orbax_tunix.version import __version__
from orbax_tunix.writing import checksums, commit, distributed, writer

PYTREE_TYPESTR = ocp.PyTreeCheckpointHandler.typestr()


@dataclasses.dataclass(frozen=True)
class Plan:
  """Everything a conversion or an export does, decided from metadata before any write.

  Attributes:
    source: the source step, canonical.
    dst: the destination (a step directory, an export folder).
    layout: the layout's name (`layouts.names()`).
    params_only: weights only (no optimizer state, no RNG state).
    dtype: floating leaves are cast to this dtype (None: kept).
    memory_budget: bytes of memory the streaming may use.
    force: replace an existing destination of the sink's kind.
    items: the items to write (a folder: one, its tensors).
    notes: things a person should know.
    merge: the LoRA merge whose weights are written (None: leaves are copied).
    custom_metadata: what the layout adds to a step's custom metadata.
    files: a folder's safetensors files and what each holds (a step: none).
    other_files: a folder's other files: (name, a path to copy or a text).
    summary: what the layout tells of its output (a family's model, architecture).
    options: the options the caller gave, by its own names (`lora_alpha`, `max_shard_size`;
      those not given left out), as given: a job's processes compare them by value
      (`agreement`), so a difference names the option, not only what it makes.
  """

  source: reader.CanonicalCheckpoint
  dst: epath.Path
  layout: str
  params_only: bool
  dtype: np.dtype | None
  memory_budget: int
  force: bool
  items: tuple[ItemOutput, ...]
  notes: tuple[str, ...] = ()
  merge: merge_lib.MergePlan | None = None
  custom_metadata: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  files: tuple[writer.Shard, ...] = ()
  other_files: tuple[tuple[str, epath.Path | str], ...] = ()
  summary: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  options: Mapping[str, Any] = dataclasses.field(default_factory=dict)

  @property
  def outputs(self) -> tuple[Output, ...]:
    """Every output, item after item (a folder's: its tensors in write order)."""
    return tuple(o for item in self.items for o in item.outputs)

  @property
  def bytes_written(self) -> int:
    return sum(o.nbytes for o in self.outputs)

  @property
  def batch_bytes(self) -> int:
    return writer.batch_bytes(self.memory_budget)

  @property
  def reads_ahead(self) -> bool:
    return writer.reads_ahead(self.memory_budget)

  @property
  def sources(self) -> list[epath.Path]:
    """The step directories read (the source, and a merge's base)."""
    return [c.step_dir for c in merge_lib.checkpoints_read(self.source, self.merge)]

  @property
  def architecture(self) -> str | None:
    return self.summary.get('architecture')


@dataclasses.dataclass(frozen=True)
class Result:
  """What a run wrote.

  Attributes:
    dst: the destination written.
    items: item name -> number of leaves (a folder's: its tensors) written.
    files: the files a folder holds (a step: none).
    bytes_read: array bytes read from the source.
    total_size: bytes of the arrays written.
    seconds: wall time of the streaming and commit.
    replaced: an existing destination was replaced (`force`).
  """

  dst: epath.Path
  items: dict[str, int]
  files: tuple[str, ...]
  bytes_read: int
  total_size: int
  seconds: float
  replaced: bool

  @property
  def num_leaves(self) -> int:
    return sum(self.items.values())

  @property
  def tensors(self) -> int:
    return self.num_leaves

  @property
  def out_dir(self) -> epath.Path:
    return self.dst


# --- planning -----------------------------------------------------------------


def _agreed(make: Callable[..., Plan]) -> Callable[..., Plan]:
  """`make`, and in a multi-process job every process's plan compared with the others'
  (`agreement.fingerprint`) before it is returned; a process that fails to plan tells the
  others, which stop too."""

  @functools.wraps(make)
  def agreed(*args: Any, **kwargs: Any) -> Plan:
    try:
      made = make(*args, **kwargs)
      # One process alone has nothing to compare (nor reads anything for it).
      fields = agreement.fingerprint(made) if distributed.active() else None
    except BaseException as e:  # noqa: BLE001 - told to every process, then raised.
      distributed.agree_on('plan', None, e)
      raise
    distributed.agree_on('plan', fields, given=agreement.asked(made))
    return made

  return agreed


@_agreed
def plan(
    src: epath.PathLike,
    dst: epath.PathLike,
    *,
    layout: str,
    step: int | None = None,
    params_only: bool = False,
    dtype: np.dtype | None = None,
    memory_budget: int | float | str = memory.DEFAULT_MEMORY_BUDGET,
    force: bool = False,
    items: Iterable[str] | None = None,
    merge_options: merge_lib.Options | None = None,
    **options: Any,
) -> Plan:
  """Plans a layout's output from metadata only; nothing is read or written.

  Args:
    src, step, dtype, memory_budget, items: as `convert.plan_convert`.
    dst: the destination to create (a step directory; a folder).
    layout: a registered layout's name (`layouts.names()`).
    params_only: write the weights only (a weights-only layout implies it).
    force: replace an existing destination (only one of the sink's kind).
    merge_options: the LoRA merge's options (`merge.Options.given`, from the
      caller's own keywords); None: no merge.
    **options: the layout's options (`layouts.options()`: `scan_layers`,
      `param_scan_axis`, `hf_config`, `max_shard_size`); another layout's
      must be left unset.

  Returns:
    A `Plan`.

  Raises:
    TypeError: an option no layout takes.
    InvalidOptionError, InvalidDestinationError, DestinationExistsError,
    LoraError, UnsupportedLayoutError and the other `TunixCheckpointError`
    subclasses: see `convert.plan_convert` and `export.plan_export`; every
    one before any array is read.
    DistributedError: in a multi-process job (where every process calls it), the
      processes were given different work (source, step, options), or another
      process failed to plan: on every process, before anything is written.
  """
  chosen = layouts.get(layout)
  known = layouts.options()
  unknown = sorted(set(options) - set(known))
  if unknown:
    raise TypeError(f'plan() got unexpected keyword arguments: {", ".join(unknown)}')
  layouts.check_options(chosen, options)
  given = {name: known[name].coerce(value) for name, value in options.items()
           if value != known[name].unset}
  params_only = params_only or merge_options is not None or chosen.weights_only
  memory_budget = sizes.parse_size(memory_budget, 'memory_budget')
  items = None if items is None else tuple(items)  # Read twice: the source, and `options`.
  source = reader.open_source(src, step, items, weights_only=params_only)
  dst = as_path(dst)
  merged = merge_options.plan(source) if merge_options is not None else None
  sink = SINKS[chosen.sink]
  for folder, what in [(given[o], f'the `{o}` folder') for o in sink.read_folders if o in given]:
    commit.check_not_over(dst, folder, what)  # First: the more specific refusal.
  commit.check_destination(
      [c.step_dir for c in merge_lib.checkpoints_read(source, merged)], dst, force, sink.kind)
  if merged is None and not chosen.adapters:
    _refuse_adapters_only(source, chosen.name)
  laid = chosen.lay_out(layouts.Request(
      source=source, params_only=params_only, dtype=dtype, merge=merged, **given))
  written = [item for item in laid.items if item.outputs or item.json]
  notes = [*source.detection.notes, *laid.notes]
  if merged is not None and merged.base is not source:
    notes += [f'base: {note}' for note in merged.base.detection.notes]
    notes += [f'base: holds the adapters of {m.get("adapters")} merged already (its metadata'
              ' records it); these adapters are merged on top'
              for m in merge_lib.recorded_merges(merged.base.detection.source.custom_metadata)]
  notes += [f'skipped item {item.name!r}: nothing to write' for item in laid.items
            if item not in written]
  if merged is not None:
    notes.append(f'merging LoRA adapters into {len(merged.merges)} of'
                 f' {len(merged.weights)} weights')
    notes += merged.notes
  notes += _dequantized_notes(written, merged)
  if not written:
    raise errors.UnsupportedLayoutError(
        f'{source.step_dir}: expected at least one PyTree item to convert,'
        f' found none ({"; ".join(notes) or "the step has no items"}).'
    )
  for item in written:
    item.check()
  _check_representable(written)
  written, files = sink.shard(written, given)
  notes += _leftover_notes(dst, sink)
  largest = max((o.nbytes for item in written for o in item.outputs), default=0)
  notes.extend(filter(None, [writer.budget_note(memory_budget, largest, sink.unit)]))
  return Plan(
      source=source, dst=dst, layout=chosen.name, params_only=params_only, dtype=dtype,
      memory_budget=memory_budget, force=force, items=tuple(written), notes=tuple(notes),
      merge=merged, custom_metadata=dict(laid.custom_metadata), files=tuple(files),
      other_files=laid.files, summary=dict(laid.summary),
      options=_asked(given, merge_options, items),
  )


def _dequantized_notes(written: Iterable[ItemOutput], merged: merge_lib.MergePlan | None
                       ) -> list[str]:
  """A note for the weights saved quantized (a QLoRA run's base) that are written
  dequantized without a merge saying so: how they were stored, and that they are float now."""
  said = set() if merged is None else {m.base.leaf.name for m in merged.merges.values()}
  found: dict[str, list[reader.LeafInfo]] = {}
  for item in written:
    for o in item.outputs:
      for i in o.inputs:
        if i.leaf.quantized is not None and i.leaf.name not in said:
          found.setdefault(i.leaf.quantized.describe(), []).append(i.leaf)
  return [f'{len({leaf.path for leaf in leaves})} weights saved quantized ({how}, e.g.'
          f' {fmt(leaves[0].path)}; a QLoRA run\'s frozen base) are written dequantized (qwix\'s'
          ' dequantize, in float): the weights the quantized base stands for'
          for how, leaves in sorted(found.items())]


def _asked(given: Mapping[str, Any], merge_options: merge_lib.Options | None,
           items: Iterable[str] | None) -> dict[str, Any]:
  """The options a caller gave, by its own names: the layout's (a merge's options among them:
  by their own names), the merge's, and the items chosen."""
  asked: dict[str, Any] = {}
  for name, value in given.items():
    asked.update(value.asked() if isinstance(value, merge_lib.Options) else {name: value})
  asked.update(merge_options.asked() if merge_options is not None else {})
  if items is not None:
    asked['items'] = sorted(items)
  return asked


def _refuse_adapters_only(source: reader.CanonicalCheckpoint, layout: str) -> None:
  """A LoRA run saved without its base weights is no model as it is (for a layout that writes
  a model: one that takes adapters as they are is not asked).

  Raises:
    LoraOnlyCheckpointError: saying how to merge instead.
  """
  try:
    found = reader.weights(source)
  except (errors.UnsupportedLayoutError, errors.MissingItemError):
    return  # No model weights (an optimizer item alone, say): nothing to refuse.
  if lora.adapters_only(path for _, path in found):
    adapters = [fmt(path) for _, path in found]
    raise errors.LoraOnlyCheckpointError(
        f'{source.step_dir}: expected model weights, found LoRA adapters only'
        f' ({len(adapters)} leaves, e.g. {adapters[0]}): the run saved no base weights'
        f" (Tunix's save_only_lora_params). A {layout} output is a model, and they alone are"
        ' none. Merge them into the base weights the run started from: `merge_lora=True`,'
        ' `lora_alpha` (the run\'s LoRA alpha) and `base` (the base checkpoint); or convert'
        " them as they are (`layout='canonical'`), or export them as a PEFT adapter"
        ' (`export_peft_adapter`).'
    )


def _needs_x64(dtype: np.dtype | None) -> bool:
  """Whether JAX holds this dtype only in its 64-bit mode (else it narrows it)."""
  if dtype is None:
    return False
  return (dtype.kind in 'fiu' and dtype.itemsize == 8) or (dtype.kind == 'c' and dtype.itemsize == 16)


def _check_representable(items: Sequence[ItemOutput]) -> None:
  """Refuses outputs JAX would silently narrow (float64 to float32, ...) with x64 off.

  Raises:
    InvalidOptionError: naming the leaves and the fix.
  """
  if jax.config.jax_enable_x64:
    return
  wide = [
      f'{item.name}/{fmt(o.path)} ({o.dtype})'
      for item in items for o in item.outputs if _needs_x64(o.dtype)
  ]
  if wide:
    raise errors.InvalidOptionError(
        f'{len(wide)} leaves would be written as 64-bit arrays, which JAX narrows'
        f' to 32 bits unless its 64-bit mode is on:\n{errors.list_paths(wide)}\n'
        "Call jax.config.update('jax_enable_x64', True) before converting (the"
        ' orbax-tunix command does), or pass a 32-bit `dtype`.'
    )


def _leftover_notes(dst: epath.Path, sink: SinkKind) -> list[str]:
  """What an interrupted run to `dst` left beside it (process 0 tells: the others would
  see its own staging)."""
  if not distributed.is_primary():
    return []
  return [f'{p} is left from an interrupted {sink.run} to {dst} (it was never committed'
          f' there); remove it when no {sink.run} is running' for p in commit.leftovers(dst)]


# --- running ------------------------------------------------------------------


def run(plan: Plan, progress: reader.Progress | None = None) -> Result:
  """Executes a plan: streams every output into its sink, then commits it once.

  Args:
    plan: from `plan`.
    progress: told the bytes read after each batch.

  Returns:
    A `Result`.

  Raises:
    DestinationExistsError: the destination appeared meanwhile and not `force`.
    InvalidDestinationError: it cannot be written (permissions, space), or
      overlaps a source's run (checked again before the first write).
    InvalidOptionError: a value leaves the range of `dtype`
      (`writer.check_range`). In every case (and on KeyboardInterrupt) what
      was written is removed and an existing destination is untouched (see
      `commit.staged`).
  """
  progress = progress or reader.NullProgress()
  start = time.monotonic()
  sink = SINKS[layouts.get(plan.layout).sink]
  mine = sink.share(plan)
  with writer.streamed(plan.dst, plan.force, sink.kind, plan.bytes_written, plan.sources,
                       progress, f'{sink.doing} {plan.dst}', writer.bytes_read(mine),
                       sink.entries(plan)) as staging:
    record = sink.write(plan, mine, staging.work, progress)
  return Result(
      dst=plan.dst, items={item.name: len(item.outputs) for item in plan.items},
      files=tuple(record.get('files', ())), bytes_read=writer.bytes_read(plan.outputs),
      total_size=record.get('total_size', plan.bytes_written),
      seconds=time.monotonic() - start, replaced=staging.replaced,
  )


# --- the step sink ------------------------------------------------------------


def _write_step(plan: Plan, mine: Sequence[Output], work: epath.Path,
                progress: reader.Progress) -> dict[str, Any]:
  """Every item into the step at `work` (each process its shards), then its metadata."""
  del mine  # Every process writes its shards of every output.
  init_ns = time.time_ns()
  sums: dict[str, dict[str, str]] = {}
  for item in plan.items:
    if item.json:
      if distributed.is_primary():
        ckpt, name = item.json
        (work / item.name).mkdir(parents=True, exist_ok=True)
        ocp.JsonCheckpointHandler().save(
            work / item.name, args=ocp.args.JsonSave(reader.read_json_item(ckpt, name)))
      continue
    sink = writer.OrbaxItemSink(item, work / item.name)
    sums[item.name] = writer.write(item.outputs, sink, plan.batch_bytes, progress,
                                  ahead=plan.reads_ahead)['checksums']
  if distributed.is_primary():
    _write_step_metadata(work, plan, init_ns, sums)
  return {}


def _step_entries(plan: Plan) -> list[str]:
  """What `_write_step` makes at the top of a step: its items and its metadata."""
  return [*(item.name for item in plan.items), CHECKPOINT_METADATA]


def _provenance(plan: Plan, sums: dict[str, dict[str, str]]) -> dict[str, Any]:
  """What a step's custom metadata records: where it came from, and its checksums."""
  detection = plan.source.detection
  record: dict[str, Any] = {
      'source': os.fspath(plan.source.step_dir),
      'source_step': detection.step,
      'source_kind': detection.kind,
      'layout': plan.layout,
      'params_only': plan.params_only,
      'dtype': None if plan.dtype is None else plan.dtype.name,
      'version': __version__,
      checksums.KEY: sums,
  }
  # Every merge the weights hold (`merge.recorded_merges`): the base's (or, copied, the
  # source's), then this one: a later merge of the same adapters into them is refused.
  held = plan.source if plan.merge is None else plan.merge.base
  merges = merge_lib.recorded_merges(held.detection.source.custom_metadata)
  if plan.merge is not None:
    record[merge_lib.MERGE] = merge_lib.record(plan.merge)
    merges = [*merges, record[merge_lib.MERGE]]
  if merges:
    record[merge_lib.MERGES] = merges
  if detection.is_tunix:
    leaves = hyperparams.side_leaves(detection)
    side = hyperparams.read_side_leaves(detection, leaves)
    found = hyperparams.hyperparameters_of(detection, side, leaves)
    if found:
      record['hyperparameters'] = {
          shell: {name: reader.json_scalar(v) for name, v in values.items()}
          for shell, values in found.items()
      }
    if side and not plan.params_only:
      # Every leaf the canonical view leaves out (counts too), as `diff` compares them.
      record[hyperparams.RECORD_KEY] = {label: checksums.as_record(v) for label, v in side.items()}
  return record


def _write_step_metadata(work: epath.Path, plan: Plan, init_ns: int,
                         sums: dict[str, dict[str, str]]) -> None:
  custom = {**plan.source.detection.source.custom_metadata, **plan.custom_metadata,
            checksums.RECORD_KEY: _provenance(plan, sums)}
  meta = ocp.metadata.StepMetadata(
      item_handlers={
          item.name: reader.JSON_TYPESTR if item.json else PYTREE_TYPESTR for item in plan.items
      },
      init_timestamp_nsecs=init_ns,
      commit_timestamp_nsecs=time.time_ns(),
      custom_metadata=custom,
  )
  store = ocp.metadata.metadata_store(enable_write=True, blocking_write=True)
  store.write(file_path=work / CHECKPOINT_METADATA, metadata=_orbax.serialize_step_metadata(meta))


# --- the folder sink ----------------------------------------------------------

# An exported folder (what `force` may replace): it holds a model's weights, as
# every export does (a config.json alone is no sign: many projects have one),
# and only the files its record names (a `.git`, notes: never deleted).
EXPORT = commit.Kind(
    'a Hugging Face export', (writer.SINGLE_FILE, writer.INDEX_FILE),
    record=writer.recorded_files, commit_file=None, in_place=False,
)


def _shard_folder(items: Sequence[ItemOutput], given: Mapping[str, Any]
                  ) -> tuple[list[ItemOutput], list[writer.Shard]]:
  """The folder's tensors in write order (those sharing sources together), and the files
  they go to, as `transformers` shards them."""
  (item,) = items
  outputs = tuple(writer.in_write_order(item.outputs))
  size = given.get('max_shard_size', hf_layouts.DEFAULT_MAX_SHARD_SIZE)
  return [dataclasses.replace(item, outputs=outputs)], writer.shards(outputs, size)


def _my_files(plan: Plan) -> list[writer.Shard]:
  """The files this process writes (all of them on one process)."""
  return [plan.files[i] for i in distributed.mine([f.nbytes for f in plan.files])]


def _share_folder(plan: Plan) -> list[Output]:
  """The tensors of the files this process writes."""
  names = {name for f in _my_files(plan) for name, _, _ in f.tensors}
  return [o for o in plan.outputs if o.path[0] in names]


def _folder_files(plan: Plan) -> list[str]:
  """Every file the export writes (its record: what `force` may replace later)."""
  index = [writer.INDEX_FILE] if len(plan.files) > 1 else []
  return sorted({*(f.name for f in plan.files), *index, *(n for n, _ in plan.other_files)})


def _write_folder(plan: Plan, mine: Sequence[Output], work: epath.Path,
                  progress: reader.Progress) -> dict[str, Any]:
  """This process's safetensors files into `work`; process 0 the index and other files."""
  sink = writer.SafetensorsSink(work, _my_files(plan), plan.files,
                                write_index=distributed.is_primary(),
                                metadata={writer.FILES_RECORD: json.dumps(_folder_files(plan))})
  record = writer.write(mine, sink, plan.batch_bytes, progress, on_host=True,
                        ahead=plan.reads_ahead)
  for name, content in plan.other_files if distributed.is_primary() else ():
    if isinstance(content, str):
      (work / name).write_text(content)
    else:
      _copy(content, work / name)
  return record


# Bytes per read of a copied file: a file is never held whole (a tokenizer may be large).
_COPY_CHUNK = 1 << 20


def _copy(path: epath.Path, dest: epath.Path) -> None:
  """A base model's file copied a chunk at a time; a failure to read it names it (not the
  destination, whose failures are the destination's: `commit.staged`)."""
  def unreadable(e: OSError) -> errors.InvalidOptionError:
    return errors.InvalidOptionError(
        f'{path}: cannot read this `hf_config` file ({e}); it was readable when the export'
        ' was planned. Fix it and run again.')

  try:
    src = path.open('rb')
  except OSError as e:
    raise unreadable(e) from e
  with src, dest.open('wb') as out:
    while True:
      try:
        chunk = src.read(_COPY_CHUNK)
      except OSError as e:
        raise unreadable(e) from e
      if not chunk:
        return
      out.write(chunk)


@dataclasses.dataclass(frozen=True)
class SinkKind:
  """A kind of destination, as data: how it is told, planned, shared and written.

  Attributes:
    kind: what it is, for the destination checks and the commit (`commit.Kind`).
    unit: what one output is, for messages ('array', 'tensor').
    run: what writing one is called ('conversion', 'export').
    doing: the progress line's verb.
    shard: (items, options) -> the items in write order and a folder's files.
    share: plan -> the outputs this process reads (across hosts).
    write: (plan, this process's outputs, the staging directory, progress) ->
      what to record of it (a folder: its files and bytes).
    entries: plan -> every entry `write` makes at the top of the destination (a bucket's
      claim names them: `commit.staged`).
    read_folders: options naming folders that are read (the destination must
      be neither one nor inside one).
  """

  kind: commit.Kind
  unit: str
  run: str
  doing: str
  shard: Callable[[Sequence[ItemOutput], Mapping[str, Any]],
                  tuple[Sequence[ItemOutput], Sequence[writer.Shard]]]
  share: Callable[[Plan], Sequence[Output]]
  write: Callable[[Plan, Sequence[Output], epath.Path, reader.Progress], dict[str, Any]]
  entries: Callable[[Plan], Sequence[str]]
  read_folders: tuple[str, ...] = ()


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


SINKS: dict[layouts.Destination, SinkKind] = {
    layouts.Destination.STEP: SinkKind(
        kind=commit.STEP, unit='array', run='conversion', doing='converting to',
        shard=lambda items, given: (items, ()), share=lambda plan: plan.outputs,
        write=_write_step, entries=_step_entries,
    ),
    layouts.Destination.FOLDER: SinkKind(
        kind=EXPORT, unit='tensor', run='export', doing='exporting to',
        shard=_shard_folder, share=_share_folder, write=_write_folder, entries=_folder_files,
        read_folders=('hf_config',),
    ),
    layouts.Destination.ADAPTER: SinkKind(
        kind=ADAPTER_EXPORT, unit='tensor', run='export', doing='exporting the adapter to',
        shard=_adapter_file, share=_share_folder, write=_write_folder, entries=_folder_files,
    ),
}

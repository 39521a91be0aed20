"""Convert: a checkpoint rewritten as an ordinary Orbax step, streamed and atomic.

What is written (DST is a step directory) is a layout's (`layouts/`):

* `canonical`: one item per source PyTree item, in the canonical view (for
  Tunix: `model_params` without the nnx `value` and adapter `base` levels,
  `optimizer_state` without the inject_hyperparams shell). With
  `params_only`, only `model_params` holding the weights (no RNG state).
* `maxtext`: the step MaxText 0.2.5 itself writes: one item `items` with
  `params/params/<weights>`, and unless `params_only` the optimizer laid out
  as MaxText's adamw chain and `step`; `scan_layers` writes the decoder's
  layers in the other form.

Every item is a plain `PyTreeCheckpointHandler` item and `_CHECKPOINT_METADATA`
names that handler, so plain Orbax (v0 and v1) restores it without this
package. The step's custom metadata keeps the source's and adds `orbax_tunix`:
where it came from, the inject_hyperparams values the canonical view leaves
out (by name, and every such leaf, counts too, as `diff` compares them), and
a CRC-32 of every array.

The layout's outputs are written by the one streaming writer (`writer.py`),
in batches within the memory budget. Committed as Orbax commits
(`commit.Staging`): on a local disk everything is written to
`<DST>.orbax-checkpoint-tmp-<ns>` beside DST and renamed at the end; on a
bucket DST is written in place and `commit_success.txt` comes last. Any
failure or interrupt removes what was written. An existing DST is refused
unless `force`, and then replaced only once the new one is complete.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Iterable, Sequence
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from orbax_tunix import errors, layouts, sizes
from orbax_tunix.keypaths import fmt
from orbax_tunix.mapping import lora
from orbax_tunix.mapping import merge as merge_lib
from orbax_tunix.mapping.outputs import ItemOutput
from orbax_tunix.reading import hyperparams, reader
from orbax_tunix.store import _orbax
from orbax_tunix.store._orbax import CHECKPOINT_METADATA
from orbax_tunix.store.fileio import as_path
from orbax_tunix.version import __version__
from orbax_tunix.writing import checksums, commit, distributed, writer

CANONICAL = 'canonical'
MAXTEXT = 'maxtext'

PYTREE_TYPESTR = ocp.PyTreeCheckpointHandler.typestr()
METADATA_KEY = checksums.RECORD_KEY


@dataclasses.dataclass(frozen=True)
class ConvertPlan:
  """Everything a conversion does, decided from metadata before any write.

  Attributes:
    source: the source step, canonical.
    dst: the step directory to create.
    layout: the layout's name (see `layouts`).
    params_only: weights only (no optimizer state, no RNG state).
    dtype: floating leaves are cast to this dtype (None: kept).
    memory_budget: bytes of memory the streaming may use.
    force: replace an existing DST.
    items: the items to write.
    notes: things a person should know (e.g. items skipped).
    merge: the LoRA merge whose weights are written (None: leaves are copied).
    custom_metadata: what the layout adds to the new step's custom metadata.
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
  custom_metadata: dict[str, Any] = dataclasses.field(default_factory=dict)

  @property
  def total_bytes(self) -> int:
    """Bytes of the source leaves read."""
    read = {i.key: i.nbytes for item in self.items for o in item.outputs for i in o.inputs}
    return sum(read.values())

  @property
  def num_leaves(self) -> int:
    return sum(len(item.outputs) for item in self.items)

  @property
  def batch_bytes(self) -> int:
    return writer.batch_bytes(self.memory_budget)


@dataclasses.dataclass(frozen=True)
class ConvertResult:
  """What a conversion wrote.

  Attributes:
    dst: the step directory written.
    items: item name -> number of leaves written.
    bytes_read: array bytes read from the source.
    seconds: wall time of the streaming and commit.
    replaced: an existing DST was replaced (`force`).
  """

  dst: epath.Path
  items: dict[str, int]
  bytes_read: int
  seconds: float
  replaced: bool

  @property
  def num_leaves(self) -> int:
    return sum(self.items.values())


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


def plan_convert(
    src: epath.PathLike,
    dst: epath.PathLike,
    *,
    step: int | None = None,
    layout: str = CANONICAL,
    params_only: bool = False,
    dtype: np.dtype | None = None,
    memory_budget: int | float | str = reader.DEFAULT_MEMORY_BUDGET,
    force: bool = False,
    items: Iterable[str] | None = None,
    merge_lora: bool = False,
    lora_alpha: float | None = None,
    lora_scale: float | None = None,
    base: epath.PathLike | None = None,
    scan_layers: bool | None = None,
    param_scan_axis: int | None = None,
) -> ConvertPlan:
  """Plans a conversion from metadata only; nothing is written.

  Args:
    src: the source: a root (latest committed step, or `step`), a step or an
      item directory.
    dst: the step directory to create.
    step: the source step (see `reader.resolve`).
    layout: a registered layout's name (`layouts.names()`: canonical, maxtext).
    params_only: write the weights only.
    dtype: cast floating leaves to this dtype.
    memory_budget: bytes the streaming may hold at once (an int, or a size such as
      '512M' or '4GB': `sizes.parse_size`).
    force: replace an existing DST (only if it is a checkpoint step).
    items: the source items to convert (default: every item the step records;
      a step holding items that are neither PyTrees nor JSON needs them named).
    merge_lora: write the weights with the LoRA adapters merged (weights
      only, as `params_only`); see `orbax_tunix.restore_merged_lora`.
    lora_alpha, lora_scale, base: the merge's `alpha`, `scale` and `base`.
    scan_layers: the `maxtext` layout's form of the decoder's layers
      (True: scanned, stacked along `param_scan_axis`; False: one array per
      layer; None: as stored).
    param_scan_axis: MaxText's layer axis of scanned weights, of the side
      that is scanned: the written layers' when `scan_layers=True`, else the
      stored ones' (None: the stored step's own, recorded or told by its
      shapes; 1, MaxText's default, for layers stacked anew).

  Returns:
    A `ConvertPlan`.

  Raises:
    InvalidOptionError: a `memory_budget` that is not a size >= 1; `scan_layers` or
      `param_scan_axis` for a layout that does not take them, or
      `param_scan_axis` without `scan_layers`.
    InvalidDestinationError: DST overlaps the source's run (symlinks
      resolved; see `commit.overlap`) or is named like an unfinished step.
    LoraError: `lora_alpha`, `lora_scale` or `base` without `merge_lora`,
      or a scaling that is not a finite number (before anything is read).
    DestinationExistsError: DST exists and not `force`.
    TunixCheckpointError subclasses: the source is not readable, or cannot be
      laid out as asked.
  """
  chosen = layouts.get(layout)
  layouts.check_options(chosen, {'scan_layers': scan_layers, 'param_scan_axis': param_scan_axis})
  params_only = params_only or merge_lora
  memory_budget = sizes.parse_size(memory_budget, 'memory_budget')
  merging = merge_lib.Options.given(merge_lora, lora_alpha, lora_scale, base)
  source = _open_source(src, step, items, params_only)
  dst = as_path(dst)
  merged = merging.plan(source) if merging else None
  commit.check_destination(
      [c.step_dir for c in merge_lib.checkpoints_read(source, merged)], dst, force)
  if merged is None:
    _refuse_adapters_only(source)
  laid = chosen.lay_out(layouts.Request(
      source=source, params_only=params_only, dtype=dtype, merge=merged,
      scan_layers=scan_layers, param_scan_axis=param_scan_axis,
  ))
  plans = [item for item in laid.items if item.outputs or item.json]
  notes = list(source.detection.notes) + list(laid.notes)
  if merged is not None and merged.base is not source:
    notes += [f'base: {note}' for note in merged.base.detection.notes]
  notes += [f'skipped item {item.name!r}: nothing to write' for item in laid.items
            if item not in plans]
  if merged is not None:
    notes.append(f'merging LoRA adapters into {len(merged.merges)} of'
                 f' {len(merged.weights)} weights')
  if not plans:
    raise errors.UnsupportedLayoutError(
        f'{source.step_dir}: expected at least one PyTree item to convert,'
        f' found none ({"; ".join(notes) or "the step has no items"}).'
    )
  for item in plans:
    item.check()
  _check_representable(plans)
  largest = max((o.nbytes for item in plans for o in item.outputs), default=0)
  notes.extend(filter(None, [writer.budget_note(memory_budget, largest, 'array')]))
  return ConvertPlan(
      source=source,
      dst=dst,
      layout=chosen.name,
      params_only=params_only,
      dtype=dtype,
      memory_budget=memory_budget,
      force=force,
      items=tuple(plans),
      notes=tuple(notes),
      merge=merged,
      custom_metadata=dict(laid.custom_metadata),
  )


def _open_source(
    src: epath.PathLike, step: int | None, items: Iterable[str] | None, params_only: bool
) -> reader.CanonicalCheckpoint:
  """The source, opened as far as the conversion needs it.

  Weights only: just the weights' item (the others are not read, and may be
  absent). A whole step (no `items`): every item it records must be there.
  """
  if params_only and items is None:
    return reader.open_weights(src, step)
  source = reader.open_checkpoint(src, step, items)
  if items is None:
    source.detection.require()
  return source


def _refuse_adapters_only(source: reader.CanonicalCheckpoint) -> None:
  """A LoRA run saved without its base weights cannot be converted as it is.

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
        " (Tunix's save_only_lora_params). Converted alone they are not a model."
        ' Merge them into the base weights the run started from: `merge_lora=True`,'
        ' `lora_alpha` (the run\'s LoRA alpha) and `base` (the base checkpoint).'
    )


def _provenance(plan: ConvertPlan, sums: dict[str, dict[str, str]]) -> dict[str, Any]:
  """What DST's custom metadata records: where it came from, and its checksums."""
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
  if plan.merge is not None:
    record['lora_merge'] = {
        'base': os.fspath(plan.merge.base.step_dir),
        'adapted': {fmt(p): {'style': m.adapter.style, 'rank': m.adapter.rank, 'scale': m.scale}
                    for p, m in sorted(plan.merge.merges.items())},
    }
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


def _write_step_metadata(
    tmp: epath.Path, plan: ConvertPlan, init_ns: int, sums: dict[str, dict[str, str]]
) -> None:
  custom = dict(plan.source.detection.source.custom_metadata)
  custom.update(plan.custom_metadata)
  custom[METADATA_KEY] = _provenance(plan, sums)
  meta = ocp.metadata.StepMetadata(
      item_handlers={
          item.name: reader.JSON_TYPESTR if item.json else PYTREE_TYPESTR for item in plan.items
      },
      init_timestamp_nsecs=init_ns,
      commit_timestamp_nsecs=time.time_ns(),
      custom_metadata=custom,
  )
  store = ocp.metadata.metadata_store(enable_write=True, blocking_write=True)
  store.write(file_path=tmp / CHECKPOINT_METADATA, metadata=_orbax.serialize_step_metadata(meta))


def run_convert(plan: ConvertPlan, progress: reader.Progress | None = None) -> ConvertResult:
  """Executes a plan: streams every item into a new step, then commits it as Orbax does.

  Args:
    plan: from `plan_convert`.
    progress: told the bytes done after each batch.

  Returns:
    A `ConvertResult`.

  Raises:
    DestinationExistsError: DST appeared meanwhile and not `force`.
    InvalidDestinationError: the destination cannot be written (permissions,
      space), or overlaps a source's run (checked again before the first
      write).
    InvalidOptionError: a value leaves the range of `dtype`
      (`writer.check_range`). In every case (and on KeyboardInterrupt) what
      was written is removed and an existing DST is untouched (see
      `commit.staged`).
  """
  progress = progress or reader.NullProgress()
  start = time.monotonic()
  init_ns = time.time_ns()
  sources = [c.step_dir for c in merge_lib.checkpoints_read(plan.source, plan.merge)]
  # Across hosts (see `distributed`): every process writes its shards of
  # every item, process 0 the JSON items and the step's metadata, and the
  # step is committed once.
  with writer.streamed(plan.dst, plan.force, commit.STEP, plan.total_bytes, sources, progress,
                       f'converting to {plan.dst}') as staging:
    sums: dict[str, dict[str, str]] = {}
    for item in plan.items:
      if item.json and not distributed.is_primary():
        continue
      if item.json:
        ckpt, name = item.json
        (staging.work / item.name).mkdir(parents=True, exist_ok=True)
        ocp.JsonCheckpointHandler().save(
            staging.work / item.name, args=ocp.args.JsonSave(reader.read_json_item(ckpt, name)))
        continue
      sink = writer.OrbaxItemSink(item, staging.work / item.name)
      record = writer.write(item.outputs, sink, plan.batch_bytes, progress)
      sums[item.name] = record['checksums']
    if distributed.is_primary():
      _write_step_metadata(staging.work, plan, init_ns, sums)
  replaced = staging.replaced
  return ConvertResult(
      dst=plan.dst,
      items={item.name: len(item.outputs) for item in plan.items},
      bytes_read=plan.total_bytes,
      seconds=time.monotonic() - start,
      replaced=replaced,
  )

"""The one plan and run of every output: a layout applied to a source, streamed into its
destination.

`plan` decides everything from metadata before any array is read: the source (opened once,
as far as the layout needs it: `reader.open_source`), the LoRA merge, the destination checks
(`commit.check_destination`, by the destination's kind), the layout's outputs (`layouts`: an
Orbax step, a Hugging Face folder per family, a PEFT adapter folder per family), the files a
folder is sharded into, and the notes. `run` hands the plan to its layout's destination
(`layouts.Destination.write`), which streams the outputs through the one writer
(`writer.write`), a batch within the memory budget at a time, inside one staged commit
(`writer.streamed`): nothing is seen at the destination until all of it is written.
`convert` and `export` are this pipeline with a step layout and a folder layout. Nothing
here knows one destination from another: each is a value (`layouts/step.py`,
`layouts/folder.py`, `layouts/peft.py`).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from etils import epath

from orbax_tunix import errors, layouts, sizes
from orbax_tunix.keypaths import fmt
from orbax_tunix.mapping import lora, merge_options
from orbax_tunix.mapping import merge as merge_lib
from orbax_tunix.mapping.outputs import ItemOutput
from orbax_tunix.reading import memory, reader, timing
from orbax_tunix.store.fileio import as_path
from orbax_tunix.tools import agreement
from orbax_tunix.writing import commit, consensus, job, places, writer

# A plan is the layouts' (`layouts.Plan`: its layout's destination writes it).
Plan = layouts.Plan


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
      fields = agreement.fingerprint(made) if job.active() else None
    except BaseException as e:  # noqa: BLE001 - told to every process, then raised.
      consensus.agree_on('plan', None, e)
      raise
    consensus.agree_on('plan', fields, given=agreement.asked(made))
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
    dtype: Any = None,
    memory_budget: int | float | str = memory.DEFAULT_MEMORY_BUDGET,
    force: bool = False,
    items: Iterable[str] | None = None,
    **options: Any,
) -> Plan:
  """Plans a layout's output from metadata only; nothing is read or written.

  Args:
    src, step, memory_budget, items: as `convert.plan_convert`.
    dst: the destination to create (a step directory; a folder).
    layout: a registered layout's name (`layouts.names()`).
    params_only: write the weights only (a weights-only layout implies it).
    dtype: cast floating leaves to this dtype, as the layout's destination takes it
      (`Destination.dtype`); None: kept.
    force: replace an existing destination (only one of the destination's kind).
    **options: the layout's options (`layouts.options()`: `scan_layers`,
      `param_scan_axis`, `hf_config`, `max_shard_size`, ...); another layout's
      must be left unset. And the LoRA merge's (`merge_options.MergeKeywords`:
      `merge_lora`, `lora_alpha`, `base`, ...), those the layout does not take itself.

  Returns:
    A `Plan`.

  Raises:
    TypeError: an option no layout takes.
    InvalidOptionError, InvalidDestinationError, DestinationExistsError,
    LoraError, UnsupportedLayoutError and the other `TunixCheckpointError`
    subclasses: see `convert.plan_convert` and `export.plan_export`; every
    one before any array is read. InvalidOptionError too for an
    `ORBAX_TUNIX_THREADS` that is no thread count (`memory.host_threads`).
    DistributedError: in a multi-process job (where every process calls it), the
      processes were given different work (source, step, options), or another
      process failed to plan: on every process, before anything is written.
  """
  chosen = layouts.get(layout)
  destination = chosen.destination
  merging = {n: options.pop(n) for n in merge_options.OPTIONS.names()
             if n in options and not chosen.takes(n)}
  merge = merge_options.MergeOptions.given(merging)
  dtype = destination.dtype(dtype)
  given = _given(chosen, options)
  params_only = params_only or merge is not None or chosen.weights_only
  memory_budget = sizes.parse_size(memory_budget, 'memory_budget')
  memory.host_threads()  # ORBAX_TUNIX_THREADS, where set, checked before anything is read.
  items = None if items is None else tuple(items)  # Read twice: the source, and `options`.
  source = reader.open_source(src, step, items, weights_only=params_only)
  dst = as_path(dst)
  merged = merge_lib.plan_merge(source, merge) if merge is not None else None
  for option in (o for o in chosen.options if o.folder and o.name in given):
    # First: the more specific refusal.
    places.check_not_over(dst, given[option.name], f'the `{option.name}` folder')
  commit.check_destination(
      [c.step_dir for c in merge_lib.checkpoints_read(source, merged)], dst, force,
      destination.kind)
  if merged is None and not chosen.adapters:
    _refuse_adapters_only(source, chosen.name)
  laid = chosen.lay_out(layouts.Request(
      source=source, params_only=params_only, dtype=dtype, merge=merged,
      options={o.name: given.get(o.name, o.default) for o in chosen.options}))
  written = [item for item in laid.items if item.outputs or item.json]
  notes = _notes(source, merged, laid, written)
  if not written:
    raise errors.UnsupportedLayoutError(
        f'{source.step_dir}: expected at least one PyTree item to convert,'
        f' found none ({"; ".join(notes) or "the step has no items"}).'
    )
  for item in written:
    item.check()
  _check_representable(written)
  written, files = destination.shard(written, given)
  _check_sizes(written, destination, dst)
  notes += _leftover_notes(dst, destination)
  largest = max((o.nbytes for item in written for o in item.outputs), default=0)
  notes.extend(filter(None, [writer.budget_note(memory_budget, largest, destination.unit)]))
  return Plan(
      source=source, dst=dst, layout=chosen.name, params_only=params_only, dtype=dtype,
      memory_budget=memory_budget, force=force, items=tuple(written), notes=tuple(notes),
      merge=merged, custom_metadata=dict(laid.custom_metadata), files=tuple(files),
      other_files=laid.files, summary=dict(laid.summary),
      options=_asked(given, merge, items),
  )


def _check_sizes(written: Sequence[ItemOutput], destination: layouts.Destination,
                 dst: epath.Path) -> None:
  """The sizes the source claims, checked before anything is written: what must be held at
  once against the machine's memory, and (uncompressed files) the bytes against the disk.

  Raises:
    TunixCheckpointError: beyond the machine (`writer.check_machine`).
    InvalidDestinationError: beyond the disk's free space (`commit.check_room`).
  """
  outputs = [o for item in written for o in item.outputs]
  writer.check_machine(outputs, destination.safetensors)
  if destination.safetensors:
    commit.check_room(dst, sum(o.nbytes for o in outputs))


def _given(layout: layouts.Layout, options: Mapping[str, Any]) -> dict[str, Any]:
  """The layout options the caller set (not at their default), coerced.

  Raises:
    TypeError: an option no layout takes.
    InvalidOptionError: one `layout` does not take (`layouts.check_options`), or a value
      the option refuses.
  """
  known = layouts.options()
  unknown = sorted(set(options) - set(known))
  if unknown:
    raise TypeError(f'plan() got unexpected keyword arguments: {", ".join(unknown)}')
  layouts.check_options(layout, options)
  return {name: known[name].coerce(value) for name, value in options.items()
          if value != known[name].default}


def _notes(source: reader.Source, merged: merge_lib.MergePlan | None,
           laid: layouts.LaidOut, written: Sequence[ItemOutput]) -> list[str]:
  """What a person should know of a plan: the source's notes (a merge's base's too), the
  layout's, the items skipped, the merge, and the weights written dequantized."""
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
  return notes + _dequantized_notes(written, merged)


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


def _asked(given: Mapping[str, Any], merge: merge_options.MergeOptions | None,
           items: Iterable[str] | None) -> dict[str, Any]:
  """The options a caller gave, by their names: the layout's, the merge's, and the items
  chosen."""
  asked = dict(given)
  asked.update(merge.asked() if merge is not None else {})
  if items is not None:
    asked['items'] = sorted(items)
  return asked


def _refuse_adapters_only(source: reader.Source, layout: str) -> None:
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
        ' none. Merge them into the base weights the run started from:'
        f' {merge_options.MERGE_LORA.named(True)}, {merge_options.LORA_ALPHA.named()} (the'
        f' run\'s LoRA alpha) and {merge_options.BASE.named()} (the base checkpoint); or convert'
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


def _leftover_notes(dst: epath.Path, destination: layouts.Destination) -> list[str]:
  """What an interrupted run to `dst` left beside it (process 0 tells: the others would
  see its own staging)."""
  if not job.is_primary():
    return []
  return [f'{p} is left from an interrupted {destination.run} to {dst} (it was never'
          f' committed there); remove it when no {destination.run} is running'
          for p in commit.leftovers(dst)]


# --- running ------------------------------------------------------------------


def run(plan: Plan, progress: reader.Progress | None = None) -> Result:
  """Executes a plan: streams every output into its destination, then commits it once.

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
  destination = layouts.get(plan.layout).destination
  mine = destination.share(plan)
  with writer.streamed(plan.dst, plan.force, destination.kind, plan.bytes_written,
                       plan.sources, progress, f'{destination.doing} {plan.dst}',
                       writer.bytes_read(mine), destination.entries(plan)) as staging:
    record = destination.write(plan, mine, staging.work, progress)
    written = time.monotonic()
  timing.add('committed', time.monotonic() - written)
  return Result(
      dst=plan.dst, items={item.name: len(item.outputs) for item in plan.items},
      files=tuple(record.get('files', ())), bytes_read=writer.bytes_read(plan.outputs),
      total_size=record.get('total_size', plan.bytes_written),
      seconds=time.monotonic() - start, replaced=staging.replaced,
  )

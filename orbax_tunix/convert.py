"""Convert: a checkpoint rewritten as an ordinary Orbax checkpoint, streamed and atomic.

What is written (DST is a step directory):

* `--layout canonical`: one item per source PyTree item, each holding the
  item's canonical tree (for Tunix: `model_params` without the nnx `value`
  level and adapter `base` level, `optimizer_state` without the
  inject_hyperparams shell). With `params_only`, only `model_params` holding
  the weights (no RNG state).
* `--layout maxtext` (with `params_only`): one item `items` holding
  `{'params': {'params': <weights>}}`, no RNG state: MaxText's
  `load_parameters_path` is then `DST/items`.

Every item is a plain `PyTreeCheckpointHandler` item and `_CHECKPOINT_METADATA`
names that handler, so plain Orbax (`ocp.Checkpointer(
ocp.CompositeCheckpointHandler()).restore(DST)`, or `ocp.CheckpointManager` on
the parent when DST is named by its step number) restores it without this
package. The step's custom metadata keeps the source's and adds
`orbax_tunix`: where it came from, and the inject_hyperparams values the
canonical view leaves out.

Streaming: leaves are read in batches whose bytes fit the memory budget (one
Orbax partial restore each) and each batch is saved with Orbax's own
`PyTreeCheckpointHandler` into the same item directory. With OCDBT (Orbax's
default) every save adds its arrays to the item's per-process database, and
Orbax appends to `_sharding` and `array_metadatas/` itself; but each save
rewrites the tree metadata (`_METADATA`, one entry per leaf) with its own
leaves only, so the entries of all saves are kept and written once at the end
(the same union Orbax's own partial-save finalization does) before Orbax's
`finalize` merges the OCDBT database into the item's root manifest.

Committed as Orbax commits (`commit.Staging`): on a local disk everything is
written to `<DST>.orbax-checkpoint-tmp-<ns>` beside DST (the name Orbax and
this package treat as an unfinished step) and renamed to DST at the end; on a
bucket, which has no rename, DST is written in place and `commit_success.txt`
comes last, so an interrupted convert is an unfinished step to Orbax and to
this package. Any failure or interrupt removes what was written. An existing
DST is refused unless `force`, and then replaced only once the new one is
complete.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import os
import time
from collections.abc import Iterable, Sequence
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from orbax.checkpoint._src.metadata import step_metadata_serialization

from orbax_tunix import (
  __version__,
  _orbax,
  checksums,
  commit,
  conventions,
  errors,
  lora,
  reader,
  storage,
)
from orbax_tunix import merge as merge_lib
from orbax_tunix.commit import InvalidDestinationError
from orbax_tunix.conventions import RL_ROLES
from orbax_tunix.hyperparams import read_hyperparameters
from orbax_tunix.keypaths import Path, fmt, nest
from orbax_tunix.storage import (
  CHECKPOINT_METADATA,
  PYTREE_METADATA,
  as_path,
  read_json,
  step_number,
)

CANONICAL = 'canonical'
MAXTEXT = 'maxtext'
LAYOUTS = (CANONICAL, MAXTEXT)

DEFAULT_MEMORY_BUDGET = reader.DEFAULT_MEMORY_BUDGET
# Bytes held per byte of a batch, measured with benchmarks/convert_memory.py:
# TensorStore holds the compressed bytes and the decoded array while reading,
# the host copy and the compressed bytes while writing, and freed buffers are
# not all returned at once: a batch of B bytes peaks at 2.5 B to 4.5 B above
# `reader.FIXED_OVERHEAD` (the larger factors for small batches, and from run
# to run). Sized for the worst case seen.
COPIES_IN_FLIGHT = 5

PYTREE_TYPESTR = ocp.PyTreeCheckpointHandler.typestr()
METADATA_KEY = checksums.RECORD_KEY


@dataclasses.dataclass(frozen=True)
class ItemPlan:
  """One item to write.

  Attributes:
    name: the item written (e.g. 'model_params', or 'items' for MaxText).
    source_item: the source item its leaves are read from.
    leaves: the source leaves, in write order.
    paths: the path each leaf is written under, in the same order.
    json: a JSON item, copied whole (no leaves).
  """

  name: str
  source_item: str
  leaves: tuple[reader.LeafInfo, ...]
  paths: tuple[Path, ...]
  json: bool = False

  @property
  def nbytes(self) -> int:
    return sum(leaf.nbytes for leaf in self.leaves)


@dataclasses.dataclass(frozen=True)
class ConvertPlan:
  """Everything a conversion does, decided from metadata before any write.

  Attributes:
    source: the source step, canonical.
    dst: the step directory to create.
    layout: CANONICAL or MAXTEXT.
    params_only: weights only (no optimizer state, no RNG state).
    dtype: floating leaves are cast to this dtype (None: kept).
    memory_budget: bytes of memory the streaming may use.
    force: replace an existing DST.
    items: the items to write.
    notes: things a person should know (e.g. items skipped).
    merge: the LoRA merge whose weights are written (None: leaves are copied).
  """

  source: reader.CanonicalCheckpoint
  dst: epath.Path
  layout: str
  params_only: bool
  dtype: np.dtype | None
  memory_budget: int
  force: bool
  items: tuple[ItemPlan, ...]
  notes: tuple[str, ...] = ()
  merge: merge_lib.MergePlan | None = None

  @property
  def total_bytes(self) -> int:
    return sum(item.nbytes for item in self.items)

  @property
  def num_leaves(self) -> int:
    return sum(len(item.leaves) for item in self.items)

  @property
  def batch_bytes(self) -> int:
    return reader.batch_bytes(self.memory_budget, COPIES_IN_FLIGHT)


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


def _check_representable(items: Sequence[ItemPlan], dtype: np.dtype | None) -> None:
  """Refuses leaves JAX would silently narrow (float64 to float32, ...) with x64 off.

  Raises:
    InvalidDestinationError: naming the leaves and the fix.
  """
  if jax.config.jax_enable_x64:
    return
  wide = [
      f'{leaf.name} ({reader.cast_dtype(leaf, dtype)})'
      for item in items
      for leaf in item.leaves
      if _needs_x64(reader.cast_dtype(leaf, dtype))
  ]
  if wide:
    raise InvalidDestinationError(
        f'{len(wide)} leaves would be written as 64-bit arrays, which JAX narrows'
        f' to 32 bits unless its 64-bit mode is on:\n{errors.list_paths(wide)}\n'
        "Call jax.config.update('jax_enable_x64', True) before converting (the"
        ' orbax-tunix command does), or pass a 32-bit `dtype`.'
    )


def _absolute(path: epath.Path) -> str:
  text = os.fspath(path)
  return os.path.abspath(text) if storage.is_local(path) else text.rstrip('/')



def _protected(step_dir: epath.Path) -> epath.Path:
  """What a conversion must not write into: the source's whole run.

  That is the root holding the step when the step is named as Orbax names
  steps (an RL root above its `actor/` or `critic/`), else the step itself.
  """
  if step_number(step_dir.name) is None:
    return step_dir
  root = step_dir.parent
  return root.parent if root.name in RL_ROLES else root


def _check_destination(
    sources: Sequence[reader.CanonicalCheckpoint], dst: epath.Path, force: bool
) -> None:
  """Refuses a DST inside (or holding) any source run, or one that may not be replaced."""
  target = _absolute(dst)
  for src in sources:
    protected, step = _absolute(_protected(src.step_dir)), _absolute(src.step_dir)
    if target == protected or target.startswith(protected + '/') or step.startswith(target + '/'):
      raise InvalidDestinationError(
          f'{dst}: the destination is inside the source checkpoint {protected} (or'
          ' holds it). The source run, every step and item in it, is never written'
          ' to: choose a dst outside it.'
      )
  try:
    commit.check_replaceable(dst, force)
  except OSError as e:
    raise InvalidDestinationError(
        f'{dst}: cannot reach the destination ({e}). Check the path, the network and'
        ' the credentials (gs:// paths need gcsfs and Google credentials).'
    ) from e


def plan_convert(
    src: epath.PathLike,
    dst: epath.PathLike,
    *,
    step: int | None = None,
    layout: str = CANONICAL,
    params_only: bool = False,
    dtype: np.dtype | None = None,
    memory_budget: int = DEFAULT_MEMORY_BUDGET,
    force: bool = False,
    items: Iterable[str] | None = None,
    merge_lora: bool = False,
    lora_alpha: float | None = None,
    lora_scale: float | None = None,
    base: epath.PathLike | None = None,
) -> ConvertPlan:
  """Plans a conversion from metadata only; nothing is written.

  Args:
    src: the source: a root (latest committed step, or `step`), a step or an
      item directory.
    dst: the step directory to create.
    step: the source step (see `reader.resolve`).
    layout: CANONICAL or MAXTEXT (MAXTEXT needs `params_only`).
    params_only: write the weights only.
    dtype: cast floating leaves to this dtype.
    memory_budget: bytes the streaming may hold at once.
    force: replace an existing DST (only if it is a checkpoint step).
    items: the source items to convert (default: every item the step records;
      a step holding items that are neither PyTrees nor JSON needs them named).
    merge_lora: write the weights with the LoRA adapters merged (weights
      only, as `params_only`); see `orbax_tunix.restore_merged_lora`.
    lora_alpha, lora_scale, base: the merge's `alpha`, `scale` and `base`.

  Returns:
    A `ConvertPlan`.

  Raises:
    InvalidDestinationError: bad options, or DST overlaps the source.
    DestinationExistsError: DST exists and not `force`.
    TunixCheckpointError subclasses: the source is not readable.
  """
  if layout not in LAYOUTS:
    raise InvalidDestinationError(
        f'`layout` {layout!r}: expected one of {", ".join(LAYOUTS)}.'
    )
  params_only = params_only or merge_lora
  if layout == MAXTEXT and not params_only:
    raise InvalidDestinationError(
        '`layout` maxtext writes the parameter tree MaxText loads with'
        ' load_parameters_path, and nothing else: add `params_only=True`. (A full'
        ' MaxText TrainState with its optimizer state is not written by this'
        ' command.)'
    )
  if memory_budget < 1:
    raise InvalidDestinationError(
        f'`memory_budget` {memory_budget}: expected a positive number of bytes.'
    )
  if base is not None and not merge_lora:
    raise InvalidDestinationError('`base` is the base of a LoRA merge: add `merge_lora=True`.')
  source = _open_source(src, step, items, params_only)
  dst = as_path(dst)
  notes: list[str] = []
  plans: list[ItemPlan] = []
  found = None
  merged = (merge_lib.plan_merge(source, alpha=lora_alpha, scale=lora_scale, base=base)
            if merge_lora else None)
  _check_destination([source] if merged is None else [source, merged.base], dst, force)
  prefix = conventions.MAXTEXT_PARAMS if layout == MAXTEXT else ()
  name = conventions.MAXTEXT_ITEM if layout == MAXTEXT else conventions.MODEL_ITEM
  if merged is not None:
    weights = sorted(merged.weights.items())
    plans.append(ItemPlan(
        name=name,
        source_item=conventions.MODEL_ITEM,
        # The merged weights, as the base stores them, under the plain model's paths.
        leaves=tuple(dataclasses.replace(s.leaf, item=name, path=p, disk_path=p)
                     for p, s in weights),
        paths=tuple(prefix + p for p, _ in weights),
    ))
    notes.append(f'merging LoRA adapters into {len(merged.merges)} of {len(weights)} weights')
  elif params_only:
    found = reader.weights(source)
    source_items = {leaf.item for leaf, _ in found}
    plans.append(
        ItemPlan(
            name=name,
            source_item=source_items.pop(),  # weights() reads one item.
            leaves=tuple(leaf for leaf, _ in found),
            paths=tuple(prefix + path for _, path in found),
        )
    )
    dropped = [
        leaf for leaf in source.items.get(conventions.MODEL_ITEM, ())
        if conventions.is_rng_state(leaf.path)
    ]
    if dropped:
      notes.append(
          f'left out {len(dropped)} RNG state leaves (paths with {conventions.RNG_KEY!r})'
      )
  else:
    for name in sorted(source.items):
      leaves = source.items[name]
      if not leaves:
        notes.append(f'skipped item {name!r}: it has no leaves')
        continue
      plans.append(ItemPlan(name, name, leaves, tuple(leaf.path for leaf in leaves)))
    plans += [ItemPlan(name, name, (), (), json=True) for name in source.json_items]
  if merged is None:
    _refuse_adapters_only(source, found)
  if not plans:
    raise errors.UnsupportedLayoutError(
        f'{source.step_dir}: expected at least one PyTree item to convert,'
        f' found none ({"; ".join(notes) or "the step has no items"}).'
    )
  _check_representable(plans, dtype)
  largest = max((leaf.nbytes for item in plans for leaf in item.leaves), default=0)
  needed = reader.FIXED_OVERHEAD + COPIES_IN_FLIGHT * largest
  if memory_budget < needed:
    notes.append(
        f'`memory_budget` {memory_budget} bytes cannot be met: streaming needs about'
        f' {needed} ({reader.FIXED_OVERHEAD >> 20} MiB whatever the batch, and'
        f' {COPIES_IN_FLIGHT}x the largest array, {largest} bytes, in flight); each'
        ' array is copied alone, and the peak will be about that'
    )
  return ConvertPlan(
      source=source,
      dst=dst,
      layout=layout,
      params_only=params_only,
      dtype=dtype,
      memory_budget=memory_budget,
      force=force,
      items=tuple(plans),
      notes=tuple(notes),
      merge=merged,
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


def _refuse_adapters_only(
    source: reader.CanonicalCheckpoint, found: list[tuple[reader.LeafInfo, Path]] | None
) -> None:
  """A LoRA run saved without its base weights cannot be converted as it is.

  Raises:
    LoraOnlyCheckpointError: saying how to merge instead.
  """
  if found is None:  # Not yet listed by the caller.
    try:
      found = reader.weights(source)
    except errors.UnsupportedLayoutError:
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


def _read_batch(plan: ConvertPlan, item: ItemPlan, batch: Sequence[reader.LeafInfo]) -> list[Any]:
  """One batch of an item's values: copied leaves, or merged weights (on one CPU device)."""
  if plan.merge is None:
    return reader.read(plan.source, item.source_item, batch, as_numpy=False, dtype=plan.dtype)
  cpu = jax.sharding.SingleDeviceSharding(jax.devices('cpu')[0])
  targets = {
      leaf.path: jax.ShapeDtypeStruct(leaf.shape, reader.cast_dtype(leaf, plan.dtype), sharding=cpu)
      for leaf in batch
  }
  values = merge_lib.read_merged(plan.merge, targets)
  return [values[leaf.path] for leaf in batch]


def _write_item(
    plan: ConvertPlan,
    item: ItemPlan,
    item_dir: epath.Path,
    progress: reader.Progress,
) -> dict[str, str]:
  """Streams one item into `item_dir`, batch by batch, with Orbax's handler.

  Returns:
    The checksum of every leaf written, by formatted path (see `checksums`).
  """
  item_dir.mkdir(parents=True, exist_ok=True)
  writer = ocp.PyTreeCheckpointHandler()
  dst_path = dict(zip((leaf.disk_path for leaf in item.leaves), item.paths, strict=True))
  written: list[dict[str, Any]] = []
  sums: dict[str, str] = {}
  with concurrent.futures.ThreadPoolExecutor(1) as summer:
    for batch in reader.batches(item.leaves, plan.batch_bytes):
      values = _read_batch(plan, item, batch)
      paths = [dst_path[leaf.disk_path] for leaf in batch]
      # Checksums are taken beside the write (zlib releases the GIL).
      summing = summer.submit(lambda vs: [checksums.checksum(v) for v in vs], values)
      writer.save(item_dir, args=ocp.args.PyTreeSave(nest(zip(paths, values, strict=True))))
      sums.update(zip((checksums.key(p) for p in paths), summing.result(), strict=True))
      del values, summing  # Free the batch before the next is read.
      # Each save writes `_METADATA` for its own leaves only: keep them all.
      written.append(read_json(item_dir / PYTREE_METADATA))
      progress.advance(sum(leaf.nbytes for leaf in batch))
  # Written as it was read (no rewrite, no new prefix): keep the source's
  # containers (lists, None) too.
  source = plan.source.detection.item_meta(item.source_item)
  same = plan.merge is None and all(
      p == leaf.disk_path for p, leaf in zip(item.paths, item.leaves, strict=True)
  )
  merged = _orbax.merge_tree_metadata(
      written,
      key_types={leaf.path: leaf.key_types for leaf in source.leaves} if same else None,
      empty_nodes=[(leaf.path, leaf.key_types) for leaf in source.leaves if leaf.is_empty]
      if same and not plan.params_only else (),
  )
  (item_dir / PYTREE_METADATA).write_text(json.dumps(merged))
  writer.finalize(item_dir)
  (item_dir / commit.COMMIT_SUCCESS).write_text(f'Checkpoint commit was successful to {item_dir}')
  return sums


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
    found = read_hyperparameters(detection)
    if found:
      record['hyperparameters'] = {
          shell: {name: reader.json_scalar(v) for name, v in values.items()}
          for shell, values in found.items()
      }
  return record


def _write_step_metadata(
    tmp: epath.Path, plan: ConvertPlan, init_ns: int, sums: dict[str, dict[str, str]]
) -> None:
  custom = dict(plan.source.detection.source.custom_metadata)
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
  store.write(
      file_path=tmp / CHECKPOINT_METADATA,
      metadata=step_metadata_serialization.serialize(meta),
  )


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
      space). In every case (and on KeyboardInterrupt) what was written is
      removed and an existing DST is untouched (see `commit.Staging`).
  """
  progress = progress or reader.NullProgress()
  start = time.monotonic()
  init_ns = time.time_ns()
  staging = commit.Staging(plan.dst, plan.force)
  try:
    work = staging.open()
  except OSError as e:
    staging.abort()
    raise InvalidDestinationError(
        f'{plan.dst}: cannot create the destination ({e}). Expected a writable'
        ' directory; choose another dst or fix its permissions.'
    ) from e
  progress.start(plan.total_bytes, f'converting to {plan.dst}')
  sums: dict[str, dict[str, str]] = {}
  try:
    for item in plan.items:
      if item.json:
        (work / item.name).mkdir(parents=True, exist_ok=True)
        ocp.JsonCheckpointHandler().save(
            work / item.name,
            args=ocp.args.JsonSave(reader.read_json_item(plan.source, item.source_item)),
        )
        continue
      sums[item.name] = _write_item(plan, item, work / item.name, progress)
    _write_step_metadata(work, plan, init_ns, sums)
    replaced = staging.commit()
  except OSError as e:
    staging.abort()
    raise InvalidDestinationError(
        f'{plan.dst}: writing failed ({e}). Expected a writable destination with'
        f' room for about {plan.total_bytes} bytes; nothing was left behind.'
        ' Free space or choose another dst.'
    ) from e
  except BaseException:
    staging.abort()
    raise
  finally:
    progress.finish()
  return ConvertResult(
      dst=plan.dst,
      items={item.name: len(item.leaves) for item in plan.items},
      bytes_read=plan.total_bytes,
      seconds=time.monotonic() - start,
      replaced=replaced,
  )

"""The step destination: an Orbax step that plain Orbax restores without this package.

Every item a plain `PyTreeCheckpointHandler` item (JSON items copied),
`_CHECKPOINT_METADATA` naming that handler, and the step's custom metadata recording the
source and a CRC-32 of every array. Across hosts every process writes its shards of every
item; process 0 the JSON items and the metadata. `convert` writes it (`canonical`,
`maxtext`).
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Sequence
from typing import Any

import orbax.checkpoint as ocp
from etils import epath

from orbax_tunix import errors
from orbax_tunix.keypaths import fmt
from orbax_tunix.layouts.base import Destination, Plan
from orbax_tunix.mapping import merge as merge_lib
from orbax_tunix.mapping.outputs import ItemOutput, Output
from orbax_tunix.reading import hyperparams, reader
from orbax_tunix.store import _orbax, names
from orbax_tunix.store._orbax import CHECKPOINT_METADATA
from orbax_tunix.version import __version__
from orbax_tunix.writing import checksums, commit, job, writer

PYTREE_TYPESTR = ocp.PyTreeCheckpointHandler.typestr()


def _write(plan: Plan, mine: Sequence[Output], work: epath.Path,
           progress: reader.Progress) -> dict[str, Any]:
  """Every item into the step at `work` (each process its shards), then its metadata."""
  del mine  # Every process writes its shards of every output.
  init_ns = time.time_ns()
  sums: dict[str, dict[str, str]] = {}
  for item in plan.items:  # Each a directory of the new step (a source's names were checked).
    names.check_plain(item.name, work, 'an item would be written as')
  for item in plan.items:
    if item.json:
      if job.is_primary():
        ckpt, name = item.json
        (work / item.name).mkdir(parents=True, exist_ok=True)
        ocp.JsonCheckpointHandler().save(
            work / item.name, args=ocp.args.JsonSave(reader.read_json_item(ckpt, name)))
      continue
    sink = writer.OrbaxItemSink(item, work / item.name)
    sums[item.name] = writer.write(item.outputs, sink, plan.batch_bytes, progress,
                                  ahead=plan.reads_ahead)['checksums']
  if job.is_primary():
    _write_metadata(work, plan, init_ns, sums)
  return {}


def _entries(plan: Plan) -> list[str]:
  """What `_write` makes at the top of a step: its items and its metadata."""
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


def _write_metadata(work: epath.Path, plan: Plan, init_ns: int,
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


def _shard(items: Sequence[ItemOutput], given: Any) -> tuple[Sequence[ItemOutput], tuple]:
  """The items as they are (a step is no set of files), once every array is one Orbax saves.

  Raises:
    UnsupportedLayoutError: an array of no elements (Orbax refuses to save one), naming
      them; before anything is written.
  """
  del given
  empty = [o for item in items for o in item.outputs if o.shape and 0 in o.shape]
  if empty:
    where = empty[0].inputs[0].ckpt.step_dir if empty[0].inputs else 'the step to write'
    listed = [f'{", ".join(i.leaf.name for i in o.inputs) or fmt(o.path)}: shape'
              f' {tuple(o.shape)}' for o in empty]
    raise errors.UnsupportedLayoutError(
        f'{where}: expected arrays Orbax can save, found arrays of zero size:\n'
        f'{errors.list_paths(listed)}\nOrbax refuses to save an array with no elements, so'
        ' no step can hold them (a header claiming such a shape may also be damaged or'
        ' edited). Leave their item out (`items`); nothing was written.'
    )
  return items, ()


@dataclasses.dataclass(frozen=True)
class StepDestination(Destination):
  """An Orbax step, each item written by Orbax's PyTree handler (`_write`)."""

  def shard(self, items: Sequence[ItemOutput], given: Any) -> tuple[Sequence[ItemOutput], tuple]:
    return _shard(items, given)

  def write(self, plan: Plan, mine: Sequence[Output], work: epath.Path,
            progress: reader.Progress) -> dict[str, Any]:
    return _write(plan, mine, work, progress)

  def entries(self, plan: Plan) -> list[str]:
    return _entries(plan)


STEP = StepDestination(
    name='step', kind=commit.STEP, unit='array', run='conversion', doing='converting to',
    command='convert',
)

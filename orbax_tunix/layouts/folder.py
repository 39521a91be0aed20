"""The folder destination: a Hugging Face safetensors folder that `transformers` and vLLM load.

Safetensors files as `transformers` shards them (`max_shard_size`), their index, and the
layout's other files (config.json, tokenizer), each file's header recording every file the
export wrote (what `force` may replace later). Across hosts the files are dealt out among the
processes (process 0 the index and the other files). `export` writes it (one layout per
family: `layouts/huggingface.py`); its sharing and writing serve the PEFT adapter folder too
(`layouts/peft.py`).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from etils import epath

from orbax_tunix import errors
from orbax_tunix.layouts.base import Destination, Plan
from orbax_tunix.mapping.outputs import ItemOutput, Output
from orbax_tunix.reading import memory, reader, timing
from orbax_tunix.writing import commit, dealing, job, writer

# transformers' default `max_shard_size`.
DEFAULT_MAX_SHARD_SIZE = 5 * 10**9

# An exported folder (what `force` may replace): it holds a model's weights, as
# every export does (a config.json alone is no sign: many projects have one),
# and only the files its record names (a `.git`, notes: never deleted).
EXPORT = commit.Kind(
    'a Hugging Face export', (writer.SINGLE_FILE, writer.INDEX_FILE),
    record=writer.recorded_files, commit_file=None, in_place=False,
)


def hf_dtype(dtype: Any) -> np.dtype | None:
  """The dtype an export writes: one Hugging Face loaders take (None: as stored).

  Raises:
    InvalidOptionError: another dtype.
  """
  if dtype is None:
    return None
  dtype = np.dtype(dtype) if not isinstance(dtype, np.dtype) else dtype
  if dtype.name not in ('bfloat16', 'float32', 'float16'):
    raise errors.InvalidOptionError(
        f'`dtype` {dtype.name}: expected bfloat16, float16 or float32 (the floating'
        ' dtypes Hugging Face loaders take).'
    )
  return dtype


def _shard(items: Sequence[ItemOutput], given: Mapping[str, Any]
           ) -> tuple[list[ItemOutput], list[writer.Shard]]:
  """The folder's tensors in write order (those sharing sources together), and the files
  they go to, as `transformers` shards them."""
  (item,) = items
  outputs = tuple(writer.in_write_order(item.outputs))
  size = given.get('max_shard_size', DEFAULT_MAX_SHARD_SIZE)
  return [dataclasses.replace(item, outputs=outputs)], writer.shards(outputs, size)


def _my_files(plan: Plan) -> list[writer.Shard]:
  """The files this process writes (all of them on one process)."""
  return [plan.files[i] for i in dealing.mine([f.nbytes for f in plan.files])]


def share(plan: Plan) -> list[Output]:
  """The tensors of the files this process writes."""
  names = {name for f in _my_files(plan) for name, _, _ in f.tensors}
  return [o for o in plan.outputs if o.path[0] in names]


def entries(plan: Plan) -> list[str]:
  """Every file the export writes (its record: what `force` may replace later)."""
  index = [writer.INDEX_FILE] if len(plan.files) > 1 else []
  return sorted({*(f.name for f in plan.files), *index, *(n for n, _ in plan.other_files)})


def write(plan: Plan, mine: Sequence[Output], work: epath.Path,
          progress: reader.Progress) -> dict[str, Any]:
  """This process's safetensors files into `work`; process 0 the index and other files."""
  sink = writer.SafetensorsSink(work, _my_files(plan), plan.files,
                                write_index=job.is_primary(),
                                metadata={writer.FILES_RECORD: json.dumps(entries(plan))},
                                threads=plan.write_threads,
                                piece_bytes=memory.copy_buffer_bytes(plan.memory_budget))
  timing.note('threads', plan.write_threads)
  record = writer.write(mine, sink, plan.batch_bytes, progress, on_host=True,
                        ahead=plan.reads_ahead)
  for name, content in plan.other_files if job.is_primary() else ():
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
class FolderDestination(Destination):
  """A Hugging Face folder of safetensors files (`share`, `write`, `entries`, `hf_dtype`);
  the PEFT adapter folder is one with its own sharding (`layouts/peft.py`)."""

  def shard(self, items: Sequence[ItemOutput], given: Mapping[str, Any]
            ) -> tuple[list[ItemOutput], list[writer.Shard]]:
    return _shard(items, given)

  def share(self, plan: Plan) -> list[Output]:
    return share(plan)

  def write(self, plan: Plan, mine: Sequence[Output], work: epath.Path,
            progress: reader.Progress) -> dict[str, Any]:
    return write(plan, mine, work, progress)

  def entries(self, plan: Plan) -> list[str]:
    return entries(plan)

  def dtype(self, dtype: Any) -> np.dtype | None:
    return hf_dtype(dtype)


FOLDER = FolderDestination(
    name='folder', kind=EXPORT, unit='tensor', run='export', doing='exporting to',
    command='export', safetensors=True,
)

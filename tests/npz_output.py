"""A new output format as README says one is added: this one module, imported once.

`export --model F --npz` writes one `model.npz` holding the family's Hugging Face tensors.
Everything a new format needs is here: its destination (what it is, how it is written
through the one writer into a sink of its own) and its layouts (one per family, registered);
the command line finds its switch and its layouts in the catalog. Imported by
tests/test_layouts.py in a process of its own (the catalog is process-wide).
"""

from __future__ import annotations

import dataclasses
import functools
import zipfile
from collections.abc import Sequence
from typing import Any

import numpy as np
from etils import epath

from orbax_tunix import layouts
from orbax_tunix.layouts import folder
from orbax_tunix.layouts import huggingface as hf_layouts
from orbax_tunix.mapping import huggingface
from orbax_tunix.mapping.executor import Made
from orbax_tunix.mapping.hf_naming import Family
from orbax_tunix.reading import reader
from orbax_tunix.writing import commit, writer

FILE = 'model.npz'


class NpzSink:
  """Each tensor as one `.npy` entry of the zip file, as batches arrive."""

  def __init__(self, path: epath.Path):
    self._zip = zipfile.ZipFile(path, 'w')

  def write(self, batch: Sequence[Made]) -> None:
    for output, value in batch:
      assert output.rows is None, 'a tensor made in blocks of rows'
      with self._zip.open(f'{output.path[0]}.npy', 'w') as entry:
        np.lib.format.write_array(entry, np.asarray(value))

  def close(self) -> dict[str, Any]:
    self._zip.close()
    return {'files': [FILE]}


def _write(plan: layouts.Plan, mine: Sequence[Any], work: epath.Path,
           progress: reader.Progress) -> dict[str, Any]:
  work.mkdir(parents=True, exist_ok=True)
  return writer.write(mine, NpzSink(work / FILE), plan.batch_bytes, progress, on_host=True)


@dataclasses.dataclass(frozen=True)
class NpzDestination(layouts.Destination):
  """One npz file of the tensors (the step's own sharing: every output, one process)."""

  def write(self, plan: layouts.Plan, mine: Sequence[Any], work: epath.Path,
            progress: reader.Progress) -> dict[str, Any]:
    return _write(plan, mine, work, progress)

  def entries(self, plan: layouts.Plan) -> list[str]:
    return [FILE]

  def dtype(self, dtype: Any) -> np.dtype | None:
    return folder.hf_dtype(dtype)


NPZ = NpzDestination(
    name='npz', kind=commit.Kind('an npz export', (FILE,), record=lambda path: None,
                                 commit_file=None, in_place=False),
    unit='tensor', run='export', doing='writing the npz to', command='export',
    switch=layouts.Switch(
        layouts.Option('npz', bool, None, 'write one model.npz of the tensors'),
        refuses={'hf_config': 'an npz holds no config.json'}, instead='export a folder'),
)


def lay_out(family: Family, request: layouts.Request) -> layouts.LaidOut:
  """The family's Hugging Face tensors (its folder layout's), no other file."""
  laid = hf_layouts.lay_out(family, request)
  return layouts.LaidOut(laid.items, laid.notes, summary=laid.summary)


for _family in map(huggingface.get, huggingface.names()):
  layouts.register(layouts.Layout(
      name=f'{_family.name}.npz', description=f'one npz of {_family.architecture}',
      lay_out=functools.partial(lay_out, _family), destination=NPZ, weights_only=True,
      adapters=True, family=_family.name))

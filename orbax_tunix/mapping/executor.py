"""The one streaming executor: outputs made a batch at a time and handed to a sink.

Every output the package makes runs here, whatever it is for:

  placement                          what is made            sinks
  `device.OnDevices` (targets)       restore into MaxText's  `Collect` (the caller's
                                     state, LoRA merge       targets)
  `writer.OnHost`                    convert, export         an Orbax item, safetensors
                                                             files, a PEFT adapter

A placement groups outputs into units (outputs sharing a source are made
together, so each source is read once), says the bytes a unit holds while it is
made, reads a batch of units (one restore per item) and makes a unit's outputs
from what was read. The executor batches units by those bytes
(`memory.batches`), streams the reads (`reader.stream`: the next batch read
while this one is made, where asked) and hands what is made to the sink,
a budget's worth at a time, releasing each batch before the next.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Generic, Protocol, TypeVar

from orbax_tunix.keypaths import Path
from orbax_tunix.mapping import dequantize
from orbax_tunix.mapping.outputs import Output
from orbax_tunix.reading import memory, reader, timing

Made = tuple[Output, Any]
U = TypeVar('U')


class Sink(Protocol):
  """Where made outputs go."""

  def write(self, batch: Sequence[Made]) -> None:
    """Takes some outputs' values (they may be released once this returns)."""

  def close(self) -> dict[str, Any]:
    """Finishes the destination; returns what to record of it (e.g. checksums)."""


class Placement(Protocol, Generic[U]):
  """Where sources are read to and outputs made (see the module)."""

  def units(self, outputs: Sequence[Output]) -> Sequence[U]:
    """The outputs as units, in the order they are to be made."""

  def held_bytes(self, unit: U) -> int:
    """Bytes a unit holds beside what it makes while it is made."""

  def read_bytes(self, batch: Sequence[U]) -> int:
    """Bytes a batch reads (for progress)."""

  def read(self, batch: Sequence[U]) -> Any:
    """Every source of a batch, once."""

  def make(self, unit: U, read: Any) -> Iterable[Made]:
    """A unit's outputs and their values, from what `read` gave."""


class Collect:
  """The sink of outputs made into the caller's targets: `close()['values']`, path -> value."""

  def __init__(self):
    self.values: dict[Path, Any] = {}

  def write(self, batch: Sequence[Made]) -> None:
    self.values.update((output.path, value) for output, value in batch)

  def close(self) -> dict[str, Any]:
    return {'values': self.values}


def run(outputs: Sequence[Output], placement: Placement, sink: Sink, budget: int,
        progress: reader.Progress | None = None, *, ahead: bool = False) -> dict[str, Any]:
  """Makes `outputs` where `placement` says, into `sink`, a batch of units at a time.

  Args:
    outputs: what to make, in order.
    placement: how sources are read and outputs made.
    sink: where made outputs go.
    budget: bytes units hold per batch; what is made is handed to the sink once this
      much is held.
    progress: told the bytes read after each batch.
    ahead: read the next batch while this one is made (`reader.stream`).

  Returns:
    What the sink records (`Sink.close`).
  """
  # Weights saved quantized made from their parts, like any output from its sources.
  units = placement.units([dequantize.with_parts(o) for o in outputs])
  batched = memory.batches(units, budget, size=placement.held_bytes)
  # Two batches in flight only where they fit the budget of two (a source larger than one
  # batch is not read beside another).
  for batch, read in reader.stream(batched, placement.read, progress or reader.NullProgress(),
                                   placement.read_bytes, ahead=ahead, limit=2 * budget,
                                   size=lambda b: sum(map(placement.held_bytes, b))):
    _make(batch, read, placement, sink, budget)
    del read  # Free the batch before the next is read.
  with timing.phase('written'):
    return sink.close()


def _make(batch: Sequence[Any], read: Any, placement: Placement, sink: Sink, budget: int) -> None:
  """A batch's outputs into `sink`, handed over once `budget` bytes of them are held (a
  source made into many outputs is not held beside them all). Nothing made outlives the
  call: an output may be a view of what was read (a layer of a stack), which it would
  keep alive beside the next batch."""
  made: list[Made] = []
  held = 0
  for unit in batch:
    for output, value in timing.timed('made', placement.make(unit, read)):
      made.append((output, value))
      held += output.nbytes
      if held >= budget:
        _write(sink, made)
        made, held = [], 0
  if made:
    _write(sink, made)


def _write(sink: Sink, made: Sequence[Made]) -> None:
  with timing.phase('written'):
    sink.write(made)

"""Where a streaming run's time goes: seconds per phase, recorded only where asked for.

The streaming code marks its phases (`phase('read')`: a batch's read, on whichever thread
reads it; `waited`: the caller blocked on a read that goes ahead; `made`, `written`: the
executor's transforms and its sink); a caller that wants them (`orbax-tunix export
--timings`) runs the work inside `recorded()` and reads the sums. Nothing is recorded, and
next to nothing spent, outside `recorded()`. The phases overlap where reads go ahead of the
writes (`reader.stream`), so their sum may exceed the wall time.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
import time
from collections.abc import Iterable, Iterator
from typing import TypeVar

T = TypeVar('T')


class Timings:
  """Seconds per phase and how many times each ran, summed over threads."""

  def __init__(self):
    self._lock = threading.Lock()  # Phases end on several threads at once.
    self.seconds: dict[str, float] = {}
    self.counts: dict[str, int] = {}
    self.facts: dict[str, object] = {}

  def add(self, name: str, seconds: float) -> None:
    with self._lock:
      self.seconds[name] = self.seconds.get(name, 0.0) + seconds
      self.counts[name] = self.counts.get(name, 0) + 1


_CURRENT: contextvars.ContextVar[Timings | None] = contextvars.ContextVar(
    'orbax_tunix_timings', default=None)


@contextlib.contextmanager
def recorded() -> Iterator[Timings]:
  """Records the phases of the work inside (and of the threads it starts that copy its
  context, as `reader.stream`'s reading thread does)."""
  timings = Timings()
  token = _CURRENT.set(timings)
  try:
    yield timings
  finally:
    _CURRENT.reset(token)


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
  """Adds the block's wall time to phase `name`, where recording."""
  timings = _CURRENT.get()
  if timings is None:
    yield
    return
  start = time.monotonic()
  try:
    yield
  finally:
    timings.add(name, time.monotonic() - start)


def add(name: str, seconds: float) -> None:
  """Adds `seconds` to phase `name`, where recording."""
  timings = _CURRENT.get()
  if timings is not None:
    timings.add(name, seconds)


def timed(name: str, items: Iterable[T]) -> Iterator[T]:
  """`items`, the time taken to make each added to phase `name` (where recording)."""
  if _CURRENT.get() is None:
    yield from items
    return
  it = iter(items)
  while True:
    with phase(name):
      item = next(it, _END)
    if item is _END:
      return
    yield item


_END = object()


def note(name: str, value: object) -> None:
  """Records a fact of the run (e.g. the threads that wrote), where recording."""
  timings = _CURRENT.get()
  if timings is not None:
    timings.facts[name] = value

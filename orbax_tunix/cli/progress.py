"""Progress on the terminal, and stopping a long command cleanly.

The library's streaming tools report bytes done to a `reader.Progress`; here
it is drawn: a rich bar on a terminal (when rich is installed), one rewritten
line otherwise, and a line every `LOG_INTERVAL` seconds into a log. SIGINT,
SIGTERM and SIGHUP stop a conversion at the next batch, so that it removes
what it wrote.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any, TextIO

from orbax_tunix.cli.display import format_bytes, format_duration, is_tty
from orbax_tunix.reading import reader

try:  # rich is optional.
  import rich.console
  import rich.progress
except ImportError:  # pragma: no cover - exercised by hiding rich in a test.
  rich = None

# Seconds between progress lines when stderr is not a terminal.
LOG_INTERVAL = 10.0


class RichProgress:
  """A progress bar with bytes done, throughput and time left (rich)."""

  def __init__(self, stream: TextIO):
    self._progress = rich.progress.Progress(
        rich.progress.TextColumn('{task.description}'),
        rich.progress.BarColumn(),
        rich.progress.DownloadColumn(binary_units=True),
        rich.progress.TransferSpeedColumn(),
        rich.progress.TimeRemainingColumn(),
        console=rich.console.Console(file=stream),
        transient=True,
    )
    self._task = None

  def start(self, total_bytes: int, description: str) -> None:
    self._progress.start()
    self._task = self._progress.add_task(description, total=max(total_bytes, 1))

  def advance(self, nbytes: int) -> None:
    self._progress.advance(self._task, nbytes)

  def finish(self) -> None:
    self._progress.stop()


class LineProgress:
  """Progress as text: one rewritten line on a terminal, else a line every LOG_INTERVAL s."""

  def __init__(self, stream: TextIO, rewrite: bool):
    self._stream = stream
    self._rewrite = rewrite
    self.start(0, '')

  def start(self, total_bytes: int, description: str) -> None:
    self._total, self._done = max(total_bytes, 1), 0
    self._start = self._last = time.monotonic()
    self._description = description

  def line(self) -> str:
    elapsed = max(time.monotonic() - self._start, 1e-9)
    rate = self._done / elapsed
    left = (self._total - self._done) / rate if rate > 0 else 0.0
    return (
        f'{self._description}: {format_bytes(self._done)} / {format_bytes(self._total)}'
        f' ({100 * self._done / self._total:.0f}%), {format_bytes(int(rate))}/s,'
        f' {format_duration(left)} left'
    )

  def advance(self, nbytes: int) -> None:
    self._done += nbytes
    now = time.monotonic()
    if self._rewrite:
      if now - self._last < 0.1 and self._done < self._total:
        return
    elif now - self._last < LOG_INTERVAL:
      return  # In a log, a quick run shows only its summary.
    self._last = now
    self._stream.write('\r\x1b[2K' + self.line() if self._rewrite else self.line() + '\n')
    self._stream.flush()

  def finish(self) -> None:
    if self._rewrite:
      self._stream.write('\r\x1b[2K')
      self._stream.flush()


def make_progress(stream: TextIO, fancy: bool) -> Any:
  """The progress display suited to `stream` (stderr)."""
  if fancy and rich is not None and is_tty(stream):
    return RichProgress(stream)
  return LineProgress(stream, rewrite=is_tty(stream))


class Interruptible:
  """A `Progress` that stops the conversion at the next batch once signalled.

  A KeyboardInterrupt raised by a signal handler can land in a callback whose
  exceptions Python ignores (e.g. XLA's garbage-collection hook) and be lost,
  and is not raised at all inside an Orbax call's event loop (see
  `signals_stop`); the flag makes the stop certain, at the latest after the
  current batch.
  """

  def __init__(self, inner: reader.Progress):
    self._inner = inner
    self.stop = threading.Event()

  def start(self, total_bytes: int, description: str) -> None:
    self._inner.start(total_bytes, description)

  def advance(self, nbytes: int) -> None:
    self._inner.advance(nbytes)
    if self.stop.is_set():
      raise KeyboardInterrupt

  def finish(self) -> None:
    self._inner.finish()


def _in_event_loop() -> bool:
  try:
    asyncio.get_running_loop()
  except RuntimeError:
    return False
  return True


@contextlib.contextmanager
def signals_stop(progress: Interruptible) -> Iterator[None]:
  """SIGINT, SIGTERM and SIGHUP stop the conversion, so its temporary files are removed."""

  def handler(signum: int, frame: Any) -> None:
    del signum, frame
    progress.stop.set()
    # Raised inside a running asyncio loop (an Orbax read or write), the interrupt
    # can drop a queued callback (a task's wake-up) and leave the interrupted
    # call's tasks waiting forever; there the stop waits for the batch's end.
    if not _in_event_loop():
      raise KeyboardInterrupt

  try:
    previous = {
        sig: signal.signal(sig, handler)
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    }
  except ValueError:  # Not the main thread: leave signals alone.
    yield
    return
  try:
    yield
  finally:
    for sig, old in previous.items():
      signal.signal(sig, old)

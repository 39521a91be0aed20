"""What the command does around its work: the output streams guarded against a reader that
goes away (`| head -1`) or a file that fails, and the noise of libraries silenced (their
warnings, their logs, asyncio's reports at shutdown).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import warnings
from collections.abc import Iterator
from typing import Any

EXIT_OK = 0
EXIT_ERROR = 2

# Libraries that log (tracebacks included) about failures this command reports
# itself: Orbax, JAX, asyncio, and the bucket clients (gcsfs logs each retry).
NOISY_LOGGERS = ('absl', 'jax', 'orbax', 'asyncio', 'gcsfs', 'fsspec', 'google', 'aiohttp',
                 'urllib3')


@contextlib.contextmanager
def quiet(debug: bool) -> Iterator[None]:
  """Silences Orbax's and JAX's warnings and logs, unless debugging.

  Their errors are silenced too: every failure reaches `main` as an
  exception, which prints one message saying what to do.
  """
  if debug:
    yield
    return
  loggers = [logging.getLogger(name) for name in NOISY_LOGGERS]
  levels = [lg.level for lg in loggers]
  with warnings.catch_warnings():
    warnings.simplefilter('ignore')
    for lg in loggers:
      lg.setLevel(logging.CRITICAL)
    try:
      yield
    finally:
      for lg, level in zip(loggers, levels, strict=True):
        lg.setLevel(level)


# What Python reports, with a traceback, about Orbax's asyncio loop when a
# command stops midway: callbacks still queued on a loop that closed, a loop
# collected while running or half made, and (after Ctrl-C or a signal) the interrupt
# landing in a callback whose exceptions Python ignores. The command itself
# stops cleanly either way (see `progress.Interruptible`).
LOOP_NOISE = ('Event loop is closed', 'Cannot close a running event loop')


def is_shutdown_noise(exc: BaseException | None) -> bool:
  return isinstance(exc, KeyboardInterrupt) or (
      isinstance(exc, RuntimeError) and str(exc) in LOOP_NOISE)


def silence_shutdown_noise() -> None:
  """Drops Python's reports of asyncio noise at a command's end (see `LOOP_NOISE`).

  Every other report is kept; --debug keeps them all.
  """
  if getattr(sys.unraisablehook, 'orbax_tunix', False):
    return  # Already installed (main may run many times in one process).
  unraisable, in_thread = sys.unraisablehook, threading.excepthook
  warnings.filterwarnings('ignore', message='coroutine .* was never awaited', category=RuntimeWarning)

  def on_unraisable(report: Any) -> None:
    # An interrupted loop's own finalizer may fail too (it was half made).
    in_loop_finalizer = getattr(report.object, '__qualname__', '') == 'BaseEventLoop.__del__'
    if not (is_shutdown_noise(report.exc_value) or in_loop_finalizer):
      unraisable(report)

  def on_thread_error(report: Any) -> None:
    if not is_shutdown_noise(report.exc_value):
      in_thread(report)

  on_unraisable.orbax_tunix = True
  sys.unraisablehook, threading.excepthook = on_unraisable, on_thread_error


class ClosedPipeGuard:
  """A text stream whose reader may go away (`orbax-tunix diff A B | head -1`), or whose
  file may fail (a log on a full disk: `> /dev/full`).

  A write or flush that fails points the stream's file descriptor at /dev/null
  (so that Python's own flush at exit succeeds too) and drops that output and
  all that follows; the command itself goes on, and its exit status is its
  result's (see `main`). A failure other than a closed pipe is kept in
  `failed`, for `main` to tell. Everything else is the wrapped stream's.
  """

  def __init__(self, stream: Any):
    self._stream = stream
    self.closed_pipe = False
    self.failed: OSError | None = None

  def write(self, text: str) -> int:
    if not self.closed_pipe:
      try:
        return self._stream.write(text)
      except OSError as e:
        self._drop(e)
    return len(text)

  def flush(self) -> None:
    if not self.closed_pipe:
      try:
        self._stream.flush()
      except OSError as e:
        self._drop(e)

  def _drop(self, error: OSError) -> None:
    self.closed_pipe = True
    if not isinstance(error, BrokenPipeError):
      self.failed = error
    with contextlib.suppress(OSError, ValueError, AttributeError):
      devnull = os.open(os.devnull, os.O_WRONLY)
      try:
        os.dup2(devnull, self._stream.fileno())
      finally:
        os.close(devnull)

  def __getattr__(self, name: str) -> Any:
    return getattr(self._stream, name)


@contextlib.contextmanager
def guarded_output() -> Iterator[ClosedPipeGuard]:
  """stdout and stderr wrapped in `ClosedPipeGuard`s for the command, then flushed
  (a closed pipe found then is dropped too) and put back; yields stdout's guard."""
  saved = sys.stdout, sys.stderr
  sys.stdout, sys.stderr = ClosedPipeGuard(sys.stdout), ClosedPipeGuard(sys.stderr)
  guard = sys.stdout
  try:
    yield guard
  finally:
    for each in (sys.stdout, sys.stderr):
      each.flush()
    sys.stdout, sys.stderr = saved


# Commands whose work is what they write at DST: their status is the work's, and a
# summary that could not be printed is a note. The others' result is their output.
WRITERS = ('convert', 'export')


def output_failed(command: str | None, failed: OSError, code: int) -> int:
  """Tells (on stderr) that stdout could not be written, and returns the status: the
  work's for a command that writes DST; else an error where the result was all fine."""
  words = failed.strerror or str(failed) or type(failed).__name__
  if command in WRITERS and code == EXIT_OK:
    message = (f'orbax-tunix: note: the summary could not be written to stdout ({words});'
               ' the work itself is done: DST is complete.')
  else:
    message = f'orbax-tunix: error: the output could not be written to stdout ({words}).'
    code = EXIT_ERROR if code == EXIT_OK else code
  with contextlib.suppress(OSError, ValueError):
    print(message, file=sys.stderr, flush=True)
  return code

"""Running a coroutine on an event loop of its own, leaving nothing running when it fails.

Plain asyncio and threading, no Orbax API: `_orbax.tidy_failures` puts
`run_tidily` in the place of Orbax's own new-loop runner, and waits with
`wait_for_threads` for the threads a failed save started.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from typing import Any

# How long a failed (or interrupted) call's writes are waited for, in seconds: its
# loop's tasks (`run_tidily`) and the threads it started (`wait_for_threads`).
PENDING_WRITES_TIMEOUT = 300.0


def drain(loop: asyncio.AbstractEventLoop) -> None:
  """Cancels and awaits every task left on `loop`, and runs the callbacks due
  (which retrieve the exceptions of tasks that finished meanwhile)."""
  pending = asyncio.all_tasks(loop)
  for task in pending:
    task.cancel()
  loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))


def finish(loop: asyncio.AbstractEventLoop) -> None:
  """Lets every task left on `loop` run to its end (an interrupted save's writes):
  the caller removes what they write only once they are done. Interrupts that
  arrive meanwhile are ignored; `PENDING_WRITES_TIMEOUT` bounds the wait."""
  pending = asyncio.all_tasks(loop)
  if not pending:
    return
  # One waiting task, resumed when an interrupt (or a task re-raising one) stops the loop.
  waiting = loop.create_task(asyncio.wait(pending, timeout=PENDING_WRITES_TIMEOUT))
  while not waiting.done():
    with contextlib.suppress(KeyboardInterrupt):
      loop.run_until_complete(waiting)
  for task in pending:  # Retrieved: Python would report them when collected.
    if task.done() and not task.cancelled():
      task.exception()


def run_tidily(coro: Any) -> Any:
  """`coro`'s result, run to completion on a new event loop (closed after it).

  When it fails, the tasks it left are cancelled and awaited (`drain`), every
  exception retrieved, before the loop closes; when it is interrupted
  (KeyboardInterrupt, SystemExit), they are let finish (`finish`). Either way
  the failure itself is raised.
  """
  loop = _dropping_late_posts(asyncio.new_event_loop())
  try:
    asyncio.set_event_loop(loop)
    try:
      return loop.run_until_complete(coro)
    except Exception:
      with contextlib.suppress(Exception):  # Best effort: the failure itself is raised.
        drain(loop)
      raise
    except BaseException:
      with contextlib.suppress(Exception):
        finish(loop)
      raise
  finally:
    asyncio.set_event_loop(None)
    loop.close()


def _dropping_late_posts(loop: asyncio.AbstractEventLoop) -> asyncio.AbstractEventLoop:
  """`loop`, whose `call_soon_threadsafe` drops what a thread posts after it closed.

  TensorStore resolves the asyncio future that awaits one of its reads or writes by
  posting to the loop from its own thread (`call_soon_threadsafe`, looked up when it
  posts). An operation that `drain` cancelled may complete just as the loop closes; its
  post then raises "Event loop is closed", which TensorStore reports as unraisable, at
  some later time. Its task was cancelled and awaited already: nothing is waiting for it.
  """
  post = loop.call_soon_threadsafe

  def call_soon_threadsafe(callback: Any, *args: Any, context: Any = None) -> Any:
    try:
      return post(callback, *args, context=context)
    except RuntimeError:
      if not loop.is_closed():
        raise
      return None

  loop.call_soon_threadsafe = call_soon_threadsafe  # type: ignore[method-assign]
  return loop


def wait_for_threads(before: set[threading.Thread]) -> None:
  """Waits for the threads started since `before`, up to `PENDING_WRITES_TIMEOUT`
  (interrupts meanwhile are ignored: the clean-up that follows needs them done)."""
  deadline = time.monotonic() + PENDING_WRITES_TIMEOUT
  for thread in threading.enumerate():
    # A thread Python did not start (TensorStore's, once it ran Python code) is listed as
    # threading's stand-in, which cannot be joined (its join fails an assertion).
    if (thread in before or thread is threading.current_thread()
        or isinstance(thread, threading._DummyThread)):  # pylint: disable=protected-access
      continue
    while thread.is_alive() and time.monotonic() < deadline:
      try:
        # The base class's join: Orbax's threads raise TimeoutError from theirs.
        threading.Thread.join(thread, 0.05)
      except KeyboardInterrupt:
        continue

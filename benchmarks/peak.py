"""Wall time and peak memory of one call, and rounds of fresh processes that run it.

Peak memory is Linux's VmHWM after resetting it to the current RSS
(`/proc/self/clear_refs`, Linux >= 4.0): what the call added at its worst.
The benchmark scripts that compare contenders side by side share these.
"""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any


def status_kb(field: str) -> int:
  """A `/proc/self/status` field in kB (VmRSS, VmHWM)."""
  with open('/proc/self/status') as f:
    for line in f:
      if line.startswith(field + ':'):
        return int(line.split()[1])
  raise KeyError(field)


def reset_peak() -> bool:
  """Resets VmHWM to the current RSS; False when not allowed."""
  try:
    with open('/proc/self/clear_refs', 'w') as f:
      f.write('5')
    return True
  except OSError:
    return False


def measure(call: Callable[[], Any]) -> tuple[Any, dict[str, float]]:
  """Runs `call` (which must block until its result is ready) once.

  Returns:
    (its result, {'wall_s', 'peak_above_kb'}): the peak above the RSS before
    the call.

  Raises:
    OSError: the peak cannot be reset here (not Linux, or not allowed).
  """
  gc.collect()
  rss0 = status_kb('VmRSS')
  if not reset_peak():
    raise OSError('cannot reset VmHWM (/proc/self/clear_refs): no peak to measure')
  t0 = time.perf_counter()
  out = call()
  wall = time.perf_counter() - t0
  return out, {'wall_s': wall, 'peak_above_kb': status_kb('VmHWM') - rss0}


def rounds(script: str, contenders: Sequence[str], reps: int,
           argv: Sequence[str]) -> dict[str, list[dict[str, Any]]]:
  """Each contender `reps` times, each run a fresh `script --child NAME *argv`.

  The order rotates from round to round, so that drift on a shared machine
  falls on every contender alike. A child prints its result as its last
  JSON line.
  """
  results: dict[str, list[dict[str, Any]]] = {name: [] for name in contenders}
  for rep in range(reps):
    k = rep % len(contenders)
    for name in (*contenders[k:], *contenders[:k]):
      done = subprocess.run([sys.executable, script, '--child', name, *argv],
                            capture_output=True, text=True, check=True)
      line = [x for x in done.stdout.splitlines() if x.startswith('{')][-1]
      results[name].append(json.loads(line))
      print(name, results[name][-1], flush=True)
  return results

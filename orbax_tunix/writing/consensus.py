"""Agreement between the processes of a job, through JAX's key-value store.

Every process calls the same rounds in the same order: `exchange` (every
process's text), `broadcast` (process 0's), `barrier`, `agree` (an outcome:
raised on every process if any failed) and `agree_on` (every process's account
of its work, compared before any is done). A process that fails mid-way
`announce`s it, so the others stop waiting for it. On one process each round
is its own answer.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import time
from collections.abc import Collection, Mapping
from typing import Any

from orbax_tunix import errors
from orbax_tunix.writing import job

# How long a process waits for the others to report an outcome (ms). Long:
# processes with more to do finish later; a process that dies is found sooner
# by JAX's heartbeat, which ends every process.
WAIT_MS = 24 * 3600 * 1000

_rounds = itertools.count()
# Which `staging.staged` run failures are announced for (every process counts alike).
_runs_started = itertools.count()
_run = -1
# How often a waiting process looks for the others' reports (ms): at most (first:
# `job.POLL_MS`).
MAX_POLL_MS = 1000
# The rounds where every process reports its outcome, failed or not.
OUTCOME_ROUNDS = ('write', 'commit')
# The rounds of a `staged` run, each once per run: keyed by the run, not by the
# call count, which differs between processes once one has left the block early
# (a failure) while the others took part in more rounds inside it (`checksums`).
RUN_ROUNDS = ('open', 'visible', 'write', 'commit', 'replaced')


def new_run() -> None:
  """Starts a `staging.staged` run: its rounds (`RUN_ROUNDS`) and the failures announced
  in it are keyed by it, so a failure announced in an earlier run stops nothing here."""
  global _run
  _run = next(_runs_started)


def exchange(name: str, text: str, timeout_ms: int = WAIT_MS) -> list[str]:
  """Every process's `text`, in process order (each process calls this in the same order).

  A barrier: returns once every process reported. Keys are numbered by call (a
  `staging.staged` run's own rounds, `RUN_ROUNDS`, by the run), so the same `name` may be
  used again. While waiting it watches for a failure another process announced
  (`announce`), so that a process that failed mid-way does not leave the others waiting
  for it.

  Raises:
    DistributedError: another process announced a failure, or one did not
      report within `timeout_ms`.
  """
  if not job.active():
    return [text]
  key = (f'{job.KEY_PREFIX}/run-{_run}/{name}' if name in RUN_ROUNDS
         else f'{job.KEY_PREFIX}/{next(_rounds)}/{name}')
  client = job.key_value_store()
  client.key_value_set(f'{key}/{job.process_index()}', text)
  waited, pause = 0, job.POLL_MS
  while True:
    # One request for every report so far (not one per process: N hosts poll).
    got = {int(k.rsplit('/', 1)[-1]): v for k, v in client.key_value_dir_get(f'{key}/')}
    if len(got) == job.process_count():
      return [got[i] for i in range(job.process_count())]
    # A failure announced stops every wait but the outcome rounds themselves
    # (every process reaches those). A process that dies is found by JAX's
    # heartbeat, which ends every process of the job.
    failed = None if name in OUTCOME_ROUNDS else _announced(client)
    if failed:
      raise errors.DistributedError(
          f'{failed.rstrip(".")}. This process stopped waiting ({name}); nothing was committed.')
    if waited >= timeout_ms:
      missing = sorted(set(range(job.process_count())) - set(got))
      raise errors.DistributedError(
          f'processes {missing} did not report {name!r} within {timeout_ms // 1000} s: they may'
          ' have died or hung. Nothing was committed; check their logs.')
    time.sleep(pause / 1000)
    waited += pause
    pause = min(2 * pause, MAX_POLL_MS)  # Long waits (a slower process) poll less.


def announce(failure: str) -> None:
  """Tells every process, wherever it waits, that this one failed."""
  if job.active():
    with contextlib.suppress(Exception):
      job.key_value_store().key_value_set(
          f'{job.KEY_PREFIX}/failed/{_run}/{job.process_index()}', failure, allow_overwrite=True)


def _announced(client: Any) -> str | None:
  """A failure another process announced, as a sentence, or None."""
  try:
    found = client.key_value_dir_get(f'{job.KEY_PREFIX}/failed/{_run}/')
  except Exception:  # noqa: BLE001
    return None
  if not found:
    return None
  key, why = sorted(found)[0]
  return f'process {key.rsplit("/", 1)[-1]} failed: {why}'


def broadcast(name: str, text: str | None) -> str:
  """Process 0's `text` on every process (others pass None)."""
  return exchange(name, text if job.is_primary() else '')[0]


def agree(name: str, failure: str | None) -> None:
  """Reports this process's outcome and raises on every process if any failed.

  Raises:
    DistributedError: naming each failed process and its message.
  """
  found = exchange(name, json.dumps(failure))
  failed = [(i, json.loads(t)) for i, t in enumerate(found) if json.loads(t) is not None]
  if failed:
    lines = '\n'.join(f'  process {i}: {why}' for i, why in failed)
    raise errors.DistributedError(
        f'{len(failed)} of {len(found)} processes failed ({name}); nothing was committed:\n{lines}')


def agree_on(name: str, fields: Mapping[str, str] | None,
             failure: BaseException | None = None, *, given: Collection[str] = ()) -> None:
  """Every process's account of its work compared, before any is done (collective).

  Each process passes its `fields` (what it was asked to do, field by field),
  or, when it could not even work that out, its `failure`; every process
  reaches this round either way, so none waits for a process that failed.
  `given` names the fields that are what the caller was given (its options):
  where one of those differs, the message lists those (the others follow from
  them, and are only named).

  Raises:
    DistributedError: on every process whose own `failure` is None: naming
      each process that failed and why, or each field whose value differs
      and every process's value. A process with its own failure returns
      (it raises that itself).
  """
  if not job.active():
    return
  reports = [json.loads(t) for t in exchange(name, json.dumps(
      {'fields': None if failure is not None else dict(fields or {}),
       'failure': None if failure is None else failure_of(failure), 'given': sorted(given)}))]
  failed = [(i, r['failure']) for i, r in enumerate(reports) if r['failure'] is not None]
  if failure is not None:
    return
  if failed:
    lines = '\n'.join(f'  process {i}: {why}' for i, why in failed)
    raise errors.DistributedError(
        f'{len(failed)} of {len(reports)} processes failed ({name}); nothing was'
        f' written:\n{lines}')
  values = [r['fields'] for r in reports]
  differ = [key for key in dict.fromkeys(k for v in values for k in v)
            if len({v.get(key) for v in values}) > 1]
  if differ:
    given = {key for r in reports for key in r['given']}  # An option one process alone got.
    options = [key for key in differ if key in given]
    shown = options or differ
    made = [key for key in differ if key not in shown]
    lines = '\n'.join(f'  {key}: ' + '; '.join(f'process {i}: {v.get(key, "(not given)")}'
                                              for i, v in enumerate(values)) for key in shown)
    what = 'options' if options else 'work'
    follows = f', and so {", ".join(made)}' if made else ''
    raise errors.DistributedError(
        f'the processes were given different {what} ({", ".join(shown)}{follows} differ):'
        ' give every process the same source, step, destination and options (a path: the'
        f' same absolute path or bucket URL on every host). Nothing was written:\n{lines}')


def failure_of(e: BaseException) -> str:
  """How a process's failure is told to the others: this package's errors as they say it,
  any other with its type."""
  if isinstance(e, KeyboardInterrupt):
    return 'interrupted'
  return f'{type(e).__name__}: {e}' if not isinstance(e, errors.TunixCheckpointError) else str(e)


def barrier(name: str) -> None:
  """Every process waits here for the others (no-op on one process)."""
  exchange(name, '')

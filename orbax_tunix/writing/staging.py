"""Staging and the one commit, for one process or all the processes of a job.

`staged` is `commit.staged` on one process; across processes, process 0 stages and
commits once, and every process agrees first that it sees the staging and that every
process wrote its part (`consensus`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from collections.abc import Collection, Iterator, Sequence
from typing import Any

from etils import epath

from orbax_tunix import errors
from orbax_tunix.writing import commit, consensus, job


@dataclasses.dataclass
class SharedStaging:
  """What `staged` yields on every process: the shared work directory.

  Attributes:
    work: where every process writes its part.
    replaced: whether an old destination was replaced (set after commit).
  """

  work: epath.Path
  replaced: bool = False


@contextlib.contextmanager
def staged(dst: epath.Path, force: bool, kind: commit.Kind = commit.STEP, nbytes: int = 0,
           sources: Sequence[epath.Path] = (), entries: Collection[str] = ()) -> Iterator[Any]:
  """`commit.staged` for one or several processes.

  One process: exactly `commit.staged`. Several: process 0 opens the staging
  directory and says where it is; every process checks that it sees it (a
  destination some hosts cannot reach is refused on every process before any
  array is written); the block runs on every process; process 0 commits only
  when every process reports success, then every process learns the outcome.

  Raises:
    DistributedError: some process failed (its message included), or cannot
      see the destination; the staging is removed and nothing is committed.
      A process's own failure is raised there as itself.
  """
  if not job.active():
    with commit.staged(dst, force, kind, nbytes, sources, entries) as staging:
      yield staging
    return
  consensus.new_run()  # A failure announced in an earlier run stops nothing here.
  stack = contextlib.ExitStack()
  opened, own = None, None
  if job.is_primary():
    try:
      opened = stack.enter_context(commit.staged(dst, force, kind, nbytes, sources, entries))
    except BaseException as e:  # noqa: BLE001 - told to every process, then raised.
      own = e
  first = json.loads(consensus.broadcast('open', json.dumps(
      [None if own is None else consensus.failure_of(own), opened and os.fspath(opened.work),
       os.fspath(dst)])))
  if own is not None:
    raise own
  if first[0] is not None:
    raise errors.DistributedError(f'process 0 could not start writing {dst}: {first[0]}')
  shared = opened or SharedStaging(epath.Path(first[1]))

  def abandon(error: BaseException) -> None:
    """Process 0 removes the staging: `commit.staged` ends with `error`, its clean-up run
    here, once (left to the collector, it ran later and raised there, unseen)."""
    if opened is not None:
      with contextlib.suppress(Exception):  # It re-raises `error`, or what it maps it to.
        stack.__exit__(type(error), error, error.__traceback__)

  if first[2] != os.fspath(dst):
    seen = (f'this process was given the destination {dst}, process 0 {first[2]}: give every'
            ' process the same absolute path or bucket URL.')
  else:
    seen = None if shared.work.exists() else (
        f'{shared.work}, the staging directory process 0 created for {dst}, is not visible'
        ' from this process: every host must write to the same storage (a bucket, or a'
        ' shared filesystem mounted at the same path on every host).')
  try:
    consensus.agree('visible', seen)
  except errors.DistributedError as e:
    abandon(e)
    raise
  try:
    yield shared
  except BaseException as e:  # noqa: BLE001 - reported, then raised on every process.
    own = e
    consensus.announce(consensus.failure_of(e))
  try:
    consensus.agree('write', None if own is None else consensus.failure_of(own))
  except errors.DistributedError as e:
    abandon(e if own is None else own)
    if own is not None:
      # This process's own failure, as one process alone says it (a full disk: the
      # destination's failure, `commit.write_failure`); another process's as it is.
      failure = own if isinstance(own, errors.DistributedError) else (
          commit.write_failure(dst, own, nbytes) or own)
      raise failure from (None if failure is own else own)
    raise
  if opened is not None:
    try:
      stack.close()  # commit.staged commits.
    except BaseException as e:  # noqa: BLE001 - told to every process.
      own = e
  try:
    consensus.agree('commit', None if own is None else consensus.failure_of(own))
  except errors.DistributedError:
    if own is not None:
      raise own from None
    raise
  shared.replaced = consensus.broadcast(
      'replaced', json.dumps(bool(getattr(opened, 'replaced', False)))) == 'true'

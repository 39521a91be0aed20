"""Convert and export across hosts: one process per host under JAX's own runtime.

The same command runs once per host. The processes find each other as JAX's
multi-controller runtime does (`jax.distributed.initialize`, from explicit
flags or its own cluster auto-detection), and coordinate only through that
runtime's key-value store and barriers (as Orbax's multi-host save does);
given explicit flags, they first meet process 0 at the coordinator's port
(`rendezvous`), so that a job that cannot form is reported rather than
aborted by JAX. Every process's plan is compared with the others'
(`agree_on`) before anything is written. What is shared out:

- `convert`: every array is placed on the global mesh of all processes'
  devices (`placement`), so each process reads and writes only its own
  shards; Orbax's multi-host save writes them, and the primary process merges
  and commits the step once (`staged`). Checksums are combined from one
  CRC-32 share per process (`checksums_of`).
- `export`: the safetensors files are dealt out to the processes by bytes
  (`mine`); each reads whole tensors for its own files only.

Every multi-process run goes through `staged`, which commits only when every
process succeeded. A process that dies is found by JAX's own heartbeat, which
ends every other process (non-zero exit); what is left is a staging
directory, which readers skip, never a finished-looking output.

On one process (no `jax.distributed`), nothing here changes anything.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import json
import math
import os
import sys
import threading
import time
import zlib
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from orbax_tunix import errors
from orbax_tunix.store import _orbax
from orbax_tunix.writing import checksums, commit, rendezvous

# How long a process waits for the others to report an outcome (ms). Long:
# processes with more to do finish later; a process that dies is found sooner
# by JAX's heartbeat, which ends every process.
WAIT_MS = 24 * 3600 * 1000
# The prefix of every key this module puts in JAX's key-value store.
KEY_PREFIX = 'orbax_tunix'

_rounds = itertools.count()
# Which `staged` run failures are announced for (every process counts alike).
_runs_started = itertools.count()
_run = -1
# How often a waiting process looks for the others' reports (ms): first, and at most.
POLL_MS = 50
MAX_POLL_MS = 1000
# The rounds where every process reports its outcome, failed or not.
OUTCOME_ROUNDS = ('write', 'commit')
# The rounds of a `staged` run, each once per run: keyed by the run, not by the
# call count, which differs between processes once one has left the block early
# (a failure) while the others took part in more rounds inside it (`checksums`).
RUN_ROUNDS = ('open', 'visible', 'write', 'commit', 'replaced')
# How long a failed process waits for the others before it exits (ms).
LEAVE_WAIT_MS = 10_000
LEAVE_LAST_S = 1.0


# How long a job may take to form (s), unless `initialization_timeout` says: one the options
# describe (processes started by hand may come late), one JAX's cluster detection found (its
# processes start together; a host where the job cannot form is told so within a minute).
GIVEN_TIMEOUT_S = 300
DETECTED_TIMEOUT_S = 60
# How long reading a detected cluster's description may take (s): JAX's metadata queries
# retry for minutes where a name does not resolve.
DESCRIBE_S = 20


@dataclasses.dataclass(frozen=True)
class JobOptions:
  """How to join a multi-process job (JAX's `jax.distributed.initialize` names).

  Attributes:
    coordinator_address: HOST:PORT of process 0's coordinator (None: auto-detect).
    num_processes: the number of processes (None: auto-detect; 1: one process, whatever
      cluster this host is in, nothing detected).
    process_id: this process's index (None: auto-detect).
    initialization_timeout: seconds to wait for every process to join; also
      how long a silent process is taken for alive (JAX's heartbeat timeout).
      None: `GIVEN_TIMEOUT_S` for a job the options describe, `DETECTED_TIMEOUT_S`
      for one JAX's cluster detection found.
  """

  coordinator_address: str | None = None
  num_processes: int | None = None
  process_id: int | None = None
  initialization_timeout: int | None = None

  @property
  def explicit(self) -> bool:
    return any(v is not None for v in (self.coordinator_address, self.num_processes,
                                       self.process_id))


@dataclasses.dataclass(frozen=True)
class Job:
  """The multi-process job a process is to join.

  Attributes:
    address: process 0's coordinator.
    num_processes, process_id: the job's size and this process's index.
    cluster: the cluster JAX's detection found, where it told any of them (None: the
      options told them all).
  """

  address: rendezvous.Address
  num_processes: int
  process_id: int
  cluster: str | None = None


def is_initialized() -> bool:
  """Whether this process already joined a `jax.distributed` job."""
  return ocp.multihost.is_jax_distributed_client_initialized()


def _within(seconds: float, call: Callable[[], Any], what: str) -> Any:
  """`call()` on a thread of its own, waited for at most `seconds` (left running after:
  a metadata query blocked on a name cannot be stopped, and ends with the process).

  Raises:
    TimeoutError: no answer within `seconds`; else what `call` raised.
  """
  box: dict[str, Any] = {}

  def run() -> None:
    try:
      box['value'] = call()
    except BaseException as e:  # noqa: BLE001 - raised in the caller's thread.
      box['error'] = e

  thread = threading.Thread(target=run, name='orbax_tunix-cluster', daemon=True)
  thread.start()
  thread.join(max(seconds, 0.0))
  if thread.is_alive():
    raise TimeoutError(f'{what}: no answer within {seconds:.0f} s')
  if 'error' in box:
    raise box['error']
  return box['value']


def _detect(seconds: float = DESCRIBE_S) -> type | None:
  """The cluster environment JAX's auto-detection finds, as its own `initialize()` walks
  them (`_orbax.jax_cluster_types`; opt-in methods, mpi4py, not probed), or None. A probe
  that fails or does not answer within `seconds` (GCE's asks the metadata server) finds
  nothing."""
  deadline = time.monotonic() + seconds
  for env in _orbax.jax_cluster_types():
    if env.opt_in_only_method:
      continue
    with contextlib.suppress(Exception):
      if _within(deadline - time.monotonic(), env.is_env_present, env.__name__):
        return env
  return None


def cluster_detected() -> str | None:
  """The name of the cluster JAX's auto-detection finds (TPU pod, Slurm, Open MPI, ...), or
  None."""
  env = _detect()
  return None if env is None else env.__name__


def _process_count(env: type) -> int:
  """The number of processes of the job the cluster `env` describes, as JAX counts them.

  A TPU slice of one host (JAX's own list of its workers, `_orbax.jax_tpu_slice_hosts`) is
  one process unless several slices make the job: `MEGASCALE_NUM_SLICES`, which JAX reads
  from the environment, else from the metadata server. That server is not asked where
  `TPU_SKIP_MDS_QUERY` is set (JAX's own sign that the host has none) and, where it does not
  answer, one slice is taken: a job of several slices is described by it, and none forms
  without it.
  """
  hosts = _orbax.jax_tpu_slice_hosts(env)
  one_host = hosts is not None and len(hosts) == 1 and not os.environ.get('MEGASCALE_NUM_SLICES')
  if one_host and os.environ.get('TPU_SKIP_MDS_QUERY'):
    return 1
  try:
    return int(env.get_process_count())
  except Exception:  # noqa: BLE001
    if one_host:
      return 1
    raise


# What to do where a detected cluster's job cannot form.
WHAT_TO_DO = (' To run as one process on this host, pass `num_processes=1`; to form the job,'
              ' start the same command on every host of the job at once, or give each process'
              ' the same `coordinator_address` (process 0\'s HOST:PORT) and `num_processes`'
              ' and its own `process_id`.')


def _job(options: JobOptions, address: rendezvous.Address | None, seconds: float
         ) -> Job | None:
  """The job the options describe, what they leave open read from JAX's cluster detection
  (within `seconds`); None: one process (no cluster, or one of a single process).

  Raises:
    DistributedError: a cluster whose description could not be read, or a process id
      outside its count; options that leave something open where no cluster is found.
  """
  if address is None and os.environ.get('JAX_COORDINATOR_ADDRESS'):
    address = rendezvous.parse_address(os.environ['JAX_COORDINATOR_ADDRESS'])  # As JAX does.
  count, me = options.num_processes, options.process_id
  if None not in (address, count, me):
    return Job(address, count, me)
  deadline = time.monotonic() + seconds
  env = _detect(seconds)
  if env is None:
    if not options.explicit:
      return None
    left = [f'`{n}`' for n, v in (('coordinator_address', address), ('num_processes', count),
                                   ('process_id', me)) if v is None]
    raise errors.DistributedError(
        f'{" and ".join(left)} not given, and JAX\'s cluster detection (TPU pods, Slurm, Open'
        ' MPI) finds no cluster to take them from: give every process the same'
        ' `coordinator_address` and `num_processes` and its own `process_id`, or pass'
        ' `num_processes=1` to run as one process.')
  name = env.__name__
  try:
    if count is None:
      count = _within(deadline - time.monotonic(), lambda: _process_count(env), name)
    if count == 1:
      return None
    if me is None:
      me = int(_within(deadline - time.monotonic(), env.get_process_id, name))
    if address is None:
      text = _within(deadline - time.monotonic(), lambda: env.get_coordinator_address(
          max(1, int(deadline - time.monotonic())), os.environ.get('JAX_COORDINATOR_PORT')),
                     name)
      address = rendezvous.parse_address(text)
  except Exception as e:  # noqa: BLE001 - JAX raises several kinds; all mean one thing.
    raise errors.DistributedError(
        f'JAX\'s cluster detection finds this host in a cluster ({name}) but could not read'
        f' its job ({"" if count is None else f"{count} processes; "}which process this is and'
        f' where process 0 is) within {seconds:.0f} s: {_first_line(e)}.'
        + WHAT_TO_DO) from e
  if not 0 <= me < count:
    raise errors.DistributedError(
        f'JAX\'s cluster detection ({name}) makes this process {me} of {count}: expected 0 to'
        f' {count - 1}.' + WHAT_TO_DO)
  return Job(address, count, me, name)


def check(options: JobOptions) -> rendezvous.Address | None:
  """The options' values, checked before anything waits on them.

  Returns:
    The coordinator's address (None: not given, JAX's cluster detection finds it).

  Raises:
    InvalidOptionError: naming the option: an address that is not HOST:PORT,
      a timeout that is not a positive number of seconds, a process count
      below 1, a process id outside 0 to N-1.
  """
  timeout = options.initialization_timeout
  if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, int)
                              or timeout <= 0):
    raise errors.InvalidOptionError(
        f'`initialization_timeout` {timeout!r}: expected a whole number of seconds above 0'
        ' (how long every process waits for the others to join).')
  count, me = options.num_processes, options.process_id
  if count is not None and count < 1:
    raise errors.InvalidOptionError(
        f'`num_processes` {count}: expected the number of processes of the job, 1 or more.')
  if me is not None and (me < 0 or (count is not None and me >= count)):
    upto = '' if count is None else f' to {count - 1} (`num_processes={count}`)'
    raise errors.InvalidOptionError(
        f'`process_id` {me}: expected this process\'s index, 0{upto}, each process its own.')
  if options.coordinator_address is None:
    return None
  return rendezvous.parse_address(options.coordinator_address)


def initialize(options: JobOptions = JobOptions()) -> bool:
  """Joins the job the options (or the cluster's environment) describe.

  Nothing happens when the process already joined one (an API caller did);
  when `num_processes` is 1 (nothing is detected); when no option is given and
  JAX detects no cluster, or one of a single process (a TPU VM of one host): one
  process, as before. Otherwise the job's processes first meet process 0 at
  its address (`rendezvous`, bounded by the timeout; see the module's
  docstring), then join JAX's runtime with every value given (JAX detects
  nothing more). On CPU the processes talk through JAX's gloo collectives.

  Returns:
    Whether this process is now part of a multi-process job.

  Raises:
    InvalidOptionError: an option out of range (`check`).
    DistributedError: the job could not be formed (a process missing, a port
      that does not answer or is taken, a process count that disagrees, two
      processes given one id, a detected cluster whose job cannot be read),
      naming the options and what to do: run as one process, or start every
      process.
  """
  if is_initialized():
    return jax.process_count() > 1
  address = check(options)
  if options.num_processes == 1:
    return False  # One process, whatever cluster this host is in.
  t0 = time.monotonic()
  given = options.initialization_timeout
  job = _job(options, address, min(DESCRIBE_S, given or DESCRIBE_S))
  if job is None:
    return False
  timeout = given or (GIVEN_TIMEOUT_S if job.cluster is None else DETECTED_TIMEOUT_S)
  found = (f'coordinator {job.address}, {job.num_processes} processes, process id'
           f' {job.process_id}')
  if job.cluster is not None:
    found = f'the job JAX\'s cluster detection finds here, {job.cluster}: {found}'
    try:  # The wait for the others, within what is left of the timeout.
      rendezvous.meet(job.address, job.process_id, job.num_processes,
                      max(1, round(timeout - (time.monotonic() - t0))))
    except errors.DistributedError as e:
      raise errors.DistributedError(f'{str(e).rstrip(".")} ({found}).{WHAT_TO_DO}') from None
  else:
    rendezvous.meet(job.address, job.process_id, job.num_processes, timeout)
  if jax.config.jax_cpu_collectives_implementation in (None, 'none', ''):
    # Cross-process CPU computations (resharding, barriers) need collectives.
    jax.config.update('jax_cpu_collectives_implementation', 'gloo')
  try:
    jax.distributed.initialize(
        str(job.address), job.num_processes, job.process_id,
        cluster_detection_method='deactivate', initialization_timeout=timeout,
        heartbeat_timeout_seconds=timeout, shutdown_timeout_seconds=timeout,
    )
  except Exception as e:  # noqa: BLE001 - JAX raises several kinds; all mean one thing.
    raise errors.DistributedError(
        f'could not form the multi-process job ({found}) within {timeout} s: {_first_line(e)}.'
        ' Expected every process started with the same --coordinator-address and'
        ' --num-processes and its own --process-id (0 to N-1), the coordinator reachable'
        ' from every host. Check that all processes are running and agree.'
        + (WHAT_TO_DO if job.cluster else '')
    ) from e
  _check_agreement(timeout)
  return jax.process_count() > 1


def _check_agreement(timeout_s: int) -> None:
  """Every process checks, before any work, that all were given the same process count.

  JAX forms the job with the coordinator's count; a process given another
  would otherwise fail alone, or wait, leaving the others waiting for it.
  Read from JAX's own record of this process's arguments (`_orbax.jax_process_claim`),
  through the key-value store, before the backends start.

  Raises:
    DistributedError: on every process, naming each process that disagrees;
      or some process did not join within `timeout_s`.
  """
  me, claimed = _orbax.jax_process_claim()
  client = _client()
  client.key_value_set(f'{KEY_PREFIX}/join/{me}', str(claimed))
  for _ in range(max(1, timeout_s * 1000 // POLL_MS)):
    told = {int(k.rsplit('/', 1)[-1]): int(v)
            for k, v in client.key_value_dir_get(f'{KEY_PREFIX}/join/')}
    wrong = sorted((i, n) for i, n in told.items() if n != told.get(0, claimed))
    if wrong:
      listed = ', '.join(f'process {i} was given --num-processes {n}' for i, n in wrong)
      raise errors.DistributedError(
          f'process 0 was given --num-processes {told.get(0, claimed)}, but {listed}: start'
          ' every process with the same --num-processes; nothing was written.')
    if len(told) >= claimed:
      return
    time.sleep(POLL_MS / 1000)
  raise errors.DistributedError(
      f'only processes {sorted(told)} of {claimed} joined within {timeout_s} s; nothing was'
      ' written. Start every process, each with its own --process-id.')


def _first_line(e: BaseException) -> str:
  text = str(e).strip() or type(e).__name__
  return text.splitlines()[0][:300]


def active() -> bool:
  """Whether this process is one of several (work must be shared and agreed)."""
  return is_initialized() and jax.process_count() > 1


def process_index() -> int:
  return jax.process_index() if is_initialized() else 0


def process_count() -> int:
  return jax.process_count() if is_initialized() else 1


def is_primary() -> bool:
  """The process that writes what is written once (metadata, index, config) and commits."""
  return process_index() == 0


# --- agreement through JAX's key-value store ----------------------------------------


def _client() -> Any:
  return ocp.multihost.get_jax_distributed_client()


def exchange(name: str, text: str, timeout_ms: int = WAIT_MS) -> list[str]:
  """Every process's `text`, in process order (each process calls this in the same order).

  A barrier: returns once every process reported. Keys are numbered by call (a `staged` run's own rounds, `RUN_ROUNDS`, by the run),
  so the same `name` may be used again. While waiting it watches for a
  failure another process announced (`_announce`), so that a process that
  failed mid-way does not leave the others waiting for it.

  Raises:
    DistributedError: another process announced a failure, or one did not
      report within `timeout_ms`.
  """
  if not active():
    return [text]
  key = (f'{KEY_PREFIX}/run-{_run}/{name}' if name in RUN_ROUNDS
         else f'{KEY_PREFIX}/{next(_rounds)}/{name}')
  client = _client()
  client.key_value_set(f'{key}/{process_index()}', text)
  waited, pause = 0, POLL_MS
  while True:
    # One request for every report so far (not one per process: N hosts poll).
    got = {int(k.rsplit('/', 1)[-1]): v for k, v in client.key_value_dir_get(f'{key}/')}
    if len(got) == process_count():
      return [got[i] for i in range(process_count())]
    # A failure announced stops every wait but the outcome rounds themselves
    # (every process reaches those). A process that dies is found by JAX's
    # heartbeat, which ends every process of the job.
    failed = None if name in OUTCOME_ROUNDS else _announced(client)
    if failed:
      raise errors.DistributedError(
          f'{failed.rstrip(".")}. This process stopped waiting ({name}); nothing was committed.')
    if waited >= timeout_ms:
      missing = sorted(set(range(process_count())) - set(got))
      raise errors.DistributedError(
          f'processes {missing} did not report {name!r} within {timeout_ms // 1000} s: they may'
          ' have died or hung. Nothing was committed; check their logs.')
    time.sleep(pause / 1000)
    waited += pause
    pause = min(2 * pause, MAX_POLL_MS)  # Long waits (a slower process) poll less.


def _announce(failure: str) -> None:
  """Tells every process, wherever it waits, that this one failed."""
  if active():
    with contextlib.suppress(Exception):
      _client().key_value_set(f'{KEY_PREFIX}/failed/{_run}/{process_index()}', failure,
                              allow_overwrite=True)


def _announced(client: Any) -> str | None:
  """A failure another process announced, as a sentence, or None."""
  try:
    found = client.key_value_dir_get(f'{KEY_PREFIX}/failed/{_run}/')
  except Exception:  # noqa: BLE001
    return None
  if not found:
    return None
  key, why = sorted(found)[0]
  return f'process {key.rsplit("/", 1)[-1]} failed: {why}'


def broadcast(name: str, text: str | None) -> str:
  """Process 0's `text` on every process (others pass None)."""
  return exchange(name, text if is_primary() else '')[0]


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
  if not active():
    return
  reports = [json.loads(t) for t in exchange(name, json.dumps(
      {'fields': None if failure is not None else dict(fields or {}),
       'failure': None if failure is None else _failure(failure), 'given': sorted(given)}))]
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


def _failure(e: BaseException) -> str:
  if isinstance(e, KeyboardInterrupt):
    return 'interrupted'
  return f'{type(e).__name__}: {e}' if not isinstance(e, errors.TunixCheckpointError) else str(e)


# --- staging and commit, once for all processes ---------------------------------------


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
  if not active():
    with commit.staged(dst, force, kind, nbytes, sources, entries) as staging:
      yield staging
    return
  global _run
  _run = next(_runs_started)  # A failure announced in an earlier run stops nothing here.
  stack = contextlib.ExitStack()
  opened, own = None, None
  if is_primary():
    try:
      opened = stack.enter_context(commit.staged(dst, force, kind, nbytes, sources, entries))
    except BaseException as e:  # noqa: BLE001 - told to every process, then raised.
      own = e
  first = json.loads(broadcast('open', json.dumps(
      [None if own is None else _failure(own), opened and os.fspath(opened.work),
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
    agree('visible', seen)
  except errors.DistributedError as e:
    abandon(e)
    raise
  try:
    yield shared
  except BaseException as e:  # noqa: BLE001 - reported, then raised on every process.
    own = e
    _announce(_failure(e))
  try:
    agree('write', None if own is None else _failure(own))
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
    agree('commit', None if own is None else _failure(own))
  except errors.DistributedError:
    if own is not None:
      raise own from None
    raise
  shared.replaced = broadcast('replaced', json.dumps(bool(getattr(opened, 'replaced', False)))) \
      == 'true'


# --- convert: arrays on the global mesh -------------------------------------------------


def _devices() -> np.ndarray:
  """Every process's CPU devices, grouped by process (process 0's first).

  The host's memory, as one process converts on its CPU device: accelerators
  stay free for whatever else the job runs.
  """
  return np.array(sorted(jax.devices('cpu'), key=lambda d: (d.process_index, d.id)))


def placement(shape: Sequence[int], chunks: Sequence[int] | None = None) -> jax.sharding.Sharding:
  """Where an array of `shape` lives while converted across processes.

  Split along one axis over the processes (and over every device when that
  divides too): the first axis whose per-process part is a whole number of
  the source's chunks (`chunks`, the stored chunk shape), so that no chunk
  is read by two processes; without chunks, the first axis that divides
  evenly. Whole on every process when none does (scalars, odd sizes).
  """
  devices = _devices()
  nproc, ndev = process_count(), devices.size
  chunks = tuple(chunks) if chunks is not None and len(chunks) == len(shape) else None

  def aligned(axis: int, parts: int) -> bool:
    if shape[axis] % parts:
      return False
    return chunks is None or (shape[axis] // parts) % max(chunks[axis], 1) == 0

  P = jax.sharding.PartitionSpec
  axis = next((a for a in range(len(shape)) if aligned(a, nproc)), None)
  if axis is not None and aligned(axis, ndev):
    return jax.sharding.NamedSharding(jax.sharding.Mesh(devices, ('all',)),
                                      P(*(None,) * axis, 'all'))
  mesh = jax.sharding.Mesh(devices.reshape(nproc, -1), ('processes', 'local'))
  if axis is None:
    return jax.sharding.NamedSharding(mesh, P())
  # Whole on each of the process's devices: read once per process (split
  # over its devices by another axis, every device would read whole chunks).
  # Every sharding spans all devices: JAX moves arrays between hosts only
  # within one device set.
  return jax.sharding.NamedSharding(mesh, P(*(None,) * axis, 'processes'))


def for_saving(value: Any) -> Any:
  """A global array whose process parts are whole on every local device, split over them.

  A part copied to every local device is a replica, which Orbax's save
  slices with one compiled slice per shape (slow); split along another axis
  that divides, a move within each process. Anything else as it is.
  """
  if not isinstance(value, jax.Array) or value.is_fully_addressable:
    return value
  sharding = value.sharding
  if not isinstance(sharding, jax.sharding.NamedSharding) or 'local' not in sharding.mesh.axis_names:
    return value
  spec = list(sharding.spec) + [None] * (value.ndim - len(sharding.spec))
  if 'processes' not in spec or 'local' in spec:
    return value
  local = sharding.mesh.shape['local']
  other = next((b for b, n in enumerate(value.shape) if spec[b] is None and n % local == 0), None)
  if other is None:
    return value
  spec[other] = 'local'
  return jax.device_put(value, jax.sharding.NamedSharding(sharding.mesh,
                                                          jax.sharding.PartitionSpec(*spec)))


def settle(value: Any) -> Any:
  """A global array a transform made (it may lie anywhere) at its `placement`, for saving."""
  if not isinstance(value, jax.Array) or value.is_fully_addressable:
    return value
  target = placement(value.shape)
  if not value.sharding.is_equivalent_to(target, value.ndim):
    value = jax.device_put(value, target)
  return for_saving(value)


def on_host(value: Any) -> np.ndarray:
  """A value whole, on every process (collective for a global array: error paths only)."""
  if isinstance(value, jax.Array) and not value.is_fully_addressable:
    from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top

    return np.asarray(multihost_utils.process_allgather(value, tiled=True))
  return np.asarray(value)


def _local_runs(value: jax.Array) -> Iterator[tuple[int, np.ndarray]]:
  """(byte offset, bytes) of each contiguous run of this process's primary shards."""
  for shard in value.addressable_shards:
    if shard.replica_id == 0:
      yield from _block_runs(shard.index, np.asarray(shard.data), value.shape)


def _process_block(value: jax.Array) -> tuple[tuple[slice, ...], np.ndarray] | None:
  """This process's primary shards as one block (index, data), when they tile a box."""
  shards = [s for s in value.addressable_shards if s.replica_id == 0]
  if not shards or not value.shape:
    return None
  bounds = [[s.indices(n)[:2] for s, n in zip(sh.index, value.shape, strict=True)]
            for sh in shards]
  box = [(min(b[d][0] for b in bounds), max(b[d][1] for b in bounds))
         for d in range(value.ndim)]
  size = math.prod(b - a for a, b in box)
  if sum(math.prod(b - a for a, b in bd) for bd in bounds) != size:
    return None
  data = np.empty([b - a for a, b in box], dtype=value.dtype)
  for shard, bd in zip(shards, bounds, strict=True):
    data[tuple(slice(a - o, b - o) for (a, b), (o, _) in zip(bd, box, strict=True))] = shard.data
  return tuple(slice(a, b) for a, b in box), data


def _block_runs(index: tuple[slice, ...], data: np.ndarray, shape: tuple[int, ...],
                ) -> Iterator[tuple[int, np.ndarray]]:
  """(byte offset, bytes) of each contiguous run of a block of an array.

  A block's elements are contiguous in C order along its trailing dims that it
  covers whole, and the one before them (from dim `k` on).
  """
  bounds = [s.indices(n)[:2] for s, n in zip(index, shape, strict=True)]
  k = len(shape)
  while k > 0 and bounds[k - 1] == (0, shape[k - 1]):
    k -= 1
  k = max(k - 1, 0)
  per_run = math.prod(b - a for a, b in bounds[k:])
  rows = np.ascontiguousarray(data).reshape(-1, per_run or 1)
  starts = [a for a, _ in bounds]
  outer = [range(a, b) for a, b in bounds[:k]]
  for row, lead in zip(rows, itertools.product(*outer), strict=True):
    offset = int(np.ravel_multi_index((*lead, *starts[k:]), shape)) if shape else 0
    yield offset * data.dtype.itemsize, row.view(np.uint8)


def _share_crc(value: jax.Array) -> int:
  """The CRC-32 of the array's bytes with this process's parts in place and zeros elsewhere.

  CRC-32 is affine over GF(2) for a fixed length, so the array's CRC is the
  XOR of every process's share (`combine_shares`): one number per process,
  however the array is split. The process's shards are joined into one block
  first where they tile one (one run when it spans whole rows).
  """
  block = _process_block(value)
  runs = _local_runs(value) if block is None else _block_runs(*block, value.shape)
  crc, at = 0, 0
  for offset, raw in sorted(runs, key=lambda r: r[0]):
    crc = zlib.crc32(raw, extend_zeros(crc, offset - at))
    at = offset + raw.size
  return extend_zeros(crc, value.nbytes - at)


def combine_shares(shares: Sequence[int], nbytes: int) -> int:
  """The whole array's CRC-32 from every process's share (see `_share_crc`)."""
  crc = 0
  for share in shares:
    crc ^= share
  # f(a ^ b) = f(a) ^ f(b) ^ f(0): an even number of shares leaves one f(0) out.
  return crc ^ extend_zeros(0, nbytes) if len(shares) % 2 == 0 else crc


def checksums_of(values: Sequence[Any]) -> list[str]:
  """`checksums.checksum` of each value; global arrays' from every process's share.

  Collective when some value is a global array: every process calls it with
  the same values in the same order.
  """
  spread = [isinstance(v, jax.Array) and not v.is_fully_addressable for v in values]
  if not any(spread):
    return [checksums.checksum(v) for v in values]
  local = [_share_crc(v) if s else 0 for v, s in zip(values, spread, strict=True)]
  everyone = [json.loads(t) for t in exchange('checksums', json.dumps(local))]
  return [
      f'{checksums.ALGORITHM}:{combine_shares([p[j] for p in everyone], v.nbytes):08x}' if s
      else checksums.checksum(v)
      for j, (v, s) in enumerate(zip(values, spread, strict=True))
  ]


def _gf2_times(matrix: Sequence[int], vector: int) -> int:
  total, i = 0, 0
  while vector:
    if vector & 1:
      total ^= matrix[i]
    vector >>= 1
    i += 1
  return total


def _gf2_square(matrix: Sequence[int]) -> list[int]:
  return [_gf2_times(matrix, row) for row in matrix]


@functools.lru_cache(maxsize=256)
def _zeros_operator(nbytes: int) -> tuple[int, ...]:
  """The GF(2) matrix that advances a CRC-32 register over `nbytes` zero bytes."""
  result = [1 << i for i in range(32)]  # Identity.
  power = [0xEDB88320] + [1 << n for n in range(31)]  # One zero bit.
  for _ in range(3):
    power = _gf2_square(power)  # One zero byte.
  n = nbytes
  while n:
    if n & 1:
      result = [_gf2_times(power, col) for col in result]
    n >>= 1
    if n:
      power = _gf2_square(power)
  return tuple(result)


def extend_zeros(crc: int, nbytes: int) -> int:
  """crc32(A + bytes(nbytes)) from crc32(A), without the zeros."""
  if nbytes <= 0:
    return crc
  return _gf2_times(_zeros_operator(nbytes), crc ^ 0xFFFFFFFF) ^ 0xFFFFFFFF


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
  """The CRC-32 of A+B from crc32(A), crc32(B) and len(B) (zlib's crc32_combine)."""
  if len2 <= 0:
    return crc1
  return _gf2_times(_zeros_operator(len2), crc1) ^ crc2


def barrier(name: str) -> None:
  """Every process waits here for the others (no-op on one process)."""
  exchange(name, '')


# --- export: files dealt out ------------------------------------------------------------


def deal(sizes: Sequence[int], count: int) -> list[int]:
  """The process each item goes to: largest first, to the least loaded (ties: lowest index).

  Deterministic, so every process computes the same deal.
  """
  load = [0] * count
  owner = [0] * len(sizes)
  for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
    p = min(range(count), key=lambda p: (load[p], p))
    owner[i] = p
    load[p] += sizes[i]
  return owner


def mine(sizes: Sequence[int]) -> list[int]:
  """The indices of the items (of these sizes) this process handles."""
  me = process_index()
  return [i for i, p in enumerate(deal(sizes, process_count())) if p == me]


def leave(code: int) -> None:
  """Ends this process now with `code`, once a multi-process run's outcome is known.

  JAX's shutdown at exit is a barrier with every process, which the
  processes of a failed job reach at different times or never (a dead
  peer): it would hold this process for the shutdown timeout and then abort
  it. The outcome is already agreed and reported, and the staging removed.
  """
  # Process 0 hosts the coordinator: leaving first would end the others
  # before they print their message. Every process that gets here waits a
  # little for the others to get here too.
  with contextlib.suppress(Exception):
    client = _client()
    # JAX's record of this process, not the backends: they may never have started.
    me, processes = _orbax.jax_process_claim()
    client.key_value_set(f'{KEY_PREFIX}/leaving/{me}', str(code), allow_overwrite=True)
    for _ in range(LEAVE_WAIT_MS // POLL_MS):
      if len(client.key_value_dir_get(f'{KEY_PREFIX}/leaving/')) >= processes:
        break
      time.sleep(POLL_MS / 1000)
    if me == 0:
      time.sleep(LEAVE_LAST_S)  # The coordinator goes last: its exit ends the others.
  for stream in (sys.stdout, sys.stderr):
    with contextlib.suppress(Exception):
      stream.flush()
  os._exit(code)

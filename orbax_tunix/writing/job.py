"""Convert and export across hosts: the job, one process per host under JAX's own runtime.

The same command runs once per host. The processes find each other as JAX's
multi-controller runtime does (`jax.distributed.initialize`, from explicit
flags or its own cluster auto-detection), and coordinate only through that
runtime's key-value store and barriers (as Orbax's multi-host save does;
`consensus`); given explicit flags, they first meet process 0 at the
coordinator's port (`rendezvous`), so that a job that cannot form is reported
rather than aborted by JAX. Every process's plan is compared with the others'
(`consensus.agree_on`) before anything is written. What is shared out:

- `convert`: every array is placed on the global mesh of all processes'
  devices (`global_arrays.placement`), so each process reads and writes only
  its own shards; Orbax's multi-host save writes them, and the primary process
  merges and commits the step once (`staging.staged`). Checksums are combined
  from one CRC-32 share per process (`global_arrays.checksums_of`).
- `export`: the safetensors files are dealt out to the processes by bytes
  (`dealing.mine`); each reads whole tensors for its own files only.

Every multi-process run goes through `staging.staged`, which commits only when
every process succeeded. A process that dies is found by JAX's own heartbeat,
which ends every other process (non-zero exit); what is left is a staging
directory, which readers skip, never a finished-looking output.

On one process (no `jax.distributed`), nothing here changes anything. This
module: the job's options, joining it (`initialize`), which process this is,
and leaving it (`leave`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
import orbax.checkpoint as ocp

from orbax_tunix import errors
from orbax_tunix.store import _orbax
from orbax_tunix.writing import rendezvous

# The prefix of every key this package puts in JAX's key-value store.
KEY_PREFIX = 'orbax_tunix'
# How often a waiting process looks for the others' reports (ms): first.
POLL_MS = 50
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
  client = key_value_store()
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


def key_value_store() -> Any:
  """JAX's key-value store client of the job this process joined."""
  return ocp.multihost.get_jax_distributed_client()


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
    client = key_value_store()
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

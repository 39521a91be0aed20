"""Before JAX's runtime: every process of a job meets process 0 at the coordinator's address.

`jax.distributed.initialize` ends the process (SIGABRT and a C++ stack trace,
from JAX's coordination service) when the job cannot form: a process that
never comes, a mistyped port, two processes given one process id; the
wait may also never end. So the processes meet first, at the same address,
with plain sockets and a bounded wait: process 0 listens at the
coordinator's port, every other process connects and says its process id
and process count, and process 0 answers every one with the verdict. On
success process 0 closes its socket before answering, so that JAX's own
coordinator can take the port; on failure every process that met raises
one `DistributedError` naming the flag or the processes concerned.

A process given process id 0 while another holds the port (a duplicated id
0) finds the port taken. A process joining after the job formed finds JAX's
coordinator there, not this exchange, and says so.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import socket
import time

from orbax_tunix import errors

# What a process says first, so that another program at the port is told apart.
MAGIC = 'orbax-tunix-join/1'
# How often a process retries connecting to process 0 (s), and how long it waits
# past its own timeout for process 0's verdict (process 0 may have started later).
RETRY_S = 0.2
VERDICT_SLACK_S = 5.0
# Longest line either side sends (bytes): a verdict names a few processes.
MAX_LINE = 1 << 16


@dataclasses.dataclass(frozen=True)
class Address:
  """A coordinator address, HOST:PORT (an IPv6 host in brackets: [::1]:1234)."""

  host: str
  port: int

  def __str__(self) -> str:
    return f'[{self.host}]:{self.port}' if ':' in self.host else f'{self.host}:{self.port}'


def parse_address(text: str) -> Address:
  """The host and port of `coordinator_address`.

  Raises:
    InvalidOptionError: not HOST:PORT with a port from 1 to 65535.
  """
  host, sep, port = text.rpartition(':')
  if host.startswith('[') and host.endswith(']'):
    host = host[1:-1]
  elif ':' in host:
    host = ''  # An IPv6 address without brackets: the port cannot be told apart.
  if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
    raise errors.InvalidOptionError(
        f'`coordinator_address` {text!r}: expected HOST:PORT (e.g. host0:1234, [::1]:1234),'
        ' the port a number from 1 to 65535 that process 0 listens at; give every process'
        ' the same address.')
  return Address(host, int(port))


def meet(address: Address, process_id: int, num_processes: int, timeout_s: float) -> None:
  """Meets every process of the job at `address` before JAX's runtime starts.

  Process 0 waits up to `timeout_s` for processes 1 to N-1; each of them
  tries to reach process 0 for up to `timeout_s`, then waits for its verdict.

  Raises:
    DistributedError: on every process that met process 0 (and on process 0),
      one message: a process given another process count, two processes
      given one process id, processes that did not come within the timeout;
      on a process alone: process 0 could not be reached, or its port is in
      use (another process 0).
  """
  if process_id == 0:
    _lead(address, num_processes, timeout_s)
  else:
    _join(address, process_id, num_processes, timeout_s)


def _send(conn: socket.socket, message: dict) -> None:
  with contextlib.suppress(OSError):
    conn.sendall(json.dumps(message).encode() + b'\n')


def _read_line(conn: socket.socket, deadline: float) -> bytes | None:
  """One line from `conn` (None: closed, or no whole line before `deadline`)."""
  data = b''
  while b'\n' not in data and len(data) < MAX_LINE:
    left = deadline - time.monotonic()
    if left <= 0:
      return None
    conn.settimeout(left)
    try:
      chunk = conn.recv(4096)
    except (TimeoutError, OSError):
      return None
    if not chunk:
      return None
    data += chunk
  return data.split(b'\n', 1)[0]


def _parse(line: bytes | None) -> dict | None:
  try:
    message = json.loads(line or b'')
  except ValueError:
    return None
  return message if isinstance(message, dict) and message.get('magic') == MAGIC else None


def _listen(address: Address) -> socket.socket:
  """Process 0's socket at the coordinator's port, on every interface (as JAX's own
  coordinator binds), without SO_REUSEPORT: a second process 0 finds it taken."""
  try:
    if socket.has_dualstack_ipv6():
      return socket.create_server(('', address.port), family=socket.AF_INET6,
                                  dualstack_ipv6=True)
    return socket.create_server(('', address.port))
  except OSError as e:
    raise errors.DistributedError(
        f'process 0 cannot listen at port {address.port} of `coordinator_address` {address}'
        f' ({os.strerror(e.errno) if e.errno else e}): another process was given `process_id=0` too (start each'
        ' process with its own), or another program holds the port (choose a free one).'
        ' Nothing was written.') from None


def _lead(address: Address, num_processes: int, timeout_s: float) -> None:
  """Process 0: waits for every other process, checks what they say, answers them all."""
  deadline = time.monotonic() + timeout_s
  server = _listen(address)
  joined: dict[int, tuple[socket.socket, str]] = {}
  others: list[socket.socket] = []  # Connections that said nothing usable.
  failure = None
  try:
    while failure is None and len(joined) < num_processes - 1:
      left = deadline - time.monotonic()
      if left <= 0:
        missing = [i for i in range(1, num_processes) if i not in joined]
        failure = (
            f'{_processes(missing)} did not join within {timeout_s:g} s'
            f' (`initialization_timeout`); joined: {_processes([0, *sorted(joined)])} of'
            f' {num_processes}. Start every process with the same `coordinator_address`'
            f' ({address}) and `num_processes`, each with its own `process_id`. Nothing was'
            ' written.')
        break
      server.settimeout(left)
      try:
        conn, peer = server.accept()
      except (TimeoutError, OSError):
        continue
      hello = _parse(_read_line(conn, min(deadline, time.monotonic() + VERDICT_SLACK_S)))
      if hello is None:
        others.append(conn)
        continue
      who, count = hello.get('process_id'), hello.get('num_processes')
      host = peer[0].removeprefix('::ffff:')  # An IPv4 peer of a dual-stack socket.
      if count != num_processes:
        failure = (
            f'process 0 was given `num_processes={num_processes}`, but process {who} was'
            f' given `num_processes={count}` (on {host}): start every process with the same'
            ' `num_processes`. Nothing was written.')
      elif not isinstance(who, int) or not 0 <= who < num_processes:
        failure = (
            f'a process on {host} was given `process_id` {who!r}: expected 0 to'
            f' {num_processes - 1}, each process its own. Nothing was written.')
      elif who == 0 or who in joined:
        first = 'process 0 (this one)' if who == 0 else f'one on {joined[who][1]}'
        failure = (
            f'two processes were given `process_id={who}`: {first} and one on {host}. Start'
            f' each process with its own `process_id`, 0 to {num_processes - 1}. Nothing was'
            ' written.')
      if failure is None:
        joined[who] = (conn, host)
      else:
        others.append(conn)
  finally:
    server.close()  # Before any verdict: JAX's coordinator takes the port next.
    formed = failure is None and len(joined) == num_processes - 1
    conns = [c for c, _ in joined.values()] + others
    for conn in conns:
      _send(conn, {'magic': MAGIC, 'error': None if formed else
                   failure or 'process 0 stopped before the job formed. Nothing was written.'})
    _wait_closed(conns, time.monotonic() + VERDICT_SLACK_S)
  if failure is not None:
    raise errors.DistributedError(failure)


def _wait_closed(conns: list[socket.socket], deadline: float) -> None:
  """Lets every peer close first (the port's closing wait falls on their side), then closes."""
  for conn in conns:
    with contextlib.suppress(OSError):
      while _read_line(conn, deadline) is not None:
        pass
    conn.close()


def _processes(ids: list[int]) -> str:
  return f'process {ids[0]}' if len(ids) == 1 else f'processes {", ".join(map(str, ids))}'


def _join(address: Address, process_id: int, num_processes: int, timeout_s: float) -> None:
  """Any other process: reaches process 0, says who it is, waits for the verdict."""
  deadline = time.monotonic() + timeout_s
  last = None
  while True:
    try:
      conn = socket.create_connection((address.host, address.port),
                                      timeout=max(0.1, min(2.0, deadline - time.monotonic())))
      break
    except OSError as e:
      last = e
    if time.monotonic() + RETRY_S >= deadline:
      raise errors.DistributedError(
          f'process {process_id}: no process 0 answered at {address} (`coordinator_address`)'
          f' within {timeout_s:g} s (`initialization_timeout`; last: {_reason(last)}). Start'
          ' process 0 (`process_id=0`), which listens there; check the host and port, and'
          ' that this host reaches it. Nothing was written.') from None
    time.sleep(RETRY_S)
  with conn:
    _send(conn, {'magic': MAGIC, 'process_id': process_id, 'num_processes': num_processes})
    line = _read_line(conn, time.monotonic() + timeout_s + VERDICT_SLACK_S)
  verdict = _parse(line)
  if verdict is None:
    said = 'nothing' if not line else 'something else'
    raise errors.DistributedError(
        f'process {process_id}: what answers at {address} (`coordinator_address`) said {said},'
        " not process 0 forming this job: another program's port, or a job that already"
        ' formed without this process (another process was given the same `process_id`, or'
        ' this one came late). Check `coordinator_address` and `process_id`. Nothing was'
        ' written.')
  if verdict.get('error'):
    raise errors.DistributedError(verdict['error'])


def _reason(e: OSError | None) -> str:
  if e is None:
    return 'no answer'
  return 'timed out' if isinstance(e, TimeoutError) else e.strerror or type(e).__name__

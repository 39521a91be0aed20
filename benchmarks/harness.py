"""What every benchmark shares: the devices it measures on, its counters, its calls.

Devices. A benchmark measures on the first `--devices N` of JAX's devices, on the
backend JAX picks (`JAX_PLATFORMS` chooses: cpu, tpu, gpu). On the CPU, N devices
are simulated (`jax_num_cpu_devices`); without `--devices`, a benchmark keeps its
own CPU default (8 where it shards arrays) and takes every device of an
accelerator. Meshes are made from the devices that are there: `make_mesh` factors
N into (data, model) as squarely as it goes ((4, 2) for 8, (1, 1) for 1), and
`sharding` leaves a mesh axis off a dimension that it does not divide.

Counters. Any of them may be missing on a host, and then reads as None (the tables
print n/a): the I/O counters (`/proc/self/io`, absent in sandboxed kernels), the
RSS peak (Linux's VmHWM, reset through `/proc/self/clear_refs`; else
`ru_maxrss`, exact only when the call raised it), the devices' peak memory
(`Device.memory_stats()`, None on the CPU backend). `BENCH_NO_COUNTERS=io,rss,device`
switches counters off, to run a benchmark as a host without them does.

Calls. A child process makes the call its user makes, first once (what a fresh
process pays: compilations, TensorStore's context, caches) and then `--warm K`
more times in the same process (what each further call of an evaluation loop
pays), each measured on its own; the parent runs the children in rounds, the
order rotating, so that drift on a shared machine falls on all alike.
`BENCH_GC_BETWEEN=1` runs Python's cyclic collection before each warm call (unmeasured): a
warm call slower than the first with it off and not with it on pays for the last call's
reference cycles.
"""

from __future__ import annotations

import dataclasses
import gc
import importlib.metadata
import json
import math
import os
import pathlib
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

MIB = 2**20
NO_COUNTERS = 'BENCH_NO_COUNTERS'
COUNTERS = ('io', 'rss', 'device')
IO_KEYS = ('rchar', 'wchar', 'read_bytes', 'write_bytes')


# --- devices -------------------------------------------------------------------


def add_flags(parser, cpu_default: int | None, warm: bool = False,
              compile_cache: bool = False) -> None:
  """Adds `--devices` (and, with `warm`, `--warm`; with `compile_cache`, `--compile-cache`)
  to a benchmark's parser.

  Args:
    parser: the benchmark's argparse parser.
    cpu_default: devices simulated on the CPU when `--devices` is not given
      (None: JAX's own default, one, in commands that are not harness children).
    warm: whether its children make warm calls after the first.
    compile_cache: whether its children may run with JAX's persistent compilation cache
      (`CompileCache`).
  """
  default = ('JAX\'s own (1 CPU device)' if cpu_default is None else
             f'{cpu_default} simulated CPU device{"s" * (cpu_default > 1)}')
  parser.add_argument(
      '--devices', type=int, default=None, metavar='N',
      help="measure on the first N of JAX's devices, on the backend JAX_PLATFORMS picks"
      f' (default: {default}, or every device of an accelerator)')
  if warm:
    parser.add_argument(
        '--warm', type=int, default=1, metavar='K',
        help='calls after the first in each fresh process, measured apart (default 1)')
  if compile_cache:
    parser.add_argument(
        '--compile-cache', choices=COMPILE_CACHE_MODES, default='off',
        help="JAX's persistent compilation cache in the children: off (default), cold (each"
        ' child a fresh empty one: it compiles and writes), warm (one filled by a first,'
        ' unmeasured child of each contender: each measured child loads its programs)')


def use_devices(n: int | None, cpu_default: int) -> list[Any]:
  """The first `n` devices of JAX's default backend (all of them when `n` is None).

  Call it before anything starts JAX's backends: it sets how many CPU devices
  are simulated (`n`, else `cpu_default`), which only the CPU backend heeds.

  Raises:
    SystemExit: the backend has fewer than `n` devices.
  """
  import jax  # pylint: disable=g-import-not-at-top

  jax.config.update('jax_num_cpu_devices', n or cpu_default)
  devices = jax.devices()
  if n is not None and not 1 <= n <= len(devices):
    raise SystemExit(
        f'--devices {n}: JAX\'s {devices[0].platform} backend has {len(devices)} device(s)'
        f' ({devices[0].device_kind}); ask for 1 to {len(devices)}, or pick another backend'
        ' with JAX_PLATFORMS')
  return devices[:n] if n else devices


def keep_off_devices() -> None:
  """In a parent that writes with JAX but measures nothing: JAX on the CPU alone.

  One process at a time may hold a TPU; a parent holding it would push its
  children onto the CPU. Call before the parent's JAX starts its backends.
  """
  import jax  # pylint: disable=g-import-not-at-top

  jax.config.update('jax_platforms', 'cpu')


def mesh_shape(n: int) -> tuple[int, int]:
  """(data, model) for `n` devices: `model` the largest divisor of n at most sqrt(n)."""
  model = max(d for d in range(1, math.isqrt(n) + 1) if n % d == 0)
  return n // model, model


def make_mesh(devices: Sequence[Any], axes: tuple[str, str] = ('data', 'model')):
  """A 2-d mesh over `devices`, shaped by `mesh_shape`."""
  import jax  # pylint: disable=g-import-not-at-top

  return jax.make_mesh(mesh_shape(len(devices)), axes, devices=list(devices))


def sharding(mesh, shape: Sequence[int], spec: Sequence[Any]):
  """`NamedSharding(mesh, P(*spec))`, less the mesh axes a dimension's size is not a multiple of."""
  import jax  # pylint: disable=g-import-not-at-top

  def fits(dim: int, axes: Any) -> Any:
    names = axes if isinstance(axes, tuple) else (axes,)
    size = math.prod(mesh.shape[a] for a in names if a is not None)
    return axes if dim % size == 0 else None

  fitted = [fits(d, a) for d, a in zip(shape, spec, strict=False)]  # a short spec replicates the rest
  return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*fitted))


def describe(devices: Sequence[Any], mesh=None) -> dict[str, Any]:
  """The backend, the device kind and count, and the mesh: what the figures ran on."""
  import jax  # pylint: disable=g-import-not-at-top

  first = devices[0]
  out = {
      'backend': first.platform,
      'device_kind': first.device_kind,
      'devices': len(devices),
      'of': len(jax.devices()),
      'platform_version': getattr(first.client, 'platform_version', 'unknown'),
  }
  if mesh is not None:
    out['mesh'] = dict(mesh.shape)
  return out


def describe_line(info: dict[str, Any] | None) -> str:
  """For a report: '1 of 1 TPU v5 lite (backend tpu), mesh data 1 x model 1'."""
  if not info:
    return 'unknown (no child reported)'
  mesh = info.get('mesh')
  shown = ' x '.join(f'{k} {v}' for k, v in mesh.items()) if mesh else 'none'
  return (f'{info["devices"]} of {info["of"]} {info["device_kind"]}'
          f' (backend {info["backend"]}), mesh {shown}')


def child_env(devices: int | None = None, base: dict[str, str] | None = None) -> dict[str, str]:
  """The environment of a child that is not a harness child (a CLI command).

  JAX_PLATFORMS and BENCH_NO_COUNTERS pass through as they are; `devices` sets
  how many CPU devices its JAX simulates (JAX_NUM_CPU_DEVICES).
  """
  env = dict(os.environ if base is None else base)
  if devices:
    env['JAX_NUM_CPU_DEVICES'] = str(devices)
  return env


def commands_line(devices: int | None) -> str:
  """For a report of commands run with `child_env(devices)`: what their JAX was told."""
  cpu = (f'{devices} simulated CPU devices (JAX_NUM_CPU_DEVICES)' if devices else
         "JAX's own CPU devices")
  return (f'commands on the host: {cpu}; JAX_PLATFORMS'
          f' {os.environ.get("JAX_PLATFORMS", "unset (JAX picks)")}')


# --- JAX's persistent compilation cache ---------------------------------------------

COMPILE_CACHE_MODES = ('off', 'cold', 'warm')
# What JAX reads its cache's settings from (the commands honour them too).
_CACHE_VARIABLES = ('JAX_ENABLE_COMPILATION_CACHE', 'JAX_COMPILATION_CACHE_DIR',
                    'JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS',
                    'JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES')


@dataclasses.dataclass(frozen=True)
class CompileCache:
  """How the children find JAX's persistent compilation cache, set through the variables JAX
  reads at import (so it holds for a child of the library and for a command alike).

  Attributes:
    mode: off (none: every first call compiles), cold (a fresh empty cache per child: it
      compiles and writes every program, as the first process ever does), warm (one cache
      under `root`, filled by `prime` before the rounds: every program is loaded).
    root: where the caches are made (a cold child's is removed after it).
  """

  mode: str
  root: pathlib.Path

  def describe(self) -> str:
    return {'off': 'no persistent compilation cache',
            'cold': 'persistent compilation cache cold (each process a fresh, empty one)',
            'warm': 'persistent compilation cache warm (filled by an earlier process)'}[self.mode]

  def env(self, directory: pathlib.Path | None, base: dict[str, str] | None = None
          ) -> dict[str, str]:
    """A child's environment with the cache at `directory` (None: off); every program cached,
    however short its compile."""
    env = {k: v for k, v in (os.environ if base is None else base).items()
           if k not in _CACHE_VARIABLES}
    if directory is None:
      env['JAX_ENABLE_COMPILATION_CACHE'] = 'false'
      return env
    return {**env, 'JAX_ENABLE_COMPILATION_CACHE': 'true',
            'JAX_COMPILATION_CACHE_DIR': str(directory),
            'JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS': '0',
            'JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES': '-1'}

  def run(self, argv: Sequence[str], timeout: float | None = None,
          base: dict[str, str] | None = None) -> dict[str, Any]:
    """`run_child(argv)` under this mode's cache."""
    if self.mode == 'off':
      return run_child(argv, timeout, self.env(None, base))
    if self.mode == 'warm':
      return run_child(argv, timeout, self.env(self.root / 'warm', base))
    self.root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix='cold-', dir=self.root) as fresh:
      return run_child(argv, timeout, self.env(pathlib.Path(fresh), base))

  def prime(self, argvs: Iterable[Sequence[str]], timeout: float | None = None) -> None:
    """Warm: each child once, unmeasured, so that the cache holds every program it compiles.

    Raises:
      SystemExit: a priming child failed.
    """
    if self.mode != 'warm':
      return
    for argv in argvs:
      res = self.run(argv, timeout)
      if 'error' in res:
        raise SystemExit(f'priming the compilation cache failed: {res["error"]}')


# --- counters --------------------------------------------------------------------


def counter_off(name: str) -> bool:
  """Whether BENCH_NO_COUNTERS switches counter `name` ('io', 'rss', 'device') off."""
  return name in {x.strip() for x in os.environ.get(NO_COUNTERS, '').split(',')}


def io_counters() -> dict[str, int] | None:
  """This process's I/O counters (all threads, dead ones included); None where absent."""
  if counter_off('io'):
    return None
  try:
    text = pathlib.Path('/proc/self/io').read_text()
  except OSError:
    return None
  found = {}
  for line in text.splitlines():
    key, _, value = line.partition(':')
    if key in IO_KEYS and value.strip().isdigit():
      found[key] = int(value)
  return found if len(found) == len(IO_KEYS) else None


def io_delta(before: dict[str, int] | None, after: dict[str, int] | None) -> dict[str, int | None]:
  """{rchar, wchar, read_bytes, write_bytes} between two readings; None where either is absent."""
  if before is None or after is None:
    return dict.fromkeys(IO_KEYS)
  return {k: after[k] - before[k] for k in IO_KEYS}


def status_kb(field: str) -> int | None:
  """A `/proc/self/status` field in kB (VmRSS, VmHWM); None where absent."""
  if counter_off('rss'):
    return None
  try:
    with open('/proc/self/status') as f:
      for line in f:
        if line.startswith(field + ':'):
          return int(line.split()[1])
  except OSError:
    pass
  return None


def reset_peak() -> bool:
  """Resets VmHWM to the current RSS; False where not allowed (or switched off)."""
  return not counter_off('rss') and _write_proc('/proc/self/clear_refs', '5')


def _write_proc(path: str, text: str) -> bool:
  """Writes `text` to a /proc control file; False where the kernel or our rights refuse."""
  try:
    with open(path, 'w') as f:
      f.write(text)
    return True
  except OSError:
    return False


def _maxrss_bytes() -> int:
  scale = 1 if sys.platform == 'darwin' else 1024  # bytes there, KiB on Linux
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


class RssPeak:
  """The RSS peak of a stretch of code above the RSS at its start.

  VmHWM after resetting it where the kernel allows (exact); else `ru_maxrss`,
  which is the call's own peak only when the call raised it (`exact` says so).
  """

  def __init__(self):
    gc.collect()
    self.rss0 = status_kb('VmRSS')
    self.reset = self.rss0 is not None and reset_peak()
    self.maxrss0 = _maxrss_bytes()

  def stop(self) -> tuple[int | None, bool]:
    """(peak above the start in bytes, or None where no RSS is readable; exact)."""
    if self.rss0 is None:
      return None, False
    if self.reset:
      hwm = status_kb('VmHWM')
      return (None, False) if hwm is None else ((hwm - self.rss0) * 1024, True)
    maxrss = _maxrss_bytes()
    return maxrss - self.rss0 * 1024, maxrss > self.maxrss0


def device_memory(devices: Sequence[Any]) -> dict[str, int] | None:
  """Bytes in use and peak bytes in use (since the process started), summed over `devices`.

  None where a device reports none (the CPU backend) or counters are switched off.
  """
  if counter_off('device') or not devices:
    return None
  stats = []
  for d in devices:
    try:
      s = d.memory_stats()
    except Exception:  # pylint: disable=broad-except  (backends that do not implement it)
      return None
    if not s or 'peak_bytes_in_use' not in s:
      return None
    stats.append(s)
  return {'in_use': sum(s.get('bytes_in_use', 0) for s in stats),
          'peak': sum(s['peak_bytes_in_use'] for s in stats),
          'limit': sum(s.get('bytes_limit', 0) for s in stats)}


# JAX's compile events (`jax.monitoring` durations), summed over each measured call: where a
# first call's compilation goes (tracing, lowering, the persistent cache's retrieval, XLA);
# and the time inside Orbax's `Checkpointer.restore`, which Orbax reports the same way: all
# of a restore through a checkpointer, the handler's own work included (ours: its
# dequantize too); none for a call that uses a handler directly (the merge's reads).
_COMPILE_EVENTS = {
    '/jax/core/compile/jaxpr_trace_duration': 'trace_s',
    '/jax/core/compile/jaxpr_to_mlir_module_duration': 'lower_s',
    '/jax/compilation_cache/cache_retrieval_time_sec': 'cache_retrieval_s',
    '/jax/core/compile/backend_compile_duration': 'backend_compile_s',
    '/jax/orbax/read/total_duration_secs': 'orbax_read_s',
}
_compile_seconds: dict[str, float] = {}


def _compile_listener() -> None:
  """Registers the sums of `_COMPILE_EVENTS` once per process (after jax is imported)."""
  if _compile_seconds:
    return
  import jax.monitoring  # pylint: disable=g-import-not-at-top

  _compile_seconds.update({name: 0.0 for name in _COMPILE_EVENTS.values()})

  def heard(event: str, seconds: float, **_: Any) -> None:
    if event in _COMPILE_EVENTS:
      _compile_seconds[_COMPILE_EVENTS[event]] += seconds
  jax.monitoring.register_event_duration_secs_listener(heard)


def measure(call: Callable[[], Any], devices: Sequence[Any] = ()) -> tuple[Any, dict[str, Any]]:
  """Runs `call` once (it must block until its result is ready) and reads the counters.

  Returns:
    (its result, figures): wall_s, cpu_s; the I/O counters' deltas (None where
    absent); peak_rss_bytes above the RSS before the call and peak_rss_exact;
    device_in_use_before, device_in_use_after and device_peak_bytes (the
    devices' peak since the process started, summed over them; None on a
    backend that reports none); `compile`: JAX's compile events and the time in Orbax's
    `Checkpointer.restore` during the call, in seconds by kind (`_COMPILE_EVENTS`; on any
    thread, so overlapping).
  """
  _compile_listener()
  compiled0 = dict(_compile_seconds)
  dev0 = device_memory(devices)
  rss = RssPeak()
  io0 = io_counters()
  cpu0 = os.times()
  t0 = time.perf_counter()
  out = call()
  wall = time.perf_counter() - t0
  cpu1 = os.times()
  io1 = io_counters()
  peak, exact = rss.stop()
  dev1 = device_memory(devices)
  return out, {
      'wall_s': wall,
      'cpu_s': (cpu1.user - cpu0.user) + (cpu1.system - cpu0.system),
      **io_delta(io0, io1),
      'peak_rss_bytes': peak,
      'peak_rss_exact': exact,
      'device_in_use_before': dev0 and dev0['in_use'],
      'device_in_use_after': dev1 and dev1['in_use'],
      'device_peak_bytes': dev1 and dev1['peak'],
      'compile': {k: round(v - compiled0[k], 4) for k, v in _compile_seconds.items()},
  }


def sampled_peak_rss(argv: Sequence[str], env: dict[str, str] | None = None,
                     interval: float = 0.003) -> tuple[int | None, float, int]:
  """Runs a command, sampling its resident memory every `interval` s.

  Returns:
    (its peak RSS in bytes, or None where it cannot be read; seconds; exit status).
  """
  import psutil  # pylint: disable=g-import-not-at-top  (the bench and test extras)

  start = time.monotonic()
  with tempfile.TemporaryFile('w+') as err:  # a file: a full pipe would stall the command
    proc = subprocess.Popen(list(argv), env=env, stdout=subprocess.DEVNULL, stderr=err)
    peak: int | None = None if counter_off('rss') else 0
    try:
      ps = psutil.Process(proc.pid)
    except psutil.Error:
      peak = None
    while proc.poll() is None:
      if peak is not None:
        try:
          peak = max(peak, ps.memory_info().rss)
        except psutil.NoSuchProcess:
          break
        except psutil.Error:
          peak = None
      time.sleep(interval)
    proc.wait()
    seconds = time.monotonic() - start
    if proc.returncode:
      err.seek(0)
      print(err.read()[-3000:], file=sys.stderr)
  return peak, seconds, proc.returncode


# --- calls -----------------------------------------------------------------------


def calls(call: Callable[[], Any], warm: int, devices: Sequence[Any] = (),
          between: Callable[[], None] | None = None,
          describe_out: Callable[[Any], dict[str, Any]] | None = None) -> list[dict[str, Any]]:
  """The first call of this process, then `warm` more, each measured (`measure`).

  Args:
    call: the call; must block until its result is ready.
    warm: calls after the first.
    devices: whose memory to read.
    between: run before each warm call, unmeasured (e.g. the page cache made
      as it was before the first).
    describe_out: more figures from a call's result (it is dropped after).

  Returns:
    One dict per call, the first first, each with `call` (0 for the first).
  """
  out = []
  for i in range(1 + warm):
    if i and os.environ.get('BENCH_GC_BETWEEN'):
      gc.collect()  # What the last call left in reference cycles, freed before the next.
    if i and between is not None:
      between()
    result, figures = measure(call, devices)
    if describe_out is not None:
      figures.update(describe_out(result))
    del result
    out.append({'call': i, **figures})
  return out


def child_result(contender: str, measured: Sequence[dict[str, Any]], devices: Sequence[Any],
                 mesh=None, **extra: Any) -> dict[str, Any]:
  """A child's report: the first call's figures at the top, the warm ones under `warm`."""
  return {'contender': contender, **measured[0], 'warm': list(measured[1:]),
          'devices': describe(devices, mesh), **extra}


def emit(result: dict[str, Any]) -> None:
  """Prints a child's report, as `run_child` reads it."""
  print('RESULT ' + json.dumps(result), flush=True)


def run_child(argv: Sequence[str], timeout: float | None = None,
              env: dict[str, str] | None = None) -> dict[str, Any]:
  """Runs one child in a fresh interpreter; returns its report, or {'error': ...}."""
  cmd = [sys.executable, *argv]
  start = time.perf_counter()
  try:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False,
                          env=env)
  except subprocess.TimeoutExpired:
    return {'error': f'timed out after {timeout:.0f} s'}
  for line in reversed(proc.stdout.splitlines()):
    if line.startswith('RESULT '):
      result = json.loads(line[len('RESULT '):])
      result['process_s'] = time.perf_counter() - start
      return result
  tail = '\n'.join((proc.stderr or proc.stdout).strip().splitlines()[-15:])
  return {'error': f'exit {proc.returncode}:\n{tail}'}


def rounds(contenders: Sequence[str], reps: int, run: Callable[[str, int], dict[str, Any]],
           prepare: Callable[[], None] | None = None) -> dict[str, list[dict[str, Any]]]:
  """Each contender `reps` times, `run(name, round)` a fresh child each, the order rotating.

  `prepare` runs before every child (the page cache). A failed child's report
  (`error`) is printed and kept; the tables leave it out.
  """
  results: dict[str, list[dict[str, Any]]] = {name: [] for name in contenders}
  for rep in range(reps):
    k = rep % len(contenders)
    for name in (*contenders[k:], *contenders[:k]):
      if prepare is not None:
        prepare()
      res = run(name, rep)
      res.setdefault('contender', name)
      res['round'] = rep
      results[name].append(res)
      if 'error' in res:
        print(f'round {rep} {name}: FAILED {res["error"]}', flush=True)
      else:
        warm = ', '.join(f'{w["wall_s"]:.2f}' for w in res.get('warm', ()))
        print(f'round {rep} {name}: first {res["wall_s"]:.2f} s'
              + (f', warm {warm} s' if warm else '')
              + f', peak RSS {mib(res.get("peak_rss_bytes"))} MiB,'
              f' device peak {mib(res.get("device_peak_bytes"))} MiB', flush=True)
  return results


def ok(results: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
  return [r for r in results if 'error' not in r]


def exit_if_failed(results: dict[str, list[dict[str, Any]]]) -> None:
  """Stops the run, naming each contender none of whose children succeeded (its first error).

  Raises:
    SystemExit: when some contender has no successful child.
  """
  failed = {k: v[0]['error'] for k, v in results.items() if not ok(v)}
  if failed:
    raise SystemExit(f'contenders failed: {failed}')


def first_device_info(results: dict[str, list[dict[str, Any]]]) -> dict[str, Any] | None:
  """The devices the first successful child reported."""
  for rs in results.values():
    for r in ok(rs):
      if 'devices' in r:
        return r['devices']
  return None


# --- the page cache ------------------------------------------------------------


def files(dirs: Iterable[pathlib.Path]) -> list[pathlib.Path]:
  return [p for d in dirs for p in pathlib.Path(d).rglob('*') if p.is_file()]


def drop_all_caches() -> bool:
  """The kernel's own drop (root only); False when not permitted."""
  os.sync()
  return _write_proc('/proc/sys/vm/drop_caches', '3\n')


def evict(dirs: Iterable[pathlib.Path]) -> None:
  """Drops the files' pages under `dirs` from the page cache, and nothing else's.

  `posix_fadvise(DONTNEED)` needs no privilege and leaves the interpreter's and
  libraries' pages cached, so child start-up stays the same for everyone.
  """
  os.sync()  # dirty pages are not dropped
  for path in files(dirs):
    fd = os.open(path, os.O_RDONLY)
    try:
      os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
      os.close(fd)


def read_all(dirs: Iterable[pathlib.Path]) -> None:
  """Reads every file under `dirs` once, so that what follows reads from memory."""
  for path in files(dirs):
    with open(path, 'rb') as f:
      while f.read(16 * MIB):
        pass


@dataclasses.dataclass(frozen=True)
class CachePolicy:
  """What happens to the page cache before every call measured (the same for all).

  Attributes:
    mode: 'cold' (the checkpoint's pages evicted), 'warm' (read in first) or
      'as-is' (left alone).
    drop_all: cold through /proc/sys/vm/drop_caches (root) rather than fadvise.
  """

  mode: str
  drop_all: bool = False

  def prepare(self, dirs: Sequence[pathlib.Path]) -> None:
    if self.mode == 'warm':
      read_all(dirs)
    elif self.mode == 'cold':
      if not (self.drop_all and drop_all_caches()):
        evict(dirs)

  def describe(self) -> str:
    if self.mode == 'warm':
      return 'warm: every checkpoint file read into the page cache before each call'
    if self.mode == 'as-is':
      return 'as left by the previous call (the same files read by all: warm after the first)'
    if self.drop_all:
      return 'cold: `sync; echo 3 > /proc/sys/vm/drop_caches` before each call (permitted here)'
    return ('cold: the checkpoint files evicted from the page cache with'
            ' posix_fadvise(DONTNEED) before each call (other pages stay cached)')


# --- reports ----------------------------------------------------------------------


def med(xs: Sequence[float]) -> float:
  return statistics.median(xs) if xs else float('nan')


def spread(xs: Sequence[float]) -> str:
  """min-max around the median, as percentages: '-4% +7%'."""
  if len(xs) < 2:
    return 'n/a'
  m = med(xs)
  return f'-{(m - min(xs)) / m:.0%} +{(max(xs) - m) / m:.0%}'


def table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
  rows = [[str(c) for c in r] for r in rows]
  out = ['| ' + ' | '.join(header) + ' |', '|' + '|'.join('---' for _ in header) + '|']
  out += ['| ' + ' | '.join(r) + ' |' for r in rows]
  return '\n'.join(out)


def mib(value: float | None, digits: int = 0) -> str:
  """Bytes as MiB, or 'n/a' for a counter this host lacks."""
  return 'n/a' if value is None else f'{value / MIB:.{digits}f}'


def med_of(rs: Sequence[dict[str, Any]], key: str) -> float | None:
  """The median of a figure over runs; None when any run lacks it (a missing counter)."""
  xs = [r.get(key) for r in rs]
  return None if not xs or any(x is None for x in xs) else med(xs)


def first_and_warm(results: dict[str, list[dict[str, Any]]], names: dict[str, str] | None = None,
                   base: str | None = None) -> str:
  """Per contender: first calls (fresh processes) against warm calls (the same process).

  Medians of wall time and peak RSS over the rounds, and (with `base`) each
  contender's wall time over `base`'s, for first calls and for warm calls apart.
  """
  names = names or {}
  rows = []
  for c, rs in results.items():
    rs = ok(rs)
    if not rs:
      rows.append([c, names.get(c, ''), 'FAILED'] + [''] * 7)
      continue
    first = [r['wall_s'] for r in rs]
    warm_runs = [w for r in rs for w in r.get('warm', ())]
    warm = [w['wall_s'] for w in warm_runs]
    row = [c, names.get(c, ''), len(rs), f'{med(first):.2f} ({spread(first)})',
           f'{med(warm):.2f} ({spread(warm)})' if warm else '-',
           f'{med(warm) / med(first):.2f}' if warm else '-',
           mib(med_of(rs, 'peak_rss_bytes')),
           mib(med_of(warm_runs, 'peak_rss_bytes')) if warm else '-',
           mib(med_of(rs, 'device_peak_bytes'))]
    if base:
      b = ok(results.get(base, []))
      bf = med([r['wall_s'] for r in b])
      bw = [w['wall_s'] for r in b for w in r.get('warm', ())]
      row += [f'{med(first) / bf:.2f}' if b else '-',
              f'{med(warm) / med(bw):.2f}' if warm and bw else '-']
    rows.append(row)
  header = ['', 'contender', 'n', 'first call s (spread)', 'warm calls s (spread)',
            'warm / first', 'peak RSS MiB, first', 'peak RSS MiB, warm',
            'device peak MiB, first']
  if base:
    header += [f'first / {base}', f'warm / {base}']
  return table(header, rows)


def host() -> dict[str, Any]:
  """What the figures depend on besides the devices: CPUs, memory, versions, load."""
  cpu = platform.processor() or 'unknown'
  try:
    with open('/proc/cpuinfo') as f:
      cpu = next((line.split(':', 1)[1].strip() for line in f
                  if line.startswith('model name')), cpu)
  except OSError:
    pass
  mem_gib = None
  try:
    with open('/proc/meminfo') as f:
      kb = int(next(line for line in f if line.startswith('MemTotal')).split()[1])
    mem_gib = round(kb / 2**20, 1)
  except (OSError, StopIteration):
    pass
  versions = {}
  for dist in ('jax', 'jaxlib', 'orbax-checkpoint', 'tensorstore', 'numpy', 'orbax-tunix'):
    try:
      versions[dist] = importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
      versions[dist] = 'not installed'
  commit = subprocess.run(
      ['git', '-C', str(pathlib.Path(__file__).resolve().parent), 'describe', '--always',
       '--dirty'], capture_output=True, text=True, check=False).stdout.strip()
  affinity = getattr(os, 'sched_getaffinity', None)
  return {
      'nproc': os.cpu_count(),
      'usable_cpus': len(affinity(0)) if affinity else os.cpu_count(),
      'memory_gib': mem_gib,
      'cpu': cpu,
      'kernel': platform.release(),
      'python': platform.python_version(),
      'versions': versions,
      'commit': commit or 'unknown',
      'jax_platforms': os.environ.get('JAX_PLATFORMS', '(unset: JAX picks)'),
      'counters_off': os.environ.get(NO_COUNTERS, ''),
      'loadavg_start': os.getloadavg(),
  }

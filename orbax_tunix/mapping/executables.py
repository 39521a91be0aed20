"""The device programs kept compiled across processes, under a key of their own: a process
loads them without tracing or lowering them.

JAX's persistent compilation cache finds a program by its lowered module, so every process
traces and lowers each program before it can load it: on a TPU v5e's host 0.18-0.34 s for a
QLoRA merge's five programs, most of what a first call with a warm cache pays above a warm
call (BENCHMARKS.md §28). The programs `transforms.on_devices` makes are known before they are
traced, by what they compute (`transforms.Program.key`) and the sources' shapes, dtypes and
shardings, so they are kept under that key, beside JAX's entries:

  where     <JAX's compilation cache directory>/orbax-tunix-executables, only while JAX's
            persistent cache is on (the commands keep it on: `cli/jax_cache.py`; for the API,
            JAX's own configuration decides), a local directory, one process
  key       sha256 of: the program's key and each source's shape, dtype and sharding (devices
            by id); JAX's, jaxlib's, numpy's, Python's and this package's versions, and this
            package's modules' names, sizes and modification times (an edit makes new keys); the
            backend's platform, version and devices; JAX's settings and the XLA flags
  not kept  a program whose key holds a value with no exact text (an object; a function other
            than this package's module-level ones and the standard library's built-ins,
            whose names stand for their bodies: `_defined_in_key`), or of sub-byte arguments
            (int4: see `key`): it is compiled as JAX compiles it
            (`ORBAX_TUNIX_EXECUTABLE_CACHE=0`: none is kept)
  shared    by processes at once: an entry is written whole under a temporary name, then
            renamed into place; one that does not load (damaged, or from another JAX) is
            compiled again and written anew
  trusted   as JAX's own entries are: what is kept there is loaded and run (the user's cache
            directory, never a checkpoint's; this subdirectory made readable by its owner only)

The programs are compiled on several threads (`device.Compiler`); they lower one at a time
(`_LOWERING`): lowering is Python, which several threads run no faster, and which slows the
read beside them (BENCHMARKS.md §29), while XLA's compiles that follow run at once.
"""

from __future__ import annotations

import enum
import hashlib
import os
import pathlib
import pickle
import sys
import tempfile
import threading
import types
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jaxlib.version
import ml_dtypes
import numpy as np

from orbax_tunix import version

SUBDIRECTORY = 'orbax-tunix-executables'
_MAGIC = b'orbax-tunix-executable/1\n'
_VARIABLE = 'ORBAX_TUNIX_EXECUTABLE_CACHE'
# JAX settings that change where and whether programs are cached, not what they compute.
_NOT_KEYED = ('jax_compilation_cache', 'jax_persistent_cache', 'jax_enable_compilation_cache',
              'jax_explain_cache_misses', 'jax_log_compiles', 'jax_raise_persistent_cache_errors')

# Loaded (or compiled) in this process, by key: the next restore takes them from here.
_LOADED: dict[str, Any] = {}
_LOCK = threading.Lock()
_LOWERING = threading.Lock()  # One program lowered at a time (see the module).
_VERSIONS: list[str] = []  # `_versions()`, once found.


class _NoText(Exception):
  """A key part with no exact, stable text: its program is not kept."""


def _text(x: Any) -> str:
  """`x` as text that tells apart any two values that compile differently."""
  if isinstance(x, np.generic):  # Before Python's scalars: np.float64 is a float.
    return f'{_text(x.dtype)}:{x.tobytes().hex()}'
  if x is None or isinstance(x, bool | int | str):
    return repr(x)
  if isinstance(x, float):  # Weakly typed in JAX, unlike numpy's.
    return float.hex(x)
  if isinstance(x, enum.Enum):
    return f'{type(x).__qualname__}.{x.name}'
  if isinstance(x, np.dtype):
    return f'dtype({x.str}{x.name})'
  if isinstance(x, tuple | list):
    return '(' + ','.join(map(_text, x)) + ')'
  if isinstance(x, jax.sharding.PartitionSpec):
    return 'P' + _text(tuple(x))
  if isinstance(x, jax.sharding.NamedSharding):
    mesh = x.mesh
    return 'Named' + _text((tuple(mesh.axis_names), tuple(mesh.devices.shape),
                            tuple(d.id for d in mesh.devices.flat), tuple(mesh.axis_types),
                            x.spec, x.memory_kind))
  if isinstance(x, jax.sharding.SingleDeviceSharding):
    return 'Single' + _text((next(iter(x.device_set)).id, x.memory_kind))
  if isinstance(x, jax.ShapeDtypeStruct):
    return 'Array' + _text((tuple(x.shape), np.dtype(x.dtype), x.sharding))
  if _defined_in_key(x):
    return f'function {x.__module__}.{x.__qualname__}'
  raise _NoText(type(x).__qualname__)


def _defined_in_key(fn: Any) -> bool:
  """Whether `fn`'s name stands for what it computes: a function defined at the top of one
  of this package's modules (their files are in `_versions`: an edit makes new keys) or a
  built-in function of Python's standard library (e.g. `math.sqrt`; Python's version is in
  `_versions`). A lambda, a nested function or another package's function has no such name:
  its body may change under the same one."""
  if isinstance(fn, types.BuiltinFunctionType):
    module = getattr(fn, '__self__', None)
    return (isinstance(module, types.ModuleType) and module.__name__ in sys.stdlib_module_names
            and getattr(module, fn.__name__, None) is fn)
  if not isinstance(fn, types.FunctionType) or '<' in fn.__qualname__:
    return False
  module = sys.modules.get(fn.__module__)
  return (fn.__module__.partition('.')[0] == __name__.partition('.')[0]
          and getattr(module, fn.__qualname__, None) is fn)


def _versions() -> str:
  """The versions of what makes a program, and this package's modules as they are on disk
  (their names, sizes and modification times: an edit makes new keys), once per process."""
  with _LOCK:  # The compile threads ask at once; one looks (a TPU host's files are slow).
    if _VERSIONS:
      return _VERSIONS[0]
    root = pathlib.Path(__file__).resolve().parents[1]
    files = []
    for path in sorted(root.rglob('*.py')):
      stat = path.stat()
      files.append((str(path.relative_to(root)), stat.st_size, stat.st_mtime_ns))
    _VERSIONS.append(_text((version.__version__, tuple(files), jax.__version__,
                            jaxlib.version.__version__, np.__version__, sys.version)))
    return _VERSIONS[0]


def _environment() -> str:
  """What else a compiled program depends on: the backend, JAX's settings, XLA's flags."""
  backend = jax.devices()[0].client
  settings = tuple(sorted((name, value) for name, value in jax.config.values.items()
                          if not name.startswith(_NOT_KEYED)))
  return _versions() + _text((
      backend.platform, backend.platform_version,
      tuple((d.id, d.device_kind, d.process_index) for d in backend.devices()), settings,
      os.environ.get('XLA_FLAGS', ''), os.environ.get('LIBTPU_INIT_ARGS', '')))


def directory() -> pathlib.Path | None:
  """Where programs are kept now, or None: not kept (see the module)."""
  where = jax.config.jax_compilation_cache_dir
  if (os.environ.get(_VARIABLE, '1') == '0' or not jax.config.jax_enable_compilation_cache
      or not where or '://' in where or jax.process_count() != 1):
    return None
  return pathlib.Path(where) / SUBDIRECTORY


def any_kept() -> bool:
  """Whether any program is kept now (`directory` holds an entry): a process likely to load its
  programs rather than compile them."""
  where = directory()
  try:
    return where is not None and any(where.iterdir())
  except OSError:  # None there yet, or unreadable: nothing to load.
    return False


def _bits(dtype: Any) -> int:
  """The bits an element of `dtype` holds (int4: 4, though numpy stores it in a byte)."""
  dtype = np.dtype(dtype)
  if dtype.kind in 'iu' or dtype.name.startswith(('int', 'uint')):
    return ml_dtypes.iinfo(dtype).bits
  if dtype.kind == 'f' or dtype.name.startswith('float'):
    return ml_dtypes.finfo(dtype).bits
  return dtype.itemsize * 8


def key(program: Any, abstract: Sequence[jax.ShapeDtypeStruct]) -> str | None:
  """The program's key for arguments like `abstract`, or None: not kept (a program with no
  key as data, or one of a value with no exact text; or of sub-byte arguments, e.g. int4,
  whose layout as read is not the one a program compiled for them expects: jit
  recompiles for it, an executable loaded would refuse it)."""
  try:
    if getattr(program, 'key', None) is None or any(_bits(a.dtype) < 8 for a in abstract):
      return None
    text = _text((program.key, tuple(abstract))) + _environment()
  except (_NoText, TypeError):  # TypeError: a dtype numpy has not (e.g. a PRNG key's).
    return None
  return hashlib.sha256(text.encode()).hexdigest()


def entry(program: Any, abstract: Sequence[jax.ShapeDtypeStruct]) -> pathlib.Path | None:
  """Where `program` for arguments like `abstract` is kept, or None: it is not (see the
  module). Cheap once a process has looked at its versions: ask it on the thread that reads,
  before the reads (on a compile thread, its file system calls wait on the reads' GIL)."""
  where = directory()
  name = None if where is None else key(program, abstract)
  return None if name is None else where / name


def compiled(program: Any, abstract: Sequence[jax.ShapeDtypeStruct],
             kept: pathlib.Path | None) -> Callable:
  """`program` compiled for arguments like `abstract`: loaded from `kept` where it is there,
  else compiled and kept there; with `kept` None, compiled into the program's own cache
  (JAX's persistent cache as configured) and the program itself returned.

  Args:
    program: a `transforms.Program`.
    abstract: its arguments' shapes, dtypes and shardings.
    kept: `entry(program, abstract)`.

  Returns:
    What to call with the arguments: the compiled executable, or the program.

  Raises:
    Whatever JAX's compile raises.
  """
  if kept is None:
    _lowered(program, abstract).compile()  # Into the jitted function's cache.
    return program
  with _LOCK:
    found = _LOADED.get(kept.name)
  if found is None:
    found = _load(kept)
    if found is None:
      found = _lowered(program, abstract).compile()
      _save(kept, found)
    with _LOCK:
      if len(_LOADED) > 256:
        _LOADED.clear()
      _LOADED[kept.name] = found
  return found


def _lowered(program: Any, abstract: Sequence[jax.ShapeDtypeStruct]) -> Any:
  with _LOWERING:
    return program.lower(*abstract)


def _load(path: pathlib.Path) -> Any:
  """The executable kept at `path`, or None: none, or it does not load."""
  from jax.experimental import serialize_executable  # pylint: disable=g-import-not-at-top
  try:
    data = path.read_bytes()
  except OSError:
    return None
  head, digest, body = data[:len(_MAGIC)], data[len(_MAGIC):len(_MAGIC) + 32], data[
      len(_MAGIC) + 32:]
  if head != _MAGIC or hashlib.sha256(body).digest() != digest:
    return None
  try:
    payload, in_tree, out_tree = pickle.loads(body)
    return serialize_executable.deserialize_and_load(payload, in_tree, out_tree)
  except Exception:  # pylint: disable=broad-except
    return None  # Another JAX's, or damaged: compiled again.


def _save(path: pathlib.Path, executable: Any) -> None:
  """Keeps `executable` at `path`, whole or not at all (a failure only loses it)."""
  from jax.experimental import serialize_executable  # pylint: disable=g-import-not-at-top
  try:
    body = pickle.dumps(serialize_executable.serialize(executable))
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f'.{path.name}.')
    try:
      with os.fdopen(fd, 'wb') as f:
        f.write(_MAGIC + hashlib.sha256(body).digest() + body)
      os.replace(temporary, path)
    except BaseException:
      os.unlink(temporary)
      raise
  except Exception:  # pylint: disable=broad-except
    pass  # Not kept: the next process compiles it again.

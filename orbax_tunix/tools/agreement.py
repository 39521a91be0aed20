"""What a process of a job was asked to write, as text every process compares.

Every process of a multi-process `convert` or `export` plans on its own, from
its own flags; given another step, source or option, one process would write
its part of another output (a step that fails its own checksums, an index
naming files no process wrote). So every process describes its plan, field
by field (`fingerprint`: every field of the plan, so a new option is compared
too, and every option as the caller gave it, by its name and value), and the
processes compare them (`consensus.agree_on`) before anything is written: a
difference names the options that differ and each process's value.

A source is told by its resolved path, its step and a digest of its metadata
files (`_CHECKPOINT_METADATA`, each item's `_METADATA`: they record the save's
timestamps and every array's shape and dtype): the same step copied to each
host's own disk at one path agrees; another run, or another step, does not.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
from etils import epath

from orbax_tunix.reading import reader
from orbax_tunix.store._orbax import CHECKPOINT_METADATA, PYTREE_METADATA

# Plan fields that differ between processes by design: only process 0 tells what an
# interrupted run left beside the destination.
PER_PROCESS = ('notes',)
# The plan field holding the options as the caller gave them: told one field per option (by
# the caller's name, in backquotes as messages name parameters: the CLI shows its flag).
OPTIONS = 'options'

# A metadata file larger than this is told by its size alone (a 1M-leaf `_METADATA`).
HASHED_BYTES = 64 << 20


def fingerprint(plan: Any) -> dict[str, str]:
  """Every field of a plan (a dataclass) as one line of text, equal on processes given
  the same work (`PER_PROCESS` fields left out).

  Args:
    plan: a `pipeline.Plan`.

  Returns:
    field name -> its value as people read it (large values: a summary and a digest).
  """
  seen: dict[str, str] = {}
  told = {f.name: _DESCRIBE.get(f.name, _value)(getattr(plan, f.name), seen)
          for f in dataclasses.fields(plan) if f.name not in (*PER_PROCESS, OPTIONS)}
  return {**{_option(name): _asked(value) for name, value in plan.options.items()}, **told}


def asked(plan: Any) -> frozenset[str]:
  """The fields of `fingerprint` that are options as the caller gave them (the others:
  what the plan made of them)."""
  return frozenset(_option(name) for name in plan.options)


def _option(name: str) -> str:
  return f'`{name}`'


def _asked(value: Any) -> str:
  """An option's value as the caller gave it (a path resolved, as `dst` is; a list of names
  as names)."""
  if isinstance(value, (epath.Path, os.PathLike)):
    return _where(epath.Path(value))
  if isinstance(value, (tuple, list)) and all(isinstance(v, str) for v in value):
    return ', '.join(value)
  return _value(value, {})


def _digest(value: Any) -> str:
  return hashlib.sha256(json.dumps(_canon(value), sort_keys=True).encode()).hexdigest()[:12]


def _canon(value: Any) -> Any:
  """`value` as JSON data, the same in every process for equal values (no ids, no reprs)."""
  kind = type(value)
  told = _CANON.get(kind)
  if told is None:
    told = _CANON[kind] = _canon_of(value)  # Decided once per type: plans have many leaves.
  return told(value)


def _canon_of(value: Any) -> Callable[[Any], Any]:
  """How `_canon` tells values of `value`'s type."""
  if value is None or isinstance(value, (bool, int, float, str)):
    return lambda v: v
  if isinstance(value, reader.Source):
    return lambda v: os.fspath(v.step_dir)  # Its identity is the source's own field.
  if isinstance(value, np.dtype):
    return _dtype_name
  if isinstance(value, np.generic):
    return lambda v: v.item()
  if isinstance(value, (epath.Path, os.PathLike)):
    return os.fspath
  if isinstance(value, Mapping):
    return lambda v: sorted(([_canon(k), _canon(x)] for k, x in v.items()), key=json.dumps)
  if isinstance(value, (frozenset, set)):
    return lambda v: sorted((_canon(x) for x in v), key=json.dumps)
  if isinstance(value, (tuple, list)):
    return lambda v: [_canon(x) for x in v]
  if dataclasses.is_dataclass(value) and not isinstance(value, type):
    names = tuple(f.name for f in dataclasses.fields(value))
    return lambda v: [_canon(getattr(v, name)) for name in names]
  if callable(value):  # A function (a transform's): by its name.
    return lambda v: getattr(v, '__qualname__', type(v).__name__)
  return lambda v: type(v).__name__


# Type -> how `_canon` tells its values.
_CANON: dict[type, Callable[[Any], Any]] = {}


@functools.cache
def _dtype_name(dtype: np.dtype) -> str:
  return dtype.name  # Slow in numpy (it is computed), and asked once per leaf.


def _value(value: Any, seen: dict[str, str]) -> str:
  """A plain value as it is; anything larger as its digest."""
  del seen
  if value is None or isinstance(value, (bool, int, float, str, np.dtype, epath.Path)):
    return str(_dtype_name(value) if isinstance(value, np.dtype) else value)
  return f'digest {_digest(value)}'


def _metadata_digest(ckpt: reader.Source, seen: dict[str, str]) -> str:
  """A digest of the step's metadata files (each read once per fingerprint)."""
  step = ckpt.step_dir
  key = os.fspath(step)
  if key not in seen:
    digest = hashlib.sha256()
    names = [CHECKPOINT_METADATA] + [f'{item}/{PYTREE_METADATA}' for item in
                                     sorted({*ckpt.items, *ckpt.json_items})]
    for name in names:
      path = step / name
      digest.update(name.encode() + b'\0')
      try:
        size = path.stat().length
        digest.update(path.read_bytes() if size <= HASHED_BYTES else str(size).encode())
      except OSError:
        digest.update(b'absent')
    seen[key] = digest.hexdigest()[:12]
  return seen[key]


def _where(path: epath.Path) -> str:
  """A local path resolved (symlinks, relative parts); a bucket's URL as it is."""
  text = os.fspath(path)
  return text if '://' in text else os.path.realpath(text)


def _checkpoint(ckpt: reader.Source, seen: dict[str, str]) -> str:
  return (f'{_where(ckpt.step_dir)} (step {ckpt.detection.step}, metadata'
          f' {_metadata_digest(ckpt, seen)})')


def _merge(merge: Any, seen: dict[str, str]) -> str:
  if merge is None:
    return 'None'
  return (f'base {_checkpoint(merge.base, seen)}, {len(merge.merges)} of {len(merge.weights)}'
          f' weights adapted (digest {_digest(merge)})')


def _items(items: Any, seen: dict[str, str]) -> str:
  del seen
  arrays = sum(len(item.outputs) for item in items)
  return f'{_count(len(items), "item")}, {_count(arrays, "leaf")} (digest {_digest(items)})'


def _files(files: Any, seen: dict[str, str]) -> str:
  del seen
  if not files:
    return 'none'
  return (f'{_count(len(files), "file")}, {sum(f.nbytes for f in files)} bytes'
          f' (digest {_digest(files)})')


def _other_files(files: Any, seen: dict[str, str]) -> str:
  """A folder's other files, by name and content (a config read from each host's disk)."""
  del seen
  if not files:
    return 'none'
  digest = hashlib.sha256()
  for name, content in files:
    digest.update(name.encode() + b'\0')
    try:
      digest.update(content.encode() if isinstance(content, str) else content.read_bytes())
    except OSError:
      digest.update(b'unreadable')
  return f'{", ".join(name for name, _ in files)} (digest {digest.hexdigest()[:12]})'


def _count(n: int, noun: str) -> str:
  return f'{n} {noun}' if n == 1 else f'{n} {"leaves" if noun == "leaf" else noun + "s"}'


# How a field is told (by name); every other field: `_value`.
_DESCRIBE: dict[str, Callable[[Any, dict[str, str]], str]] = {
    'source': _checkpoint,
    'dst': lambda dst, seen: _where(dst),
    'merge': _merge,
    'items': _items,
    'files': _files,
    'other_files': _other_files,
}

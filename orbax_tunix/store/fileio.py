"""Reading an Orbax checkpoint's small files: capped in size, every failure in our terms.

Every file is read with a cap on its size, and every failure names the file,
what was expected and what was found. No array data is read here.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import posixpath
import stat
from collections.abc import Iterator
from typing import Any

import fsspec
from etils import epath

from orbax_tunix import errors

# No metadata file of a real checkpoint comes near this (a 1M-leaf _METADATA
# is ~250 MB); a larger one is damaged, or not a metadata file.
MAX_METADATA_BYTES = 1 << 30


def as_path(path: epath.PathLike) -> epath.Path:
  """An `epath.Path`, made absolute when local (TensorStore's OCDBT needs it)."""
  path = epath.Path(path)
  return path if '://' in os.fspath(path) or path.is_absolute() else path.resolve()


def is_local(path: epath.Path) -> bool:
  """Whether a path is on a local disk (not a bucket)."""
  return '://' not in os.fspath(path)


def identity(path: epath.PathLike) -> str:
  """What a path names, as one text however it is spelled: a local path absolute, its links
  followed and its `.` and `..` taken out (`os.path.realpath`); a bucket's URL normalized
  (`gs://b//x/./y/../z/` is `gs://b/x/z`: an object store has no links)."""
  text = os.fspath(path)
  if '://' not in text:
    return os.path.realpath(text)
  scheme, rest = text.split('://', 1)
  bucket, _, key = rest.partition('/')
  key = posixpath.normpath('/' + key).lstrip('/')
  return f'{scheme}://{bucket}' + (f'/{key}' if key else '')


def same_place(a: epath.PathLike, b: epath.PathLike) -> bool:
  """Whether two paths name one file or folder: one `identity`, or (local, both there) one
  file on one device (a bind mount, another name `realpath` cannot see through)."""
  if identity(a) == identity(b):
    return True
  if '://' in os.fspath(a) or '://' in os.fspath(b):
    return False
  try:
    return os.path.samefile(a, b)
  except OSError:  # Either is not there (any more): nothing to compare.
    return False


# What to do about a damaged metadata file of a checkpoint (the default remedy).
_USE_ANOTHER_STEP = 'The checkpoint is damaged; use another step (`step`).'


def read_bytes(path: epath.Path, what: str, remedy: str = _USE_ANOTHER_STEP) -> bytes:
  """A metadata file's bytes, at most `MAX_METADATA_BYTES` of them.

  Args:
    path: the file.
    what: what it should be, for messages (e.g. "Orbax's PyTree metadata").
    remedy: what to do when it is damaged, for messages.

  Raises:
    CorruptMetadataError: missing, not a regular file, larger than the cap,
      or unreadable.
  """
  if is_local(path):
    try:
      info = os.stat(path)
    except OSError as e:
      raise _unreadable(path, what, e) from e
    if not stat.S_ISREG(info.st_mode):
      raise errors.CorruptMetadataError(
          f'{path}: expected {what} in a regular file, found {_kind(info.st_mode)}. {remedy}'
      )
    if info.st_size > MAX_METADATA_BYTES:
      raise _too_large(path, what, info.st_size, remedy)
  try:
    with path.open('rb') as f:
      data = f.read(MAX_METADATA_BYTES + 1)
  except OSError as e:
    raise _unreadable(path, what, e) from e
  if len(data) > MAX_METADATA_BYTES:
    raise _too_large(path, what, None, remedy)
  return data


def _kind(mode: int) -> str:
  if stat.S_ISDIR(mode):
    return 'a directory'
  if stat.S_ISREG(mode):
    return 'a file'
  return 'a device, pipe or socket'


def what_is_at(path: epath.Path) -> str:
  """What is at a path, for messages: 'a file', 'a directory', 'a device, pipe
  or socket', 'a broken link', 'nothing' (links followed), or, where it cannot
  be looked at, 'a path this user cannot reach (<the reason>)'."""
  if not is_local(path):
    return 'a directory' if path.is_dir() else 'a file' if path.exists() else 'nothing'
  try:
    return _kind(os.stat(path).st_mode)
  except FileNotFoundError:
    return 'a broken link' if os.path.islink(path) else 'nothing'
  except OSError as e:  # A directory on the way this user may not enter, a loop of links.
    return f'a path this user cannot reach ({e.strerror or e})'


def _unreadable(path: epath.Path, what: str, e: OSError) -> errors.CorruptMetadataError:
  if isinstance(e, FileNotFoundError):
    return errors.CorruptMetadataError(
        f'{path}: expected {what}, found nothing. The checkpoint is incomplete;'
        ' use another step (`step`) or re-save it.'
    )
  return errors.CorruptMetadataError(
      f'{path}: cannot read {what} ({e}). Check the path and its permissions.'
  )


def found_at(path: epath.Path) -> str:
  """What is at a path that should be a directory, for messages."""
  found = what_is_at(path)
  return 'nothing (or a broken link)' if found == 'nothing' else found


def _too_large(path: epath.Path, what: str, size: int | None,
               remedy: str = _USE_ANOTHER_STEP) -> errors.CorruptMetadataError:
  found = f'{size} bytes' if size is not None else 'more than that'
  return errors.CorruptMetadataError(
      f'{path}: expected {what}, found a file larger than the {MAX_METADATA_BYTES}'
      f' bytes a metadata file may hold ({found}). {remedy}'
  )


@contextlib.contextmanager
def no_gc() -> Iterator[None]:
  """Python's cyclic GC paused: building a million small objects (a large
  `_METADATA`) otherwise triggers collection after collection, 2-4x the time."""
  enabled = gc.isenabled()
  gc.disable()
  try:
    yield
  finally:
    if enabled:
      gc.enable()


def read_json(path: epath.Path, what: str = 'an Orbax metadata file',
              remedy: str = _USE_ANOTHER_STEP) -> Any:
  """A JSON metadata file, parsed, within the size cap.

  Args:
    path, what, remedy: as `read_bytes`.

  Raises:
    CorruptMetadataError: see `read_bytes`; or not JSON, or nested deeper
      than Python's parser allows.
  """
  data = read_bytes(path, what, remedy)
  try:
    return json.loads(data)
  except RecursionError as e:
    raise errors.CorruptMetadataError(
        f'{path}: expected {what}, found JSON nested deeper than the parser allows'
        f' (metadata is a few levels deep). {remedy}'
    ) from e
  except ValueError as e:
    raise errors.CorruptMetadataError(
        f'{path}: expected {what} as JSON, found {len(data)} bytes that do not'
        f' parse ({e}). {remedy}'
    ) from e


def folder_bytes(folder: epath.Path) -> int | None:
  """The bytes of every file under `folder` (links followed, each directory once), as the
  file system or the bucket's listing tells them; None where they cannot be told."""
  text = os.fspath(folder)
  if not is_local(folder):
    try:
      fs, where = fsspec.core.url_to_fs(text)
      return int(fs.du(where, total=True))
    except Exception:  # pylint: disable=broad-except  # A client's own errors: not told.
      return None
  total, seen = 0, set()
  try:
    for top, dirs, files in os.walk(text, followlinks=True, onerror=_raise):
      info = os.stat(top)
      if (info.st_dev, info.st_ino) in seen:
        dirs[:] = []  # A link back up: counted once, not entered again.
        continue
      seen.add((info.st_dev, info.st_ino))
      total += sum(os.stat(os.path.join(top, f)).st_size for f in files)
  except OSError:
    return None
  return total


def _raise(error: OSError) -> None:
  raise error

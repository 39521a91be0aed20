"""Names read from a checkpoint that become paths: each one plain name inside its folder.

A checkpoint is a stranger's download (a bucket copy, a colleague's tarball):
an item named `../../shared` in `_CHECKPOINT_METADATA`, or a key `..` of an
item whose arrays are directories named after their keys (no OCDBT), would
otherwise be read from, and written to, outside the checkpoint and the
destination. Every such name is checked here before anything is read
through it or written with it, on local disks and buckets alike. Names
inside an OCDBT store are keys of its database, not paths: they are not
checked (a key may hold '/').
"""

from __future__ import annotations

import os
import re

from orbax_tunix import errors

# A Windows drive ('C:'): a path of its own wherever it is joined.
_DRIVE = re.compile(r'^[A-Za-z]:')


def why_not_plain(name: object) -> str | None:
  """Why `name` is not one plain file or directory name, or None when it is.

  A plain name is a non-empty string, not `.` or `..`, holding no `/`, `\\`
  or NUL, and not beginning with a drive (`C:`).
  """
  if not isinstance(name, str):
    return f'it is a {type(name).__name__}, not a string'
  if not name:
    return 'it is empty (it would name the folder itself)'
  if name in ('.', '..'):
    return f'{name!r} names {"the folder itself" if name == "." else "the folder above"}'
  for char, what in (('/', 'a /'), ('\\', 'a \\'), ('\0', 'a NUL character')):
    if char in name:
      return 'it is an absolute path' if name.startswith(char) else f'it holds {what}'
  if _DRIVE.match(name):
    return 'it begins with a drive (an absolute Windows path)'
  return None


def _refusal(where: os.PathLike | str, what: str, name: object, why: str,
             ) -> errors.UnsafeNameError:
  return errors.UnsafeNameError(
      f'{where}: {what} {name!r}, which is not a plain name inside its folder ({why}). A'
      ' name read from a checkpoint must be one file or directory name there; this one'
      ' would lead elsewhere (the checkpoint is damaged, or was edited to read or write'
      ' outside it). Nothing was read through it or written. Use another step, or a'
      ' trusted copy of the checkpoint.'
  )


def check_plain(name: object, where: os.PathLike | str, what: str) -> str:
  """Returns `name` when it is one plain name (`why_not_plain`).

  Args:
    name: the name, as read from the checkpoint.
    where: the file it was read from (or the folder it names an entry of), for messages.
    what: what names it, for messages ('item_handlers names the item').

  Raises:
    UnsafeNameError: naming the entry and why.
  """
  why = why_not_plain(name)
  if why is not None:
    raise _refusal(where, what, name, why)
  return name  # type: ignore[return-value]


def check_relative(name: str, where: os.PathLike | str, what: str) -> str:
  """Returns `name` when it is plain names joined by `/` (a path inside its folder).

  Orbax names an array stored without OCDBT after its keys (joined by '.'): a
  directory of the item, nested where a key holds '/'. Every part must be a
  plain name, so the path stays inside the item.

  Raises:
    UnsafeNameError: naming the entry and why.
  """
  if name.startswith('/'):
    raise _refusal(where, what, name, 'it is an absolute path')
  for part in name.split('/'):
    why = why_not_plain(part)
    if why is not None:
      raise _refusal(where, what, name, f'its part {part!r}: {why}' if part != name else why)
  return name

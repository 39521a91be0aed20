"""Where a new step (or an export) may go: never over a source's run, a folder that is read,
a name Orbax takes for an unfinished step, or a mount point; locations compared as what they
are (every symlink resolved, by identity for bind mounts, bucket URLs normalized).

Decided before anything is written (`commit.check_destination`), and again before the first
write (`commit.staged`).
"""

from __future__ import annotations

import os
import posixpath
import re
from collections.abc import Sequence

from etils import epath

from orbax_tunix import errors
from orbax_tunix.conventions import RL_ROLES
from orbax_tunix.store import fileio, step_store


def what_it_is(path: epath.Path) -> str:
  """What a path is, for comparing locations: local paths with every symlink resolved
  (`os.path.realpath`; components not there yet normalized), bucket URLs normalized
  (scheme and bucket in lower case; repeated slashes, `.`, `..` and a trailing slash
  folded)."""
  text = os.fspath(path)
  if fileio.is_local(path):
    return os.path.realpath(text)
  scheme, _, rest = text.partition('://')
  bucket, _, key = rest.partition('/')
  key = posixpath.normpath('/' + key).rstrip('/')
  return f'{scheme.lower()}://{bucket.lower()}{key}'


def source_run(step_dir: epath.Path) -> epath.Path:
  """What a new step must stay out of: the source step's whole run.

  That is the root holding the step when the step is named as Orbax names
  steps (an RL root above its `actor/` or `critic/`), else the step itself.
  """
  if step_store.step_number(step_dir.name) is None:
    return step_dir
  root = step_dir.parent
  return root.parent if root.name in RL_ROLES else root


def _within(path: str, area: str) -> bool:
  return path == area or path.startswith(area.rstrip('/') + '/')


def _identity(path: str) -> tuple[int, int] | None:
  try:
    info = os.stat(path)
  except OSError:
    return None
  return info.st_dev, info.st_ino


def _same_directory_within(path: str, areas: Sequence[str]) -> str | None:
  """The area `path` or one of its existing ancestors is (by device and inode), or None.

  Catches what the path text does not show: a bind mount of the area.
  """
  ids = {_identity(area): area for area in areas}
  ids.pop(None, None)
  while True:
    found = ids.get(_identity(path))  # None for a path that does not exist.
    if found is not None or os.path.dirname(path) == path:
      return found
    path = os.path.dirname(path)


def overlap(step_dir: epath.Path, dst: epath.Path) -> str | None:
  """How a destination overlaps a source step's run, or None when it does not.

  The one decision of every command that writes a new step from an existing
  one: the destination may be neither inside the source's run (`source_run`:
  a step added there is one the source's trainer resumes from), nor the run
  itself, nor a directory holding the source step. Paths are compared as what
  they are (`what_it_is`), local directories also by identity (a bind mount).

  Args:
    step_dir: the source step directory (as given, links and all).
    dst: the destination path.

  Returns:
    A phrase saying how they overlap, or None.
  """
  if fileio.is_local(step_dir) != fileio.is_local(dst):
    return None
  local = fileio.is_local(dst)
  real_step = what_it_is(step_dir)
  runs = sorted({what_it_is(source_run(step_dir)), what_it_is(source_run(epath.Path(real_step)))})
  targets = [what_it_is(dst)]
  if local:
    targets.append(os.path.abspath(os.fspath(dst)))  # A rename replaces a link itself.
  for target in targets:
    for run in runs:
      if _within(target, run):
        return f'inside the source run {run}' if target != run else f'the source run {run}'
  if local:
    run = _same_directory_within(targets[0], runs)
    if run is not None:
      return f'inside the source run {run} (the same directory under another name)'
  return _holding(dst, real_step, 'the source step')


def _holding(dst: epath.Path, real: str, what: str) -> str | None:
  """How `dst` is or holds the location `real` (`what_it_is`), or None."""
  local = fileio.is_local(dst)
  targets = [what_it_is(dst)] + ([os.path.abspath(os.fspath(dst))] if local else [])
  if any(_within(real, target) for target in targets):
    return f'a directory holding {what}' if real != targets[0] else what
  if local and os.path.isdir(targets[0]) and _same_directory_within(real, [targets[0]]):
    return f'a directory holding {what} (under another name)'
  return None


def check_not_over(dst: epath.Path, folder: epath.Path, what: str) -> None:
  """Refuses a destination that is, or holds, an input folder (writing would replace it).

  Args:
    dst: the destination path.
    folder: a folder the command reads (e.g. the Hugging Face folder whose
      config an export copies).
    what: what `folder` is, for the message.

  Raises:
    InvalidDestinationError: naming both.
  """
  if fileio.is_local(folder) != fileio.is_local(dst):
    return
  how = _holding(dst, what_it_is(folder), what)
  if how is not None:
    raise errors.InvalidDestinationError(
        f'{dst}: the destination is {how} ({folder}), which this command reads and never'
        ' writes to: choose a destination outside it.'
    )


def check_outside_source(step_dir: epath.Path, dst: epath.Path) -> None:
  """Refuses a destination that overlaps a source step's run (see `overlap`).

  Raises:
    InvalidDestinationError: naming both and how they overlap.
  """
  how = overlap(step_dir, dst)
  if how is not None:
    raise errors.InvalidDestinationError(
        f'{dst}: the destination overlaps the source checkpoint: it is {how} (source'
        f' step {step_dir}). The source run,'
        ' every step and item in it, is never written to, and a step added there'
        ' would be taken as the run\'s latest: choose a dst outside it.'
    )


def _unescape(field: str) -> str:
  """A path as /proc/self/mountinfo writes it (space, tab, newline, backslash as octal)."""
  return re.sub(r'\\([0-7]{3})', lambda m: chr(int(m.group(1), 8)), field)


def _mount_points() -> frozenset[str]:
  """Every mount point of this process's mount namespace (bind mounts too: unlike
  `os.path.ismount`, which compares devices, this sees a bind mount within one file
  system); empty where /proc is not there."""
  try:
    with open('/proc/self/mountinfo', encoding='utf-8', errors='surrogateescape') as f:
      lines = f.read().splitlines()
  except OSError:
    return frozenset()
  return frozenset(_unescape(line.split(' ')[4]) for line in lines if line.count(' ') >= 4)


def check_not_mount_point(dst: epath.Path, what: str) -> None:
  """Refuses a local DST that is a mount point, before anything is written.

  A new one is written complete beside DST and renamed onto it (the one way a
  reader never sees it half made), and a mount point can be neither renamed nor
  replaced (EBUSY): written there, the whole output would land on the parent's
  file system first, then fail.

  Raises:
    InvalidDestinationError: saying why and what to do.
  """
  # A link given as DST is no mount point: a rename replaces the link itself.
  if not fileio.is_local(dst) or os.path.islink(dst) or not os.path.isdir(dst):
    return
  text = os.path.abspath(os.fspath(dst))
  where = os.path.join(os.path.realpath(os.path.dirname(text)), os.path.basename(text))
  if os.path.ismount(where) or where in _mount_points():
    raise errors.InvalidDestinationError(
        f'{dst}: the destination is a mount point (a volume is mounted there). This'
        f' command writes {what} complete beside its destination and renames it onto'
        ' it, so that no reader sees it half made, and a mount point cannot be renamed or'
        ' replaced.'
        f' Choose a new directory inside it instead (e.g. {os.path.join(os.fspath(dst), "out")}).'
    )


def check_no_broken_link(dst: epath.Path, what: str) -> None:
  """Refuses a local DST that is, or lies under, a symbolic link to nothing, before anything
  is written. A link to something is replaced itself (`commit.Staging`); a link to nothing
  (`latest -> exports/run-7`, not there) might be meant either way, to be replaced or to be
  written through, so neither is guessed at.

  Raises:
    InvalidDestinationError: naming the link, where it points and what to do.
  """
  if not fileio.is_local(dst):
    return
  path = os.path.abspath(os.fspath(dst))
  while not os.path.exists(path):
    if os.path.islink(path):
      target = os.readlink(path)
      whose = 'the destination' if path == os.path.abspath(os.fspath(dst)) else (
          f'a folder above the destination {dst}')
      raise errors.InvalidDestinationError(
          f'{path}: {whose} is a symbolic link to {target}, which does not exist. A link to'
          f' nothing is not guessed at: pass the path {what} should be'
          f' written to ({os.path.join(os.path.dirname(path), target)} to write where the'
          ' link points), or remove the link; nothing was written.'
      )
    if os.path.dirname(path) == path:
      return
    path = os.path.dirname(path)


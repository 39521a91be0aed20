"""Writing a new step so that it is seen only once complete, as Orbax does.

Orbax decides per kind of path how a step becomes final (its
`get_default_temporary_path_class`): on a local disk a step is written into a
temporary sibling and renamed; on a bucket, where a rename is a copy, it is
written in place and `commit_success.txt`, written last, makes it final. A
`Staging` follows the same rule, and replaces an existing step only once the
new one is complete. A step it writes in place holds `MARKER` until it is
committed, so that a rerun after an interruption may replace what it left.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import time
from collections.abc import Sequence

import fsspec
import orbax.checkpoint as ocp
from etils import epath

from orbax_tunix import _orbax, errors, storage
from orbax_tunix.storage import CHECKPOINT_METADATA, TMP_MARKER

COMMIT_SUCCESS = 'commit_success.txt'
# In a step being written in place (on a bucket), until its commit.
MARKER = '.orbax-tunix-writing'
# A replacement written beside an existing bucket step (never a step name).
NEW_MARKER = '.orbax-tunix-new-'


DestinationExistsError = errors.DestinationExistsError
InvalidDestinationError = errors.InvalidDestinationError


def is_ours_unfinished(path: epath.Path) -> bool:
  """A step this package was writing in place when it was interrupted."""
  return (path / MARKER).exists() and not ocp.path.step.is_path_finalized(path)


@dataclasses.dataclass(frozen=True)
class Kind:
  """What is written: how to tell one at a path (to replace it), and how it is committed.

  Attributes:
    what: for messages ('a checkpoint step').
    holds: the entries one of these holds, any of which tells it (for `force`).
    commit_file: written last to make it final (None: the rename alone).
    in_place: on a bucket, written in place (Orbax's way for steps); else
      written beside and copied over once complete.
  """

  what: str
  holds: tuple[str, ...]
  commit_file: str | None = COMMIT_SUCCESS
  in_place: bool = True

  def is_one(self, path: epath.Path) -> bool:
    return path.is_dir() and TMP_MARKER not in path.name and any(
        (path / name).exists() for name in self.holds)


STEP = Kind('a checkpoint step', (CHECKPOINT_METADATA,))


def check_replaceable(dst: epath.Path, force: bool, kind: Kind = STEP) -> None:
  """Says whether `dst` may be written: absent, our own leftover, or (force) one of `kind`.

  Raises:
    DestinationExistsError: it exists and `force` was not given.
    InvalidDestinationError: `force`, but it is not one of `kind`.
  """
  if not dst.exists() or is_ours_unfinished(dst):
    return
  if not force:
    raise DestinationExistsError(
        f'{dst}: already exists. Pass `force=True` to replace it (the old one is'
        ' removed only once the new one is complete), or choose another dst.'
    )
  if not kind.is_one(dst):
    found = 'a file' if not dst.is_dir() else (
        'a directory holding ' + (', '.join(sorted(p.name for p in dst.iterdir())[:5]) or 'nothing')
    )
    raise InvalidDestinationError(
        f'{dst}: `force=True` replaces only {kind.what} (a directory holding'
        f' {" or ".join(kind.holds)}), found {found}. Remove it yourself if it may go,'
        ' or choose another dst.'
    )


def remove_tree(path: epath.Path) -> None:
  """Removes a directory tree, tolerating writers still finishing in it."""
  for _ in range(5):  # Retried: a background write may still add a file.
    if not path.exists():
      return
    try:
      if storage.is_local(path):
        shutil.rmtree(os.fspath(path), ignore_errors=True)
      else:
        path.rmtree()
    except OSError:
      pass
    time.sleep(0.05)


class Staging:
  """Where a new step at `dst` is written, and how it is made final.

  Use: `work = staging.open()`, write the step's items and metadata into
  `work`, then `staging.commit()`; on any failure `staging.abort()`.
  """

  def __init__(self, dst: epath.Path, force: bool, kind: Kind = STEP):
    self.dst = dst
    self.force = force
    self.kind = kind
    self.in_place = _orbax.commits_with_file(dst)
    self.work = dst
    self._created: list[epath.Path] = []

  def open(self) -> epath.Path:
    """Creates the directory the new step is written into, and returns it."""
    dst = self.dst
    if self.in_place:
      if is_ours_unfinished(dst):
        remove_tree(dst)  # What an interrupted run of ours left: nobody's step.
      if dst.exists() or not self.kind.in_place:
        if dst.exists():
          check_replaceable(dst, self.force, self.kind)
        self.work = dst.parent / f'{dst.name}{NEW_MARKER}{time.time_ns()}'
      (self.work / MARKER).write_text('written by orbax-tunix; not committed yet')
      return self.work
    parent = dst.parent
    while not parent.exists() and parent != parent.parent:
      self._created.append(parent)
      parent = parent.parent
    dst.parent.mkdir(parents=True, exist_ok=True)
    self.work = dst.parent / f'{dst.name}{TMP_MARKER}-{time.time_ns()}'
    self.work.mkdir()
    return self.work

  def commit(self) -> bool:
    """Makes the new step final at `dst`; returns whether an old one was replaced.

    Raises:
      DestinationExistsError: `dst` appeared meanwhile and `force` is off.
    """
    if self.in_place:
      return self._commit_in_place()
    if self.kind.commit_file:
      (self.work / self.kind.commit_file).write_text(
          f'Checkpoint commit was successful to {self.dst}')
    if not self.dst.exists():
      self.work.rename(self.dst)
      return False
    check_replaceable(self.dst, self.force, self.kind)
    old = self.dst.parent / f'{self.dst.name}.orbax-tunix-old-{time.time_ns()}'
    self.dst.rename(old)
    try:
      self.work.rename(self.dst)
    except BaseException:
      old.rename(self.dst)
      raise
    remove_tree(old)
    return True

  def _commit_in_place(self) -> bool:
    dst, copied = self.dst, self.work != self.dst
    replaced = copied and dst.exists()
    if copied:
      # The new step is complete beside the old one: from here the old one is
      # unfinished (ours to replace on a rerun), then emptied and refilled.
      (dst / MARKER).write_text('written by orbax-tunix convert; not committed yet')
      (dst / COMMIT_SUCCESS).unlink(missing_ok=True)
      for entry in list(dst.iterdir()):
        if entry.name != MARKER:
          remove_tree(entry) if entry.is_dir() else entry.unlink()
      fs, _ = fsspec.core.url_to_fs(os.fspath(self.work))
      for entry in self.work.iterdir():
        if entry.name != MARKER:
          fs.copy(os.fspath(entry), os.fspath(dst / entry.name), recursive=True)
      remove_tree(self.work)
    (dst / MARKER).unlink()
    if self.kind.commit_file:
      (dst / self.kind.commit_file).write_text(f'Checkpoint commit was successful to {dst}')
    return replaced

  def abort(self) -> None:
    """Removes what was written (and the parent folders `open` created)."""
    remove_tree(self.work)
    _remove_empty(self._created)


def _remove_empty(directories: Sequence[epath.Path]) -> None:
  """Removes directories, deepest first, if they are empty."""
  for directory in directories:
    with contextlib.suppress(OSError):
      if directory.exists() and not any(directory.iterdir()):
        directory.rmdir()


def leftovers(dst: epath.Path) -> list[epath.Path]:
  """What interrupted conversions to `dst` left beside it (temporaries, replacements)."""
  if not dst.parent.exists():
    return []
  return sorted(
      [*dst.parent.glob(f'{dst.name}{TMP_MARKER}-*'), *dst.parent.glob(f'{dst.name}{NEW_MARKER}*')]
  )

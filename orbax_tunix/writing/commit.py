"""Writing a new step so that it is seen only once complete, as Orbax does.

Orbax decides per kind of path how a step becomes final (its
`get_default_temporary_path_class`): on a local disk a step is written into a
temporary sibling and renamed; on a bucket, where a rename is a copy, it is
written in place and `commit_success.txt`, written last, makes it final. A
`Staging` follows the same rule, and replaces an existing step only once the
new one is complete (on a bucket: complete beside it first, kept until it is
committed in place). What a run writes in a bucket holds `MARKER`, its claim
(`Claim`: the run, the location, every entry it may write there), until it is
committed: a rerun replaces what an interrupted run left, never what a live one
writes; a run on another host is taken as gone only once its claim has not been
renewed for `LEASE_SECONDS` by the store's own clock. Only what this package's
own record names is ever replaced: a finished one's (`Kind.record`), or an
unfinished one's claim; a `MARKER` that proves nothing counts for nothing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import hashlib
import json
import os
import secrets
import shutil
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence

import fsspec
from etils import epath

from orbax_tunix import errors
from orbax_tunix.store import _orbax, fileio, netprobe, step_store, storage_errors
from orbax_tunix.store._orbax import CHECKPOINT_METADATA, TMP_MARKER
from orbax_tunix.writing import checksums, places

COMMIT_SUCCESS = _orbax.COMMIT_SUCCESS
# In a step being written in place (on a bucket), until its commit.
MARKER = '.orbax-tunix-writing'
# A replacement written beside an existing bucket step (never a step name).
NEW_MARKER = '.orbax-tunix-new-'
# An old step moved aside while a local replacement is renamed into place.
OLD_MARKER = '.orbax-tunix-old-'


# --- a name Orbax takes for an unfinished step ----------------------------------------


def check_step_name(dst: epath.Path) -> None:
  """Refuses a destination named as Orbax or this package names unfinished work.

  Such a directory (`5.orbax-checkpoint-tmp-1`) is skipped by every reader,
  so the step written there would never be read.

  Raises:
    InvalidDestinationError: naming the marker and what to do.
  """
  marker = next((m for m in (TMP_MARKER, NEW_MARKER, OLD_MARKER, CLOCK_MARKER)
                 if m in dst.name), None)
  if marker is not None:
    raise errors.InvalidDestinationError(
        f'{dst}: the destination is named like an unfinished step ({marker!r} in its'
        ' name), which Orbax and the tools skip: the step written there would never'
        ' be read. Choose a dst without it, named by its step number (e.g. out/1000).'
    )


# --- which run a location is (being) written by ------------------------------------
#
# A run claims what it writes into on a bucket by creating `MARKER` there
# exclusively (a create that fails when the object exists), and renews the claim
# while it writes. The claim is the run's record of that location: the location
# itself and every entry the run may write there (`Claim`). A second run never
# deletes what a live run claims. What an interrupted run left is only what such a
# claim proves: the claim is this package's, made for that very location, and names
# every entry there; its run is gone: its process on this host has ended, or, for a
# run on another host, the claim was not renewed for `LEASE_SECONDS` by the store's
# own clock (the claim's modification time against that of an object written now:
# `_age`), never by comparing two hosts' clocks. Anything else holding `MARKER` (a
# marker copied or made by hand, a claim of another location, entries it does not
# name) is no leftover, and is refused as it would be without the marker. A local
# destination is never claimed (it is written beside and renamed onto it).

# A claim lapses this long after its last renewal (a run on another host, whose
# process cannot be looked up, is taken as gone only then), by the store's clock.
LEASE_SECONDS = 120.0
# How often a run renews its claims.
RENEW_SECONDS = 15.0
# An object written beside a claimed location for a moment, to read the store's time now.
CLOCK_MARKER = '.orbax-tunix-clock-'


def _host() -> str:
  """This host, as far as a process id means something on it: its name, its kernel's
  boot and its process-id namespace (containers sharing a name differ in the latter)."""
  parts = [socket.gethostname()]
  for where, read in (('/proc/sys/kernel/random/boot_id', 'file'), ('/proc/self/ns/pid', 'link')):
    with contextlib.suppress(OSError):
      parts.append(open(where).read().strip() if read == 'file' else os.readlink(where))
  return '/'.join(parts)


# The runs of this process under way (a claim of this process whose run is not
# here is a leftover of an earlier call).
_RUNS_HERE: set[str] = set()


@dataclasses.dataclass(frozen=True)
class Claim:
  """Who writes a location, and what it may leave there: the content of its `MARKER`.

  Attributes:
    run: the run (unique across hosts).
    host: the host of its process (`_host`).
    pid: its process.
    where: the location claimed (`places.what_it_is`): a claim copied elsewhere claims nothing.
    entries: every entry the run may write at the location (besides `MARKER`).
    age: seconds since the claim was last written, by the store's clock (`_age`); None
      when not asked (a claim of this host's, judged by its process) or not told by the
      store. Not part of the marker.
  """

  run: str
  host: str
  pid: int
  where: str
  entries: tuple[str, ...]
  age: float | None = dataclasses.field(default=None, compare=False)

  @classmethod
  def mine(cls, run: str, location: epath.Path, entries: Iterable[str]) -> Claim:
    return cls(run, _host(), os.getpid(), places.what_it_is(location), tuple(sorted(set(entries))))

  def text(self) -> str:
    return json.dumps({'run': self.run, 'host': self.host, 'pid': self.pid,
                       'where': self.where, 'entries': list(self.entries)})

  @classmethod
  def read(cls, marker: epath.Path) -> Claim | None:
    """The claim a marker holds; None when it holds none of this package's (any other
    text: an empty file, a claim an earlier version wrote, which named no entries)."""
    try:
      found = json.loads(marker.read_text())
      entries = found['entries']
      if not isinstance(entries, list) or not all(isinstance(e, str) for e in entries):
        return None
      return cls(str(found['run']), str(found['host']), int(found['pid']),
                 str(found['where']), tuple(entries))
    except (OSError, ValueError, KeyError, TypeError):
      return None

  @property
  def here(self) -> bool:
    """Whether its process runs (or ran) on this host: told by its process, not a clock."""
    return self.host == _host()

  def live(self) -> bool:
    """Whether its run may still be writing: its process is running (on this host), or
    its claim was written within `LEASE_SECONDS` by the store's clock (another host;
    an age the store does not tell counts as live)."""
    if self.here:
      if self.pid == os.getpid():
        return self.run in _RUNS_HERE
      try:
        os.kill(self.pid, 0)
      except ProcessLookupError:
        return False
      except OSError:
        return True  # Running, as another user.
      return True
    return self.age is None or self.age < LEASE_SECONDS

  def describe(self) -> str:
    if self.here:
      return f'run {self.run}, process {self.pid} on this host'
    age = ('its claim\'s age unknown (the store tells no modification times)'
           if self.age is None else
           f'its claim last renewed {max(self.age, 0.0):.0f} s ago by the store\'s clock')
    return f'run {self.run}, process {self.pid} on host {self.host.split("/")[0]}, {age}'


def _age(marker: epath.Path) -> float | None:
  """Seconds since `marker` was last written, by the store's own clock: its modification
  time against that of an object written beside its location now (and removed at once),
  both the store's; None where the store tells no modification times."""
  fs, where = fsspec.core.url_to_fs(os.fspath(marker))
  location = marker.parent
  probe = location.parent / f'{_stem(location)}{CLOCK_MARKER}{secrets.token_hex(6)}'
  _, probe_where = fsspec.core.url_to_fs(os.fspath(probe))
  try:
    fs.invalidate_cache(where)  # A listing read earlier holds an older time.
    written = fs.modified(where)  # First: the time read after it is no earlier than now.
    fs.pipe_file(probe_where, b'')
    try:
      fs.invalidate_cache(probe_where)
      now = fs.modified(probe_where)
    finally:
      with contextlib.suppress(OSError):
        fs.rm_file(probe_where)
    return (now - written).total_seconds()
  except (NotImplementedError, OSError, KeyError, TypeError, ValueError):
    return None


def _entries(path: epath.Path) -> set[str]:
  return {entry.name for entry in path.iterdir()}


def _claim_at(path: epath.Path, kind: Kind) -> tuple[Claim | None, str | None]:
  """(the claim proving `path` unfinished work of this package's, None) or (None, why
  its `MARKER` proves nothing), or (None, None) where there is no marker or it is left
  from a commit (see `unfinished_claim`)."""
  marker = path / MARKER
  if not marker.exists():
    return None, None
  if kind.commit_file is not None and (path / kind.commit_file).exists():
    return None, None  # Committed: the marker is left from the commit's last step.
  if not _orbax.commits_with_file(path):
    return None, ('this package never claims a local destination (it writes one beside it'
                  ' and renames it onto it)')
  claim = Claim.read(marker)
  if claim is None:
    return None, 'it holds no claim of this package (a claim names the run and all it writes)'
  if claim.where != places.what_it_is(path):
    return None, f'its claim is for another location ({claim.where})'
  foreign = sorted(_entries(path) - set(claim.entries) - {MARKER})
  if foreign:
    return None, f'its claim does not name {_listed(foreign)}'
  if not claim.here:
    claim = dataclasses.replace(claim, age=_age(marker))
  return claim, None


def unfinished_claim(path: epath.Path, kind: Kind) -> Claim | None:
  """The claim on `path` when it is unfinished work of this package: it holds `MARKER`
  with a claim of this package's for this very location that names every entry there,
  and is not committed; None otherwise (a marker copied or made by hand proves nothing,
  whatever it holds). A claim from another host carries its age by the store's clock."""
  return _claim_at(path, kind)[0]


def _being_written(dst: epath.Path, claim: Claim, kind: Kind) -> errors.InvalidDestinationError:
  return errors.InvalidDestinationError(
      f'{dst}: expected no other run writing there, found {kind.what} being written by'
      f' another run ({claim.describe()}); a run never deletes what another is writing.'
      ' Wait for it to finish (then pass `force=True` to replace what it wrote), or, if'
      f' that run is dead, run again once its claim lapses ({LEASE_SECONDS:.0f} s after'
      ' its last renewal, by the store\'s clock; at once on the same host).'
  )


def _create(path: epath.Path, text: str) -> bool:
  """Creates a file only if it does not exist (atomic on a bucket too: a create
  conditional on no object being there); returns whether this call created it."""
  if fileio.is_local(path):
    path.parent.mkdir(parents=True, exist_ok=True)
  fs, where = fsspec.core.url_to_fs(os.fspath(path))
  try:
    fs.pipe_file(where, text.encode(), mode='create')
  except FileExistsError:
    return False
  return True


class _Lease:
  """The claims one run holds, renewed every `RENEW_SECONDS` until `stop` (each renewal
  writes the claim again: the store's time of it is what ages)."""

  def __init__(self, run: str):
    self.run = run
    self.claims: dict[epath.Path, Claim] = {}
    self._stop = threading.Event()
    self._thread: threading.Thread | None = None

  def claim(self, location: epath.Path, entries: Iterable[str]) -> bool:
    """Claims a location for these entries (creates its marker); False when another
    run holds it."""
    marker = location / MARKER
    claim = Claim.mine(self.run, location, entries)
    if not _create(marker, claim.text()):
      return False
    self.claims[marker] = claim
    if self._thread is None:
      self._thread = threading.Thread(target=self._renew, name='orbax-tunix-claim', daemon=True)
      self._thread.start()
    return True

  def holds(self, marker: epath.Path) -> bool:
    claim = Claim.read(marker)
    return claim is not None and claim.run == self.run

  def _renew(self) -> None:
    while not self._stop.wait(RENEW_SECONDS):
      for marker, claim in list(self.claims.items()):
        with contextlib.suppress(OSError):
          if self.holds(marker):  # Never over another run's (one that took over).
            marker.write_text(claim.text())

  def stop(self) -> None:
    self._stop.set()
    if self._thread is not None:
      self._thread.join()


@dataclasses.dataclass(frozen=True)
class Kind:
  """What is written: how to tell one at a path (to replace it), and how it is committed.

  Attributes:
    what: for messages ('a checkpoint step').
    holds: the entries one of these holds, any of which tells it.
    record: path -> the entries this package's own record in it says it wrote
      there (None: no record, so not written by this package). Replacing
      deletes every entry, so only a directory whose every entry the record
      names is replaced: nothing this package did not write is touched,
      whatever its name.
    commit_file: written last to make it final (None: the rename alone).
    in_place: on a bucket, written in place (Orbax's way for steps); else
      written beside and copied over once complete.
  """

  what: str
  holds: tuple[str, ...]
  record: Callable[[epath.Path], frozenset[str] | None]
  commit_file: str | None = COMMIT_SUCCESS
  in_place: bool = True

  def is_one(self, path: epath.Path) -> bool:
    return path.is_dir() and TMP_MARKER not in path.name and any(
        (path / name).exists() for name in self.holds)


# What this package writes at the top of a step besides the items its metadata names.
_STEP_FILES = frozenset({CHECKPOINT_METADATA, COMMIT_SUCCESS, MARKER})


def _step_record(path: epath.Path) -> frozenset[str] | None:
  """The entries a step this package wrote holds: the items its `_CHECKPOINT_METADATA`
  names (`item_handlers`) and the step's own files; None when the metadata is not
  this package's (no `orbax_tunix` record in its custom metadata) or unreadable."""
  try:
    step = step_store.open_step(path)
  except errors.TunixCheckpointError:
    return None
  if checksums.RECORD_KEY not in step.custom_metadata or step.recorded is None:
    return None
  return frozenset(step.recorded) | _STEP_FILES


STEP = Kind('a checkpoint step', (CHECKPOINT_METADATA,), record=_step_record)


def _is_empty_dir(path: epath.Path) -> bool:
  return path.is_dir() and next(iter(path.iterdir()), None) is None


def _some_entries(path: epath.Path) -> str:
  return _listed(sorted(p.name for p in path.iterdir()))


def _listed(names: Sequence[str]) -> str:
  """Names for a message: the first five, and how many more."""
  return ', '.join(names[:5]) + (f' and {len(names) - 5} more' if len(names) > 5 else '')


def check_replaceable(dst: epath.Path, force: bool, kind: Kind = STEP) -> None:
  """Says whether `dst` may be written: absent, an empty directory, what an
  interrupted run left (`unfinished_claim`: a claim of this package's proving it, its
  run gone), or (force) one of `kind` this package wrote, holding only what its record
  names (`Kind.record`). A `MARKER` that proves nothing counts for nothing: the rest
  is judged as if it were not there (it is one more entry no record names).

  Raises:
    DestinationExistsError: it is one of `kind` and `force` was not given.
    InvalidDestinationError: another run is writing it; or it is something else
      (a file, another folder, one of `kind` this package did not write, or
      holding entries its record does not name), with or without `force`:
      replacing deletes every entry, so only its owner may remove them.
  """
  if not dst.exists() or _is_empty_dir(dst):
    return
  claim, unproven = _claim_at(dst, kind) if dst.is_dir() else (None, None)
  if claim is not None:
    if claim.live():
      raise _being_written(dst, claim, kind)
    return  # What an interrupted run left: unfinished, never a committed one.
  marker = '' if unproven is None else (
      f' Its {MARKER} is no sign of an interrupted run of this package ({unproven}), so'
      ' it counts for nothing.')
  if not kind.is_one(dst):
    found = 'a file' if not dst.is_dir() else f'a directory holding {_some_entries(dst)}'
    raise errors.InvalidDestinationError(
        f'{dst}: expected a new (or empty) directory, found {found}: not {kind.what}'
        f' (a directory holding {" or ".join(kind.holds)}), so it is never written over.'
        f'{marker} Choose another dst, or move it away yourself.'
    )
  recorded = kind.record(dst)
  if recorded is None:
    raise errors.InvalidDestinationError(
        f'{dst}: holds {kind.what} that this package did not write ({_some_entries(dst)},'
        ' and no record of this package naming what it wrote), so it is never written'
        f' over: replacing it would delete what its owner wrote.{marker} Choose another'
        ' dst, or move it away yourself.'
    )
  foreign = sorted(entry.name for entry in dst.iterdir() if entry.name not in recorded)
  if foreign:
    raise errors.InvalidDestinationError(
        f'{dst}: holds {kind.what} and also {_listed(foreign)}, which this package did not'
        ' write (its record there does not name them); replacing the folder would delete'
        f' them.{marker} Choose another dst, or move those entries away yourself.'
    )
  if not force:
    raise errors.DestinationExistsError(
        f'{dst}: already exists ({kind.what}). Pass `force=True` to replace it (the old one is'
        ' removed only once the new one is complete), or choose another dst.'
    )


def remove_tree(path: epath.Path) -> None:
  """Removes a directory tree (a link: the link alone), tolerating writers still
  finishing in it."""
  if fileio.is_local(path) and os.path.islink(path):
    os.unlink(path)  # A link moved aside: what it points to is not ours.
    return
  for _ in range(5):  # Retried: a background write may still add a file.
    if not path.exists():
      return
    with contextlib.suppress(OSError):
      if fileio.is_local(path):
        shutil.rmtree(os.fspath(path), ignore_errors=True)
      else:
        path.rmtree()
    time.sleep(0.05)


# How often a local commit is tried when another run changes DST under it, and the errors
# that tell so (DST taken again: not empty, exists; DST moved aside: gone; etils raises
# FileExistsError without an errno).
_COMMIT_TRIES = 5
_RACED = frozenset({errno.ENOTEMPTY, errno.EEXIST, errno.ENOENT, errno.ENOTDIR})

# In a bucket copy-in's staging folder once it is complete, when its kind has no commit
# file (a step's staging gets its commit file: Orbax reads it there); never copied over.
COMPLETE = '.orbax-tunix-complete'


class Staging:
  """Where a new step (or export) at `dst` is written, and how it is made final.

  Use: `work = staging.open()`, write into `work`, then `staging.commit()`; on
  any failure `staging.abort()`, which says what each location holds.

  Local disks: written into a temporary sibling, renamed onto `dst` (an old one
  is first renamed aside, removed once the new one is in place). Buckets (no
  rename): a new step is written in place, claimed by `MARKER`, committed by
  `COMMIT_SUCCESS`; a replacement (or an export) is written complete into a
  sibling, then copied in: `dst` is claimed and made unfinished, emptied, filled,
  committed, and only then the sibling removed. At every instant `dst` holds the
  old one, the new one complete, or an unfinished step Orbax skips while the new
  one is complete in the sibling.
  """

  def __init__(self, dst: epath.Path, force: bool, kind: Kind = STEP,
               entries: Iterable[str] = ()):
    self.dst = dst
    self.force = force
    self.kind = kind
    # What the new one holds at its top (a claim on a bucket names them: `Claim`).
    self.entries = frozenset(entries) | ({kind.commit_file} if kind.commit_file else set())
    self.in_place = _orbax.commits_with_file(dst)  # A bucket.
    self.work: epath.Path = None  # type: ignore[assignment]  # Set by `open`.
    self.replaced = False  # Set by `staged` once committed.
    self.run = f'{time.time_ns()}-{secrets.token_hex(4)}'  # Unique across hosts, short.
    self._created: list[epath.Path] = []
    self._lease = _Lease(self.run)
    # Set before the step they name (the storage then tells whether it happened).
    self._committing = False
    self._claiming_dst = False
    self._finishing = False
    self._replacing = False
    self._old: epath.Path | None = None  # The old one moved aside, while it may go back.
    self._superseded: list[epath.Path] = []  # Moved aside, then replaced by another run.

  def open(self) -> epath.Path:
    """Creates the directory the new one is written into, and returns it.

    Raises:
      InvalidDestinationError: another run is writing `dst`; a mount point.
    """
    _RUNS_HERE.add(self.run)
    if self.in_place:
      return self._open_bucket()
    places.check_not_mount_point(self.dst, self.kind.what)
    dst = self.dst
    parent = dst.parent
    while not parent.exists() and parent != parent.parent:
      self._created.append(parent)
      parent = parent.parent
    dst.parent.mkdir(parents=True, exist_ok=True)
    self.work = dst.parent / f'{_stem(dst)}{TMP_MARKER}-{time.time_ns()}'
    self.work.mkdir()
    return self.work

  def _open_bucket(self) -> epath.Path:
    dst, kind = self.dst, self.kind
    claim = unfinished_claim(dst, kind)
    if claim is not None:
      if claim.live():
        raise _being_written(dst, claim, kind)
      remove_tree(dst)  # An interrupted run's: nobody's step.
    if kind.in_place and (not dst.exists() or _is_empty_dir(dst)):
      self._claim_dst(self.entries)
      self.work = dst
      return dst
    if dst.exists():
      check_replaceable(dst, self.force, kind)
    self.work = dst.parent / f'{_stem(dst)}{NEW_MARKER}{self.run}'
    self._lease.claim(self.work, self.entries | {COMPLETE})
    return self.work

  def _claim_dst(self, entries: Iterable[str]) -> None:
    """Claims `dst` for `entries` (all that may be there until the commit).

    Raises:
      InvalidDestinationError: another run claimed it just now.
    """
    self._claiming_dst = True
    if not self._lease.claim(self.dst, entries):
      claim = Claim.read(self.dst / MARKER) or Claim('?', '?', 0, '?', ())
      raise _being_written(self.dst, claim, self.kind)

  def commit(self) -> bool:
    """Makes the new one final at `dst`; returns whether an old one was replaced.

    Raises:
      DestinationExistsError: `dst` appeared meanwhile and `force` is off.
      InvalidDestinationError: another run claimed `dst` meanwhile.
    """
    self._committing = True
    if self.in_place:
      return self._commit_bucket()
    if self.kind.commit_file:
      (self.work / self.kind.commit_file).write_text(
          f'Checkpoint commit was successful to {self.dst}')
    # Another run (two `force` runs at once) may commit DST, or move it aside, between any
    # two renames here: a rename that finds DST so changed is tried anew on what is there.
    for attempt in range(_COMMIT_TRIES):
      try:
        return self._rename_in()
      except OSError as e:
        raced = isinstance(e, FileExistsError | FileNotFoundError) or e.errno in _RACED
        if attempt + 1 == _COMMIT_TRIES or not raced or not self.work.exists():
          raise
    raise AssertionError('unreachable')

  def _rename_in(self) -> bool:
    """One try of a local commit: the new one renamed onto DST (an old one moved aside
    first, and removed once the new one is in: with those another run's commit put
    there meanwhile, each replaced in turn)."""
    if not self.dst.exists():
      self.work.rename(self.dst)
      return self._remove_olds()
    if fileio.is_local(self.dst) and _is_empty_dir(self.dst) and not os.path.islink(self.dst):
      os.replace(self.work, self.dst)  # rename(2) replaces an empty directory at once.
      return self._remove_olds()
    check_replaceable(self.dst, self.force, self.kind)
    if self._old is not None:
      self._superseded.append(self._old)  # Replaced by another run's commit meanwhile.
    # Named before the rename: whatever happens next, `abort` knows where it went.
    self._old = self.dst.parent / f'{_stem(self.dst)}{OLD_MARKER}{time.time_ns()}'
    self.dst.rename(self._old)
    self.work.rename(self.dst)  # If this fails, `abort` puts the old one back.
    return self._remove_olds()

  def _remove_olds(self) -> bool:
    """Removes what was moved aside; returns whether anything was (an old one replaced)."""
    moved = [p for p in (*self._superseded, self._old) if p is not None and os.path.lexists(p)]
    with contextlib.suppress(Exception):  # Committed: what is left is named by `abort`.
      for old in moved:
        remove_tree(old)
    return bool(moved)

  def _commit_text(self) -> str:
    return f'Checkpoint commit was successful to {self.dst} (orbax-tunix run {self.run})'

  def _commit_bucket(self) -> bool:
    dst = self.dst
    if self.work != dst:
      return self._copy_in()
    if not self._lease.holds(dst / MARKER):
      raise errors.InvalidDestinationError(
          f'{dst}: another run took this step over while this one wrote it (it found this'
          f' run\'s claim not renewed for {LEASE_SECONDS:.0f} s); nothing was committed.'
          ' Check what it wrote there before running again.')
    self._finish()
    return False

  def _copy_in(self) -> bool:
    """Copies the complete new one from its sibling into `dst` (see the class)."""
    dst, work, kind = self.dst, self.work, self.kind
    replaced = self._replacing = dst.exists()
    if replaced:
      check_replaceable(dst, self.force, kind)
    # Complete: a step Orbax reads where it is (should the copy-in be interrupted).
    (work / (kind.commit_file or COMPLETE)).write_text(self._commit_text())
    # Until the commit `dst` holds some of the old entries and some of the new ones.
    old = _entries(dst) if replaced else set()
    self._claim_dst(old | (_entries(work) - {COMPLETE, MARKER}) | self.entries)
    if kind.commit_file:
      (dst / kind.commit_file).unlink(missing_ok=True)  # From here: unfinished.
    for entry in list(dst.iterdir()):
      if entry.name != MARKER:
        remove_tree(entry) if entry.is_dir() else entry.unlink()
    fs, _ = fsspec.core.url_to_fs(os.fspath(work))
    for entry in work.iterdir():
      if entry.name not in (MARKER, COMPLETE, kind.commit_file):
        fs.copy(os.fspath(entry), os.fspath(dst / entry.name), recursive=True)
    self._finish()
    with contextlib.suppress(Exception):  # Committed: what is left is named by `abort`.
      remove_tree(work)
    return replaced

  def _finish(self) -> None:
    """Makes `dst` final: its commit file written, then its `MARKER` removed (the commit
    itself for a kind without a commit file: an export)."""
    self._finishing = True
    if self.kind.commit_file:
      (self.dst / self.kind.commit_file).write_text(self._commit_text())
    self._lease.stop()
    (self.dst / MARKER).unlink(missing_ok=True)

  def committed(self) -> bool:
    """Whether the new one is final at `dst` (read from the storage, not from flags:
    an interruption may land between a step and the flag that follows it)."""
    if not self._committing:
      return False
    if not self.in_place:
      return not os.path.lexists(self.work) and os.path.lexists(self.dst)
    if self.kind.commit_file:
      try:
        return self.run in (self.dst / self.kind.commit_file).read_text()
      except OSError:
        return False
    return self._finishing and not (self.dst / MARKER).exists()

  def abort(self) -> str | None:
    """Removes what is not committed and is this run's, and puts an old one moved
    aside back.

    Returns:
      None when `dst` holds what it held before (nothing was written there), else
      what `dst` and the staging hold now, for the message.
    """
    self._lease.stop()
    _RUNS_HERE.discard(self.run)
    dst, work, what = self.dst, self.work, self.kind.what
    if work is None:  # `open` failed before creating anything.
      _remove_empty(self._created)
      return None
    if self.committed():
      # Best effort, a second interruption included: the state is read after it.
      with contextlib.suppress(OSError, KeyboardInterrupt):
        if self.in_place:
          (dst / MARKER).unlink(missing_ok=True)
          if work != dst:
            remove_tree(work)
        else:
          self._remove_olds()
      left = [p for p in (*self._superseded, self._old, None if work == dst else work)
              if p is not None and p.exists()]
      return (f'{dst} holds the new {_bare(what)}, complete (committed before the'
              ' interruption)' + (f'; {left[0]}, left beside it, is not read by Orbax or'
                                  ' this package: remove it' if left else ''))
    if not self.in_place:
      if self._old is not None and os.path.lexists(self._old) and not os.path.lexists(dst):
        self._old.rename(dst)  # The new one never went in: the old one goes back.
        self._old = None
      # What is left moved aside was replaced by another run's commit at DST meanwhile.
      self._remove_olds()
      remove_tree(work)
      _remove_empty(self._created)
      return None
    claimed = self._claiming_dst and self._lease.holds(dst / MARKER)
    if work == dst:
      if claimed:
        remove_tree(dst)  # This run's unfinished step.
      return None
    if not claimed:
      remove_tree(work)  # `dst` was never touched.
      return None
    with contextlib.suppress(OSError):
      (work / MARKER).unlink(missing_ok=True)  # Kept: complete, and nobody's work now.
    skipped = f' and no {self.kind.commit_file}: Orbax and this package skip it' \
        if self.kind.commit_file else ''
    gone = '; the old one is gone' if self._replacing else ''
    return (f'the new {_bare(what)} is complete at {work}; {dst} is unfinished (it holds'
            f' {MARKER}{skipped}){gone}. Run again to write {dst} anew (this run\'s claim on'
            f' it has ended), or copy {work} there yourself; then remove {work}')


def _bare(what: str) -> str:
  """'a checkpoint step' -> 'checkpoint step'."""
  return what.split(' ', 1)[1] if what.startswith(('a ', 'an ')) else what


@contextlib.contextmanager
def staged(dst: epath.Path, force: bool, kind: Kind = STEP, nbytes: int = 0,
           sources: Sequence[epath.Path] = (), entries: Iterable[str] = ()
           ) -> Iterator[Staging]:
  """A new `kind` at `dst`: its work directory for the block, committed when
  the block ends, removed when it fails.

  Use: `with staged(dst, force, kind) as s: <write into s.work>`; then
  `s.replaced` says whether an old one was replaced.

  Args:
    dst: where the new one goes.
    force: replace one of `kind` already there.
    kind: what is written.
    nbytes: about what will be written (for the message when space runs out).
    sources: step directories that must stay untouched, checked again just
      before the first write (links may have changed since planning; see
      `places.check_outside_source`).
    entries: what the new one holds at its top (files, item directories): a
      bucket's claim names them, so that what an interrupted run leaves is
      told from anything else (`unfinished_claim`).

  Raises:
    InvalidDestinationError: `dst` overlaps a source, or cannot be created or
      written (permissions, space); what was written is removed.
    DestinationExistsError: `dst` appeared meanwhile and not `force`.
    Whatever the block raises (KeyboardInterrupt too), after the same
    clean-up; an existing `dst` is untouched, except once a bucket's copy-in
    has begun (`Staging`): then the complete new one is kept, and the
    KeyboardInterrupt or InvalidDestinationError raised says what `dst` and
    the staging hold (its `state`).
  """
  for source in sources:
    places.check_outside_source(source, dst)
  staging = Staging(dst, force, kind, entries)
  try:
    staging.open()
  except BaseException as e:
    staging.abort()
    if not isinstance(e, OSError):
      raise
    raise errors.InvalidDestinationError(
        f'{dst}: cannot create {kind.what} there ({e}). Expected a writable'
        ' directory; choose another destination or fix its permissions.'
    ) from e
  try:
    yield staging
    staging.replaced = staging.commit()
  except BaseException as e:
    state = staging.abort()
    if state is not None:
      raise _with_state(dst, e, state) from e
    failure = write_failure(dst, e, nbytes)
    if failure is None:
      raise
    raise failure from e
  finally:
    _RUNS_HERE.discard(staging.run)


def _with_state(dst: epath.Path, exc: BaseException, state: str) -> BaseException:
  """A failure (an interruption) once `dst` was written to, saying what each location
  holds: KeyboardInterrupt(state), or an InvalidDestinationError naming the failure
  (its `state` attribute holds the state, for a caller that reports it as an
  interruption)."""
  if isinstance(exc, KeyboardInterrupt):
    return KeyboardInterrupt(state)
  failure = errors.InvalidDestinationError(f'{dst}: writing failed ({exc}); {state}.')
  failure.state = state
  return failure


def write_failure(dst: epath.Path, exc: BaseException, nbytes: int,
                  ) -> errors.InvalidDestinationError | None:
  """What a failed write to `dst` says, when it is the destination's (its disk full, a
  file-size limit, its permissions), whichever writer failed: Python's file writes or
  TensorStore's: one message per cause, whichever command wrote.

  Returns:
    The error to raise (its clean-up done: nothing is left behind), or None
    when the failure is not the destination's.
  """
  full = storage_errors.out_of_space(exc)
  if full is not None:
    return errors.InvalidDestinationError(
        f'{dst}: writing failed: no space left on the device'
        f' ({storage_errors.os_words(full)}); nothing was left behind. Expected room for'
        f' about {nbytes} bytes. Free space or choose another destination.'
    )
  big = storage_errors.too_large(exc)
  if big is not None:
    return errors.InvalidDestinationError(
        f'{dst}: writing failed: a file grew past the largest file size allowed'
        f' ({storage_errors.os_words(big)}: {_size_limit()}); nothing was left behind.'
        f' Expected to write about {nbytes} bytes.'
        ' Raise the limit (`ulimit -f unlimited` in the shell that runs this) or choose'
        ' another destination.'
    )
  if isinstance(exc, OSError):
    return errors.InvalidDestinationError(
        f'{dst}: writing failed ({exc}); nothing was left behind. Expected a writable'
        f' destination with room for about {nbytes} bytes. Free space or choose'
        ' another destination.'
    )
  return None

def check_room(dst: epath.Path, nbytes: int) -> None:
  """Refuses a local DST whose file system has less room than `nbytes`, the bytes a write
  of uncompressed files makes there (an old one replaced is removed only once the new one is
  complete, so all of them), with the message a full disk gives (`write_failure`), before
  anything is written. Buckets, and file systems that tell no capacity (some FUSE mounts),
  are not checked.

  Raises:
    InvalidDestinationError: as `write_failure` for a full disk.
  """
  if not fileio.is_local(dst):
    return
  where = os.path.abspath(os.fspath(dst))
  while not os.path.isdir(where) and os.path.dirname(where) != where:
    where = os.path.dirname(where)
  try:
    info = os.statvfs(where)
  except OSError:
    return
  if info.f_blocks == 0 or nbytes <= info.f_bavail * info.f_frsize:
    return
  full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), where)
  raise write_failure(dst, full, nbytes) from full


def _size_limit() -> str:
  """Which file-size limit a write met, for the message: this process's own (`ulimit -f`)
  when it has one, else the file system's."""
  with contextlib.suppress(ImportError, OSError, ValueError):
    import resource  # pylint: disable=g-import-not-at-top  # Unix only.

    limit, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    if limit != resource.RLIM_INFINITY:
      return f'this process may write files of at most {limit} bytes, `ulimit -f`'
  return "the file system's largest file"


def _remove_empty(directories: Sequence[epath.Path]) -> None:
  """Removes directories, deepest first, if they are empty."""
  for directory in directories:
    with contextlib.suppress(OSError):
      if directory.exists() and not any(directory.iterdir()):
        directory.rmdir()


def leftovers(dst: epath.Path) -> list[epath.Path]:
  """What interrupted writes to `dst` left beside it (temporaries, replacements,
  an old one moved aside), found by the names `Staging` gives them."""
  prefixes = tuple(f'{_stem(dst)}{m}'
                   for m in (f'{TMP_MARKER}-', NEW_MARKER, OLD_MARKER, CLOCK_MARKER))
  try:
    return sorted(p for p in dst.parent.iterdir() if p.name.startswith(prefixes))
  except OSError:
    return []


# The longest file name most file systems take (bytes).
NAME_MAX = 255
# Room kept for a marker and a time in nanoseconds (the longest is 41 bytes).
_SUFFIX_ROOM = 64


def _stem(dst: epath.Path) -> str:
  """How the names of `dst`'s temporaries begin: its name, cut and tagged with
  its hash when a marker and a time would not fit in `NAME_MAX` bytes."""
  name = dst.name
  encoded = name.encode()
  if len(encoded) <= NAME_MAX - _SUFFIX_ROOM:
    return name
  digest = hashlib.sha256(encoded).hexdigest()[:12]
  cut = encoded[:NAME_MAX - _SUFFIX_ROOM - len(digest) - 1].decode(errors='ignore')
  return f'{cut}~{digest}'


def check_destination(
    sources: Sequence[epath.Path], dst: epath.Path, force: bool, kind: Kind = STEP,
) -> None:
  """Refuses a DST that overlaps any source run, is named like unfinished
  work, or may not be replaced (the rules above); nothing is written.

  Args:
    sources: the step directories read.
    dst: the destination (a step, an export folder).
    force: whether an existing DST of `kind` may be replaced.
    kind: what is written there.

  Raises:
    InvalidDestinationError: DST overlaps a source (symlinks resolved; see
      `overlap`), is named like an unfinished step, is (or lies under) a link to
      nothing, or cannot be reached.
    DestinationExistsError: DST exists and not `force` (or is not one of `kind`).
  """
  check_step_name(dst)
  places.check_no_broken_link(dst, kind.what)
  for src in sources:
    places.check_outside_source(src, dst)
  places.check_not_mount_point(dst, kind.what)
  problem = netprobe.unreachable(dst)  # Before any client call (their retries take ~50 s).
  if problem is not None:
    raise _unreachable(dst, problem)
  try:
    check_replaceable(dst, force, kind)
  except OSError as e:
    raise _unreachable(dst, str(e)) from e


def _unreachable(dst: epath.Path, why: str) -> errors.InvalidDestinationError:
  return errors.InvalidDestinationError(
      f'{dst}: cannot reach the destination ({why}). Check the path, the network and'
      ' the credentials (gs:// paths need gcsfs and Google credentials).'
  )

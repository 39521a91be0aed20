"""Steps as they sit on disk: the steps under a root, a step's items, what a path stands for.

A step's `_CHECKPOINT_METADATA` (items and their handlers) is read once; a
`Step` keeps its `Item`s (`item_store`). `resolve` turns a path (a root, a
step, an item) into the step and item it stands for, with the reasons it
skipped others. No array data is read here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import operator
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from orbax_tunix import errors
from orbax_tunix.conventions import RL_ROLES
from orbax_tunix.store._orbax import CHECKPOINT_METADATA, PYTREE_METADATA, TMP_MARKER
from orbax_tunix.store.fileio import as_path, is_local, read_json
from orbax_tunix.store.item_store import Item, has_tree, open_item
from orbax_tunix.store.names import check_plain
from orbax_tunix.store.netprobe import unreachable

# --- steps under a root -----------------------------------------------------


@dataclasses.dataclass(frozen=True)
class StepEntry:
  """One step directory under a root.

  Attributes:
    step: its number.
    path: the directory.
    committed: whether Orbax counts it as finished (on a local disk: its name
      carries no tmp marker; on a bucket: it holds `commit_success.txt`).
    empty: committed by name, but holding no step: neither
      `_CHECKPOINT_METADATA` nor an item (see `holds_step`). Skipped, as an
      unfinished step is.
    unreadable: why the directory cannot be read (the system's error, e.g.
      'Permission denied'), '' when it can. Skipped too, and said so.
  """

  step: int
  path: epath.Path
  committed: bool
  empty: bool = False
  unreadable: str = ''

  @property
  def usable(self) -> bool:
    """A step the tools may read: committed, readable and not empty."""
    return self.committed and not self.empty and not self.unreadable

  @property
  def state(self) -> str:
    """'' for a usable step, else why it is skipped ('unfinished', 'unreadable', 'empty')."""
    if not self.committed:
      return 'unfinished'
    return 'unreadable' if self.unreadable else 'empty' if self.empty else ''


def step_number(name: str) -> int | None:
  """The step a directory name stands for, as Orbax reads it ('7', 'ckpt_7', tmp)."""
  try:
    return ocp.path.step.step_from_checkpoint_name(name)
  except ValueError:
    return None


def step_argument(step: Any, name: str = 'step') -> int | None:
  """A step number passed by a caller, as an int (None stays None).

  Accepts ints (numpy's too) and their decimal text ('7').

  Raises:
    TunixCheckpointError: anything else (a bool, a float, a negative number),
      naming the parameter.
  """
  if step is None:
    return None
  value = None
  if isinstance(step, str) and step.strip().isdigit():
    value = int(step)
  elif not isinstance(step, bool | float | np.bool_):
    with contextlib.suppress(TypeError):
      value = operator.index(step)
  if value is None or value < 0:
    raise errors.TunixCheckpointError(
        f'`{name}={step!r}`: expected a step number (an int >= 0, as in a step'
        f' directory\'s name) or None for the latest committed step.'
    )
  return value


def _is_item_dir(child: epath.Path) -> bool:
  """An entry of a step that is an item: a directory not named as Orbax's own files."""
  return not child.name.startswith(('.', '_')) and child.is_dir()


def holds_step(directory: epath.Path) -> bool:
  """Whether a directory named as a step holds one (the rule for every tool).

  A step holds `_CHECKPOINT_METADATA` (every Orbax release that writes it),
  or is one item saved alone (`_METADATA`), or holds at least one item
  directory (older releases). An empty numbered directory, or one holding
  stray files only, is not a step: Orbax's `CheckpointManager` would count
  it, and fail to restore it.

  Raises:
    OSError: the directory cannot be read.
  """
  if (directory / CHECKPOINT_METADATA).exists() or has_tree(directory):
    return True
  return any(_is_item_dir(child) for child in directory.iterdir())


def list_steps(root: epath.Path) -> list[StepEntry]:
  """Step directories directly under `root`, committed or not, by step number.

  "Committed" is Orbax's own decision for the kind of path
  (`ocp.path.step.is_path_finalized`); a committed one that holds no step
  (`holds_step`) is marked `empty`, one that cannot be read `unreadable`.
  """
  steps = []
  for child in root.iterdir():
    number = step_number(child.name)
    if number is None or not child.is_dir():
      continue
    committed = TMP_MARKER not in child.name and ocp.path.step.is_path_finalized(child)
    held, unreadable = True, ''
    if committed:
      try:
        held = holds_step(child)
      except OSError as e:
        unreadable = e.strerror or str(e) or type(e).__name__  # In a few words.
    steps.append(StepEntry(number, child, committed, not held, unreadable))
  return sorted(steps, key=lambda s: (s.step, s.usable, s.path.name))


def describe_steps(steps: Sequence[StepEntry]) -> str:
  """'1, 2, 3 (unfinished), 4 (empty)': the steps of a root, for messages."""
  if not steps:
    return 'none'
  return ', '.join(f'{s.step}' + (f' ({s.state})' if s.state else '') for s in steps)


def _reading_options(entry: StepEntry) -> str:
  """The `CheckpointManager` options under which Orbax reads this step's directory."""
  name = entry.path.name
  prefix, _, digits = name.rpartition('_')
  options = [f'step_prefix={prefix!r}'] if prefix else []
  if digits != str(entry.step):
    options.append(f'step_format_fixed_length={len(digits)}')
  return ', '.join(options) or 'its default options'


def _only_one(root: epath.Path, found: Sequence[StepEntry]) -> StepEntry:
  """The one directory of a step; several (`5` and `0005`) are refused, naming which Orbax reads."""
  if len(found) == 1:
    return found[0]
  which = '; '.join(f'{s.path.name} with {_reading_options(s)}' for s in found)
  raise errors.UnsupportedLayoutError(
      f'{root}: step {found[0].step} is held by {len(found)} directories,'
      f' {", ".join(s.path.name for s in found)}, so which one is meant is not'
      f" clear. Orbax's CheckpointManager reads {which}. Pass the step directory"
      ' itself (not the root), or remove or rename the other one.'
  )


# --- a step's items -----------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Step:
  """One step directory, read once from its `_CHECKPOINT_METADATA`.

  Attributes:
    directory: the step directory.
    number: its step number, when its name carries one.
    recorded: item name -> the handler typestr recorded at save time (None
      when none was); None when the step records no items.
    custom_metadata: the user's custom metadata recorded with the step.
    single_item: the directory is one item saved on its own (by a
      `Checkpointer` over a PyTree handler): `_METADATA` and
      `_CHECKPOINT_METADATA` side by side. Its one item is named `item_name`.
    metadata_json: `_CHECKPOINT_METADATA` as parsed (None when there is none),
      handed to Orbax's composite so that the file is parsed once.
  """

  directory: epath.Path
  number: int | None
  recorded: Mapping[str, str | None] | None
  custom_metadata: Mapping[str, Any]
  single_item: bool = False
  metadata_json: Mapping[str, Any] | None = dataclasses.field(default=None, repr=False)

  @functools.cached_property
  def present(self) -> tuple[str, ...]:
    """Items on disk: subdirectories that are not Orbax's own files."""
    if self.single_item:
      return (self.item_name,)
    try:
      children = list(self.directory.iterdir())
    except OSError as e:
      raise errors.CorruptMetadataError(f'{self.directory}: cannot list it ({e}).') from e
    # A bucket's listing may hold any object name ('a//b', '..'): each is checked.
    return tuple(sorted(check_plain(c.name, self.directory, 'holds the entry')
                        for c in children if _is_item_dir(c)))

  @property
  def item_name(self) -> str:
    return self.directory.name

  @property
  def items(self) -> tuple[str, ...]:
    """The items the step holds: those it records, else those on disk."""
    if self.recorded is not None and not self.single_item:
      return tuple(sorted(self.recorded))
    return self.present

  def item_dir(self, name: str) -> epath.Path:
    """The item's directory.

    Raises:
      UnsafeNameError: `name` is not one plain name (`names.check_plain`).
    """
    if self.single_item:
      return self.directory
    return self.directory / check_plain(name, self.directory, 'an item was asked for as')

  def handler(self, name: str) -> str | None:
    return None if self.recorded is None else self.recorded.get(name)

  def item(self, name: str) -> Item:
    """The item `name`, read once.

    Raises:
      CorruptMetadataError: it is recorded but absent, or its metadata is
        damaged (the message names the step).
    """
    if name not in self._items:
      item = open_item(self.item_dir(name), name)
      self._items[name] = dataclasses.replace(item, saved_by=self.handler(name))
    return self._items[name]

  @functools.cached_property
  def _items(self) -> dict[str, Item]:
    return {}

  def is_pytree(self, name: str) -> bool:
    """Whether the item holds a PyTree (its files, not only its recorded handler)."""
    return has_tree(self.item_dir(name))


def open_step(directory: epath.PathLike) -> Step:
  """Reads a step directory's `_CHECKPOINT_METADATA`.

  Raises:
    CorruptMetadataError: the file is damaged or not a JSON object.
    UnsafeNameError: it names an item that is not one plain directory name
      (`../../x`, `/abs`, `a/b`): checked before any item is looked at.
  """
  directory = as_path(directory)
  meta_file = directory / CHECKPOINT_METADATA
  exists = meta_file.exists()
  meta = read_json(meta_file, "Orbax's step metadata") if exists else {}
  if not isinstance(meta, dict):
    raise errors.CorruptMetadataError(
        f'{meta_file}: expected a JSON object with "item_handlers", found'
        f' {type(meta).__name__}. The file is damaged; use another step (`step`).'
    )
  handlers = meta.get('item_handlers')
  # A Checkpointer over a PyTree handler writes both files into one directory.
  single = has_tree(directory)
  recorded: dict[str, str | None] | None = None
  if single:
    recorded = {directory.name: handlers if isinstance(handlers, str) else None}
  elif isinstance(handlers, dict):
    recorded = {check_plain(k, meta_file, 'item_handlers names the item'):
                v if isinstance(v, str) else None for k, v in handlers.items()}
  custom = meta.get('custom_metadata')
  return Step(
      directory=directory,
      number=step_number(directory.name),
      recorded=recorded,
      custom_metadata=dict(custom) if isinstance(custom, dict) else {},
      single_item=single,
      metadata_json=meta if exists else None,
  )


# --- what a path stands for -----------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Location:
  """What a path given by a user stands for.

  Attributes:
    path: the path given (absolute).
    step: the step it resolves to.
    item: the item, when the path was an item directory.
    root: the directory holding the step's siblings, when there is one.
    listed: the steps under that root, when resolving had to list them.
    notes: things a person should know (e.g. unfinished steps skipped).
  """

  path: epath.Path
  step: Step
  item: str | None
  root: epath.Path | None
  listed: tuple[StepEntry, ...] | None = None
  notes: tuple[str, ...] = ()

  @functools.cached_property
  def steps(self) -> tuple[StepEntry, ...]:
    """The steps under the root, committed or not (listed when first asked:
    a restore of a step does not need its siblings, one request each on a bucket)."""
    if self.listed is not None:
      return self.listed
    return tuple(list_steps(self.root)) if self.root is not None else ()


def step_roots(path: epath.Path) -> list[epath.Path]:
  """The directories whose children may be steps: the path, then RL roles."""
  return [path] + [path / role for role in RL_ROLES if (path / role).is_dir()]


def _is_step(path: epath.Path) -> bool:
  return (path / CHECKPOINT_METADATA).exists()


def resolve(path: epath.PathLike, step: int | None = None) -> Location:
  """Finds the step (and item) a path stands for.

  Args:
    path: a root (its latest committed step, or `step`), an RL root holding
      `actor/`, a step directory, an item directory, or one item saved alone.
    step: the step number wanted under a root; None for the latest.

  Raises:
    NotACheckpointError: nothing checkpoint-like is there, or no step `step`;
      or a bucket that cannot be reached.
    UncommittedStepError: the step is unfinished, or a root's steps all are.
    CorruptMetadataError: `_CHECKPOINT_METADATA` is damaged.
    UnsupportedLayoutError: the step asked for (or the latest) is held by
      two directories (`5` and `0005`).
    TunixCheckpointError: `step` is not a step number.
  """
  step = step_argument(step)
  path = as_path(path)
  problem = unreachable(path)
  if problem is not None:
    raise errors.NotACheckpointError(
        f'{path}: cannot reach the storage service ({problem}). Check the network'
        ' (and STORAGE_EMULATOR_HOST, if set); gs:// paths need gcsfs and Google'
        ' credentials.'
    )
  # A bucket's client raises errors of its own (gcsfs: HttpError, ...).
  failures = OSError if is_local(path) else Exception
  try:
    exists = path.exists()
  except failures as e:  # pylint: disable=broad-except
    raise errors.NotACheckpointError(
        f'{path}: cannot read it ({str(e).splitlines()[0] if str(e) else type(e).__name__}).'
        ' Check the path, the network and the credentials (gs:// paths need gcsfs'
        ' and Google credentials).'
    ) from e
  if not exists:
    raise errors.NotACheckpointError(
        f'{path}: no such file or directory. Expected an Orbax checkpoint'
        ' root, step or item directory; check the path.'
    )
  if not path.is_dir():
    raise errors.NotACheckpointError(
        f'{path}: expected a checkpoint directory, found a file. Pass the'
        ' directory that holds the steps, a step, or an item.'
    )
  if TMP_MARKER in path.name:
    raise errors.UncommittedStepError(
        f'{path}: this step is unfinished (its name contains {TMP_MARKER!r}):'
        ' its writer is still running or died. Restore a committed step.'
    )
  item = None
  if _is_step(path):
    step_dir = path
  elif has_tree(path) and _is_step(path.parent):
    step_dir, item = path.parent, path.name
  else:
    return _resolve_root(path, step)
  found = open_step(step_dir)
  root = step_dir.parent if found.number is not None and not found.single_item else None
  if step is not None and found.number != step:
    raise errors.NotACheckpointError(
        f'{path}: this is step {found.number}, but `step={step}` was asked for.'
        ' Pass the root directory that holds the steps, or drop `step`.'
    )
  if not ocp.path.step.is_path_finalized(step_dir) and not found.single_item:
    raise errors.UncommittedStepError(
        f'{step_dir}: this step is unfinished (Orbax does not count it as'
        ' committed: on a bucket, it has no commit_success.txt): its writer is'
        ' still running or died. Restore a committed step.'
    )
  return Location(path, found, item, root)


def _skip_notes(steps: Sequence[StepEntry]) -> list[str]:
  """What choosing the latest step skipped: unfinished and empty step directories."""
  notes = [f'skipped unfinished step {s.step} ({s.path.name})' for s in steps if not s.committed]
  notes += [f'skipped step directory {s.path.name}: it cannot be read ({s.unreadable})'
            for s in steps if s.unreadable]
  return notes + [
      f'skipped step directory {s.path.name}: it is empty (no {CHECKPOINT_METADATA} and'
      ' no item), not a step' for s in steps if s.empty
  ]


def _latest(path: epath.Path, root: epath.Path, steps: Sequence[StepEntry]) -> StepEntry:
  """The latest usable step of a root (see `StepEntry.usable`; the errors are `resolve`'s)."""
  usable = [s for s in steps if s.usable]
  if usable:
    return _only_one(root, [s for s in usable if s.step == usable[-1].step])
  unreadable = [s for s in steps if s.unreadable]
  if unreadable:
    raise _cannot_read(path, unreadable, steps)
  empty = ', '.join(s.path.name for s in steps if s.empty)
  if all(s.empty for s in steps):
    raise errors.NotACheckpointError(
        f'{path}: expected a committed step, found only empty step directories'
        f' ({empty}): they hold no {CHECKPOINT_METADATA} and no item, so they are'
        ' not checkpoints. Check the path; a save that wrote nothing leaves these.'
    )
  raise errors.UncommittedStepError(
      f'{path}: expected a committed step, found only unfinished ones:'
      f' {", ".join(s.path.name for s in steps if not s.committed)}'
      + (f' (and empty directories {empty})' if empty else '')
      + '. Wait for the writer to finish, or restore from an earlier checkpoint.'
  )


def _cannot_read(path: epath.Path, unreadable: Sequence[StepEntry], steps: Sequence[StepEntry],
                 ) -> errors.NotACheckpointError:
  """The error for step directories that cannot be read (and no usable step instead)."""
  which = ', '.join(f'{s.path.name} ({s.unreadable})' for s in unreadable)
  return errors.NotACheckpointError(
      f'{path}: expected a readable committed step, found step directories that cannot be'
      f' read: {which}. Steps present: {describe_steps(steps)}. Check their permissions'
      ' (and mounts), or pass another step.'
  )


def _numbered(path: epath.Path, root: epath.Path, steps: Sequence[StepEntry], step: int
              ) -> StepEntry:
  """Step `step` of a root (the errors are `resolve`'s)."""
  matching = [s for s in steps if s.step == step]
  done = [s for s in matching if s.usable]
  if done:
    return _only_one(root, done)
  if any(s.unreadable for s in matching):
    raise _cannot_read(path, [s for s in matching if s.unreadable], steps)
  if any(s.empty for s in matching):
    raise errors.NotACheckpointError(
        f'{next(s.path for s in matching if s.empty)}: step {step} is an empty'
        f' directory (no {CHECKPOINT_METADATA} and no item), not a step. Pick'
        f' another: {describe_steps(steps)}.'
    )
  if matching:
    raise errors.UncommittedStepError(
        f'{matching[0].path}: step {step} is unfinished (its writer is still'
        f' running or died). Pick a committed step: {describe_steps(steps)}.'
    )
  raise errors.NotACheckpointError(
      f'{path}: expected a step {step}, found none. Steps present:'
      f' {describe_steps(steps)}. Pass one of these as `step`.'
  )


def _resolve_root(path: epath.Path, step: int | None) -> Location:
  for root in step_roots(path):
    steps = list_steps(root)
    if not steps:
      continue
    notes = [f'RL root: using {root.name}/'] if root != path else []
    if step is None:
      chosen = _latest(path, root, steps)
      notes += _skip_notes(steps)
    else:
      chosen = _numbered(path, root, steps, step)
    return Location(path, open_step(chosen.path), None, root, tuple(steps), tuple(notes))
  empty = not any(path.iterdir())
  raise errors.NotACheckpointError(
      f'{path}: expected an Orbax checkpoint (a root of numbered steps, a step'
      f' holding {CHECKPOINT_METADATA}, or an item holding {PYTREE_METADATA}),'
      f' found {"an empty directory" if empty else "none of these"}. Check the path.'
  )

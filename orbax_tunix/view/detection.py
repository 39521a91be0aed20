"""Detection: what a checkpoint path holds and which rewrites apply.

`detect()` resolves a path to a step (`store.step_store`), checks that every item the
step records is there and readable as what it claims to be, classifies the
checkpoint (Tunix, MaxText or plain Orbax) and plans the rewrites of each
PyTree item (`canonical_map.plan_step`). Only metadata is read, once.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Mapping

from etils import epath

from orbax_tunix import conventions, errors
from orbax_tunix.store import _orbax, fileio, item_store, step_store
from orbax_tunix.view import canonical_map, source_kinds


@dataclasses.dataclass(frozen=True)
class Detection:
  """What `detect()` found.

  Attributes:
    location: where the path led (the step, the item if the path was one,
      the root and its steps, notes).
    kind: 'tunix', 'maxtext' or 'orbax' (any other Orbax checkpoint).
    writer: 'v0' or 'v1', the Orbax API the step was written with.
    maps: PyTree item name -> its `CanonicalMap` (identity for items that
      are not Tunix's).
    others: items that are not PyTrees -> the handler they were saved with.
    absent: items the step records that are not on disk (a step copied or
      pruned without them); left out, and named when asked for (`require`).
    notes: things a person should know.
  """

  location: step_store.Location
  kind: str
  writer: str
  maps: Mapping[str, canonical_map.CanonicalMap]
  others: Mapping[str, str | None] = dataclasses.field(default_factory=dict)
  absent: tuple[str, ...] = ()
  notes: tuple[str, ...] = ()

  @property
  def path(self) -> epath.Path:
    return self.location.path

  @property
  def source(self) -> step_store.Step:
    return self.location.step

  @property
  def step_dir(self) -> epath.Path:
    return self.location.step.directory

  @property
  def step(self) -> int | None:
    return self.location.step.number

  @property
  def item(self) -> str | None:
    return self.location.item

  @property
  def steps(self) -> tuple[step_store.StepEntry, ...]:
    return self.location.steps

  @property
  def is_tunix(self) -> bool:
    return self.kind == source_kinds.TUNIX.name

  @property
  def source_kind(self) -> source_kinds.SourceKind:
    """What the step's kind holds, and where (`source_kinds`)."""
    return source_kinds.get(self.kind)

  @property
  def items(self) -> tuple[str, ...]:
    return tuple(sorted({*self.maps, *self.others}))

  @property
  def item_handlers(self) -> dict[str, str | None]:
    """Item name -> handler typestr recorded at save time (None if none was)."""
    return {name: self.source.handler(name) for name in self.items}

  @property
  def rewrites(self) -> dict[str, tuple[str, ...]]:
    """Tunix item name -> names of the rules that apply to it, in order."""
    return {name: m.rule_names for name, m in self.maps.items() if m.rewrites}

  def item_meta(self, name: str) -> item_store.Item:
    """An item's leaves as read for this detection."""
    return self.source.item(name)

  def require(self, names: Iterable[str] | None = None) -> None:
    """Checks that items a caller needs are on disk.

    Args:
      names: the items needed; None for the whole step (every item it records).

    Raises:
      MissingItemError: naming each needed item the step records but lacks.
    """
    needed = self.absent if names is None else [n for n in names if n in self.absent]
    if needed:
      raise absent_error(self.source, needed)


def _writer(step: step_store.Step) -> str:
  recorded = step.recorded or {}
  return 'v1' if any(t and '.v1.' in t for t in recorded.values()) else 'v0'


def is_absent(step: step_store.Step, name: str) -> bool:
  """An item the step records with nothing at its path (not even a broken link)."""
  item_dir = step.item_dir(name)
  if fileio.is_local(item_dir):
    return not os.path.lexists(item_dir)
  return not item_dir.exists()


def absent_error(step: step_store.Step, names: Iterable[str]) -> errors.MissingItemError:
  """The error for needed items that the step records but does not hold."""
  names = sorted(names)
  present = [n for n in step.present if n not in names]
  return errors.MissingItemError(
      f'{step.directory}: expected the item(s) {names} that its'
      f' {_orbax.CHECKPOINT_METADATA} records, found no directory for them (the step was'
      f' copied or pruned without them). The step holds {present or "no items"}: ask for'
      ' those only (`items`), or restore from a complete copy of the step.'
  )


def _sort_items(step: step_store.Step, names: Iterable[str]) -> tuple[dict[str, str | None], list[str]]:
  """(non-PyTree items -> handler, notes); raises for items that are not what they claim."""
  others: dict[str, str | None] = {}
  notes = []
  for name in names:
    item_dir = step.item_dir(name)
    typestr = step.handler(name)
    if not item_dir.is_dir():
      raise errors.CorruptMetadataError(
          f'{step.directory}: the step records the item {name!r}, found'
          f' {fileio.found_at(item_dir)} at {item_dir} instead of its directory. The'
          ' step is damaged: use another step (`step`), or ask for the other items'
          ' only (`items`).'
      )
    is_pytree = _orbax.is_pytree_handler(typestr)
    if is_pytree is None and typestr is not None and not step.is_pytree(name):
      # A handler unknown here that wrote no PyTree (a data iterator's state,
      # as grain and MaxText save it): an item of its own kind, not a damaged one.
      others[name] = typestr
      continue
    if is_pytree is False:
      if step.is_pytree(name):
        raise errors.CorruptMetadataError(
            f'{step.directory}: {_orbax.CHECKPOINT_METADATA} says item {name!r} was'
            f' saved by {typestr}, but it holds a PyTree ({_orbax.PYTREE_METADATA}).'
            ' The step metadata is damaged; restore the item with explicit'
            ' PyTreeRestore args, or use another step (`step`).'
        )
      others[name] = typestr
    elif is_pytree is None and typestr is not None:
      notes.append(f'item {name!r} records a handler unknown here ({typestr}); read as'
                   ' the PyTree its files hold')
  return others, notes


def _unrecorded_note(step: step_store.Step) -> list[str]:
  """A note naming directories of a step that its `_CHECKPOINT_METADATA` does not record.

  Orbax restores only recorded items, and so do the tools: such entries (a
  `custom/` folder, a data iterator saved beside the step) are left out.
  """
  if step.recorded is None or step.single_item:
    return []
  extra = [name for name in step.present if name not in step.recorded]
  if not extra:
    return []
  return [f'left out {", ".join(f"{n}/" for n in extra)}: in the step directory but not an'
          f' item its {_orbax.CHECKPOINT_METADATA} records (Orbax does not restore such'
          ' entries either; copy them yourself if they matter)']


def detect(
    path: epath.PathLike | step_store.Location,
    *,
    step: int | None = None,
    items: Iterable[str] | None = None,
    roles: Iterable[str] | None = None,
) -> Detection:
  """Says what a checkpoint path holds and which rewrites apply.

  Reads metadata only (`_CHECKPOINT_METADATA`, the `_METADATA` of the items
  looked at), each file once.

  Args:
    path: a checkpoint root (its latest committed step is used; an RL root
      with `actor/` too), a step directory, an item directory, or one item
      saved on its own; or where `step_store.resolve` found one.
    step: the step wanted under a root (None: the latest committed one).
    items: the items to look at; each must be on disk. Default: every item
      the step records (an item directory: that item); those it records but
      lacks are left out and named in `absent` and `notes`. Items not looked
      at are not read, and damage to them is not reported.
    roles: instead of `items`, the Tunix items a caller needs (`conventions.MODEL_ITEM`,
      `OPTIMIZER_ITEM`): those of them the step records or holds, so that nothing else is
      opened; every item where the step holds none of them (not Tunix's: its own items
      decide), and the item of an item directory or of one saved on its own.

  Returns:
    A `Detection`; `is_tunix` is False for plain Orbax and MaxText checkpoints.

  Raises:
    NotACheckpointError, UncommittedStepError, CorruptMetadataError,
    UnsupportedLayoutError: see their docstrings; each message names the path.
    MissingItemError: an item in `items` is not in the step.
  """
  location = path if isinstance(path, step_store.Location) else step_store.resolve(path, step)
  if roles is not None:
    if items is not None:
      raise TypeError('detect: pass items or roles, not both')
    items = _of_roles(location, roles)
  found = location.step
  absent: list[str] = []
  if items is not None:
    names = list(dict.fromkeys(items))
    unknown = sorted(set(names) - set(found.items) - set(found.present))
    if unknown:
      raise errors.MissingItemError(
          f'{found.directory}: expected the items asked for, {unknown} not found (the'
          f' step has {list(found.items)}). Ask only for items the step has.'
      )
    missing = [n for n in names if is_absent(found, n)]
    if missing:
      raise absent_error(found, missing)
  elif location.item is not None:
    names = [location.item]
  else:
    names = list(found.items)
    absent = [n for n in names if is_absent(found, n)]
    names = [n for n in names if n not in absent]
  others, notes = _sort_items(found, names)
  notes = [
      f'item {n!r} is recorded in {_orbax.CHECKPOINT_METADATA} but not on disk (the step'
      ' was copied or pruned without it); left out' for n in absent
  ] + notes + (_unrecorded_note(found) if items is None and location.item is None else [])
  pytrees = [n for n in names if n not in others]
  maps = {n: cmap for n, (_, cmap) in plan_items(found, pytrees).items()}
  return Detection(
      location=location,
      kind=source_kinds.classify(maps).name,
      writer=_writer(found),
      maps=maps,
      others=others,
      absent=tuple(absent),
      notes=location.notes + tuple(notes),
  )


def _of_roles(location: step_store.Location, roles: Iterable[str]) -> list[str] | None:
  """The items `detect(roles=...)` looks at: those of `roles` the step records or holds;
  None (every item) for an item directory or an item saved on its own, or a step that holds
  none of them."""
  step = location.step
  if location.item is not None or step.single_item:
    return None
  known = set(step.items) | set(step.present)
  return [r for r in roles if r in known] or None


Planned = tuple[item_store.Item, canonical_map.CanonicalMap]


def plan_items(step: step_store.Step, names: Iterable[str]) -> dict[str, Planned]:
  """Reads and plans some PyTree items of one step, each read once.

  The optimizer item is planned with the step's model item, whose weights
  identify the adapter level in mu/nu (read for that when not asked for); an
  item saved on its own, as the Tunix item its contents are (`conventions.role`).

  Raises:
    CorruptMetadataError, UnsupportedLayoutError.
  """
  names = list(names)
  metas = {n: step.item(n) for n in names}
  model = conventions.MODEL_ITEM
  if (conventions.OPTIMIZER_ITEM in metas and model not in metas and not step.single_item
      and step.is_pytree(model)):
    metas[model] = step.item(model)
  with fileio.no_gc():
    if step.single_item:
      (name, meta), = metas.items()
      role = conventions.role(name, {p[0] for p in meta.paths if p})
      planned = canonical_map.plan_step({role: meta.paths})[role]
      maps = {name: dataclasses.replace(planned, item=name)}
    else:
      maps = canonical_map.plan_step({name: meta.paths for name, meta in metas.items()})
  return {n: (metas[n], maps[n]) for n in names}


def plan_item(item_dir: epath.PathLike) -> Planned | None:
  """Reads and plans one item directory, or None when it holds no PyTree.

  Raises:
    CorruptMetadataError, UnsupportedLayoutError.
  """
  item_dir = fileio.as_path(item_dir)
  if not item_store.has_tree(item_dir):
    return None
  single = (item_dir / _orbax.CHECKPOINT_METADATA).exists()
  step = step_store.open_step(item_dir if single else item_dir.parent)
  name = step.item_name if step.single_item else item_dir.name
  return plan_items(step, [name])[name]

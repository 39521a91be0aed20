"""`TunixAwareHandler`: the drop-in composite handler for Tunix steps.

It is Orbax's `CompositeCheckpointHandler`, constructed, saving and choosing
handlers exactly as Orbax's does, with one difference: an item restored by a
PyTree handler (`PyTreeRestore`, `StandardRestore`, or no args for an item
saved by one) reads a Tunix item in canonical form, through the handler Orbax
chose, with its options. Items that are not Tunix's, targets that already
have an item's on-disk shape (`PlannedItem.as_stored`), and every other
handler behave as with Orbax's own class.
"""

from __future__ import annotations

import contextvars
import dataclasses
import logging
from typing import Any

import orbax.checkpoint as ocp
from etils import epath

from orbax_tunix import conventions, errors
from orbax_tunix.handlers.pytree_handler import (
    TunixPyTreeHandler,
    TunixPyTreeRestore,
    TunixPyTreeSave,
)
from orbax_tunix.reading import planned_item
from orbax_tunix.store import _orbax, fileio, item_store, step_store
from orbax_tunix.store._orbax import CHECKPOINT_METADATA, PYTREE_METADATA
from orbax_tunix.view.detection import Detection, detect, plan_items

logger = logging.getLogger('orbax_tunix')

_PYTREE_HANDLERS = (ocp.PyTreeCheckpointHandler, ocp.StandardCheckpointHandler)
_PYTREE_RESTORE_ARGS = (ocp.args.PyTreeRestore, ocp.args.StandardRestore)
# Orbax's PyTree args -> the ones `TunixPyTreeHandler` is registered with.
_OUR_ARGS = {ocp.args.PyTreeSave: TunixPyTreeSave, ocp.args.PyTreeRestore: TunixPyTreeRestore}

# The step a restore of this context is restoring (Orbax's no-arg restore
# calls `metadata()` for the recorded handlers only: the canonical item trees,
# which open every array, are not needed then).
_RESTORING: contextvars.ContextVar[tuple[epath.Path, step_store.Step | None] | None] = (
    contextvars.ContextVar('orbax_tunix_restoring_step', default=None)
)


class TunixAwareHandler(ocp.CompositeCheckpointHandler):
  """A `CompositeCheckpointHandler` that restores Tunix steps canonically.

  Example::

    ckptr = ocp.Checkpointer(orbax_tunix.TunixAwareHandler())
    state = ckptr.restore(step_dir)                      # every item
    params = ckptr.restore(step_dir, args=ocp.args.Composite(
        model_params=ocp.args.PyTreeRestore(item=abstract_params)))

  Takes the arguments of `ocp.CompositeCheckpointHandler` (item names, item
  handlers or a handler registry, composite options) with the same meaning.
  """

  def __init__(self, *item_names: str, **kwargs: Any):
    super().__init__(*item_names, **kwargs)
    # Orbax's handler for an item -> the Tunix reader over it (one each).
    self._tunix_readers: dict[int, tuple[Any, TunixPyTreeHandler]] = {}
    _orbax.serve_step_reads(self)

  def _tunix_reader(self, handler: Any) -> Any:
    """The handler an item restore goes to: Tunix-aware over a PyTree handler."""
    if isinstance(handler, TunixPyTreeHandler) or not isinstance(handler, _PYTREE_HANDLERS):
      return handler
    key = id(handler)
    if key not in self._tunix_readers:
      self._tunix_readers[key] = (handler, TunixPyTreeHandler(reader=handler))
    return self._tunix_readers[key][1]

  # The one Orbax hook used: the composite asks this method for each item's
  # handler (tests/test_orbax_assumptions.py pins it). Saves, and the item's
  # binding to its handler, stay Orbax's; only restores are routed.
  def _get_or_set_handler(self, item_name: str, args: Any) -> Any:
    handler = (self._given_tunix_handler(item_name, args)
               or super()._get_or_set_handler(item_name, args))
    if isinstance(args, _PYTREE_RESTORE_ARGS):
      return self._tunix_reader(handler)
    return handler

  def _given_tunix_handler(self, item_name: str, args: Any) -> Any:
    """A `TunixPyTreeHandler` given as an item's handler, for Orbax's plain PyTree args.

    Orbax registers an item's handler under the args types registered for its
    class (`TunixPyTreeSave`/`TunixPyTreeRestore` for ours), so `PyTreeSave`
    and `PyTreeRestore` for that item would find no handler, where they find
    a `PyTreeCheckpointHandler` given the same way: ours takes them alike.
    """
    ours = _OUR_ARGS.get(type(args))
    registry = self._handler_registry
    if ours is None or registry is None or not registry.has(item_name, ours):
      return None
    return registry.get(item_name, ours)

  def restore(self, directory: epath.Path, args: ocp.args.Composite | None = None) -> Any:
    """Restores the items named in `args`, or every item when there are none.

    With no args, the items on disk are restored, as Orbax's composite does;
    items the step records but lacks are left out (and logged).

    Raises:
      NotACheckpointError: `directory` is missing or a file (also a
        `FileNotFoundError`), or Orbax found nothing to restore because it is
        a checkpoint root or an item, not a step (the message names the step).
      UncommittedStepError: it is a root whose steps are all unfinished.
      MissingItemError: an item named in `args` is not in the step (also the
        `KeyError` Orbax raises).
      CorruptMetadataError: an item to restore is damaged.
    """
    directory = fileio.as_path(directory)
    if not directory.is_dir():
      raise errors.NotACheckpointError(
          f'{directory}: expected a step directory, found'
          f' {fileio.found_at(directory)}. Check the path.'
      )
    step = None
    if args is None or not dict(args.items()):
      step, found = _whole_step(directory)
    else:
      missing = sorted(name for name in args.keys() if not (directory / name).is_dir())
      if missing:
        present = sorted(p.name for p in directory.iterdir() if p.is_dir())
        raise errors.MissingItemError(
            f'{directory}: expected the items asked for, {missing} not found (the'
            f' step has {present}). Ask only for items the step has, or pick'
            ' another step.'
        )
      found = _planned_items(directory, [n for n, a in args.items() if isinstance(a, _PYTREE_RESTORE_ARGS)])
    plans = []
    if found is not None:
      for name in found.absent:
        logger.warning('%s: item %r is recorded but not on disk; restoring the others.',
                       directory, name)
      step = found.source
      # Planned once here: each item's reader uses it.
      if found.is_tunix:
        plans = [planned_item.PlannedItem.of(found, n) for n in found.maps]
    # Orbax is handed the step's metadata as parsed here (no file is read twice).
    served = {} if step is None else {step.directory / CHECKPOINT_METADATA: step.metadata_json}
    token = _RESTORING.set((directory, step))
    try:
      with planned_item.using(plans), _orbax.serving(served):
        return super().restore(directory, args=args)
    except (ValueError, KeyError) as e:
      _raise_if_not_a_step(directory, e)
      raise
    finally:
      _RESTORING.reset(token)

  def metadata(self, directory: epath.Path) -> ocp.metadata.StepMetadata:
    """Step metadata as Orbax gives it; Tunix items' trees are canonical.

    Orbax's warning that an item "could not be restored" is kept only for
    items no handler can restore (it is logged for any item without a
    handler bound, also those whose recorded handler restores them).
    """
    restoring = _RESTORING.get()
    if restoring is not None and restoring[0] == fileio.as_path(directory):
      step = restoring[1]
      with _orbax.silence_unrestorable_warnings(_restorable(step) if step else ()):
        return super().metadata(directory)
    step = step_store.open_step(directory)
    with (
        _orbax.serving({step.directory / CHECKPOINT_METADATA: step.metadata_json}),
        _orbax.silence_unrestorable_warnings(_restorable(step)),
    ):
      meta = super().metadata(directory)
    found = dict(meta.item_metadata.items()) if meta.item_metadata is not None else {}
    # Other kinds of items (JSON, ...) stay as Orbax described them.
    names = [
        n for n, m in found.items()
        if (m is None or isinstance(m, _orbax.TreeMetadata))
        and not step.single_item and step.is_pytree(n)
    ]
    tunix = {n: planned for n, planned in plan_items(step, names).items() if planned[1].rewrites}
    if not tunix:
      return meta
    for name, (item, cmap) in tunix.items():
      if found[name] is None:  # The arrays' metadata, with the plan just made.
        found[name] = planned_item.PlannedItem(item, cmap).metadata()
      else:
        found[name] = planned_item.canonical_metadata(found[name], cmap, str(item.directory))
    return dataclasses.replace(meta, item_metadata=type(meta.item_metadata)(**found))


def _restorable(step: step_store.Step) -> list[str]:
  """Items on disk whose recorded handler Orbax can restore them with."""
  return [n for n in step.present if _orbax.handler_class(step.handler(n) or '') is not None]


def _whole_step(directory: epath.Path) -> tuple[step_store.Step | None, Detection | None]:
  """A step restored whole: its metadata, and its detection (None where Orbax decides).

  A Tunix step (one holding an item Tunix names) that is damaged raises here
  (an item holding other than its recorded handler says, unreadable
  metadata). Other steps restore, or fail, exactly as with Orbax's own handler.
  """
  if not (directory / CHECKPOINT_METADATA).exists() or item_store.has_tree(directory):
    return None, None
  try:
    found = detect(directory)
  except errors.UnsafeNameError:
    raise  # Never handed to Orbax, which would follow the name.
  except errors.TunixCheckpointError:
    if any((directory / n).is_dir() for n in conventions.TUNIX_ITEMS):
      raise
    try:
      return step_store.open_step(directory), None
    except errors.UnsafeNameError:
      raise
    except errors.TunixCheckpointError:
      return None, None
  return found.source, found


def _planned_items(directory: epath.Path, names: list[str]) -> Detection | None:
  """The items asked for, read and planned together (the optimizer's with the weights).

  None when that is not possible here: each item's reader then plans, and
  reports, on its own, as Orbax's handler would fail or succeed on its own.
  """
  if not names or not (directory / CHECKPOINT_METADATA).exists():
    return None
  try:
    return detect(directory, items=names)
  except errors.UnsafeNameError:
    raise  # Never handed to Orbax, which would follow the name.
  except errors.TunixCheckpointError:
    return None


def _raise_if_not_a_step(directory: epath.Path, error: Exception) -> None:
  """Says what to pass instead when Orbax failed on a root or an item directory.

  Only when the directory is recognisably one of those; otherwise Orbax's own
  error stands.
  """
  if (directory / PYTREE_METADATA).exists():
    if (directory / CHECKPOINT_METADATA).exists():
      found = 'one item saved on its own (by a Checkpointer over a PyTree handler)'
      fix = 'Restore it with ocp.Checkpointer(orbax_tunix.TunixPyTreeHandler()).'
    else:
      found = f'an item of the step {directory.parent}'
      fix = 'Pass the step directory instead, or restore the item with TunixPyTreeHandler.'
    raise errors.NotACheckpointError(
        f'{directory}: expected a step directory of items, found {found}. {fix}'
    ) from error
  if (directory / CHECKPOINT_METADATA).exists():
    return
  if not any(step_store.list_steps(root) for root in step_store.step_roots(directory)):
    return
  step_dir = step_store.resolve(directory).step.directory  # Raises if none is committed.
  raise errors.NotACheckpointError(
      f'{directory}: expected a step directory (holding {CHECKPOINT_METADATA}),'
      f' found a checkpoint root. Pass the step directory instead, e.g. {step_dir}.'
  ) from error


@ocp.args.register_with_handler(TunixAwareHandler, for_save=True, for_restore=True)
class TunixComposite(ocp.args.Composite):
  """`ocp.args.Composite`, registered for `TunixAwareHandler`."""

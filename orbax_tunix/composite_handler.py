"""`TunixAwareHandler`: the drop-in composite handler for Tunix steps.

It is Orbax's `CompositeCheckpointHandler`, constructed, saving and choosing
handlers exactly as Orbax's does, with one difference: an item restored by a
PyTree handler (`PyTreeRestore`, `StandardRestore`, or no args for an item
saved by one) reads a Tunix item in canonical form, through the handler Orbax
chose, with its options. Items that are not Tunix's, and every other handler,
behave as with Orbax's own class.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import orbax.checkpoint as ocp
from etils import epath

from orbax_tunix import _orbax, errors, storage
from orbax_tunix.detection import Detection, detect, plan_item, plan_items
from orbax_tunix.pytree_handler import TunixPyTreeHandler, canonical_metadata
from orbax_tunix.storage import CHECKPOINT_METADATA, PYTREE_METADATA

logger = logging.getLogger('orbax_tunix')

_PYTREE_HANDLERS = (ocp.PyTreeCheckpointHandler, ocp.StandardCheckpointHandler)
_PYTREE_RESTORE_ARGS = (ocp.args.PyTreeRestore, ocp.args.StandardRestore)


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
    # The items of the step being restored, planned once and handed to every
    # reader ({item directory: (item, canonical map)}).
    self._plans: dict[epath.Path, Any] = {}
    # Orbax's no-arg restore calls metadata() for the recorded handlers only:
    # the canonical item trees (which open every array) are not needed then.
    self._restoring = False

  def _tunix_reader(self, handler: Any) -> Any:
    """The handler an item restore goes to: Tunix-aware over a PyTree handler."""
    if isinstance(handler, TunixPyTreeHandler) or not isinstance(handler, _PYTREE_HANDLERS):
      return handler
    key = id(handler)
    if key not in self._tunix_readers:
      self._tunix_readers[key] = (handler, TunixPyTreeHandler(reader=handler, plans=self._plans))
    return self._tunix_readers[key][1]

  # The one Orbax hook used: the composite asks this method for each item's
  # handler (tests/test_orbax_assumptions.py pins it). Saves, and the item's
  # binding to its handler, stay Orbax's; only restores are routed.
  def _get_or_set_handler(self, item_name: str, args: Any) -> Any:
    handler = super()._get_or_set_handler(item_name, args)
    if isinstance(args, _PYTREE_RESTORE_ARGS):
      return self._tunix_reader(handler)
    return handler

  def restore(self, directory: epath.Path, args: ocp.args.Composite | None = None) -> Any:
    """Restores the items named in `args`, or every item when there are none.

    Raises:
      NotACheckpointError: `directory` is missing or a file (also a
        `FileNotFoundError`), or Orbax found nothing to restore because it is
        a checkpoint root or an item, not a step (the message names the step).
      UncommittedStepError: it is a root whose steps are all unfinished.
      MissingItemError: an item named in `args` is not in the step (also the
        `KeyError` Orbax raises).
      CorruptMetadataError: an item to restore is damaged.

    With no args, the items on disk are restored, as Orbax's composite does;
    items the step records but lacks are left out (and logged).
    """
    directory = storage.as_path(directory)
    if not directory.is_dir():
      raise errors.NotACheckpointError(
          f'{directory}: expected a step directory, found'
          f' {storage.found_at(directory)}. Check the path.'
      )
    if args is None or not dict(args.items()):
      found = _tunix_detection(directory)
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
    if found is not None:
      for name in found.absent:
        logger.warning('%s: item %r is recorded but not on disk; restoring the others.',
                       directory, name)
      # Planned once here: each item's reader uses it (no metadata read again).
      self._plans.update(
          (found.source.item_dir(n), (found.item_meta(n), m)) for n, m in found.maps.items()
      )
    self._restoring = True
    try:
      return super().restore(directory, args=args)
    except (ValueError, KeyError) as e:
      _raise_if_not_a_step(directory, e)
      raise
    finally:
      self._restoring = False
      self._plans.clear()

  def metadata(self, directory: epath.Path) -> ocp.metadata.StepMetadata:
    """Step metadata as Orbax gives it; Tunix items' trees are canonical."""
    meta = super().metadata(directory)
    if self._restoring:
      return meta
    found = dict(meta.item_metadata.items()) if meta.item_metadata is not None else {}
    step = storage.open_step(directory)
    # Other kinds of items (JSON, ...) stay as Orbax described them.
    names = [
        n for n, m in found.items()
        if (m is None or isinstance(m, _orbax.TreeMetadata))
        and not step.single_item and step.is_pytree(n)
    ]
    changed = False
    for name, (item, cmap) in plan_items(step, names).items():
      if not cmap.rewrites:
        continue
      if found[name] is None:
        # The arrays' metadata, read once with the plan just made.
        reader = TunixPyTreeHandler(plans={item.directory: (item, cmap)})
        found[name] = reader.metadata(item.directory)
      else:
        found[name] = canonical_metadata(found[name], cmap)
      changed = True
    if not changed:
      return meta
    return dataclasses.replace(meta, item_metadata=type(meta.item_metadata)(**found))


def _tunix_detection(directory: epath.Path) -> Detection | None:
  """The detection of a whole Tunix step, or None for any other step.

  For a Tunix step, damage is raised here (an item holding other than its
  recorded handler says, or unreadable metadata). Other steps restore, or
  fail, exactly as with Orbax's own handler.
  """
  if not (directory / CHECKPOINT_METADATA).exists() or storage.has_tree(directory):
    return None
  try:
    found = detect(directory)
  except errors.TunixCheckpointError:
    step = storage.open_step(directory)
    for name in step.present:
      try:
        planned = plan_item(step.item_dir(name))
      except errors.TunixCheckpointError:
        continue
      if planned is not None and planned[1].rewrites:
        raise
    return None
  return found if found.is_tunix else None


def _planned_items(directory: epath.Path, names: list[str]) -> Detection | None:
  """The items asked for, read and planned together (the optimizer's with the weights).

  None when that is not possible here: each item's reader then plans, and
  reports, on its own, as Orbax's handler would fail or succeed on its own.
  """
  if not names or not (directory / CHECKPOINT_METADATA).exists():
    return None
  try:
    return detect(directory, items=names)
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
  if not any(storage.list_steps(root) for root in storage.step_roots(directory)):
    return
  step_dir = storage.resolve(directory).step.directory  # Raises if none is committed.
  raise errors.NotACheckpointError(
      f'{directory}: expected a step directory (holding {CHECKPOINT_METADATA}),'
      f' found a checkpoint root. Pass the step directory instead, e.g. {step_dir}.'
  ) from error


@ocp.args.register_with_handler(TunixAwareHandler, for_save=True, for_restore=True)
class TunixComposite(ocp.args.Composite):
  """`ocp.args.Composite`, registered for `TunixAwareHandler`."""

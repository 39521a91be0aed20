"""`TunixAwareHandler`: the drop-in composite handler for Tunix steps.

`ocp.Checkpointer(TunixAwareHandler()).restore(step_dir)` returns every item,
Tunix items in canonical form, whether the step was written through Orbax's v0
or v1 API. Items restored with `PyTreeRestore` or `StandardRestore` go to
`TunixPyTreeHandler`; saving goes to Orbax's own handlers and writes an
ordinary checkpoint.
"""

from __future__ import annotations

from typing import Any

import orbax.checkpoint as ocp
from etils import epath
from orbax.checkpoint._src.handlers import handler_type_registry

from orbax_tunix import errors

# Names, not the module: the package re-exports the function `detect`, which
# shadows the module attribute of the same name.
from orbax_tunix.detect import CHECKPOINT_METADATA, recorded_item_handlers, require_step_dir
from orbax_tunix.pytree_handler import V1_PYTREE_TYPESTR, TunixPyTreeHandler, TunixPyTreeRestore

# Item handler typestrs whose items hold a PyTree `TunixPyTreeHandler` reads:
# the v0 PyTree and Standard handlers (both module spellings) and v1's.
PYTREE_TYPESTRS = frozenset(
    f'orbax.checkpoint.{space}._src.handlers.{module}'.replace('..', '.')
    for space in ('', 'v0')
    for module in (
        'pytree_checkpoint_handler.PyTreeCheckpointHandler',
        'standard_checkpoint_handler.StandardCheckpointHandler',
    )
) | {V1_PYTREE_TYPESTR, TunixPyTreeHandler.typestr()}

RESTORE_ARGS = (TunixPyTreeRestore, ocp.args.PyTreeRestore, ocp.args.StandardRestore)
SAVE_HANDLERS = {
    ocp.args.PyTreeSave: ocp.PyTreeCheckpointHandler,
    ocp.args.StandardSave: ocp.StandardCheckpointHandler,
}


class TunixAwareHandler(ocp.CompositeCheckpointHandler):
  """A `CompositeCheckpointHandler` that restores Tunix steps canonically.

  Example::

    ckptr = ocp.Checkpointer(orbax_tunix.TunixAwareHandler())
    state = ckptr.restore(step_dir)                      # every item
    params = ckptr.restore(step_dir, args=ocp.args.Composite(
        model_params=ocp.args.PyTreeRestore(item=abstract_params)))

  Args:
    *item_names, **kwargs: as for `ocp.CompositeCheckpointHandler`.
    item_handler: the handler for PyTree items (a `TunixPyTreeHandler` by
      default; pass one to set its options).
  """

  def __init__(
      self,
      *item_names: str,
      item_handler: TunixPyTreeHandler | None = None,
      handler_registry: Any = None,
      **kwargs: Any,
  ):
    registry = ocp.handlers.DefaultCheckpointHandlerRegistry(handler_registry)
    self._item_handler = item_handler or TunixPyTreeHandler()
    for args_type in RESTORE_ARGS:
      if not registry.has(None, args_type):
        registry.add(None, args_type, self._item_handler)
    # Saves go to Orbax's own handlers, so what is written is ordinary.
    for args_type, handler_type in SAVE_HANDLERS.items():
      if not registry.has(None, args_type):
        registry.add(None, args_type, handler_type())
    super().__init__(*item_names, handler_registry=registry, **kwargs)

  def metadata(self, directory: epath.Path) -> Any:
    """Step metadata; PyTree items' trees are canonical for Tunix items."""
    directory = require_step_dir(directory)
    self._bind_pytree_items(directory)
    return super().metadata(directory)

  def restore(self, directory: epath.Path, args: ocp.args.Composite | None = None) -> Any:
    """Restores the items named in `args`, or every item when there are none."""
    directory = require_step_dir(directory)
    if args is None or not dict(args.items()):
      args = self._default_args(directory)
    missing = sorted(name for name in args.keys() if not (directory / name).is_dir())
    if missing:
      raise errors.TargetMismatchError(
          f'{directory}: expected the items asked for, {missing} not found (the'
          f' step has {sorted(self._existing_items(directory))}). Ask only for'
          ' items the step has, or pick another step.'
      )
    return super().restore(directory, args=args)

  def _pytree_items(self, directory: epath.Path) -> tuple[list[str], dict[str, Any]]:
    """(PyTree items, other items -> recorded typestr) of a step on disk."""
    recorded = recorded_item_handlers(directory)
    existing = self._existing_items(directory)
    absent = sorted(set(recorded) - set(existing))
    if absent:
      # Restoring the rest would hand back a partial step as if it were whole.
      raise errors.CorruptMetadataError(
          f'{directory}: {CHECKPOINT_METADATA} records the items'
          f' {sorted(recorded)}, but {absent} are missing (or not directories).'
          ' The step is damaged: restore another step, or name the items you'
          ' want in args.'
      )
    pytrees, others = [], {}
    for name in existing:
      typestr = recorded.get(name)
      if typestr is None or typestr in PYTREE_TYPESTRS:
        pytrees.append(name)
      else:
        others[name] = typestr
    return pytrees, others

  def _bind_pytree_items(self, directory: epath.Path) -> None:
    """Gives each PyTree item the Tunix handler, as Orbax's metadata() needs."""
    for name in self._pytree_items(directory)[0]:
      if not self._handler_registry.has(name, TunixPyTreeRestore):
        self._handler_registry.add(name, TunixPyTreeRestore, self._item_handler)

  def _default_args(self, directory: epath.Path) -> ocp.args.Composite:
    """Args for every item on disk; PyTree items get the Tunix handler."""
    pytrees, others = self._pytree_items(directory)
    items: dict[str, Any] = {name: TunixPyTreeRestore() for name in pytrees}
    for name, typestr in others.items():
      try:
        handler_type = handler_type_registry.get_handler_type(typestr)
        items[name] = ocp.args.get_registered_args_cls(handler_type)[1]()
      except (KeyError, ValueError):
        continue  # As Orbax does: an item no handler can read is skipped.
    return ocp.args.Composite(**items)


@ocp.args.register_with_handler(TunixAwareHandler, for_save=True, for_restore=True)
class TunixComposite(ocp.args.Composite):
  """`ocp.args.Composite`, registered for `TunixAwareHandler`."""

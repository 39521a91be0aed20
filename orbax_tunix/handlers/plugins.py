"""Plugging into Orbax: the v0 handler registry, the v1 API, entry points.

Orbax loads no plugins by itself. `register()` is what the entry point
`tunix = orbax_tunix:register` (group `orbax.checkpoint.handlers`) runs, and
`load_plugins()` is the one line a trainer adds to load every plugin declared
in that group.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
from typing import Any

import orbax.checkpoint as ocp
from etils import epath

from orbax_tunix.handlers.pytree_handler import (
  TunixPyTreeHandler,
  TunixPyTreeRestore,
  V1ItemRestore,
)
from orbax_tunix.mapping import device, warmup
from orbax_tunix.reading import planned_item
from orbax_tunix.store import _orbax

# Item handler typestrs whose items hold a PyTree that the v1 loader reads.
PYTREE_TYPESTRS = _orbax.PYTREE_TYPESTRS | {TunixPyTreeHandler.typestr()}

ENTRY_POINT_GROUP = 'orbax.checkpoint.handlers'


def handler_registry(
    item_handler: TunixPyTreeHandler | None = None,
) -> ocp.handlers.DefaultCheckpointHandlerRegistry:
  """A v0 handler registry for `ocp.CheckpointManager`.

  Example::

    mngr = ocp.CheckpointManager(root, handler_registry=orbax_tunix.handler_registry())
    state = mngr.restore(mngr.latest_step())

  PyTree items restore through `TunixPyTreeHandler` (Tunix items in canonical
  form), with no arguments or with `PyTreeRestore`/`StandardRestore`, whether
  the step was written with Orbax's v0 or v1 API. Saves go to Orbax's own
  handlers and write ordinary checkpoints. As in Orbax, a manager that saved
  an item keeps the handler that saved it for a later restore of that item
  without args (the tree as saved); pass args, or open a new manager, to get
  the canonical tree.

  Args:
    item_handler: the handler for Tunix items (a new `TunixPyTreeHandler` by
      default).

  Returns:
    A `DefaultCheckpointHandlerRegistry`.
  """
  restore_handler = item_handler or TunixPyTreeHandler()
  registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
  # General entries, not per item name: saves then fall through to Orbax's
  # own handlers, so the typestr recorded in a new step is Orbax's and the
  # step restores without this package. A no-arg restore finds the handler
  # type by the recorded typestr, then these entries by its default args.
  for args_type in (
      TunixPyTreeRestore, V1ItemRestore, ocp.args.PyTreeRestore, ocp.args.StandardRestore
  ):
    registry.add(None, args_type, restore_handler)
  return registry


class TunixV1PyTreeHandler(ocp.v1.handlers.PyTreeHandler):
  """The v1 PyTree handler, reading Tunix items canonically.

  Registered for loading only (`is_handleable` is False, so saving keeps
  Orbax's own handler and typestr); any item that is not Tunix is loaded by
  the stock `PyTreeHandler` unchanged.
  """

  def is_handleable(self, checkpointable: Any) -> bool:
    del checkpointable
    return False

  async def load(self, directory: epath.Path, abstract_checkpointable: Any = None):
    warmup.start(abstract_checkpointable)  # Started while it is planned.
    planned = await asyncio.to_thread(planned_item.find, directory)
    if (planned is None or not planned.is_tunix
        or planned.as_stored(abstract_checkpointable)):  # Orbax's, unchanged.
      return await super().load(directory, abstract_checkpointable)
    args = TunixPyTreeRestore(item=abstract_checkpointable)
    # Read through the v0 machinery (with the plan made here); v1 awaits the result.
    restored = await asyncio.to_thread(planned.restore, args, None, device.plan_read)

    async def _done():
      return restored

    return _done()

  async def metadata(self, directory: epath.Path) -> Any:
    planned = await asyncio.to_thread(planned_item.find, directory)
    if planned is None or not planned.is_tunix:
      return await super().metadata(directory)
    meta = await asyncio.to_thread(planned.metadata)
    return meta.tree


_registered = False


def register() -> None:
  """Registers orbax_tunix with Orbax's v1 API. Idempotent.

  After it, `ocp.v1.load_checkpointables(step_dir)` returns Tunix items in
  canonical form and leaves every other checkpoint to Orbax's handlers. The
  v0 handlers need no registration: pass `TunixAwareHandler()` or
  `handler_registry()` where Orbax takes a handler.
  """
  global _registered
  if _registered:
    return
  ocp.v1.handlers.register_handler(
      TunixV1PyTreeHandler, secondary_typestrs=sorted(PYTREE_TYPESTRS)
  )
  _registered = True


def load_plugins(group: str = ENTRY_POINT_GROUP) -> list[str]:
  """Loads and runs every plugin declared in an entry-point group.

  Args:
    group: the entry-point group (Orbax handler plugins by default).

  Returns:
    The names of the plugins loaded, in the order run.
  """
  loaded = []
  for entry_point in sorted(importlib.metadata.entry_points(group=group), key=lambda e: e.name):
    plugin = entry_point.load()
    if callable(plugin):
      plugin()
    loaded.append(entry_point.name)
  return loaded

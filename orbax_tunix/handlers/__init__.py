"""The Orbax handlers and their wiring: thin adapters over `reading.planned_item`.

  pytree_handler.py     `TunixPyTreeHandler` (an item)
  composite_handler.py  `TunixAwareHandler` (a step)
  plugins.py            Orbax's v0 registry, the v1 API, the entry-point group
"""

"""The Orbax seam and storage: how a checkpoint sits on disk, and every use of Orbax's private API.

  _orbax.py       Orbax's private API and its on-disk schema (file names, recorded values), only here
  fileio.py       reading its small files, capped, every failure in our terms
  item_store.py   an item: its leaves from `_METADATA`, its arrays' headers
  step_store.py   the steps under a root, a step's items, what a path stands for
  netprobe.py     whether a bucket's storage service answers
"""

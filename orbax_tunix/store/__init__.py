"""The Orbax seam and storage: how a checkpoint sits on disk, and every use of Orbax's private API.

  _orbax.py          Orbax's private API and its on-disk schema (file names, recorded values), only here
  storage_errors.py  telling missing or damaged data and a full disk from the caller's errors
  zarr_format.py     zarr's header files, headers and chunk keys (how Orbax's arrays are stored)
  loops.py           running a coroutine on its own event loop, leaving nothing running on failure
  fileio.py          reading its small files, capped, every failure in our terms
  item_store.py      an item: its leaves from `_METADATA`, its arrays' headers
  step_store.py      the steps under a root, a step's items, what a path stands for
  netprobe.py        whether a bucket's storage service answers
"""

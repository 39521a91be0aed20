"""Counts the opens of Orbax's metadata files, with a Python audit hook.

Orbax and this package open `_METADATA` and `_CHECKPOINT_METADATA` from
Python (TensorStore opens only the array stores), so every open is seen.
"""

from __future__ import annotations

import collections
import contextlib
import os
import sys
from collections.abc import Iterator

NAMES = ('_METADATA', '_CHECKPOINT_METADATA')
_counts: collections.Counter[str] | None = None


def _hook(event: str, args: tuple) -> None:
  if _counts is None or event != 'open' or not args:
    return
  path = args[0]
  if isinstance(path, str | bytes | os.PathLike):
    path = os.fsdecode(path)
    if os.path.basename(path) in NAMES:
      _counts[os.path.normpath(path)] += 1


sys.addaudithook(_hook)


@contextlib.contextmanager
def counting() -> Iterator[collections.Counter[str]]:
  """{metadata file path: opens} for the calls made inside the block."""
  global _counts
  _counts = collections.Counter()
  try:
    yield _counts
  finally:
    _counts = None

"""The zarr format Orbax stores arrays in (v2 or v3): header names, headers, chunk keys.

Zarr's own specification, not Orbax's API: pure functions on names and bytes.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np


def header_name(zarr3: bool) -> str:
  """The name of an array's header file: `zarr.json` (v3) or `.zarray` (v2)."""
  return 'zarr.json' if zarr3 else '.zarray'


def parse_header(
    data: bytes, zarr3: bool
) -> tuple[tuple[int, ...], np.dtype, tuple[int, ...] | None]:
  """(shape, dtype, chunk shape) from an array's `.zarray` (zarr v2) or `zarr.json` (v3).

  The chunk shape is what a read decodes whole: v2's `chunks`; v3's grid
  chunk, or the inner chunk of its `sharding_indexed` codec (None: unstated).
  """
  header = json.loads(data)
  dtype = header['data_type'] if zarr3 else header['dtype']
  if not zarr3:
    chunks = header.get('chunks')
  else:
    chunks = header.get('chunk_grid', {}).get('configuration', {}).get('chunk_shape')
    for codec in header.get('codecs') or ():
      if isinstance(codec, dict) and codec.get('name') == 'sharding_indexed':
        chunks = codec.get('configuration', {}).get('chunk_shape', chunks)
  return (tuple(header['shape']), np.dtype(jnp.dtype(dtype)),
          tuple(chunks) if isinstance(chunks, list) else None)


def chunk_key(index: Sequence[int], zarr3: bool) -> str:
  """The store key of chunk `index` of an array, below the array's name.

  Zarr names chunk (i, j) `i.j` (v2; `0` for a 0-d array) or `c/i/j` (v3).
  """
  if zarr3:
    return '/'.join(['c', *map(str, index)])
  return '.'.join(map(str, index)) or '0'

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

  Raises:
    ValueError: not a header: not JSON, no shape or dtype, a shape that is not
      whole numbers >= 0, or a chunk shape that is not whole numbers >= 1 of the
      shape's rank (a header is a stranger's: its sizes are checked, not trusted).
  """
  try:
    header = json.loads(data)
    dtype = header['data_type'] if zarr3 else header['dtype']
    if not zarr3:
      chunks = header.get('chunks')
    else:
      chunks = header.get('chunk_grid', {}).get('configuration', {}).get('chunk_shape')
      for codec in header.get('codecs') or ():
        if isinstance(codec, dict) and codec.get('name') == 'sharding_indexed':
          chunks = codec.get('configuration', {}).get('chunk_shape', chunks)
    shape = _whole_numbers(header['shape'], 0, 'shape')
    dtype = np.dtype(jnp.dtype(dtype))
  except (KeyError, TypeError, AttributeError) as e:
    raise ValueError(f'not a zarr header ({type(e).__name__}: {e})') from e
  if chunks is not None and not (isinstance(chunks, list) and len(chunks) == len(shape)):
    raise ValueError(f'its chunk shape {chunks!r} is not one of the shape\'s rank {len(shape)}')
  return shape, dtype, None if chunks is None else _whole_numbers(chunks, 1, 'chunk shape')


def _whole_numbers(values: object, least: int, what: str) -> tuple[int, ...]:
  """A header's list of sizes, each a whole number >= `least` (a bool is none)."""
  if not isinstance(values, list) or not all(
      isinstance(v, int) and not isinstance(v, bool) and v >= least for v in values):
    raise ValueError(f'its {what} {values!r} is not a list of whole numbers >= {least}')
  return tuple(values)


def chunk_key(index: Sequence[int], zarr3: bool) -> str:
  """The store key of chunk `index` of an array, below the array's name.

  Zarr names chunk (i, j) `i.j` (v2; `0` for a 0-d array) or `c/i/j` (v3).
  """
  if zarr3:
    return '/'.join(['c', *map(str, index)])
  return '.'.join(map(str, index)) or '0'

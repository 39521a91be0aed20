"""Sizes in bytes, as every option of this package takes them (one rule).

A size is an int, a float holding a whole number of bytes (`5e9`), or text:
a number and an optional unit, case-insensitive. Units follow `transformers`'
`max_shard_size`: `KB`, `MB`, `GB`, `TB` are decimal (10**3 per step), `KiB`,
`MiB`, `GiB`, `TiB` binary (2**10 per step); a bare letter (`K`, `M`, `G`,
`T`, as `ls -h` and `free` print them) is binary; no unit (or `B`) is bytes.
So `--memory-budget 1G` is 2**30 bytes and `--max-shard-size 5GB` 5*10**9.
"""

from __future__ import annotations

import math
import numbers
import re

from orbax_tunix import errors

_SIZE = re.compile(r'^\s*(\d+(?:\.\d*)?(?:e\+?\d+)?|\.\d+)\s*([a-z]*)\s*$', re.IGNORECASE)
_UNITS = {'': 1, 'b': 1,
          'k': 2**10, 'm': 2**20, 'g': 2**30, 't': 2**40,
          'kb': 10**3, 'mb': 10**6, 'gb': 10**9, 'tb': 10**12,
          'kib': 2**10, 'mib': 2**20, 'gib': 2**30, 'tib': 2**40}
# Far above any disk; larger "sizes" are typos (1e400 is inf as a float).
MAX_BYTES = 2**62
HELP = ('bytes, or a number with a unit: KB, MB, GB, TB (powers of 1000), KiB, MiB, GiB, TiB or'
        ' K, M, G, T (powers of 1024)')


def parse_size(value: object, name: str) -> int:
  """Bytes from a size (see the module docstring).

  Args:
    value: an int, a float holding a whole number, or text such as '512M',
      '5GB', '1.5GiB', '1000000'.
    name: the parameter, for messages (e.g. 'memory_budget').

  Returns:
    The size in bytes, >= 1.

  Raises:
    InvalidOptionError: not a size, not a whole number of bytes, below 1, or
      above `MAX_BYTES`.
  """
  if isinstance(value, bool) or not isinstance(value, (numbers.Real, str)):
    raise _bad(value, name, f'found a {type(value).__name__}')
  if isinstance(value, str):
    m = _SIZE.match(value)
    unit = m and _UNITS.get(m.group(2).lower())
    if unit is None:
      raise _bad(value, name, 'found text that is not one')
    number = float(m.group(1)) * unit
    number = math.floor(number) if math.isfinite(number) else number  # '1.5K': 1536.
  elif isinstance(value, numbers.Integral):
    number = int(value)
  elif math.isnan(value) or (math.isfinite(value) and value != math.floor(value)):
    raise _bad(value, name, 'found a number that is not a whole number of bytes')
  else:
    number = value if math.isinf(value) else int(value)
  if number < 1 or number > MAX_BYTES:
    raise _bad(value, name, 'found one below 1 byte' if number < 1
               else f'found one above {MAX_BYTES} bytes (more than any disk)')
  return int(number)


def _bad(value: object, name: str, found: str) -> errors.InvalidOptionError:
  return errors.InvalidOptionError(
      f'`{name}` {value!r}: expected a positive size ({HELP}), {found}.')


def parse_size_text(text: str) -> int:
  """Bytes from a size option's text (a flag's value), as `parse_size`.

  Raises:
    ValueError: the text is not a size; the message starts with it.
  """
  try:
    return parse_size(text, 'size')
  except errors.InvalidOptionError as e:
    raise ValueError(str(e).replace('`size` ', '', 1)) from None

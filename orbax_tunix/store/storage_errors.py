"""Telling a storage failure (missing or damaged data, a full disk) from the caller's error.

Pure functions on exception chains: TensorStore reports storage failures as
`ValueError`s whose text starts with a status code (`NOT_FOUND: ...`), Python
as `OSError`s, and Orbax wraps either (a failed array read: a bare `Exception`
whose `__cause__` is TensorStore's). No Orbax API is used here.
"""

from __future__ import annotations

import errno
from collections.abc import Iterator

# TensorStore's status codes that say stored data is missing or damaged, or the
# storage unreachable. Other codes (INVALID_ARGUMENT, ...) and JAX's own errors
# are about the request, i.e. the caller's.
_STORAGE_CODES = (
    'OUT_OF_RANGE:', 'NOT_FOUND:', 'DATA_LOSS:', 'UNAVAILABLE:', 'PERMISSION_DENIED:',
    'FAILED_PRECONDITION:', 'ABORTED:', 'INTERNAL:', 'UNKNOWN:',
)

# Errors a full disk (or quota) gives: errno, and the words TensorStore's
# RESOURCE_EXHAUSTED write failures carry (it reports `os_error_code='28'`).
_NO_SPACE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
_NO_SPACE_TEXT = ('No space left on device', 'Disk quota exceeded')


def storage_failure(exc: BaseException) -> BaseException | None:
  """The exception in `exc`'s chain that says stored data is missing or damaged.

  Returns None when the failure is about the request (a sharding that does not
  divide an array, a wrong dtype...), which the caller must see as raised.
  """
  return next((e for e in _chain(exc)
               if isinstance(e, OSError) or str(e).startswith(_STORAGE_CODES)), None)


def out_of_space(exc: BaseException) -> BaseException | None:
  """The exception in `exc`'s chain that says the destination is full, or None.

  Python's file writes raise `OSError(ENOSPC)`; TensorStore's (an Orbax save)
  a `ValueError('RESOURCE_EXHAUSTED: ... No space left on device ...')`, which
  Orbax may wrap.
  """
  return next((e for e in _chain(exc) if isinstance(e, OSError) and e.errno in _NO_SPACE_ERRNOS
               or any(text in str(e) for text in _NO_SPACE_TEXT)), None)


def _chain(exc: BaseException | None) -> Iterator[BaseException]:
  """`exc`, then its cause (else its context), and so on, each once."""
  seen = set()
  while exc is not None and id(exc) not in seen:
    seen.add(id(exc))
    yield exc
    exc = exc.__cause__ or exc.__context__


def failure_text(exc: BaseException) -> str:
  """A storage failure's first line, without the TensorStore spec Orbax appends."""
  text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
  return text.split(' [tensorstore_spec=')[0]

"""Telling a storage failure (missing or damaged data, a full disk, a file-size limit) from
the caller's error.

Pure functions on exception chains: TensorStore reports storage failures as
`ValueError`s whose text starts with a status code (`NOT_FOUND: ...`), Python
as `OSError`s, and Orbax wraps either (a failed array read: a bare `Exception`
whose `__cause__` is TensorStore's). No Orbax API is used here.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator

# TensorStore's status codes that say stored data is missing or damaged, or the
# storage unreachable. Other codes (INVALID_ARGUMENT, ...) and JAX's own errors
# are about the request, i.e. the caller's.
_STORAGE_CODES = (
    'OUT_OF_RANGE:', 'NOT_FOUND:', 'DATA_LOSS:', 'UNAVAILABLE:', 'PERMISSION_DENIED:',
    'FAILED_PRECONDITION:', 'ABORTED:', 'INTERNAL:', 'UNKNOWN:',
)

# Errors a destination without room gives, by errno: a full disk (or quota), and a file-size
# limit (the process's `ulimit -f`, or the file system's largest file). Python raises them as
# `OSError`s; TensorStore's write failures (RESOURCE_EXHAUSTED, OUT_OF_RANGE) carry the same
# words, the OS's own (`os.strerror`), and `os_error_code='28'`.
_NO_SPACE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
_TOO_LARGE_ERRNOS = frozenset({errno.EFBIG})


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
  return _failing(exc, _NO_SPACE_ERRNOS)


def too_large(exc: BaseException) -> BaseException | None:
  """The exception in `exc`'s chain that says a file outgrew a size limit, or None.

  Python's file writes raise `OSError(EFBIG)`; TensorStore's a
  `ValueError('OUT_OF_RANGE: ... File too large ...')`, which Orbax may wrap.
  """
  return _failing(exc, _TOO_LARGE_ERRNOS)


def _failing(exc: BaseException, codes: frozenset[int]) -> BaseException | None:
  return next((e for e in _chain(exc) if _words(e, codes) is not None), None)


def _words(exc: BaseException, codes: frozenset[int]) -> str | None:
  """The OS's words for the first of `codes` that `exc` is (or names), or None."""
  for code in sorted(codes):
    if (isinstance(exc, OSError) and exc.errno == code) or os.strerror(code) in str(exc):
      return os.strerror(code)
  return None


def os_words(exc: BaseException) -> str:
  """A destination failure (`out_of_space`, `too_large`) as the OS words it ('No space left
  on device'), without the paths and codes TensorStore adds (its staging paths are gone)."""
  return _words(exc, _NO_SPACE_ERRNOS | _TOO_LARGE_ERRNOS) or failure_text(exc)


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

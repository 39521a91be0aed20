"""Whether a bucket's storage service answers at all, asked once before a long wait."""

from __future__ import annotations

import functools
import os
import socket
import urllib.parse

from etils import epath

from orbax_tunix.store.fileio import is_local

# How long `unreachable` waits for a bucket's storage service to answer a
# connection: the clients' own retries take ~50 s to give up.
PROBE_TIMEOUT = 5.0


def _storage_endpoint(path: epath.Path) -> tuple[str, int] | None:
  """(host, port) of the service gcsfs talks to for a gs:// path; None for others.

  As gcsfs chooses it: `STORAGE_EMULATOR_HOST` when set (an emulator), else
  Google's endpoint in the configured universe.
  """
  if os.fspath(path).split('://', 1)[0].lower() != 'gs':
    return None
  url = os.environ.get('STORAGE_EMULATOR_HOST', '')
  if url in ('', 'default'):
    url = 'https://storage.' + os.environ.get('GOOGLE_CLOUD_UNIVERSE_DOMAIN', 'googleapis.com')
  elif '://' not in url:
    url = 'http://' + url
  parts = urllib.parse.urlsplit(url)
  if not parts.hostname:
    return None
  return parts.hostname, parts.port or (443 if parts.scheme == 'https' else 80)


@functools.lru_cache(maxsize=8)
def _connects(host: str, port: int) -> None:
  """Opens (and closes) one connection; raises OSError if none can be made.

  Cached: a service reached once in this process is not probed again.
  """
  socket.create_connection((host, port), timeout=PROBE_TIMEOUT).close()


def unreachable(path: epath.Path) -> str | None:
  """Why a bucket path's storage service cannot be reached, or None.

  One connection attempt (at most `PROBE_TIMEOUT` seconds), before any
  client call: without a network the clients retry for about a minute
  before failing. Local paths, and services reached before, cost nothing.
  """
  if is_local(path):
    return None
  endpoint = _storage_endpoint(path)
  if endpoint is None:
    return None
  try:
    _connects(*endpoint)
  except OSError as e:
    reason = 'no answer' if isinstance(e, TimeoutError) else (e.strerror or str(e))
    return f'{endpoint[0]}:{endpoint[1]}: {reason}'
  return None

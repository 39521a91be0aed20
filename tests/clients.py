"""The test side of the client workers (MaxText's, Tunix's): a subprocess fed jobs.

A worker (`tests/maxtext_client.py`, `tests/tunix_client.py`, built on
`tests/serve_jobs.py`) runs in the client's own environment and answers jobs,
one JSON line each on a pipe, so that one process pays the client's imports
for a whole test module.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import threading

ROOT = pathlib.Path(__file__).resolve().parent.parent


def subprocess_env(**extra: str) -> dict[str, str]:
  """This environment without conftest's 8 simulated devices (the clients' tiny models need one)."""
  env = dict(os.environ)
  flags = [f for f in env.get('XLA_FLAGS', '').split()
           if not f.startswith('--xla_force_host_platform_device_count')]
  if flags:
    env['XLA_FLAGS'] = ' '.join(flags)
  else:
    env.pop('XLA_FLAGS', None)
  env['JAX_PLATFORMS'] = 'cpu'
  env.update(extra)
  return env


def client_env(script: str, **env: str) -> str:
  """What `scripts/<script>` prints last: a client's environment (its python or its packages'
  directory), built on first use, then reused."""
  out = subprocess.run(['bash', str(ROOT / 'scripts' / script)], capture_output=True, text=True,
                       timeout=1800, check=False, env={**os.environ, **env})
  assert out.returncode == 0, f'scripts/{script} failed:\n{out.stderr[-5000:]}'
  return out.stdout.strip().splitlines()[-1]


class Worker:
  """`python SCRIPT --serve`: jobs on stdin, one JSON result per line on a pipe.

  Attributes:
    results: job id -> its result, as they arrive ('__ready__' once imported).
  """

  def __init__(self, name: str, python: str, script: pathlib.Path, out_dir: pathlib.Path,
               log_path: pathlib.Path, env: dict[str, str] | None = None):
    self.name, self.out_dir, self.log_path = name, out_dir, log_path
    read_fd, write_fd = os.pipe()
    self._log = open(log_path, 'w')  # noqa: SIM115 - closed in finish()
    self.proc = subprocess.Popen(
        [python, str(script), '--serve', '--reply-fd', str(write_fd)],
        stdin=subprocess.PIPE, stdout=self._log, stderr=subprocess.STDOUT, pass_fds=(write_fd,),
        cwd=ROOT, env=env or subprocess_env(), text=True)
    os.close(write_fd)
    self.results: dict[str, dict] = {}
    self._replies = os.fdopen(read_fd)
    self._reader = threading.Thread(target=self._read, daemon=True)
    self._reader.start()

  def _read(self):
    for line in self._replies:
      result = json.loads(line)
      self.results[result['id']] = result

  def send(self, *jobs: dict):
    try:
      for job in jobs:
        self.proc.stdin.write(json.dumps({'out_dir': str(self.out_dir), **job}) + '\n')
      self.proc.stdin.flush()
    except BrokenPipeError:  # The worker died: its log says why (finish, then each test).
      pass

  def finish(self, timeout: float):
    try:
      self.proc.stdin.close()
    except BrokenPipeError:
      pass
    self._reader.join(timeout)
    if self._reader.is_alive():
      self.proc.kill()
      raise AssertionError(f'the {self.name} worker did not finish in {timeout} s; log:\n'
                           f'{self.log()}')
    self.proc.wait(60)
    self._log.close()

  def log(self) -> str:
    return self.log_path.read_text()[-6000:]


def read_back(name: str, out) -> tuple[dict, dict]:
  """MaxText's client's jobs on the export `name` at `out`: its safetensors read back
  (`read_hf`, result `read_{name}`) and its config.json through AutoConfig (`auto_{name}`)."""
  return ({'id': f'read_{name}', 'job': 'read_hf', 'path': str(out)},
          {'id': f'auto_{name}', 'job': 'auto_config', 'path': str(out)})

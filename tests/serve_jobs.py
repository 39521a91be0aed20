"""The worker side of the client workers: jobs read as JSON, each answered, none fatal.

Imported by `tests/maxtext_client.py` and `tests/tunix_client.py`, which run in
the clients' own environments (only the standard library is used here).

  python WORKER --serve --reply-fd FD     jobs on stdin, one JSON result per line on FD
  python WORKER REQUEST.json [OUT.json]   {"out_dir": ..., "jobs": [...]}, results as a list
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from collections.abc import Callable, Mapping
from typing import Any

Job = Callable[[dict[str, Any], str], dict[str, Any]]


def _chain(e: BaseException | None) -> list[str]:
  out, seen = [], set()
  while e is not None and id(e) not in seen:
    seen.add(id(e))
    out.append(f'{type(e).__name__}: {e}')
    e = e.__cause__ or e.__context__
  return out


def run_job(jobs: Mapping[str, Job], job: dict[str, Any], out_dir: str, name: str) -> dict[str, Any]:
  """One job's result: what it returned, or its error (the next job still runs)."""
  t = time.time()
  result = {'id': job['id'], 'job': job['job']}
  try:
    result.update(jobs[job['job']](job, out_dir))
    result['ok'] = True
  except Exception as e:  # noqa: BLE001 - reported to the test
    first = str(e).strip().splitlines()[0] if str(e).strip() else ''
    result.update(ok=False, error=f'{type(e).__name__}: {first}', error_chain=_chain(e),
                  traceback=traceback.format_exc())
  result['seconds'] = round(time.time() - t, 3)
  print(f"[{name}] {job['id']} ({job['job']}): "
        f"{'ok' if result['ok'] else result['error']} in {result['seconds']} s",
        file=sys.stderr, flush=True)
  return result


def main(argv: list[str], jobs: Mapping[str, Job], name: str, ready: Mapping[str, Any]) -> int:
  """Serves jobs (see the module docstring); `ready` goes in the first reply."""
  if argv and argv[0] == '--serve':
    fd = int(argv[argv.index('--reply-fd') + 1])
    with os.fdopen(fd, 'w') as reply:
      reply.write(json.dumps({'id': '__ready__', 'ok': True, **ready}) + '\n')
      reply.flush()
      for line in sys.stdin:
        if not line.strip():
          continue
        job = json.loads(line)
        os.makedirs(job['out_dir'], exist_ok=True)
        reply.write(json.dumps(run_job(jobs, job, job['out_dir'], name)) + '\n')
        reply.flush()
    return 0
  with open(argv[0]) if argv and argv[0] != '-' else sys.stdin as f:
    request = json.loads(f.read())
  os.makedirs(request['out_dir'], exist_ok=True)
  results = [run_job(jobs, job, request['out_dir'], name) for job in request['jobs']]
  text = json.dumps(results, indent=1)
  if len(argv) > 1:
    with open(argv[1], 'w') as f:
      f.write(text)
  else:  # The clients print to stdout too: the results follow a marker line.
    print(f'=== {name} results ===\n{text}', flush=True)
  return 0

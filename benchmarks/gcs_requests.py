"""Storage requests on gs:// as the leaf count grows, counted at a GCS emulator.

For each leaf count, a Tunix-shaped step (`model_params` and `optimizer_state`,
every leaf under nnx's `value` level) is saved by Orbax straight into a bucket
of a local fake-gcs-server; then the requests it serves are counted for
`detect`, `orbax-tunix inspect`, the planning of a full restore into a target
(everything before Orbax's read of the arrays), the whole restore, and plain
Orbax's restore of the same step for comparison. The restores go to the first of
`--devices N` of JAX's devices (the backend JAX_PLATFORMS picks; `harness.py`).

  python benchmarks/gcs_requests.py [--leaves 100,1000,10000]
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / 'benchmarks'))

import harness  # noqa: E402  (a sibling module)

from tests import gcs as gcs_lib  # noqa: E402

URL = f'http://127.0.0.1:{gcs_lib.free_port()}'
os.environ.update(gcs_lib.environment(URL))  # Before the clients are imported.

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from etils import epath  # noqa: E402

import orbax_tunix as ot  # noqa: E402
from orbax_tunix import cli  # noqa: E402
from orbax_tunix.reading import planned_item  # noqa: E402


class _BeforeTheRead(Exception):
  pass


def _count(emulator: gcs_lib.Emulator, call) -> int:
  time.sleep(0.3)  # The emulator logs a request after answering it.
  before = emulator.requests()
  call()
  time.sleep(0.3)
  return emulator.requests() - before


def _state(leaves: int) -> dict:
  half = leaves // 2
  weights = {f'layer{i}': {'w': {'value': np.full((16,), i, np.float32)}} for i in range(half)}
  opt = {'opt_state': {'0': {'mu': weights}}, 'step': {'value': np.uint32(7)}}
  return {'model_params': weights, 'optimizer_state': opt}


def _target(state: dict) -> dict:
  def strip(node):
    if isinstance(node, dict) and set(node) == {'value'}:
      v = node['value']
      return jax.ShapeDtypeStruct(np.shape(v), jnp.asarray(v).dtype)
    return {k: strip(c) for k, c in node.items()}

  return strip(state)


def measure(emulator: gcs_lib.Emulator, bucket: epath.Path, leaves: int) -> dict[str, int]:
  state = _state(leaves)
  step_dir = bucket / f'run{leaves}' / '1'
  with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckptr:
    ckptr.save(step_dir, args=ocp.args.Composite(
        **{k: ocp.args.PyTreeSave(v) for k, v in state.items()}))
  target = _target(state)
  args = ocp.args.Composite(**{k: ocp.args.PyTreeRestore(item=v) for k, v in target.items()})

  def restore():
    ocp.Checkpointer(ot.TunixAwareHandler()).restore(step_dir, args=args)

  def plan():
    original = planned_item.PlannedItem._orbax_read  # pylint: disable=protected-access

    def stop(*a, **k):
      raise _BeforeTheRead

    planned_item.PlannedItem._orbax_read = stop  # pylint: disable=protected-access
    try:
      restore()
    except _BeforeTheRead:
      pass
    finally:
      planned_item.PlannedItem._orbax_read = original  # pylint: disable=protected-access

  def plain():
    ocp.Checkpointer(ocp.CompositeCheckpointHandler()).restore(step_dir, args=ocp.args.Composite(
        **{k: ocp.args.PyTreeRestore() for k in state}))

  n = sum(len(jax.tree.leaves(v)) for v in state.values())
  return {
      'leaves': n,
      'detect': _count(emulator, lambda: ot.detect(step_dir.parent)),
      'inspect': _count(emulator, lambda: cli.main(['inspect', str(step_dir.parent), '--json'])),
      'planning': _count(emulator, plan),
      'restore': _count(emulator, restore),
      'plain Orbax restore': _count(emulator, plain),
  }


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--leaves', default='100,1000,10000')
  harness.add_flags(parser, cpu_default=1)
  args = parser.parse_args(argv)
  devices = harness.use_devices(args.devices, cpu_default=1)
  emulator = gcs_lib.Emulator(URL)
  emulator.start()
  rows = []
  try:
    bucket = epath.Path(emulator.bucket())
    with open(os.devnull, 'w') as devnull:
      for leaves in (int(x) for x in args.leaves.split(',')):
        stdout, sys.stdout = sys.stdout, devnull  # inspect's own output
        try:
          rows.append(measure(emulator, bucket, leaves))
        finally:
          sys.stdout = stdout
        print(rows[-1], flush=True)
  finally:
    emulator.stop()
  keys = list(rows[0])
  print(f'\nCommand: `python benchmarks/gcs_requests.py --leaves {args.leaves}'
        + (f' --devices {args.devices}`' if args.devices else '`')
        + f' on {harness.describe_line(harness.describe(devices))}\n')
  print('| ' + ' | '.join(keys) + ' |')
  print('|' + '---|' * len(keys))
  for row in rows:
    print('| ' + ' | '.join(str(row[k]) for k in keys) + ' |')


if __name__ == '__main__':
  main()

"""One JAX process of the multi-process restore test (`tests/test_multiprocess.py`).

The test runs this script twice, as process 0 and 1 of one `jax.distributed`
job over localhost, each process with 4 simulated CPU devices::

  python tests/mp_worker.py --port P --process-id I --ckpt STEP_DIR --out DIR \\
      --mode {tunix_aware,maxtext}

Each process builds the (4, 2) ('data', 'model') mesh over the 8 global
devices, restores the step with a sharded canonical target through the chosen
mode, checks every array against its target, measures the bytes it read, and
writes `DIR/process_I.npz` (the raw bytes of every local shard) and
`DIR/process_I.json` (per leaf: sharding, dtype, and each shard's device,
replica id and index; plus the byte counts). The test assembles both
processes' shards and compares them with a single-process restore.

The module is importable too (the test computes its single-process reference
with the same `MODES`); only run as a script does it set up its own devices.

Exit status: 0 when every check passed, `EXIT_NO_DISTRIBUTED` when
`jax.distributed` could not initialize, anything else on a failure (with a
traceback on stderr).
"""

from __future__ import annotations

import os
import re

LOCAL_DEVICES = 4
NUM_PROCESSES = 2
MESH_SHAPE = (4, 2)
MESH_AXES = ('data', 'model')
EXIT_NO_DISTRIBUTED = 3


def xla_flags(flags: str, device_count: int) -> str:
  """`flags` with the simulated CPU device count replaced by `device_count`."""
  kept = re.sub(r'--xla_force_host_platform_device_count=\S*', '', flags).split()
  return ' '.join([*kept, f'--xla_force_host_platform_device_count={device_count}'])


# As a script this process owns its JAX runtime, and XLA reads the device count
# once, when jax is first imported: it must be set above the imports below.
# Imported by the test, jax is already set up (conftest: 8 devices) and the
# environment is left alone.
if __name__ == '__main__':
  os.environ['XLA_FLAGS'] = xla_flags(os.environ.get('XLA_FLAGS', ''), LOCAL_DEVICES)
  os.environ['JAX_PLATFORMS'] = 'cpu'

import argparse  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
import sys  # noqa: E402
import traceback  # noqa: E402
from collections.abc import Callable  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from etils import epath  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import orbax_tunix  # noqa: E402
from orbax_tunix.keypaths import flatten, fmt  # noqa: E402

ITEMS = ('model_params', 'optimizer_state')
# shape -> the sharding of a target leaf of that shape.
ShardingFor = Callable[[tuple[int, ...]], NamedSharding]
# A restore mode: (step dir, sharding rule) -> (restored tree, target tree),
# two trees of one structure whose leaves pair up.
Mode = Callable[[epath.Path, ShardingFor], tuple[Any, Any]]


def make_mesh() -> Mesh:
  """The (4, 2) mesh over every global device, in `jax.devices()` order.

  Built by hand rather than with `jax.make_mesh`, so the device order (and
  with two processes, which rows each process owns: process 0 rows 0-1) is
  the same in the workers and in the single-process reference.
  """
  devices = np.asarray(jax.devices())
  assert devices.size == np.prod(MESH_SHAPE), f'expected 8 devices, found {devices.size}'
  return Mesh(devices.reshape(MESH_SHAPE), MESH_AXES)


def sharded(mesh: Mesh) -> ShardingFor:
  """Splits every array's first dimension over 'data' and its second over 'model'.

  With the mesh rows split between the processes, each process owns half of
  every non-scalar array; the checkpoint is saved with this same rule, so its
  chunks never straddle two processes' shards.
  """

  def sharding_for(shape: tuple[int, ...]) -> NamedSharding:
    return NamedSharding(mesh, P(*MESH_AXES[: len(shape)]))

  return sharding_for


def replicated(mesh: Mesh) -> ShardingFor:
  """Every array whole on every device: the baseline read of everything."""
  return lambda shape: NamedSharding(mesh, P())


def canonical_target(item_dir: epath.Path, sharding_for: ShardingFor) -> Any:
  """The item's canonical tree as abstract arrays, from metadata only."""
  tree = orbax_tunix.TunixPyTreeHandler().metadata(item_dir).tree
  return jax.tree.map(
      lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=sharding_for(tuple(m.shape))),
      tree,
  )


def restore_tunix_aware(step_dir: epath.Path, sharding_for: ShardingFor) -> tuple[Any, Any]:
  """Both items, canonical, through `TunixAwareHandler` (the documented path)."""
  targets = {item: canonical_target(step_dir / item, sharding_for) for item in ITEMS}
  with ocp.Checkpointer(orbax_tunix.TunixAwareHandler()) as ckptr:
    restored = ckptr.restore(
        step_dir,
        args=ocp.args.Composite(
            **{item: ocp.args.PyTreeRestore(item=t) for item, t in targets.items()}
        ),
    )
  return {item: restored[item] for item in ITEMS}, targets


def restore_maxtext(step_dir: epath.Path, sharding_for: ShardingFor) -> tuple[Any, Any]:
  """The step as MaxText's train state, through `maxtext.restore_train_state`.

  The abstract state is built as MaxText builds it: its weights under the
  Linen `params` collection, `opt_state` from `jax.eval_shape` of the
  optimizer's `init` (the test saved with `optax.adamw`), an int32 `step`.
  """
  # Imported here, so that the TunixAwareHandler mode does not depend on it.
  import optax

  from orbax_tunix import maxtext

  def shard(leaf: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding_for(tuple(leaf.shape)))

  params = {'params': canonical_target(step_dir / 'model_params', sharding_for)}
  target = {
      'params': params,
      'opt_state': jax.tree.map(shard, jax.eval_shape(optax.adamw(1e-3).init, params)),
      'step': shard(jax.ShapeDtypeStruct((), np.int32)),
  }
  return maxtext.restore_train_state(step_dir, target), target


MODES: dict[str, Mode] = {
    'tunix_aware': restore_tunix_aware,
    'maxtext': restore_maxtext,
}


def rchar() -> int | None:
  """Bytes this process has passed through read()/pread() so far, or None.

  Page-cache hits count too (unlike `read_bytes`), so it measures what
  tensorstore asked for, not what the disk delivered. Linux only.
  """
  try:
    text = pathlib.Path('/proc/self/io').read_text()
  except OSError:
    return None
  match = re.search(r'^rchar:\s*(\d+)', text, re.M)
  return int(match.group(1)) if match else None


def measured(mode: Mode, step_dir: epath.Path, sharding_for: ShardingFor) -> tuple[Any, Any, int | None]:
  """Runs one restore; returns (restored, target, bytes read or None)."""
  before = rchar()
  restored, target = mode(step_dir, sharding_for)
  after = rchar()
  return restored, target, None if before is None or after is None else after - before


def check_leaf(path: str, arr: Any, target: jax.ShapeDtypeStruct) -> None:
  """Raises AssertionError unless `arr` is what `target` asked for, held locally."""
  assert isinstance(arr, jax.Array), f'{path}: expected a jax.Array, got {type(arr)}'
  assert arr.shape == target.shape, f'{path}: shape {arr.shape}, target {target.shape}'
  assert arr.dtype == target.dtype, f'{path}: dtype {arr.dtype}, target {target.dtype}'
  assert arr.sharding == target.sharding, (
      f'{path}: sharding {arr.sharding}, target {target.sharding}'
  )
  local = set(jax.local_devices())
  held = [s.device for s in arr.addressable_shards]
  assert len(held) == len(local) and set(held) == local, (
      f'{path}: shards held on {sorted(d.id for d in held)}, local devices'
      f' {sorted(d.id for d in local)}'
  )


def index_json(index: tuple[slice, ...], shape: tuple[int, ...]) -> list[list[int]]:
  return [list(s.indices(n)[:2]) for s, n in zip(index, shape, strict=True)]


def dump_shards(restored: Any, target: Any, out: pathlib.Path, process_id: int, extra: dict) -> int:
  """Writes every local shard to `out/process_I.{npz,json}`; returns the leaf count.

  Shard data is stored as raw bytes (dtype in the JSON), since `.npz` cannot
  hold bfloat16.
  """
  pairs, _ = flatten(restored)
  targets = dict(flatten(target)[0])
  arrays: dict[str, np.ndarray] = {}
  leaves = []
  for path, arr in pairs:
    check_leaf(fmt(path), arr, targets[path])
    shards = []
    for shard in arr.addressable_shards:
      key = f's{len(arrays)}'
      arrays[key] = np.ascontiguousarray(np.asarray(shard.data)).reshape(-1).view(np.uint8)
      shards.append({
          'key': key,
          'device': shard.device.id,
          'process': shard.device.process_index,
          'replica_id': shard.replica_id,
          'index': index_json(shard.index, arr.shape),
      })
    leaves.append({
        'path': fmt(path),
        'shape': list(arr.shape),
        'dtype': str(arr.dtype),
        'spec': str(arr.sharding.spec),
        'nbytes': arr.nbytes,
        'shards': shards,
    })
  np.savez(out / f'process_{process_id}.npz', **arrays)
  report = {
      'process_id': process_id,
      'process_index': jax.process_index(),
      'process_count': jax.process_count(),
      'device_count': jax.device_count(),
      'local_devices': sorted(d.id for d in jax.local_devices()),
      'leaves': leaves,
      **extra,
  }
  (out / f'process_{process_id}.json').write_text(json.dumps(report, indent=1))
  return len(leaves)


def initialize(port: int, process_id: int) -> None:
  """Joins the 2-process job; exits with `EXIT_NO_DISTRIBUTED` if it cannot."""
  try:
    # CPU collectives (the barriers Orbax runs) need gloo across processes.
    jax.config.update('jax_cpu_collectives_implementation', 'gloo')
    # Bounded waits: a peer that never comes (or dies) must fail this process
    # well inside the test's own timeout, not after jax's 5-minute default.
    jax.distributed.initialize(
        f'localhost:{port}',
        num_processes=NUM_PROCESSES,
        process_id=process_id,
        initialization_timeout=60,
        shutdown_timeout_seconds=30,
    )
    assert jax.process_count() == NUM_PROCESSES, jax.process_count()
    assert jax.local_device_count() == LOCAL_DEVICES, jax.local_device_count()
  except Exception:  # noqa: BLE001 - every init failure means the same thing here.
    print('jax.distributed could not initialize:', file=sys.stderr)
    traceback.print_exc()
    sys.stderr.flush()
    os._exit(EXIT_NO_DISTRIBUTED)


def run(args: argparse.Namespace) -> None:
  initialize(args.port, args.process_id)
  mesh = make_mesh()
  step_dir = epath.Path(args.ckpt)
  mode = MODES[args.mode]
  # The first restore in a process imports code lazily (~0.8 MB of modules,
  # which rchar counts as reads): a warm-up keeps that out of the measurement.
  # Tensorstore keeps no chunk cache here, so the warm-up leaves nothing for
  # the measured restores to reuse (the replicated one still reads it all).
  _, _, read_warm_up = measured(mode, step_dir, sharded(mesh))
  restored, target, read_sharded = measured(mode, step_dir, sharded(mesh))
  # The baseline runs last: anything it found cached would only make it read
  # less, so comparing against it is conservative.
  _, _, read_everything = measured(mode, step_dir, replicated(mesh))
  out = pathlib.Path(args.out)
  n = dump_shards(
      restored,
      target,
      out,
      args.process_id,
      {
          'mode': args.mode,
          'rchar_warm_up': read_warm_up,
          'rchar_sharded': read_sharded,
          'rchar_replicated': read_everything,
      },
  )
  print(
      f'process {args.process_id}: {n} leaves ok; read {read_sharded} bytes sharded,'
      f' {read_everything} replicated',
      file=sys.stderr,
  )
  jax.distributed.shutdown()


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--port', type=int, required=True)
  parser.add_argument('--process-id', type=int, required=True, choices=range(NUM_PROCESSES))
  parser.add_argument('--ckpt', required=True, help='the step directory')
  parser.add_argument('--out', required=True, help='directory for process_I.{npz,json}')
  parser.add_argument('--mode', default='tunix_aware', choices=sorted(MODES))
  args = parser.parse_args(argv)
  try:
    run(args)
  except BaseException:  # noqa: BLE001
    traceback.print_exc()
    sys.stderr.flush()
    # Skip jax's atexit shutdown: it is a barrier with the peer, which may be
    # gone or stuck; exiting now lets the test report this traceback at once.
    os._exit(1)


if __name__ == '__main__':
  main()

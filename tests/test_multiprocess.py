"""Two JAX processes restore one sharded Tunix checkpoint, as a TPU pod does.

The test process (8 devices, see conftest) writes a Tunix step whose arrays
are sharded over a (4, 2) mesh, so its chunks are the shards. Two workers
(`tests/mp_worker.py`, 4 CPU devices each) then join one `jax.distributed`
job over localhost, build the (4, 2) mesh over the 8 global devices (process
0 owns mesh rows 0-1, process 1 rows 2-3) and restore the step with a sharded
target, in each mode: `tunix_aware` (both items, canonical, through
`TunixAwareHandler`) and `maxtext` (MaxText's train state, through
`maxtext.restore_train_state`). The tests below check, from what the workers
wrote:

- each process holds only its own devices' shards: exactly half of every
  array, the two halves disjoint;
- the shards of both processes, assembled, equal a single-process restore
  (and the values written);
- each process read about half of the checkpoint's bytes (`/proc/self/io`),
  against a baseline restore in the same process that reads everything.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from etils import epath
from flax import nnx

import orbax_tunix
from orbax_tunix.keypaths import flatten, fmt
from tests import builders, mp_worker

WORKER = pathlib.Path(__file__).with_name('mp_worker.py')
# Both workers together; a healthy run takes well under 30 s on 2 cores.
TIMEOUT_S = 120
# The restore paths the workers exercise (keys of `mp_worker.MODES`).
MODES = ('tunix_aware', 'maxtext')
# A process that reads only its half must stay clearly below a full read.
MAX_READ_FRACTION = 0.75


class Wide(nnx.Module):
  """Two layers big enough (~0.6 MB of weights) that array data dominates I/O."""

  def __init__(self, rngs: nnx.Rngs):
    self.layers = nnx.List([
        nnx.Linear(256, 512, rngs=rngs),
        nnx.Linear(512, 128, rngs=rngs, param_dtype=jnp.bfloat16),
    ])


def write_checkpoint(root: pathlib.Path) -> tuple[pathlib.Path, dict[str, np.ndarray]]:
  """Saves one Tunix step (weights and adamw state) sharded as the workers shard.

  Every array gets seeded random values: every element differs (a misplaced
  shard shows), and chunks do not compress away (byte counts stay meaningful).

  Returns:
    (step dir, {'item/canonical/path': the value written}).
  """
  model = Wide(nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
  sharding_for = mp_worker.sharded(mp_worker.make_mesh())
  rng = np.random.default_rng(0)

  def fill(x: jax.Array) -> jax.Array:
    if jnp.issubdtype(x.dtype, jnp.floating):
      value = rng.standard_normal(x.shape).astype(x.dtype)
    else:
      value = np.full(x.shape, 7, x.dtype)  # count, step
    return jax.device_put(value, sharding_for(x.shape))

  nnx.update(model, jax.tree.map(fill, nnx.state(model)))
  nnx.update(optimizer, jax.tree.map(fill, nnx.state(optimizer, nnx.optimizer.OptState)))
  step_dir = builders.save_tunix(root, 1, model, optimizer)
  truth = {}
  for item, state in (
      ('model_params', nnx.state(model)),
      ('optimizer_state', nnx.state(optimizer, nnx.optimizer.OptState)),
  ):
    for path, leaf in flatten(state)[0]:
      assert path[-1] == 'value', path  # Tunix layout: canonical drops it.
      truth[fmt((item, *path[:-1]))] = np.asarray(leaf)
  return step_dir, truth


def free_port() -> int:
  with socket.socket() as s:
    s.bind(('localhost', 0))
    return s.getsockname()[1]


def launch(step_dir: pathlib.Path, out: pathlib.Path, mode: str) -> None:
  """Runs both workers to completion, or fails (or skips) the test.

  Skips only when both workers report that `jax.distributed` cannot
  initialize, twice (a fresh port the second time, in case another program
  took the first). Any other failure, or the time limit, fails with both
  workers' output.
  """
  env = dict(
      os.environ,
      XLA_FLAGS=mp_worker.xla_flags(os.environ.get('XLA_FLAGS', ''), mp_worker.LOCAL_DEVICES),
      JAX_PLATFORMS='cpu',
  )
  for attempt in range(2):
    port = free_port()
    logs = [out / f'worker_{i}.log' for i in range(mp_worker.NUM_PROCESSES)]
    procs: list[subprocess.Popen] = []
    timed_out = False
    try:
      for i, log in enumerate(logs):
        with log.open('w') as f:
          procs.append(subprocess.Popen(
              [sys.executable, str(WORKER), '--port', str(port), '--process-id', str(i),
               '--ckpt', str(step_dir), '--out', str(out), '--mode', mode],
              env=env, cwd=out, stdout=f, stderr=subprocess.STDOUT,
              # Its own process group, so a timeout kills it and anything it spawned.
              start_new_session=True,
          ))
      deadline = time.monotonic() + TIMEOUT_S
      for p in procs:
        p.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
      timed_out = True
    finally:
      for p in procs:
        if p.poll() is None:
          os.killpg(p.pid, signal.SIGKILL)
          p.wait()
    output = '\n'.join(
        f'--- worker {i} (exit {p.returncode}) ---\n{log.read_text()[-6000:]}'
        for i, (p, log) in enumerate(zip(procs, logs, strict=True))
    )
    if timed_out:
      pytest.fail(f'workers still running after {TIMEOUT_S} s; killed.\n{output}')
    codes = [p.returncode for p in procs]
    if codes == [0] * len(procs):
      return
    if codes == [mp_worker.EXIT_NO_DISTRIBUTED] * len(procs):
      if attempt == 0:
        continue
      pytest.skip(f'jax.distributed cannot initialize on this machine:\n{output}')
    pytest.fail(f'a worker failed (exit codes {codes}).\n{output}')


@dataclasses.dataclass(frozen=True)
class Leaf:
  """One array as a worker reported it, its local shards read back."""

  path: str
  shape: tuple[int, ...]
  dtype: np.dtype
  spec: str
  # (device id, owning process, replica id, index, data) per local shard.
  shards: list[tuple[int, int, int, tuple[slice, ...], np.ndarray]]


def read_worker(out: pathlib.Path, process_id: int) -> tuple[dict[str, Any], dict[str, Leaf]]:
  """A worker's JSON report and its leaves, by canonical path."""
  report = json.loads((out / f'process_{process_id}.json').read_text())
  leaves = {}
  with np.load(out / f'process_{process_id}.npz') as npz:
    for entry in report['leaves']:
      dtype = np.dtype(jnp.dtype(entry['dtype']))
      shards = []
      for s in entry['shards']:
        index = tuple(slice(a, b) for a, b in s['index'])
        shape = tuple(b - a for a, b in s['index'])
        data = npz[s['key']].view(dtype).reshape(shape)
        shards.append((s['device'], s['process'], s['replica_id'], index, data))
      leaves[entry['path']] = Leaf(
          entry['path'], tuple(entry['shape']), dtype, entry['spec'], shards
      )
  return report, leaves


@dataclasses.dataclass(frozen=True)
class Run:
  """Both workers' results for one mode, and the single-process reference."""

  mode: str
  step_dir: pathlib.Path
  reports: list[dict[str, Any]]
  leaves: list[dict[str, Leaf]]
  reference: dict[str, np.ndarray]
  reference_specs: dict[str, str]


@pytest.fixture(scope='module')
def checkpoint(tmp_path_factory) -> tuple[pathlib.Path, dict[str, np.ndarray]]:
  assert jax.device_count() == 8, 'conftest must give the test process 8 devices'
  return write_checkpoint(tmp_path_factory.mktemp('mp_ckpt'))


@pytest.fixture(scope='module', params=MODES)
def run(request, checkpoint, tmp_path_factory) -> Run:
  mode = request.param
  step_dir, _ = checkpoint
  out = tmp_path_factory.mktemp(f'mp_{mode}')
  launch(step_dir, out, mode)
  reports, leaves = zip(*(read_worker(out, i) for i in range(mp_worker.NUM_PROCESSES)), strict=True)
  # The single-process restore: same mode, same mesh shape and sharding rule,
  # all 8 devices in this one process.
  restored, _ = mp_worker.MODES[mode](epath.Path(step_dir), mp_worker.sharded(mp_worker.make_mesh()))
  pairs = flatten(restored)[0]
  return Run(
      mode=mode,
      step_dir=step_dir,
      reports=list(reports),
      leaves=list(leaves),
      reference={fmt(p): np.asarray(a) for p, a in pairs},
      reference_specs={fmt(p): str(a.sharding.spec) for p, a in pairs},
  )


def region(leaf: Leaf) -> np.ndarray:
  """Boolean mask of the elements a process holds."""
  mask = np.zeros(leaf.shape, bool)
  for *_, index, _ in leaf.shards:
    mask[index] = True
  return mask


def test_workers_form_one_job(run: Run):
  for i, report in enumerate(run.reports):
    assert report['mode'] == run.mode
    assert report['process_index'] == i
    assert report['process_count'] == 2
    assert report['device_count'] == 8
    assert len(report['local_devices']) == mp_worker.LOCAL_DEVICES
  assert not set(run.reports[0]['local_devices']) & set(run.reports[1]['local_devices'])


def test_each_process_holds_only_its_own_shards(run: Run):
  assert run.leaves[0].keys() == run.leaves[1].keys() == run.reference.keys()
  for path in run.reference:
    mine, theirs = run.leaves[0][path], run.leaves[1][path]
    for i, leaf in enumerate((mine, theirs)):
      devices = [d for d, *_ in leaf.shards]
      assert sorted(devices) == run.reports[i]['local_devices'], path
      assert {p for _, p, *_ in leaf.shards} == {i}, path
    if not mine.shape:
      continue  # Scalars (count, step) are replicated: both hold them whole.
    # Each process holds exactly its half (its mesh rows); together, all.
    masks = [region(mine), region(theirs)]
    for mask in masks:
      assert mask.sum() * 2 == mask.size, f'{path}: a process holds {mask.mean():.0%}'
    assert not (masks[0] & masks[1]).any(), f'{path}: both processes hold some elements'
    assert (masks[0] | masks[1]).all(), path


def test_assembled_values_equal_single_process_restore(run: Run):
  for path, expected in run.reference.items():
    full = np.zeros(expected.shape, expected.dtype)
    for leaves in run.leaves:
      leaf = leaves[path]
      assert (leaf.shape, leaf.dtype) == (expected.shape, expected.dtype), path
      assert leaf.spec == run.reference_specs[path], path
      for *_, index, data in leaf.shards:
        full[index] = data
    np.testing.assert_array_equal(full, expected, err_msg=path, strict=True)


def maxtext_path(path: str) -> str:
  """A canonical Tunix leaf ('item/...') -> its place in MaxText's train state."""
  item, _, rest = path.partition('/')
  if item == 'model_params':
    return f'params/params/{rest}'
  if rest == 'step':
    return 'step'
  # opt_state/<chain position>/{count, mu/<weights>, nu/<weights>}
  parts = rest.split('/')
  if parts[3:]:
    parts.insert(3, 'params')  # mu and nu mirror MaxText's params tree.
  return '/'.join(parts)


# Where each written leaf ('item/canonical/path') lands in each mode's result.
WRITTEN_PATH = {'tunix_aware': lambda path: path, 'maxtext': maxtext_path}


def test_single_process_reference_is_what_was_written(run: Run, checkpoint):
  _, truth = checkpoint
  expected = {WRITTEN_PATH[run.mode](p): v for p, v in truth.items()}
  assert run.reference.keys() == expected.keys()
  for path, value in expected.items():
    # MaxText's step is int32 where Tunix wrote uint32; values are exact.
    np.testing.assert_array_equal(
        run.reference[path], value.astype(run.reference[path].dtype), err_msg=path, strict=True
    )


def data_bytes(step_dir: pathlib.Path) -> int:
  """Bytes of array data on disk: the OCDBT data files (`d/`) of every item."""
  return sum(f.stat().st_size for f in step_dir.rglob('*') if f.is_file() and f.parent.name == 'd')


def test_each_process_reads_only_its_own_shards(run: Run):
  if not sys.platform.startswith('linux'):
    pytest.skip('bytes read are measured with /proc/self/io')
  # Precondition: no chunk straddles the two processes' halves (row 0 to
  # shape[0] / 2 and the rest), else a process must read some of the other's.
  for item in mp_worker.ITEMS:
    meta = orbax_tunix.TunixPyTreeHandler().metadata(epath.Path(run.step_dir / item)).tree
    for path, m in flatten(meta)[0]:
      if m.shape:
        chunk = m.storage.chunk_shape
        assert (m.shape[0] // 2) % chunk[0] == 0, f'{fmt(path)}: chunk {chunk}'
  on_disk = data_bytes(run.step_dir)
  for report in run.reports:
    sharded, everything = report['rchar_sharded'], report['rchar_replicated']
    assert sharded is not None and everything is not None, 'no /proc/self/io'
    detail = (
        f"process {report['process_id']}: read {sharded} B for its shards,"
        f' {everything} B for everything; {on_disk} B of array data on disk'
    )
    # The measurement sees tensorstore's reads: reading everything reads at
    # least the data files once.
    assert everything >= 0.9 * on_disk, detail
    # Its own half (about 0.5 of the data, plus a little metadata): clearly
    # less than everything.
    assert sharded < MAX_READ_FRACTION * on_disk, detail
    assert sharded < MAX_READ_FRACTION * everything, detail

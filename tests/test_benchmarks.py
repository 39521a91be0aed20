"""The benchmarks keep running where CI runs them, on the CPU, as on any JAX backend.

`restore_cost.py` end to end on one device of a host without I/O counters (the
counters switched off as `harness.py` lets one): the checkpoints are written on
8 devices, so the naive contender restores onto another topology, as on a
one-chip TPU; and the harness's meshes and shardings on device counts that the
synthetic model's dimensions do not divide.
"""

import json
import os
import pathlib
import subprocess
import sys

import jax
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / 'benchmarks'
sys.path.insert(0, str(BENCHMARKS))

import harness  # noqa: E402
import synthetic  # noqa: E402


def test_restore_cost_reaches_its_ratio_table_on_one_device_without_io_counters(tmp_path):
  # The smallest run that still writes both checkpoints (on 8 devices) and restores a, b
  # and d in fresh processes on one, each with a warm call after its first.
  env = {**os.environ, 'BENCH_NO_COUNTERS': 'io',
         'PYTHONPATH': os.pathsep.join(filter(None, [str(ROOT), os.environ.get('PYTHONPATH')]))}
  out = tmp_path / 'figures.json'
  done = subprocess.run(
      [sys.executable, str(BENCHMARKS / 'restore_cost.py'), '--quick', '--devices', '1',
       '--contenders', 'abd', '--reps', '1', '--warm', '1', '--no-verify', '--scan-leaves', '',
       '--memory-check-gb', '0', '--size-mb', '2', '--leaves', '40',
       '--workdir', str(tmp_path / 'work'), '--json', str(out)],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False)
  assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
  for ratio in ('b/a', 'd/b'):
    for calls in ('first', 'warm'):
      assert f'| {ratio} | {calls} |' in done.stdout, done.stdout[-3000:]
  results = json.loads(out.read_text())['compare']['results']
  for name in 'abd':
    (run,) = results[name]
    assert 'error' not in run, run
    assert run['devices'] == {**run['devices'], 'backend': 'cpu', 'devices': 1,
                              'mesh': {'data': 1, 'model': 1}}
    assert run['rchar'] is None and run['read_bytes'] is None  # switched off: n/a, no KeyError
    assert len(run['warm']) == 1 and run['warm'][0]['wall_s'] > 0
    assert run['device_peak_bytes'] is None  # the CPU backend reports no memory_stats()
  assert '| a | plain Orbax, canonical copy (floor) | 1 |' in done.stdout
  assert 'n/a / ' in done.stdout  # the bytes read: n/a against the bytes on disk


@pytest.mark.parametrize('count', [1, 3, 5, 6, 8])
def test_synthetic_target_shards_over_any_device_count(count):
  mesh = harness.make_mesh(jax.devices()[:count])
  assert mesh.devices.size == count
  shape = synthetic.Shape(layers=1, d_model=16)  # dims 16, 64, 128: 3 and 5 divide none
  target = synthetic.target(shape, mesh)
  for leaf in jax.tree.leaves(target):
    leaf.sharding.shard_shape(leaf.shape)  # JAX's own check: raises on an uneven split
    assert leaf.sharding.mesh.devices.size == count
  if count == 8:  # (4, 2) divides every dimension: the specs as the model writes them
    for path, _, spec in shape.weights():
      leaf = target[synthetic.MODEL_ITEM]
      for key in path:
        leaf = leaf[key]
      assert leaf.sharding.spec == jax.sharding.PartitionSpec(*spec), path


@pytest.mark.parametrize('chunks', ['whole', 'layer', 'expert'])
def test_export_maxtext_writes_a_moe_step_the_export_takes(tmp_path, chunks):
  """`export_maxtext.py --model qwen3_moe` (its MaxText side runs in the MaxText venv, not
  here): the step it writes is a scanned qwen3 MoE the export takes whole, one tensor per
  expert, layer and projection; its sizes (model, largest array, largest chunk) are the
  arrays' and the chunks' it asked Orbax for."""
  import math  # noqa: PLC0415

  import export_maxtext  # noqa: PLC0415

  from orbax_tunix.tools import export  # noqa: PLC0415

  layers, dim, experts, moe_mlp = 2, 64, 4, 16
  step = export_maxtext.write_checkpoint(tmp_path / 'src', layers, dim, chunks, 'qwen3_moe',
                                         experts, moe_mlp)
  shapes = export_maxtext.shapes(layers, dim, 'qwen3_moe', experts, moe_mlp)
  sizes = {p: 4 * math.prod(s) for p, s in shapes.items()}
  model, largest, chunk = export_maxtext.stored_sizes(step)
  assert (model, largest) == (sum(sizes.values()), max(sizes.values()))
  stack = sizes['decoder/layers/moe_block/wi_0']
  embedding = sizes['token_embedder/embedding']
  assert chunk == {'whole': largest, 'layer': max(stack // layers, embedding // 8),
                   'expert': max(sizes['decoder/layers/moe_block/gate/kernel'] // layers,
                                 embedding // 8, stack // experts)}[chunks]
  plan = export.plan_export(tmp_path / 'src', tmp_path / 'out', model='qwen3_moe')
  names = [o.path[0] for o in plan.outputs]
  assert sum('.mlp.experts.' in n for n in names) == 3 * experts * layers
  assert f'weights: MaxText model (scanned, {layers} layers)' in plan.notes


CACHE_CHILD = """
import json, os, pathlib
import jax
where = os.environ.get('JAX_COMPILATION_CACHE_DIR')
before = len(list(pathlib.Path(where).glob('*-cache'))) if where else None
jax.jit(lambda x: x * 3 + 1)(jax.numpy.arange(7.0)).block_until_ready()
print('RESULT ' + json.dumps({'dir': where, 'before': before, 'enabled':
      jax.config.jax_enable_compilation_cache}))
"""


def test_compile_cache_modes_reach_the_children(tmp_path):
  """`--compile-cache`: off (JAX's cache disabled, the commands' default too), cold (a fresh
  empty cache per child, removed after it), warm (one cache, filled by `prime`)."""
  argv = ['-c', CACHE_CHILD]
  off = harness.CompileCache('off', tmp_path).run(argv)
  assert off['enabled'] is False and off['dir'] is None, off
  cold = harness.CompileCache('cold', tmp_path)
  first, second = cold.run(argv), cold.run(argv)
  assert first['before'] == second['before'] == 0 and first['dir'] != second['dir'], first
  assert not pathlib.Path(first['dir']).exists()
  warm = harness.CompileCache('warm', tmp_path)
  warm.prime([argv])
  loaded = warm.run(argv)
  assert loaded['dir'] == str(tmp_path / 'warm') and loaded['before'] >= 1, loaded


def test_copy_threads_checks_both_copies_and_reports_each(capsys):
  """`copy_threads.py` on small odd shapes (a remainder of columns past the last strip):
  both copies checked against numpy's, one row per shape, dtype and thread count."""
  import copy_threads  # noqa: PLC0415

  copy_threads.main(['--shapes', '300x77,64x40', '--dtypes', 'float32,bfloat16,int8',
                     '--threads', '1,2', '--reps', '1'])
  rows = [line for line in capsys.readouterr().out.splitlines()
          if line.startswith('| ') and line[2].isdigit()]
  assert len(rows) == 2 * 3 * 2
  assert all(float(cell) > 0 for row in rows for cell in row.strip('| ').split(' | ')[3:5])


def test_compile_effort_compiles_each_program_at_both_efforts_to_the_same_bits(capsys):
  """`compile_effort.py` on small sizes: one row per size and program, each compiled anew at
  both efforts (JAX's caches defeated: a nonzero compile each), the bits the same."""
  import compile_effort  # noqa: PLC0415

  compile_effort.main(['--sizes', '64,96', '--reps', '1'])
  rows = [line.strip('| ').split(' | ') for line in capsys.readouterr().out.splitlines()
          if line.startswith('| ') and line[2].isdigit()]
  assert [(r[0], r[1]) for r in rows] == [(n, p) for n in ('64', '96')
                                          for p in ('merge', 'qmerge', 'requant')]
  assert all(r[7] == 'yes' and float(r[2].split()[0]) > 0 < float(r[3].split()[0])
             for r in rows), rows

"""XLA's compiler started when a restore begins (`mapping/warmup.py`): on a TPU where no program
is kept, else only when asked; once per process; never on a device the target does not name;
and a restore it precedes computes the same bits. What it saves on a TPU is BENCHMARKS.md §34."""

from __future__ import annotations

import collections
import threading

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import orbax_tunix as ot
from orbax_tunix.keypaths import flatten, nest
from orbax_tunix.mapping import executables, merge, warmup
from orbax_tunix.reading import planned_item
from tests.test_scan_layers import compiled_on_threads

_Device = collections.namedtuple('_Device', 'platform id')


@pytest.fixture
def fresh(monkeypatch):
  """No platform warmed yet in this process; the warm-ups' devices, as compiled."""
  monkeypatch.setattr(warmup, '_DECIDED', set())
  compiled = []
  real = warmup._compile

  def recorded(device):
    compiled.append((device, threading.current_thread().name))
    real(device)
  monkeypatch.setattr(warmup, '_compile', recorded)
  return compiled


def _events(monkeypatch) -> list[str]:
  """'started' each time `warmup.start` starts a thread, in order with what the test adds."""
  events, start = [], warmup.start

  def recorded(target):
    thread = start(target)
    if thread is not None:
      events.append('started')
    return thread
  monkeypatch.setattr(warmup, 'start', recorded)
  return events


def _target(mesh):
  """A nested target whose first leaves name no device."""
  sharded = jax.ShapeDtypeStruct((8, 4), jnp.float32, sharding=NamedSharding(mesh, P('data')))
  return {'a': [np.zeros(3), 7, None], 'b': {'c': ocp.RestoreArgs(), 'd': (sharded,)}}


def test_nothing_starts_on_the_cpu_unless_asked(fresh, mesh, monkeypatch):
  monkeypatch.delenv(warmup.VARIABLE, raising=False)
  assert warmup.start(_target(mesh)) is None
  monkeypatch.setenv(warmup.VARIABLE, '0')
  assert warmup.start(_target(mesh)) is None and fresh == []


def test_asked_for_it_compiles_once_per_process_on_a_device_the_target_names(fresh, mesh,
                                                                            monkeypatch):
  monkeypatch.setenv(warmup.VARIABLE, '1')
  assert warmup.start([np.zeros(3), ocp.RestoreArgs()]) is None  # No device named: none.
  # The walk stops after `_LOOKED_AT` nodes: a large target costs no flattening.
  assert warmup.start({'a': [np.zeros(1)] * warmup._LOOKED_AT, 'b': _target(mesh)}) is None

  def started_and_done():
    thread = warmup.start(_target(mesh))
    thread.join()
    return thread
  thread, heard = compiled_on_threads(monkeypatch, started_and_done)
  first = min(mesh.devices.flat, key=lambda d: d.id)
  assert fresh == [(first, 'orbax_tunix-warm-compiler')]
  assert heard == ['orbax_tunix-warm-compiler'] and not thread.daemon
  assert warmup.start(_target(mesh)) is None and len(fresh) == 1  # Once per process.


def test_on_a_tpu_only_where_no_program_is_kept(fresh, monkeypatch, tmp_path):
  """auto: a TPU's restore warms the compiler while its programs must be compiled (JAX's cache
  off, or on and holding none of this package's); where they are kept, they are loaded, and
  the warm-up would only compete with the read."""
  monkeypatch.delenv(warmup.VARIABLE, raising=False)
  tpu = _Device('tpu', 0)
  monkeypatch.setattr(warmup, '_device', lambda leaves: tpu)
  monkeypatch.setattr(warmup, '_compile', lambda device: fresh.append(device))
  before = (jax.config.jax_enable_compilation_cache, jax.config.jax_compilation_cache_dir)
  try:
    jax.config.update('jax_enable_compilation_cache', False)
    warmup.start([]).join()
    jax.config.update('jax_enable_compilation_cache', True)
    jax.config.update('jax_compilation_cache_dir', str(tmp_path))
    for kept in (False, True):
      warmup._DECIDED.clear()
      if kept:
        executables.directory().mkdir()
        (executables.directory() / ('0' * 64)).write_bytes(b'a kept program')
      assert executables.any_kept() is kept
      thread = warmup.start([])
      assert (thread is None) is kept
      if thread is not None:
        thread.join()
    # Decided once per process: a later restore does not look for kept programs again.
    monkeypatch.setattr(executables, 'any_kept', lambda: pytest.fail('looked again'))
    assert warmup.start([]) is None
  finally:
    jax.config.update('jax_enable_compilation_cache', before[0])
    jax.config.update('jax_compilation_cache_dir', before[1])
  assert fresh == [tpu, tpu]
  monkeypatch.setattr(warmup, '_device', lambda leaves: _Device('gpu', 0))
  warmup._DECIDED.clear()
  assert warmup.start([]) is None


def test_an_unknown_value_is_refused_naming_the_variable_and_the_choices(mesh, monkeypatch):
  monkeypatch.setenv(warmup.VARIABLE, 'yes')
  with pytest.raises(ValueError, match=r"ORBAX_TUNIX_WARM_COMPILER='yes': expected one of"
                                       r' auto, 1, 0'):
    warmup.start(_target(mesh))


def test_a_qlora_restore_warms_the_compiler_before_planning_and_reads_the_same(
    tunix_data, mesh, fresh, monkeypatch):
  """The handler's dequantizing restore of a QLoRA save (real google-tunix), asked to warm the
  compiler: started before the item is planned, and every leaf the same bits, sharding and
  dtype as without it."""
  item_dir = ot.detect(tunix_data / 'hf_qwen3_qlora_int8').step_dir / 'model_params'
  ckptr = ocp.Checkpointer(ot.TunixPyTreeHandler())
  meta = ckptr.metadata(item_dir).item_metadata.tree
  target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(
      m.shape, m.dtype, sharding=NamedSharding(mesh, P())), meta)
  monkeypatch.setenv(warmup.VARIABLE, '0')
  want = ckptr.restore(item_dir, args=ocp.args.PyTreeRestore(item=target))
  events, find = _events(monkeypatch), planned_item.find

  def spied(directory):
    events.append('planned')
    return find(directory)
  monkeypatch.setattr(planned_item, 'find', spied)
  monkeypatch.setenv(warmup.VARIABLE, '1')
  got = ckptr.restore(item_dir, args=ocp.args.PyTreeRestore(item=target))
  assert events[:2] == ['started', 'planned'] and [d for d, _ in fresh] == [min(mesh.devices.flat, key=lambda d: d.id)]
  (want_leaves, treedef), got_leaves = jax.tree.flatten(want), jax.tree.leaves(got)
  assert treedef == jax.tree.structure(got) and len(want_leaves) > 10
  for w, g, t in zip(want_leaves, got_leaves, jax.tree.leaves(target), strict=True):
    assert g.sharding == t.sharding and g.dtype == t.dtype == w.dtype
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_a_merge_warms_the_compiler_before_planning_and_merges_the_same(tunix_data, mesh, fresh,
                                                                         monkeypatch):
  """`restore_merged_lora` of a QLoRA save (real google-tunix), asked to warm the compiler:
  started before the merge is planned, the merged weights the same bits as without it."""
  run = tunix_data / 'hf_qwen3_qlora_int8'
  shapes = merge.plan_merge(run, merge.MergeOptions(alpha=4.0)).shapes()
  target = nest((p, jax.ShapeDtypeStruct(s, d, sharding=NamedSharding(mesh, P())))
                for p, (s, d) in shapes.items())
  monkeypatch.setenv(warmup.VARIABLE, '0')
  want = dict(flatten(ot.restore_merged_lora(run, target, lora_alpha=4.0))[0])
  events, plan = _events(monkeypatch), merge.plan_merge

  def spied(*args, **kwargs):
    events.append('planned')
    return plan(*args, **kwargs)
  monkeypatch.setattr(merge, 'plan_merge', spied)
  monkeypatch.setenv(warmup.VARIABLE, '1')
  got = dict(flatten(ot.restore_merged_lora(run, target, lora_alpha=4.0))[0])
  assert events == ['started', 'planned'] and len(fresh) == 1 and set(got) == set(want)
  for path, w in want.items():
    assert got[path].sharding == w.sharding and got[path].dtype == w.dtype
    np.testing.assert_array_equal(np.asarray(got[path]), np.asarray(w))

"""The private Orbax details `orbax_tunix/store/_orbax.py` and the handlers lean on, one test each.

When an Orbax upgrade moves one of them, the test naming it fails here.
"""

import inspect
import json

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from orbax_tunix.handlers.composite_handler import TunixAwareHandler
from orbax_tunix.store import _orbax
from tests import opens


def test_standard_handler_reads_through_its_impl(tmp_path):
  """StandardCheckpointHandler.restore/metadata go through `_impl`'s public methods."""
  calls = []

  class Spy(ocp.PyTreeCheckpointHandler):
    def restore(self, directory, *args, **kwargs):
      calls.append('restore')
      return super().restore(directory, *args, **kwargs)

    def metadata(self, directory):
      calls.append('metadata')
      return super().metadata(directory)

  with ocp.Checkpointer(ocp.PyTreeCheckpointHandler()) as ckptr:
    ckptr.save(tmp_path / 'x', args=ocp.args.PyTreeSave({'a': np.arange(4)}))
  spy = Spy()
  standard = _orbax.standard_handler_over(spy)
  assert _orbax.pytree_handler_of(standard) is spy
  abstract = {'a': jax.ShapeDtypeStruct((4,), np.int64)}
  restored = standard.restore(tmp_path / 'x', args=ocp.args.StandardRestore(abstract))
  np.testing.assert_array_equal(restored['a'], np.arange(4))
  assert 'restore' in calls and 'metadata' in calls


def test_composite_picks_item_handlers_through_get_or_set_handler():
  """The one composite hook we override keeps its name and signature."""
  parameters = list(inspect.signature(
      ocp.CompositeCheckpointHandler._get_or_set_handler).parameters)
  assert parameters == ['self', 'item_name', 'args']
  source = inspect.getsource(ocp.CompositeCheckpointHandler.restore)
  assert 'self._get_or_set_handler(item_name, arg)' in source
  assert '_get_or_set_handler' in TunixAwareHandler.__dict__


def test_tree_metadata_types():
  meta = ocp.PyTreeCheckpointHandler().metadata
  assert _orbax.TreeMetadata.__name__ == 'TreeMetadata'
  assert 'TreeMetadata' in str(inspect.signature(meta).return_annotation)


def _saved(tmp_path):
  tree = {'a': np.arange(4, dtype=np.float32), 'b': {'c': np.ones(3, np.int32)}}
  with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckptr:
    ckptr.save(tmp_path / '1', args=ocp.args.Composite(state=ocp.args.PyTreeSave(tree)))
  return tmp_path / '1', tree


def test_pytree_handlers_read_metadata_through_read_metadata_file(tmp_path):
  """Restore and metadata read `_METADATA` only via `_read_metadata_file`, which is
  served: no open of the file, and the served (cut down) tree is what is used."""
  step, tree = _saved(tmp_path)
  item = step / 'state'
  parsed = json.loads((item / '_METADATA').read_text())
  key = next(k for k in parsed['tree_metadata'] if "'a'" in k)
  only_a = {**parsed, 'tree_metadata': {key: parsed['tree_metadata'][key]}}
  handler = ocp.PyTreeCheckpointHandler()
  _orbax.serve_tree_reads(handler)
  _orbax.serve_tree_reads(handler)  # Idempotent.
  target = {'a': np.zeros(4, np.float32)}
  with opens.counting() as counts, _orbax.serving({item / '_METADATA': only_a}):
    restored = handler.restore(item, args=ocp.args.PyTreeRestore(
        target, {'a': ocp.RestoreArgs(restore_type=np.ndarray)}, partial_restore=True))
    meta = handler.metadata(item)
  np.testing.assert_array_equal(restored['a'], tree['a'])
  assert set(meta.tree) == {'a'}  # The served entries, not the file's.
  assert not counts
  with opens.counting() as counts:  # Outside `serving`: the file, as usual.
    assert set(handler.metadata(item).tree) == {'a', 'b'}
  assert sum(counts.values()) == 1


def test_composite_reads_step_metadata_through_its_store(tmp_path):
  step, _ = _saved(tmp_path)
  parsed = json.loads((step / '_CHECKPOINT_METADATA').read_text())
  composite = ocp.CompositeCheckpointHandler()
  _orbax.serve_step_reads(composite)
  _orbax.serve_step_reads(composite)
  served = {**parsed, 'custom_metadata': {'served': True}}
  with opens.counting() as counts, _orbax.serving({step / '_CHECKPOINT_METADATA': served}):
    meta = composite.metadata(step)
  assert meta.custom_metadata == {'served': True}
  assert not [p for p in counts if p.endswith('_CHECKPOINT_METADATA')]


def test_composite_warns_that_unbound_items_cannot_be_restored(tmp_path, caplog):
  """The text `silence_unrestorable_warnings` drops, for the items it names only."""
  step, _ = _saved(tmp_path)
  caplog.set_level('WARNING')
  ocp.CompositeCheckpointHandler().metadata(step)
  found = [r for r in caplog.records if r.msg.startswith(_orbax.UNRESTORABLE_WARNING)]
  assert found and found[0].args[0] == 'state'
  caplog.clear()
  with _orbax.silence_unrestorable_warnings(['state']):
    ocp.CompositeCheckpointHandler().metadata(step)
  assert not [r for r in caplog.records if 'could not be restored' in r.getMessage()]
  with _orbax.silence_unrestorable_warnings(['other']):
    ocp.CompositeCheckpointHandler().metadata(step)
  assert [r for r in caplog.records if 'could not be restored' in r.getMessage()]


def test_handler_type_registry_finds_recorded_handlers():
  assert _orbax.handler_class(ocp.PyTreeCheckpointHandler.typestr()) is ocp.PyTreeCheckpointHandler
  assert _orbax.handler_class('no.such.Handler') is None
  assert _orbax.is_pytree_handler(ocp.StandardCheckpointHandler.typestr()) is True
  assert _orbax.is_pytree_handler(ocp.JsonCheckpointHandler.typestr()) is False


def test_open_kvstore_lists_the_arrays_orbax_wrote(tmp_path):
  step, _ = _saved(tmp_path)
  store = _orbax.open_kvstore(step / 'state', use_ocdbt=True)
  keys = {k.decode() for k in store.list().result()}
  assert {'a/.zarray', 'b.c/.zarray'} <= keys or {'a/zarr.json', 'b.c/zarr.json'} <= keys


def test_merge_tree_metadata_is_the_union_orbax_restores(tmp_path):
  """Two batch saves into one item, their `_METADATA` merged: Orbax restores both."""
  item = tmp_path / 'item'
  handler = ocp.PyTreeCheckpointHandler()
  files = []
  for batch in ({'a': np.arange(3)}, {'b': np.ones(2, np.float32)}):
    handler.save(item, args=ocp.args.PyTreeSave(batch))
    files.append(json.loads((item / '_METADATA').read_text()))
  empty = [(('e',), (2,), 'None'), (('d',), (2,), 'Dict'), (('l',), (2,), 'List')]
  merged = _orbax.merge_tree_metadata(files, empty_nodes=empty)
  (item / '_METADATA').write_text(json.dumps(merged))
  handler.finalize(item)
  restored = ocp.PyTreeCheckpointHandler().restore(item)
  np.testing.assert_array_equal(restored['a'], np.arange(3))
  np.testing.assert_array_equal(restored['b'], np.ones(2, np.float32))
  assert restored['e'] is None and restored['d'] == {} and restored['l'] == []


def test_untargeted_restore_on_other_devices_fails_for_want_of_a_sharding(tmp_path, mesh, monkeypatch):
  """What `_orbax.is_topology_mismatch` recognises: Orbax's PyTree restore without a
  target where the saved devices are gone."""
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec('data'))
  tree = {'a': jax.device_put(np.zeros(8, np.float32), sharding)}
  with ocp.Checkpointer(ocp.PyTreeCheckpointHandler()) as ckptr:
    ckptr.save(tmp_path / 'x', args=ocp.args.PyTreeSave(tree))
  one_device = jax.devices()[:1]
  monkeypatch.setattr(jax, 'devices', lambda *a: one_device)
  with pytest.raises(ValueError) as e:
    ocp.PyTreeCheckpointHandler().restore(tmp_path / 'x')
  assert _orbax.is_topology_mismatch(e.value)
  with pytest.raises(ValueError, match=_orbax.TOPOLOGY_MISMATCH[:30]):
    ocp.StandardCheckpointHandler().restore(tmp_path / 'x')


def test_pytree_typestrs_are_what_orbax_records(tmp_path):
  """The PyTree typestrs the v1 registration claims include what a save records."""
  for handler, save in ((ocp.PyTreeCheckpointHandler(), ocp.args.PyTreeSave),
                        (ocp.StandardCheckpointHandler(), ocp.args.StandardSave)):
    step = tmp_path / type(handler).__name__
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckptr:
      ckptr.save(step, args=ocp.args.Composite(x=save({'a': np.arange(2)})))
    recorded = json.loads((step / '_CHECKPOINT_METADATA').read_text())['item_handlers']['x']
    assert recorded in _orbax.PYTREE_TYPESTRS
  assert _orbax.V1_PYTREE_TYPESTR in _orbax.PYTREE_TYPESTRS


def test_run_sync_without_a_loop_goes_through_one_function(monkeypatch):
  """What `_orbax.tidy_failures` wraps: with no loop running, Orbax's run_sync
  calls `asyncio_utils._run_sync_via_new_loop`, looked up at each call."""
  from orbax.checkpoint._src import asyncio_utils  # pylint: disable=g-import-not-at-top

  assert _orbax._ORBAX_RUN_ON_NEW_LOOP is not None  # pylint: disable=protected-access
  calls = []
  through = asyncio_utils._run_sync_via_new_loop  # pylint: disable=protected-access
  monkeypatch.setattr(asyncio_utils, '_run_sync_via_new_loop',
                      lambda coro: calls.append(coro) or through(coro))

  async def answer():
    return 42

  assert asyncio_utils.run_sync(answer()) == 42 and len(calls) == 1


def test_tidy_failures_drains_what_a_failed_call_left():
  """A call that fails leaves a sibling task pending (as Orbax's gather of array
  reads does): within `tidy_failures` it is cancelled and awaited before the loop
  closes; outside, it is left pending, as Orbax leaves it."""
  from orbax.checkpoint._src import asyncio_utils  # pylint: disable=g-import-not-at-top

  from tests.test_store_helpers import failing_call  # pylint: disable=g-import-not-at-top
  tidy, untidy = [], []
  with _orbax.tidy_failures(), pytest.raises(RuntimeError, match='one read failed'):
    asyncio_utils.run_sync(failing_call(tidy))
  assert tidy[0].cancelled()
  with pytest.raises(RuntimeError, match='one read failed'):
    asyncio_utils.run_sync(failing_call(untidy))
  assert not untidy[0].done()
  untidy[0]._log_destroy_pending = False  # pylint: disable=protected-access


def test_jax_cluster_registry_is_what_initialize_walks():
  """`_orbax.jax_cluster_types`: JAX's cluster environments, each telling whether it is
  present and whether it is opt-in (mpi4py is: `job.cluster_detected` skips it)."""
  envs = _orbax.jax_cluster_types()
  names = {env.__name__ for env in envs}
  assert {'SlurmCluster', 'OmpiCluster', 'Mpi4pyCluster'} <= names, names
  assert all(callable(env.is_env_present) and isinstance(env.opt_in_only_method, bool)
             for env in envs)
  assert [env.opt_in_only_method for env in envs if env.__name__ == 'Mpi4pyCluster'] == [True]


def test_jax_process_claim_is_one_process_before_initialize():
  """`_orbax.jax_process_claim`: JAX's record of the process's id and count, (0, 1) in a
  process that joined no job (inside a job, processes given other counts are told apart by
  it: tests/test_distributed.py)."""
  assert _orbax.jax_process_claim() == (0, 1)


def test_jax_tpu_slice_hosts_are_what_jax_counts(monkeypatch):
  """`_orbax.jax_tpu_slice_hosts`: JAX's own list of a TPU slice's hosts (GKE's from
  TPU_WORKER_HOSTNAMES), whose length times the slices is JAX's process count; None for a
  cluster that is not a TPU slice."""
  envs = {env.__name__: env for env in _orbax.jax_cluster_types()}
  monkeypatch.delenv('TPU_PROCESS_ADDRESSES', raising=False)
  monkeypatch.setenv('TPU_WORKER_HOSTNAMES', 'h0,h1,h2')
  monkeypatch.setenv('MEGASCALE_NUM_SLICES', '2')
  gke = envs['GkeTpuCluster']
  assert _orbax.jax_tpu_slice_hosts(gke) == ['h0', 'h1', 'h2']
  assert gke.get_process_count() == 6
  assert _orbax.jax_tpu_slice_hosts(envs['SlurmCluster']) is None


def test_jax_cache_entries_appear_whole(tmp_path):
  """`_orbax.jax_cache_writes_whole`: the file cache JAX makes (its private `get_file_cache`)
  shows an entry to a reader only once it is whole (JAX 0.10's own writes it in place, where
  another process sharing the cache may read it half written)."""
  import threading  # pylint: disable=g-import-not-at-top

  from jax._src import compilation_cache  # pylint: disable=g-import-not-at-top

  _orbax.jax_cache_writes_whole()
  cache, _ = compilation_cache.get_file_cache(str(tmp_path))
  value = np.random.default_rng(0).bytes(32 << 20)
  seen, stop = [], threading.Event()

  def read() -> None:
    while not stop.is_set() and not seen:
      got = cache.get('k')
      if got is not None:
        seen.append(len(got))

  reader = threading.Thread(target=read)
  reader.start()
  cache.put('k', value)
  stop.set()
  reader.join()
  assert seen in ([], [len(value)]) and cache.get('k') == value
  cache.put('k', b'other')  # A key already there is kept.
  assert cache.get('k') == value and [p.name for p in tmp_path.iterdir()] == ['k-cache']

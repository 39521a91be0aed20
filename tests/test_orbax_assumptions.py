"""The private Orbax details `orbax_tunix/_orbax.py` and the handlers lean on, one test each.

When an Orbax upgrade moves one of them, the test naming it fails here.
"""

import inspect

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from orbax_tunix import _orbax
from orbax_tunix.composite_handler import TunixAwareHandler


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


@pytest.mark.parametrize('text, storage', [
    ('OUT_OF_RANGE: Error reading "x/.zarray"', True),
    ('NOT_FOUND: Error opening "zarr" driver', True),
    ('DATA_LOSS: checksum mismatch', True),
    ('INVALID_ARGUMENT: dtype mismatch', False),
    ('One of device_put args was given the sharding of NamedSharding', False),
])
def test_storage_failures_are_told_from_request_errors(text, storage):
  wrapped = Exception('Encountered error while reading array index: (0,).')
  wrapped.__cause__ = ValueError(text)
  assert (_orbax.storage_failure(wrapped) is not None) == storage
  assert _orbax.storage_failure(FileNotFoundError('x')) is not None

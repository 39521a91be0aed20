"""How hard XLA optimizes the package's programs (`mapping/effort.py`): the lowest effort on a
TPU unless told otherwise, part of each program's key. That such programs compute the same
bits is `test_qlora.py`'s `test_merges_compiled_at_the_lowest_effort_are_the_same_bits`."""

from __future__ import annotations

import collections
import types

import jax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from orbax_tunix.mapping import effort, executables, transforms

_Device = collections.namedtuple('_Device', 'platform')


def _on(platform: str):
  """A sharding over devices of `platform` (only what `compiler_options` asks of one)."""
  return types.SimpleNamespace(device_set={_Device(platform)})


@pytest.mark.parametrize('value, cpu, tpu', [
    (None, (), effort._LOWEST), ('auto', (), effort._LOWEST), ('AUTO ', (), effort._LOWEST),
    ('low', effort._LOWEST, effort._LOWEST), ('default', (), ())])
def test_lowest_on_a_tpu_unless_told(value, cpu, tpu, monkeypatch):
  if value is None:
    monkeypatch.delenv(effort.VARIABLE, raising=False)
  else:
    monkeypatch.setenv(effort.VARIABLE, value)
  assert effort.compiler_options([_on('cpu')]) == cpu
  assert effort.compiler_options([_on('tpu'), _on('tpu')]) == tpu
  assert effort.compiler_options([_on('tpu'), _on('cpu')]) == (effort._LOWEST if value == 'low'
                                                                else ())


def test_an_unknown_value_is_refused_naming_the_variable_and_the_choices(monkeypatch):
  monkeypatch.setenv(effort.VARIABLE, 'fast')
  with pytest.raises(ValueError, match=r"ORBAX_TUNIX_COMPILE_EFFORT='fast': expected one of"
                                       r' auto, low, default'):
    effort.compiler_options([_on('tpu')])


def test_the_effort_is_part_of_the_programs_key(mesh, monkeypatch):
  sharding = NamedSharding(mesh, P('data', 'model'))
  abstract = [jax.ShapeDtypeStruct((8, 4), 'float32', sharding=sharding)]
  keys = {}
  for value in ('default', 'low'):
    monkeypatch.setenv(effort.VARIABLE, value)
    program = transforms.on_devices([transforms.shift(1.0)], [sharding], ['float32'])
    keys[value] = (program, executables.key(program, abstract))
  (default, default_key), (low, low_key) = keys['default'], keys['low']
  assert default is not low and None not in (default_key, low_key) and default_key != low_key
  x = jax.device_put(jax.numpy.arange(32.0).reshape(8, 4), sharding)
  (got,) = low(x)
  assert got.sharding == sharding and (got == x + 1).all()

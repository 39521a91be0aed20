"""The device programs kept across processes (`mapping/executables.py`): the key tells apart
whatever compiles differently, and what is kept is where JAX's persistent cache is, only while
it is on. The round trip through a second process is `test_qlora.py`'s
`test_the_next_process_loads_the_merges_programs_without_lowering_them`."""

from __future__ import annotations

import math
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from orbax_tunix.mapping import executables, hf_maxtext, transforms

SPEC = P('data', 'model')


@pytest.fixture
def cache_on(tmp_path):
  before = (jax.config.jax_enable_compilation_cache, jax.config.jax_compilation_cache_dir)
  jax.config.update('jax_enable_compilation_cache', True)
  jax.config.update('jax_compilation_cache_dir', str(tmp_path))
  yield tmp_path
  jax.config.update('jax_enable_compilation_cache', before[0])
  jax.config.update('jax_compilation_cache_dir', before[1])


def _abstract(mesh, shape=(8, 4), dtype=jnp.float32, spec=SPEC):
  return [jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))]


def _program(mesh, transform=None, dtype=jnp.float32, spec=SPEC):
  return transforms.on_devices([transform or transforms.shift(1.0)],
                               [NamedSharding(mesh, spec)], [dtype])


def test_the_key_tells_apart_what_compiles_differently(mesh, monkeypatch):
  base = executables.key(_program(mesh), _abstract(mesh))
  assert base is not None and base == executables.key(_program(mesh), _abstract(mesh))
  others = [
      executables.key(_program(mesh, transforms.shift(2.0)), _abstract(mesh)),
      executables.key(_program(mesh, dtype=jnp.bfloat16), _abstract(mesh)),
      executables.key(_program(mesh, spec=P('data')), _abstract(mesh)),
      executables.key(_program(mesh), _abstract(mesh, shape=(16, 4))),
      executables.key(_program(mesh), _abstract(mesh, dtype=jnp.bfloat16)),
      executables.key(_program(mesh), _abstract(mesh, spec=P(None, 'model'))),
      # The same devices in another order are another program.
      executables.key(_program(mesh), _abstract(jax.sharding.Mesh(
          mesh.devices[::-1], mesh.axis_names))),
  ]
  monkeypatch.setenv('XLA_FLAGS', '--xla_cpu_enable_fast_math=true')
  others.append(executables.key(_program(mesh), _abstract(mesh)))
  assert None not in others and len({base, *others}) == len(others) + 1


def _half(n: int) -> float:
  return n / 2


def test_a_function_in_a_key_is_kept_only_where_its_name_stands_for_its_body(mesh):
  """A re-layout made with one of this package's module-level functions (MaxText's
  sqrt(hidden)) or the standard library's (`math.sqrt`) is kept, under a key of that function,
  what it does with it and along which axis; one made with a lambda, a nested function or
  another module's (here, this test's) is not: its body may change under the same name."""

  def nested(n):
    return 2.0

  kept = [transforms.divide('sqrt', math.sqrt, axis=1), transforms.multiply('sqrt', math.sqrt, axis=1),
          transforms.divide('sqrt', math.sqrt, axis=0), transforms.divide('sqrt', math.log, axis=1),
          transforms.divide('sqrt', hf_maxtext._f32_sqrt, axis=1),
          transforms.divide('sqrt', hf_maxtext._bf16_sqrt, axis=1)]
  keys = [executables.key(_program(mesh, t), _abstract(mesh)) for t in kept]
  assert None not in keys and len(set(keys)) == len(kept)
  for fn in (lambda n: 2.0, nested, _half):
    assert executables.key(_program(mesh, transforms.divide('x', fn, axis=0)), _abstract(mesh)) is None


def test_kept_only_beside_a_local_jax_cache_that_is_on(cache_on, monkeypatch):
  assert executables.directory() == cache_on / executables.SUBDIRECTORY
  monkeypatch.setenv('ORBAX_TUNIX_EXECUTABLE_CACHE', '0')
  assert executables.directory() is None
  monkeypatch.delenv('ORBAX_TUNIX_EXECUTABLE_CACHE')
  jax.config.update('jax_compilation_cache_dir', 'gs://bucket/jax')
  assert executables.directory() is None
  jax.config.update('jax_compilation_cache_dir', str(cache_on))
  jax.config.update('jax_enable_compilation_cache', False)
  assert executables.directory() is None


@pytest.mark.parametrize('transform, formula', [
    (transforms.shift(1.0), lambda x: x + 1.0),
    (transforms.divide('sqrt', math.sqrt, axis=1), lambda x: x / np.float32(2.0)),
])
def test_a_kept_program_computes_what_the_jitted_one_does(mesh, cache_on, monkeypatch,
                                                          transform, formula):
  """Compiled, kept, then loaded (this process's own copies forgotten): the values of the
  formula in numpy, in the destination's sharding and dtype."""
  x = jax.device_put(np.arange(32, dtype=np.float32).reshape(8, 4),
                     NamedSharding(mesh, P('data', 'model')))
  program, abstract = _program(mesh, transform, dtype=jnp.bfloat16), _abstract(mesh)
  fresh = executables.compiled(program, abstract, executables.entry(program, abstract))
  assert fresh is not program and len(list((cache_on / executables.SUBDIRECTORY).iterdir())) == 1
  monkeypatch.setattr(executables, '_LOADED', {})
  monkeypatch.setattr(transforms.Program, 'lower', lambda *a: pytest.fail('lowered again'))
  loaded = executables.compiled(program, abstract, executables.entry(program, abstract))
  assert loaded is not fresh
  (out,) = loaded(x)
  assert out.dtype == jnp.bfloat16 and out.sharding == NamedSharding(mesh, P('data', 'model'))
  want = formula(np.arange(32, dtype=np.float32).reshape(8, 4)).astype(jnp.bfloat16)
  np.testing.assert_array_equal(np.asarray(out), want)


def test_programs_of_sub_byte_arguments_and_programs_without_a_key_are_not_kept(mesh):
  """int4 arrays as read have the layout of a byte an element, not the packed one a program
  compiled for int4 expects (jit compiles for what it is given; a loaded program refuses it)."""
  assert executables.key(_program(mesh), _abstract(mesh, dtype=jnp.int4)) is None
  jitted = jax.jit(lambda x: x + 1)
  assert executables.key(jitted, _abstract(mesh)) is None


def test_programs_lower_one_at_a_time_and_compile_on_several_threads(mesh, monkeypatch):
  """Lowering is Python: the compile threads take turns at it (`executables._LOWERING`), and
  compile (XLA, outside the GIL) at once."""
  from orbax_tunix.mapping import device  # pylint: disable=g-import-not-at-top
  monkeypatch.setenv('ORBAX_TUNIX_THREADS', '8')  # 4 compile threads.
  monkeypatch.setattr(transforms, '_COMPILED', {})
  lowering, most, threads = [0], [0], set()
  lower = transforms.Program.lower

  def slow_lower(self, *abstract):
    lowering[0] += 1
    most[0] = max(most[0], lowering[0])
    time.sleep(0.05)
    lowering[0] -= 1
    threads.add(threading.current_thread().name)
    return lower(self, *abstract)

  monkeypatch.setattr(transforms.Program, 'lower', slow_lower)
  programs = [(_program(mesh, transforms.shift(float(i))), _abstract(mesh)) for i in range(6)]
  with device.compiling() as compiler:
    for program, abstract in programs:
      compiler.submit(program, abstract)
    x = jax.device_put(np.zeros((8, 4), np.float32), NamedSharding(mesh, SPEC))
    outs = [compiler.ready(p, a)(x)[0] for p, a in programs]
  assert most[0] == 1 and len(threads) > 1, (most, threads)
  for i, out in enumerate(outs):
    np.testing.assert_array_equal(np.asarray(out), np.full((8, 4), float(i), np.float32))

"""QLoRA runs: a weight qwix saved quantized is one weight in the canonical view, and merges.

Models are built with the real qwix and flax nnx (`lora_models.QwixLM`), quantized and adapted
by qwix's `LoraProvider(weight_qtype=...)` as Tunix applies it, trained a few steps and saved
as Tunix saves them. The expected values are qwix's own: `qwix.dequantize` of the raw parts
read by plain Orbax, `qwix.quantize` of the float base, and the QLoRA model's own logits.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
import pytest
import qwix
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from qwix._src.core import numerics, qarray

import orbax_tunix as ot
from orbax_tunix import errors
from orbax_tunix.keypaths import flat_dict, flatten, fmt, nest
from orbax_tunix.mapping import dequantize, device, effort, executables, executor, merge, transforms
from orbax_tunix.mapping.outputs import Input, Output
from orbax_tunix.reading import memory, quantized, reader
from orbax_tunix.reading.planned_item import PlannedItem
from orbax_tunix.store import item_store
from orbax_tunix.writing import writer
from tests import builders, clients
from tests import lora_models as lm
from tests.test_lora_merge import F32_ATOL, abstract_weights, forward
from tests.test_scan_layers import compiled_on_threads

# (name, LoraProvider's quantization keywords, dtype of the model's params)
RECIPES = {
    'int8_minmax_tile4': (dict(weight_qtype='int8', tile_size=4,
                               weight_calibration_method='minmax'), jnp.float32),
    'int4_absmax': (dict(weight_qtype='int4'), jnp.float32),
    'fp8_tile4': (dict(weight_qtype='float8_e4m3fn', tile_size=4), jnp.float32),
    'int8_bf16': (dict(weight_qtype='int8', weight_calibration_method='minmax'), jnp.bfloat16),
}
ADAPTED = ('q_proj/w', 'v_proj/w', 'o_proj/w', 'up/kernel', 'down/kernel')


def _qarray(raw: dict[str, np.ndarray], weight: str) -> qwix.QArray:
  """qwix's `QArray` of a weight's parts as plain Orbax reads them."""
  parts = {k: raw[f'{weight}/array/{k}/value'] for k in ('qvalue', 'scale', 'zero_point')
           if f'{weight}/array/{k}/value' in raw}
  qvalue = jnp.asarray(parts['qvalue'])
  qtype = 'nf4' if qvalue.dtype == jnp.uint4 else qvalue.dtype
  zero_point = parts.get('zero_point')
  return qwix.QArray(qvalue, jnp.asarray(parts['scale']),
                     None if zero_point is None else jnp.asarray(zero_point), qtype)


def _cast(model: nnx.Module, dtype) -> nnx.Module:
  if dtype != jnp.float32:
    state = nnx.state(model)
    nnx.update(model, jax.tree.map(lambda x: x.astype(dtype), state))
  return model


@pytest.fixture(scope='module')
def runs(tmp_path_factory):
  """Each recipe's QLoRA run saved in full and adapters-only, with its float base."""
  root = tmp_path_factory.mktemp('qlora')
  out = {}
  for name, (recipe, dtype) in RECIPES.items():
    base = _cast(lm.QwixLM(rngs=nnx.Rngs(0)), dtype)
    builders.save_tunix(root / name / 'base', 1, base)
    model = lm.train(lm.with_qwix_lora(nnx.clone(base), **recipe))
    builders.save_tunix(root / name / 'full', 1, model)
    only = nnx.state(model, nnx.LoRAParam)
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckptr:
      ckptr.save(root / name / 'only' / '1',
                 args=ocp.args.Composite(model_params=ocp.args.PyTreeSave(only)))
    out[name] = {'root': root / name, 'dtype': dtype, 'recipe': recipe,
                 'logits': np.asarray(model(jnp.asarray(lm.TOKENS)), np.float32)}
  return out


def _raw(run) -> dict[str, np.ndarray]:
  return builders.raw_leaves(run['root'] / 'full' / '1' / 'model_params')


@pytest.mark.parametrize('name', RECIPES)
def test_a_quantized_weight_reads_as_qwix_dequantizes_it(runs, name):
  """No target: every weight canonical, the quantized ones dequantized, in scale's dtype."""
  run = runs[name]
  step = run['root'] / 'full' / '1'
  ckptr = ocp.Checkpointer(ot.TunixAwareHandler())
  state = flat_dict(ckptr.restore(step)['model_params'])
  meta = flat_dict(ckptr.metadata(step).item_metadata['model_params'])
  raw = _raw(run)
  assert not any('array' in path for path in state), 'parts left in the canonical view'
  for layer, weight in itertools.product(('0', '1'), ADAPTED):
    path = ('layers', layer, *weight.split('/'))
    want = qwix.dequantize(_qarray(raw, f'layers/{layer}/{weight}'))
    got = state[path]
    assert got.dtype == want.dtype and got.shape == want.shape  # scale's dtype, as qwix's
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert (meta[path].shape, meta[path].dtype) == (want.shape, want.dtype)


@pytest.mark.parametrize('name', ['int8_minmax_tile4', 'fp8_tile4'])
@pytest.mark.parametrize('dtype', [jnp.float32, jnp.bfloat16])
def test_sharded_target_is_dequantized_into_its_sharding_and_dtype(runs, mesh, name, dtype):
  run = runs[name]
  raw = _raw(run)
  target = {'layers': {'1': {
      'v_proj': {'w': jax.ShapeDtypeStruct((lm.N, lm.D, lm.H), dtype,
                                            sharding=NamedSharding(mesh, P('model', None, 'data')))},
      'up': {'kernel': jax.ShapeDtypeStruct((lm.D, lm.F), dtype,
                                            sharding=NamedSharding(mesh, P('model', 'data')))},
  }}}
  ckptr = ocp.Checkpointer(ot.TunixAwareHandler())
  got = ckptr.restore(run['root'] / 'full' / '1', args=ocp.args.Composite(
      model_params=ocp.args.PyTreeRestore(item=target)))['model_params']
  for weight in ('v_proj/w', 'up/kernel'):
    value = flat_dict(got)[('layers', '1', *weight.split('/'))]
    want_leaf = flat_dict(target)[('layers', '1', *weight.split('/'))]
    assert value.sharding == want_leaf.sharding and value.dtype == dtype
    want = qwix.dequantize(_qarray(raw, f'layers/1/{weight}')).astype(dtype)
    np.testing.assert_array_equal(np.asarray(value), np.asarray(want))


def _float_target(mesh, dtype=jnp.float32):
  """Both layers' v_proj (tiled on D) and up weights, sharded."""
  return {'layers': {layer: {
      'v_proj': {'w': jax.ShapeDtypeStruct((lm.N, lm.D, lm.H), dtype,
                                            sharding=NamedSharding(mesh, P('model', None, 'data')))},
      'up': {'kernel': jax.ShapeDtypeStruct((lm.D, lm.F), dtype,
                                            sharding=NamedSharding(mesh, P('model', 'data')))},
  } for layer in ('0', '1')}}


def _restore_params(step, target):
  return ocp.Checkpointer(ot.TunixAwareHandler()).restore(step, args=ocp.args.Composite(
      model_params=ocp.args.PyTreeRestore(item=target)))['model_params']


def test_each_weights_parts_are_freed_once_it_is_made(runs, mesh, monkeypatch):
  """Not every weight's parts held until the last weight is dequantized: a restore into a
  float target peaks at the target and the parts not yet used, not the target beside all
  the parts (benchmarks/qlora.py)."""
  run = runs['int8_minmax_tile4']  # qvalue and zero point int8: two int8 arrays a weight.
  alive, on_devices = [], transforms.on_devices

  def counting(*args, **kwargs):  # Each weight's program, called once its parts are read.
    program = on_devices(*args, **kwargs)

    def call(*xs):
      alive.append(sum(1 for a in jax.live_arrays() if a.dtype == jnp.int8))
      return program(*xs)
    call.lower = program.lower
    return call

  monkeypatch.setattr(transforms, 'on_devices', counting)
  got = _restore_params(run['root'] / 'full' / '1', _float_target(mesh))
  assert len(alive) == 4 and len(jax.tree.leaves(got)) == 4, alive
  # As each weight is made, the weights made before it hold no parts any more.
  assert np.diff(alive).tolist() == [-2, -2, -2], alive


def test_the_parts_are_read_a_group_at_a_time_each_made_before_the_next_is_read(
    runs, mesh, monkeypatch):
  """Weights of more parts than a device group (`memory.DEVICE_GROUP_BYTES`) are read a
  group at a time, one Orbax restore each (the other leaves with the first), each group
  dispatched to the devices before the next is read (so that it is made while that one is
  read): every part read once, the values, shardings and dtypes those of one read."""
  step = runs['int8_minmax_tile4']['root'] / 'full' / '1'
  bias = {'bias': jax.ShapeDtypeStruct((lm.F,), jnp.float32)}  # Stored as it is.
  target = _float_target(mesh)
  target['layers']['0']['up'].update(bias)
  whole = _restore_params(step, target)
  events, on_devices, restore = [], transforms.on_devices, ocp.PyTreeCheckpointHandler.restore

  def made(*args, **kwargs):
    program = on_devices(*args, **kwargs)

    def call(*xs):
      events.append('made')
      return program(*xs)
    call.lower = program.lower
    return call

  def read(self, directory, *args, **kwargs):
    leaves = [fmt(p) for p, leaf in flatten(kwargs['args'].item)[0] if leaf is not ocp.PLACEHOLDER]
    events.append(leaves)
    return restore(self, directory, *args, **kwargs)

  monkeypatch.setattr(transforms, 'on_devices', made)
  monkeypatch.setattr(ocp.PyTreeCheckpointHandler, 'restore', read)
  monkeypatch.setattr(memory, 'DEVICE_GROUP_BYTES', 1)  # A weight a group.
  grouped = _restore_params(step, target)
  reads = [e for e in events if e != 'made']
  assert ['made' if e == 'made' else 'read' for e in events] == ['read', 'made'] * 4, events
  parts = [p for leaves in reads for p in leaves]
  assert len(parts) == len(set(parts)) == 4 * 3 + 1, reads  # qvalue, scale, zero point.
  with_bias = [any('up/bias' in p for p in leaves) for leaves in reads]
  assert with_bias == [True, False, False, False], reads
  for want, got in zip(jax.tree.leaves(whole), jax.tree.leaves(grouped), strict=True):
    assert got.sharding == want.sharding and got.dtype == want.dtype
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_the_parts_headers_are_read_in_one_batch(runs, mesh, monkeypatch):
  """A restore of several quantized weights reads their scales' and zero points' headers
  together, not one round trip per weight (a bucket's latency each)."""
  batches, read_headers = [], item_store.Item._read_headers

  def reading(self, paths):
    batches.append([fmt(p) for p in paths])
    return read_headers(self, paths)

  monkeypatch.setattr(item_store.Item, '_read_headers', reading)
  run = runs['int8_minmax_tile4']
  got = _restore_params(run['root'] / 'full' / '1', _float_target(mesh))
  assert len(jax.tree.leaves(got)) == 4
  with_scales = [b for b in batches if any('/array/scale' in p for p in b)]
  assert len(with_scales) == 1, batches
  assert sum('/array/scale' in p or '/array/zero_point' in p for p in with_scales[0]) == 8, batches


def test_the_dequantize_programs_compile_while_the_parts_are_read(runs, mesh, monkeypatch):
  """A fresh process's first restore: each kind of weight's dequantize program is compiled
  on the executor's compile thread (`device.Compiler`), asked for before Orbax reads the
  parts, none on the caller's thread after the read; one program per kind, not per weight."""
  events, orbax_read, submit = [], PlannedItem._orbax_read, device.Compiler.submit

  def reading(self, *args, **kwargs):
    events.append('read')
    return orbax_read(self, *args, **kwargs)

  def submitting(self, *args):
    events.append('ahead')
    return submit(self, *args)

  monkeypatch.setattr(PlannedItem, '_orbax_read', reading)
  monkeypatch.setattr(device.Compiler, 'submit', submitting)
  run = runs['int8_minmax_tile4']
  got, threads = compiled_on_threads(monkeypatch, lambda: _restore_params(
      run['root'] / 'full' / '1', _float_target(mesh, jnp.bfloat16)))
  raw = _raw(run)
  for layer, weight in itertools.product(('0', '1'), ('v_proj/w', 'up/kernel')):
    want = qwix.dequantize(_qarray(raw, f'layers/{layer}/{weight}')).astype(jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(flat_dict(got)[('layers', layer, *weight.split('/'))]),
                                  np.asarray(want))
  # Asked for before the read; two shapes, two programs, compiled off the caller's thread.
  assert events == ['ahead'] * 4 + ['read'], events
  assert len(threads) == 2 and all(t.startswith('orbax_tunix-compile') for t in threads), threads


def test_a_target_of_the_stored_parts_reads_them_as_stored(runs, mesh):
  run = runs['int8_minmax_tile4']
  raw = _raw(run)
  sharding = NamedSharding(mesh, P())
  parts = {k: jax.ShapeDtypeStruct(raw[f'layers/0/q_proj/w/array/{k}/value'].shape,
                                   raw[f'layers/0/q_proj/w/array/{k}/value'].dtype,
                                   sharding=sharding)
           for k in ('qvalue', 'scale', 'zero_point')}
  target = {'layers': {'0': {'q_proj': {'w': {'array': parts}}}}}
  got = ocp.Checkpointer(ot.TunixPyTreeHandler()).restore(
      run['root'] / 'full' / '1' / 'model_params', args=ocp.args.PyTreeRestore(item=target))
  for k in parts:
    value = got['layers']['0']['q_proj']['w']['array'][k]
    assert value.dtype == parts[k].dtype and value.sharding == sharding
    np.testing.assert_array_equal(np.asarray(value), raw[f'layers/0/q_proj/w/array/{k}/value'])


def test_orbax_v1_loads_the_dequantized_weights(runs):
  ot.register()
  run = runs['int4_absmax']
  loaded = ocp.v1.load_checkpointables(run['root'] / 'full' / '1')['model_params']
  want = qwix.dequantize(_qarray(_raw(run), 'layers/0/o_proj/w'))
  np.testing.assert_array_equal(np.asarray(loaded['layers']['0']['o_proj']['w']),
                                np.asarray(want))


@pytest.mark.parametrize('numpy', [True, False])
def test_parts_of_a_quantized_weight_read_as_the_same_region_dequantized(runs, numpy):
  """A layer's slice or a block of rows (the writer's partial reads) of a tiled weight: its
  parts' regions read, the same region made (on the host, or on a CPU device)."""
  run = runs['int8_minmax_tile4']
  ckpt = reader.open_source(run['root'] / 'full' / '1')
  leaf = next(x for x in ckpt.items['model_params'] if fmt(x.path) == 'layers/0/v_proj/w')
  whole = np.asarray(qwix.dequantize(_qarray(_raw(run), 'layers/0/v_proj/w')))  # (N, D, H)
  regions = {  # (takes, rows) -> the index into the weight (tiles of 4 on D).
      'layer': (((0, 1),), None, (1, slice(None), slice(None))),
      'rows': ((), (1, 1, 7), (slice(None), slice(1, 7), slice(None))),
      'both': (((0, 0), (1, 2)), (0, 3, 8), (0, slice(3, 8), 2)),
      'one tile': (((2, 1),), (1, 5, 6), (slice(None), slice(5, 6), 1)),
  }
  outputs = [Output(('r', str(k)), (Input(ckpt, leaf, takes, rows),), shape=whole[i].shape,
                    dtype=leaf.dtype) for k, (takes, rows, i) in enumerate(regions.values())]
  got = executor.run(outputs, writer.OnHost(numpy), executor.Collect(), 1 << 30)['values']
  for k, (_, _, index) in enumerate(regions.values()):
    np.testing.assert_array_equal(np.asarray(got[('r', str(k))]), whole[index], err_msg=str(k))


@pytest.mark.parametrize('qtype', ['int8', 'int4', 'float8_e4m3fn', 'nf4'])
@pytest.mark.parametrize('scale_dtype', [np.float32, ml_dtypes.bfloat16])
def test_dequantize_is_qwix_dequantize(qtype, scale_dtype):
  """The arithmetic alone, on host and device, nf4's table included (nf4 full saves fail in
  Orbax: uint4 cannot be stored, so only the arithmetic can be checked)."""
  rs = np.random.RandomState(1)
  storage = {'int8': np.int8, 'int4': ml_dtypes.int4, 'float8_e4m3fn': ml_dtypes.float8_e4m3fn,
             'nf4': ml_dtypes.uint4}[qtype]
  shape, scale_shape = (6, 8, 4), (6, 2, 1)
  if qtype == 'float8_e4m3fn':
    qvalue = rs.uniform(-400, 400, shape).astype(storage)
  else:
    info = ml_dtypes.iinfo(storage)
    qvalue = rs.randint(int(info.min), int(info.max) + 1, shape).astype(storage)
  scale = rs.uniform(0.01, 2, scale_shape).astype(scale_dtype)
  zero_point = (rs.randint(-8, 8, scale_shape).astype(storage)
                if qtype in ('int8', 'int4') else None)
  want = qarray.dequantize(qwix.QArray(
      jnp.asarray(qvalue), jnp.asarray(scale), None if zero_point is None else jnp.asarray(
          zero_point), 'nf4' if qtype == 'nf4' else jnp.dtype(storage)))
  nf4 = qtype == 'nf4'
  host = dequantize.dequantize(qvalue, scale, zero_point, nf4=nf4)
  dev = jax.jit(lambda *xs: dequantize.dequantize(*xs, nf4=nf4))(
      *(jnp.asarray(x) for x in (qvalue, scale) + (() if zero_point is None else (zero_point,))))
  for got in (host, dev):
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(np.asarray(got).view(np.uint8), np.asarray(want).view(np.uint8))
  np.testing.assert_array_equal(quantized.NF4_BUCKETS, np.asarray(numerics.get_nf4_buckets()))


@pytest.mark.parametrize('qtype,calibration', [
    ('int8', 'absmax'), ('int8', 'minmax'), ('int4', 'minmax'), ('int4', 'absmax'),
    ('float8_e4m3fn', 'absmax'), ('nf4', 'absmax')])
@pytest.mark.parametrize('dtype', [np.float32, ml_dtypes.bfloat16])
def test_requantize_is_qwix_quantize_then_dequantize(qtype, calibration, dtype):
  """Bit for bit, per channel and tiled, einsum weights of 2-4 axes, host and device."""
  rs = np.random.RandomState(2)
  for tile, (shape, contracting) in itertools.product(
      [None, 4], [((40, 56), (0,)), ((4, 12, 40), (0, 1)), ((2, 4, 40, 12), (2,))]):
    w = (rs.randn(*shape) * rs.uniform(0.01, 3)).astype(dtype)
    w[..., 0] = 0  # A channel of zeros: qwix's scale of 1.
    recipe = quantized.Recipe(qtype, tile, calibration)
    how = qarray.HowToQuantize(
        qtype='nf4' if qtype == 'nf4' else jnp.dtype(qtype),
        channelwise_axes=[a for a in range(len(shape)) if a not in contracting],
        tiled_axes=recipe.tiled_axes(shape, contracting), calibration_method=calibration)
    want = np.asarray(qarray.dequantize(qarray.quantize(jnp.asarray(w), how)))
    host = np.asarray(quantized.requantize(w, recipe, contracting)).astype(want.dtype)
    dev = np.asarray(jax.jit(lambda x, r=recipe, c=contracting: quantized.requantize(x, r, c))(
        jnp.asarray(w))).astype(want.dtype)
    eager = np.asarray(quantized.requantize(jnp.asarray(w), recipe, contracting)
                       ).astype(want.dtype)
    for got in (host, dev, eager):
      np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8),
                                    err_msg=f'{recipe} {shape}')


@pytest.mark.parametrize('qtype,calibration', [
    ('int8', 'absmax'), ('int8', 'minmax'), ('int4', 'minmax'), ('float8_e4m3fn', 'absmax'),
    ('nf4', 'absmax')])
@pytest.mark.parametrize('dtype', [np.float32, ml_dtypes.bfloat16])
def test_requantize_is_qwix_s_in_a_sharded_program_of_several(mesh, qtype, calibration, dtype):
  """Several re-quantizations in one compiled program, sharded over a mesh of explicit axes
  (`jax.make_mesh`'s), each bit for bit qwix's: the bound divided as qwix's eager step
  divides it, not as XLA happens to fold it in a larger program (JAX 0.10: the second of two
  divided where the first multiplied), and nf4's table read without a gather (which a sharded
  index cannot take there)."""
  rs = np.random.RandomState(5)
  sharding = NamedSharding(mesh, P(None, 'model'))
  for tile in (None, 4):
    recipe = quantized.Recipe(qtype, tile, calibration)
    how = qarray.HowToQuantize(qtype='nf4' if qtype == 'nf4' else jnp.dtype(qtype),
                               channelwise_axes=[1], tiled_axes=recipe.tiled_axes((16, 8), (0,)),
                               calibration_method=calibration)
    weights = [(rs.randn(16, 8) * rs.uniform(0.01, 3)).astype(dtype) for _ in range(3)]
    got = jax.jit(lambda *ws, r=recipe: [quantized.requantize(w, r, (0,)) for w in ws],
                  out_shardings=sharding)(*(jax.device_put(w, sharding) for w in weights))
    for w, value in zip(weights, got, strict=True):
      want = np.asarray(qarray.dequantize(qarray.quantize(jnp.asarray(w), how)))
      assert value.sharding == sharding and value.dtype == jnp.float32
      np.testing.assert_array_equal(np.asarray(value).astype(want.dtype).view(np.uint8),
                                    want.view(np.uint8), err_msg=f'{recipe}')


def test_nf4_dequantizes_as_qwix_does_on_a_mesh_of_explicit_axes(mesh):
  """nf4's qvalue is an index into its table: sharded over a mesh of explicit axes it is read
  without a gather, each value qwix's, in the output's sharding."""
  rs = np.random.RandomState(3)
  qvalue = rs.randint(0, 16, (16, 8)).astype(ml_dtypes.uint4)
  scale = rs.uniform(0.01, 2, (1, 8)).astype(np.float32)
  sharding = NamedSharding(mesh, P(None, 'model'))
  got = jax.jit(lambda q, s: dequantize.dequantize(q, s, nf4=True), out_shardings=sharding)(
      jax.device_put(qvalue.astype(np.uint8), sharding), jax.device_put(scale, sharding))
  want = qarray.dequantize(qwix.QArray(jnp.asarray(qvalue), jnp.asarray(scale), None, 'nf4'))
  assert got.sharding == sharding and got.dtype == want.dtype
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def _equations(jaxpr):
  """Every equation of a jaxpr and of the jaxprs inside it."""
  for eqn in jaxpr.eqns:
    yield eqn
    for param in eqn.params.values():
      for sub in param if isinstance(param, tuple | list) else (param,):
        inner = getattr(sub, 'jaxpr', sub)
        if hasattr(inner, 'eqns'):
          yield from _equations(inner)


@pytest.mark.parametrize('calibration', ['absmax', 'minmax'])
def test_requantize_divides_a_bfloat16_weight_in_bfloat16(calibration):
  """qwix's eager quotients of a bfloat16 weight (x / scale, and minmax's zero point) are
  divisions in bfloat16, which a TPU computes by a method of its own (not float32's rounded:
  1e-4 of the quotients differ on a v5e, BENCHMARKS §26); the re-quantization divides so too,
  and fences each step from the next as qwix's eager programs are. The CPU divides bfloat16 as
  float32 rounded, so only the program can show it here."""
  w = jnp.ones((64, 8), jnp.bfloat16)
  recipe = quantized.Recipe('int8', None, calibration)
  jaxpr = jax.make_jaxpr(lambda x: quantized.requantize(x, recipe, (0,)))(w).jaxpr
  eqns = list(_equations(jaxpr))
  divisions = [e for e in eqns if e.primitive.name == 'div']
  in_bf16 = [e for e in divisions if all(v.aval.dtype == jnp.bfloat16 for v in e.invars)]
  assert any(e.outvars[0].aval.shape == (64, 8) for e in in_bf16), divisions
  if calibration == 'minmax':  # The zero point's low / scale: one per channel.
    assert any(e.outvars[0].aval.shape == (1, 8) for e in in_bf16), divisions
  fences = [e for e in eqns if e.primitive.name == 'optimization_barrier']
  assert len(fences) >= 6, len(fences)


# --- merges ------------------------------------------------------------------------


@pytest.mark.parametrize('name', RECIPES)
def test_full_save_merges_onto_its_dequantized_base(runs, mesh, name):
  """No `base`: the save's quantized base is the one merged onto; the plain model with
  the merged weights computes the QLoRA model's logits."""
  run = runs[name]
  target = abstract_weights('qwix', mesh, jnp.float32)
  plan = merge.plan_merge(run['root'] / 'full', merge.MergeOptions(alpha=lm.ALPHA))
  assert any('saved quantized' in n for n in plan.notes), plan.notes
  merged = ot.restore_merged_lora(run['root'] / 'full', target, lora_alpha=lm.ALPHA)
  right = np.abs(forward('qwix', merged) - run['logits']).max()
  # The float base merged instead is another model (what a silent float merge wrote).
  floats = ot.restore_merged_lora(run['root'] / 'only', target, lora_alpha=lm.ALPHA,
                                  base=run['root'] / 'base')
  wrong = np.abs(forward('qwix', floats) - run['logits']).max()
  if run['dtype'] == jnp.float32:
    assert right <= F32_ATOL and wrong > 5 * F32_ATOL, (right, wrong)
  else:  # bfloat16 through the network blurs both; the quantized base is still the nearer.
    assert right < wrong / 2, (right, wrong)


def test_a_full_save_merge_compiles_one_program_per_kind_of_weight(runs, mesh, monkeypatch):
  """The dequantize runs inside the merge's program (issue 53): one program per kind of
  adapted weight (its scheme, shape, rank, scale and sharding), compiled on the compile
  thread while the parts are read, none for the dequantize alone; the merge still as the
  formula computes it from qwix's dequantize."""
  run = runs['int8_minmax_tile4']
  target = abstract_weights('qwix', mesh, jnp.float32)
  merged, threads = compiled_on_threads(monkeypatch, lambda: ot.restore_merged_lora(
      run['root'] / 'full', target, alpha=lm.ALPHA))
  merges = merge.plan_merge(run['root'] / 'full', merge.MergeOptions(alpha=lm.ALPHA)).merges
  leaves = dict(flatten(target)[0])
  kinds = {(m.base.leaf.quantized, m.contraction, m.scale, leaves[p].sharding)
           for p, m in merges.items()}
  assert len(merges) > len(kinds) and len(threads) == len(kinds), (threads, kinds)
  assert all(t.startswith('orbax_tunix-compile') for t in threads), threads
  got = dict(flatten(merged)[0])
  for path, expected in _merged_by_formula(run).items():
    np.testing.assert_allclose(np.asarray(got[path]), expected, atol=1e-6, err_msg=fmt(path))


def _merged_by_formula(run) -> dict:
  """Each adapted weight of a full save merged, from the raw parts plain Orbax reads: qwix's
  dequantize of the base plus the adapters' scaled product (float32)."""
  raw, out = _raw(run), {}
  for path, m in merge.plan_merge(run['root'] / 'full',
                                  merge.MergeOptions(alpha=lm.ALPHA)).merges.items():
    assert not m.contraction.reshape and not m.contraction.stacked
    w = np.asarray(qwix.dequantize(_qarray(raw, fmt(path))))
    delta = np.tensordot(raw[f'{fmt(path)}_lora_a/value'], raw[f'{fmt(path)}_lora_b/value'], 1)
    out[path] = w + m.scale * delta.transpose(m.contraction.permutation)
  return out


def test_the_next_process_loads_the_merges_programs_without_lowering_them(runs, tmp_path):
  """With JAX's persistent cache on (as the commands keep it), the merge's programs are kept
  under their own key (`executables`): a second process loads them and lowers none; an entry
  that does not load is compiled again and kept anew; `ORBAX_TUNIX_EXECUTABLE_CACHE=0` keeps
  none. Every process's weights are the formula's, in their targets' shardings and dtypes."""
  run, cache = runs['int8_minmax_tile4'], tmp_path / 'jax-cache'
  kept = cache / executables.SUBDIRECTORY
  expected = _merged_by_formula(run)

  def merge_in_a_process(name: str, **env: str) -> int:
    out = subprocess.run(
        [sys.executable, '-m', 'tests.merge_in_a_process', str(run['root'] / 'full'), str(cache),
         str(tmp_path / f'{name}.npz')], capture_output=True, text=True, timeout=600,
        check=False, cwd=clients.ROOT, env={**os.environ, 'PYTHONPATH': str(clients.ROOT), **env})
    assert out.returncode == 0, out.stderr[-3000:]
    said = json.loads(out.stdout.strip().splitlines()[-1])
    assert said['as_targets'], name
    got = np.load(tmp_path / f'{name}.npz')
    for path, value in expected.items():
      np.testing.assert_allclose(got[fmt(path)], value, atol=1e-6, err_msg=f'{name}: {fmt(path)}')
    return said['lowered']

  programs = merge_in_a_process('first')
  assert programs > 0 and len(list(kept.iterdir())) == programs
  assert merge_in_a_process('second') == 0
  for entry in kept.iterdir():  # Damaged: one byte of each changed.
    data = bytearray(entry.read_bytes())
    data[-1] ^= 0xFF
    entry.write_bytes(bytes(data))
  assert merge_in_a_process('damaged') == programs
  assert merge_in_a_process('after') == 0  # Kept anew.
  shutil.rmtree(kept)
  assert merge_in_a_process('off', ORBAX_TUNIX_EXECUTABLE_CACHE='0') == programs
  assert not kept.exists()


def test_full_save_with_a_base_is_refused_naming_quantization(runs):
  run = runs['int4_absmax']
  with pytest.raises(errors.LoraError, match='QLoRA save.*quantized.*int4'):
    merge.plan_merge(run['root'] / 'full', merge.MergeOptions(
        alpha=lm.ALPHA, base=run['root'] / 'base'))


def test_an_nf4_run_s_adapters_merge_onto_its_requantized_base_on_a_mesh(tmp_path, mesh):
  """A QLoRA run of an nf4 base, saved adapters-only (nf4's uint4 parts cannot be saved in
  full): merged onto its float base re-quantized as qwix did, into a target sharded over a
  mesh of explicit axes, it computes the run's logits."""
  base = lm.QwixLM(rngs=nnx.Rngs(0))
  builders.save_tunix(tmp_path / 'base', 1, base)
  model = lm.train(lm.with_qwix_lora(nnx.clone(base), weight_qtype='nf4'))
  with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckptr:
    ckptr.save(tmp_path / 'only' / '1', args=ocp.args.Composite(
        model_params=ocp.args.PyTreeSave(nnx.state(model, nnx.LoRAParam))))
  target = abstract_weights('qwix', mesh, jnp.float32)
  merged = ot.restore_merged_lora(tmp_path / 'only', target, lora_alpha=lm.ALPHA,
                                  base=tmp_path / 'base', base_qtype='nf4')
  values = flat_dict(merged)
  for path, leaf in flatten(target)[0]:
    assert values[path].sharding == leaf.sharding and values[path].dtype == leaf.dtype, path
  logits = np.asarray(model(jnp.asarray(lm.TOKENS)), np.float32)
  assert np.abs(forward('qwix', merged) - logits).max() <= F32_ATOL
  # The float base merged as it is, not re-quantized, is measurably another model.
  floats = ot.restore_merged_lora(tmp_path / 'only', target, lora_alpha=lm.ALPHA,
                                  base=tmp_path / 'base', base_qtype=None)
  assert np.abs(forward('qwix', floats) - logits).max() > 5 * F32_ATOL


@pytest.mark.parametrize('name', RECIPES)
def test_adapters_only_with_the_recipe_merges_onto_the_requantized_base(runs, mesh, name):
  run = runs[name]
  recipe = run['recipe']
  target = abstract_weights('qwix', mesh, jnp.float32)

  def restore(path, **keywords):
    return flat_dict(ot.restore_merged_lora(path, target, **keywords))

  given = dict(base=run['root'] / 'base', base_qtype=recipe['weight_qtype'],
               base_tile_size=recipe.get('tile_size'),
               base_calibration=recipe.get('weight_calibration_method'))
  merged = restore(run['root'] / 'only', alpha=lm.ALPHA, **given)
  full = restore(run['root'] / 'full', alpha=lm.ALPHA)
  right = np.abs(forward('qwix', nest(merged.items())) - run['logits']).max()
  if run['dtype'] == jnp.float32:
    assert right <= F32_ATOL, right
  # The full save's merge (its saved quantized base), weight for weight: the sum may round
  # differently in another compiled program (a fused multiply-add), by a float32 step of
  # the largest addend.
  for path, value in merged.items():
    want = np.asarray(full[path], np.float32)
    np.testing.assert_allclose(np.asarray(value, np.float32), want, rtol=0,
                               atol=2 * float(np.spacing(np.abs(want).max())), err_msg=str(path))
  # With a scale of 0 the merge adds nothing: the re-quantized base is the saved one, exactly.
  requantized = restore(run['root'] / 'only', scale=0.0, **given)
  saved = restore(run['root'] / 'full', scale=0.0)
  for path, value in requantized.items():
    np.testing.assert_array_equal(np.asarray(value), np.asarray(saved[path]), err_msg=str(path))


def test_adapters_only_without_the_recipe_says_it_cannot_tell(runs):
  run = runs['int8_minmax_tile4']
  plan = merge.plan_merge(run['root'] / 'only', merge.MergeOptions(
      alpha=lm.ALPHA, base=run['root'] / 'base'))
  assert any('cannot tell whether' in n and 'base_qtype' in n for n in plan.notes), plan.notes


@pytest.mark.parametrize('keywords,match', [
    (dict(base_qtype='int3'), 'qtype .int3.: expected one of int8, int4'),
    (dict(base_qtype='float8_e4m3fn', base_calibration='minmax'), 'minmax with qtype float8'),
    (dict(base_tile_size=4), '`base_tile_size` given without `base_qtype`'),
    (dict(base_qtype='int8', base_tile_size=0), 'tile size 0: expected a positive integer'),
    (dict(base_qtype='int8', base_tile_size=3), 'tile size 3 does not divide axis'),
])
def test_a_recipe_that_does_not_fit_is_refused_before_any_read(runs, mesh, keywords, match):
  run = runs['int4_absmax']
  with pytest.raises(errors.LoraError, match=match):
    ot.restore_merged_lora(run['root'] / 'only', abstract_weights('qwix', mesh),
                           lora_alpha=lm.ALPHA, base=run['root'] / 'base', **keywords)


def test_a_recipe_without_a_base_is_refused(runs, mesh):
  with pytest.raises(errors.LoraError, match='`base_qtype=int8` without `base`'):
    ot.restore_merged_lora(runs['int4_absmax']['root'] / 'full', abstract_weights('qwix', mesh),
                           lora_alpha=lm.ALPHA, base_qtype='int8')


@pytest.mark.parametrize('name', ['int8_minmax_tile4', 'int8_bf16'])
def test_merges_compiled_at_the_lowest_effort_are_the_same_bits(runs, mesh, name, monkeypatch):
  """ORBAX_TUNIX_COMPILE_EFFORT=low (a TPU's default: `mapping/effort.py`): this JAX takes the
  option, and the re-quantizing and the full save's merges come out as at XLA's default
  effort, bit for bit, in the target's shardings and dtypes."""
  run, recipe = runs[name], runs[name]['recipe']
  target = abstract_weights('qwix', mesh, jnp.bfloat16)
  given = dict(base=run['root'] / 'base', base_qtype=recipe['weight_qtype'],
               base_tile_size=recipe.get('tile_size'),
               base_calibration=recipe.get('weight_calibration_method'))

  def both():
    return (flat_dict(ot.restore_merged_lora(run['root'] / 'only', target, alpha=lm.ALPHA,
                                             **given)),
            flat_dict(ot.restore_merged_lora(run['root'] / 'full', target, alpha=lm.ALPHA)))

  monkeypatch.setenv(effort.VARIABLE, 'default')
  default = both()
  monkeypatch.setenv(effort.VARIABLE, 'low')
  transforms._COMPILED.clear()
  low = both()
  options = {key[-1] for key in transforms._COMPILED}
  assert options == {effort.compiler_options(list(flat_dict(target).values())[:1])}, options
  assert options != {()}
  wanted = flat_dict(target)
  for at_default, at_low in zip(default, low, strict=True):
    assert at_default.keys() == at_low.keys() == wanted.keys()
    for path, value in at_low.items():
      assert value.sharding == wanted[path].sharding and value.dtype == jnp.bfloat16, path
      np.testing.assert_array_equal(np.asarray(value), np.asarray(at_default[path]),
                                    err_msg=str(path))

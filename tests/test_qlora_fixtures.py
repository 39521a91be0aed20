"""The committed QLoRA fixtures hold what their MANIFEST.json entries say, read with plain Orbax,
TensorStore and qwix only (no orbax_tunix code).

`scripts/make_tunix_fixtures.py` wrote them with google-tunix 0.1.7 + qwix 0.1.8 (a LoraProvider
rule with `weight_qtype`) and recorded, from the in-memory trees, each leaf's path, shape and
dtype, the recipe (qtype, tile, calibration) and, per quantized weight, the axes qwix chose.
Here the files are checked against that record, and against the float base they started from:
re-quantizing the base with the recorded recipe must give the saved qvalue, scale and zero point
bit for bit (bfloat16 included), which is what an adapters-only merge relies on.
"""

from __future__ import annotations

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import qwix
import tensorstore as ts

from tests import builders
from tests.conftest import DATA

MANIFEST = json.loads((DATA / 'MANIFEST.json').read_text())['fixtures']
REFERENCE = json.loads((DATA / 'lora_reference.json').read_text())
QLORA = sorted(name for name, entry in MANIFEST.items() if 'qlora' in entry)
FULL = [name for name in QLORA if not MANIFEST[name]['qlora']['saved'].startswith('adapters')]
ONLY = [name for name in QLORA if name not in FULL]


def step_of(name: str) -> int:
  return MANIFEST[name]['steps'][-1]


@functools.cache
def raw(name: str, item: str = 'model_params') -> dict[str, np.ndarray]:
  return builders.raw_leaves(DATA / name / str(step_of(name)) / item)


@functools.cache
def quantizer(qtype: str, channelwise: tuple[int, ...], tiled: tuple[tuple[int, int], ...],
              calibration: str):
  """qwix.quantize with a recipe, jitted once per recipe (the fixture script checked that jit
  and eager give the same bits)."""
  return jax.jit(lambda w: qwix.quantize(w, qtype, channelwise_axes=channelwise,
                                         tiled_axes=dict(tiled), calibration_method=calibration))


dequantize = jax.jit(qwix.dequantize)


def weight(leaves: dict[str, np.ndarray], path: str, field: str) -> np.ndarray | None:
  return leaves.get(f'{path}/array/{field}/value')


def scale_shape(shape: list[int], how: dict) -> tuple[int, ...]:
  """qwix's scale shape: the channel axes kept, a tiled axis divided by its tile, others 1."""
  tiled = {int(k): v for k, v in how['tiled_axes'].items()}
  return tuple(d if a in how['channelwise_axes'] else d // tiled[a] if a in tiled else 1
               for a, d in enumerate(shape))


def broadcast(scale: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
  """Each scale axis repeated to W's size (a scale covers shape/scale.shape values per axis)."""
  for axis, (n, s) in enumerate(zip(shape, scale.shape, strict=True)):
    scale = np.repeat(scale, n // s, axis=axis)
  return scale


def test_the_matrix_covers_every_axis():
  """Every qtype, calibration, tiling, save kind and family, and one bfloat16 run."""
  q = [MANIFEST[n]['qlora'] for n in QLORA]
  assert {x['qtype'] for x in q} == {'int8', 'int4', 'nf4', 'float8_e4m3fn'}
  assert {x['calibration'] for x in q} == {'absmax', 'minmax'}
  assert {x['tile_size'] for x in q} == {None, 4}
  assert {x['dtype'] for x in q} == {'float32', 'bfloat16'}
  for family in ('qwen3', 'gemma3'):
    assert {n in FULL for n in QLORA if MANIFEST[n]['family'] == family} == {True, False}


@pytest.mark.parametrize('name', QLORA)
def test_leaves_are_the_manifests(name):
  """Paths, shapes and dtypes on disk are the in-memory trees Tunix handed to Orbax."""
  for item, want in MANIFEST[name]['step_items'][str(step_of(name))]['items'].items():
    got = {path: (list(v.shape), str(v.dtype)) for path, v in raw(name, item).items()}
    assert got == {e['path']: (e['shape'], e['dtype']) for e in want}, (name, item)


@pytest.mark.parametrize('name', FULL)
def test_a_full_save_holds_the_quantized_base(name):
  """qvalue in W's shape and the qtype, scale in the run's dtype and qwix's scale shape, a zero
  point exactly with minmax; dequantized, finite and within a quantization step of the float
  base, while the float base is not the saved weight (the difference a merge must not miss)."""
  q = MANIFEST[name]['qlora']
  leaves, base = raw(name), raw(q['base'])
  assert sorted(q['quantized']) == sorted(
      p[:-len('/array/qvalue/value')] for p in leaves if p.endswith('/array/qvalue/value'))
  for path, how in q['quantized'].items():
    qvalue, scale = weight(leaves, path, 'qvalue'), weight(leaves, path, 'scale')
    zero_point = weight(leaves, path, 'zero_point')
    w = base[f'{path}/value']
    assert qvalue.shape == w.shape and str(qvalue.dtype) == q['qtype'], path
    assert scale.shape == scale_shape(list(w.shape), how) and str(scale.dtype) == q['dtype']
    assert (zero_point is not None) == (q['calibration'] == 'minmax'), path
    if zero_point is not None:
      assert zero_point.shape == scale.shape and zero_point.dtype == qvalue.dtype, path
    deq = dequantize(qwix.QArray(qvalue=jnp.asarray(qvalue), scale=jnp.asarray(scale),
                                      zero_point=None if zero_point is None else
                                      jnp.asarray(zero_point)))
    assert deq.dtype == scale.dtype and bool(jnp.isfinite(deq).all()), path
    w = np.asarray(w, np.float32)
    err = np.abs(np.asarray(deq, np.float32) - w)
    step = broadcast(np.asarray(scale, np.float32), w.shape)
    # One step of the integer grid (rounding, and the zero point's own with minmax); fp8 keeps
    # 3 mantissa bits: 1/16 of the value, a step near zero.
    bound = step + np.abs(w) / 16 if q['qtype'].startswith('float8') else step
    assert err.max() > 0 and (err <= bound).all(), path


def _eager_divides_truly() -> bool:
  """Whether this JAX's eager `array / python_float` is a true division (jax 0.12.1) or a
  product with the reciprocal (0.10.2, which wrote the fixtures): qwix's `absmax / qmax`."""
  x = np.linspace(1, 2, 257, dtype=np.float32)
  return bool(np.array_equal(np.asarray(jnp.asarray(x) / 127.5), x / np.float32(127.5)))


# The fixtures were quantized by qwix on jax 0.10.2. On a JAX whose eager division differs
# (0.12.1), qwix's own arithmetic differs too: measured on the int8 fixture, eagerly most float32
# scales take another last bit, and under jit (this check's) the scales agree but 0.2-0.4 % of the
# qvalues are one step off. Which weights differ depends on the values (bfloat16 and nf4 agree),
# so the mark is not strict there; on the fixtures' own JAX every case must hold. (orbax_tunix
# follows the running JAX as qwix does: tests/test_qlora.py checks it against qwix on each stack.)
OTHER_DIVISION = pytest.mark.xfail(
    _eager_divides_truly() != (
        tuple(int(v) for v in MANIFEST[FULL[0]]['versions']['jax'].split('.')[:2]) >= (0, 12)),
    strict=False,
    reason='qwix on this JAX quantizes a float32 base otherwise than on the fixtures\' jax')


@pytest.mark.parametrize('name', [
    pytest.param(n, marks=OTHER_DIVISION) if MANIFEST[n]['qlora']['dtype'] == 'float32'
    and MANIFEST[n]['qlora']['qtype'] != 'nf4' else n for n in FULL])
def test_requantizing_the_float_base_gives_the_save_bit_for_bit(name):
  """qwix.quantize of the base fixture's weight with the recorded recipe and axes is the saved
  qvalue, scale and zero point, byte for byte."""
  q = MANIFEST[name]['qlora']
  leaves, base = raw(name), raw(q['base'])
  for path, how in q['quantized'].items():
    tiled = tuple((int(k), v) for k, v in how['tiled_axes'].items())
    requantize = quantizer(q['qtype'], tuple(how['channelwise_axes']), tiled, q['calibration'])
    again = requantize(jnp.asarray(base[f'{path}/value']))
    for field in ('qvalue', 'scale', 'zero_point'):
      saved, mine = weight(leaves, path, field), getattr(again, field)
      if saved is None:
        assert mine is None, (path, field)
        continue
      mine = np.asarray(mine)
      assert (mine.dtype, mine.shape) == (saved.dtype, saved.shape), (path, field)
      assert mine.tobytes() == saved.tobytes(), (path, field)


@pytest.mark.parametrize('name', ONLY)
def test_an_adapters_only_save_looks_like_plain_lora(name):
  """Only `<w>_lora_a` / `<w>_lora_b`: nothing says the base was quantized."""
  targets = MANIFEST[name]['qlora']['targets']
  assert set(raw(name)) == {f'{t}_lora_{ab}/value' for t in targets for ab in 'ab'}


def test_the_bfloat16_run_saved_both_ways_holds_the_same_adapters():
  full, only = raw('hf_qwen3_bf16_qlora'), raw('hf_qwen3_bf16_qlora_only')
  assert only and all(np.asarray(v).dtype == jnp.bfloat16 for v in only.values())
  for path, value in only.items():
    assert value.tobytes() == full[path].tobytes(), path


@pytest.mark.parametrize('name', QLORA)
def test_the_reference_logits_are_recorded(name):
  ref, entry = REFERENCE[name], MANIFEST[name]
  assert ref['tokens'] == entry['tokens']
  logits = np.asarray(ref['logits'])
  vocab = entry['model_config'].get('vocab_size', entry['model_config'].get('num_embed'))
  assert logits.shape == (*np.asarray(ref['tokens']).shape, vocab) and np.isfinite(logits).all()


def zarr_metadata(name: str, leaf: str) -> tuple[dict, ts.TensorStore]:
  """A leaf's zarr metadata (.zarray) and the array, opened through TensorStore."""
  kv = {'driver': 'ocdbt', 'base': {'driver': 'file',
                                    'path': str(DATA / name / str(step_of(name)) / 'model_params')}}
  key = leaf.replace('/', '.')
  store = ts.KvStore.open(kv).result()
  meta = json.loads(store.read(f'{key}/.zarray').result().value)
  array = ts.open({'driver': 'zarr', 'kvstore': {**kv, 'path': f'{key}/'}}).result()
  return meta, array


@pytest.mark.parametrize('name, leaf, zarr_dtype, dtype', [
    ('hf_qwen3_bf16_qlora', 'layers/0/mlp/gate_proj/kernel/array/qvalue/value', 'int4', 'int4'),
    ('hf_qwen3_bf16_qlora', 'layers/0/mlp/gate_proj/kernel/array/zero_point/value', 'int4',
     'int4'),
    ('hf_qwen3_bf16_qlora', 'layers/0/mlp/gate_proj/kernel/array/scale/value', 'bfloat16',
     'bfloat16'),
    ('hf_gemma3_qlora_int8', 'layers/0/attn/kv_einsum/w/array/zero_point/value', '|i1', 'int8'),
    ('hf_gemma3_fused_qlora_fp8', 'layers/0/attn/qkv_einsum/w/array/qvalue/value',
     'float8_e4m3fn', 'float8_e4m3fn'),
])
def test_orbax_writes_the_qtypes_as_zarr_dtypes(name, leaf, zarr_dtype, dtype):
  meta, array = zarr_metadata(name, leaf)
  assert meta['dtype'] == zarr_dtype and array.dtype.name == dtype

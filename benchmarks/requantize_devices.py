"""Which program re-quantizes a QLoRA base as the run did, on which kind of device.

Tunix quantizes a QLoRA run's frozen base in `qwix.apply_lora_to_model`, which calls the
model once, eagerly (qwix/_src/model.py `quantize_nnx_model`; tunix/cli/utils/model.py calls it
outside any jit): every jnp op of qwix's `quantize` is then dispatched alone, in the weight's
dtype, on the weight's device. This compares, per qtype, calibration, tiling and base dtype,
on each device kind JAX has here, the base qwix makes that way (the reference) with:

  qwix_jit   the same qwix calls under one jax.jit (XLA may fuse and rewrite them);
  ours       orbax_tunix's `quantized.requantize`, eagerly on the device's array;
  ours_jit   the same compiled, as the merge compiles it (inside the merge's program);
  cpu        the reference computed on the CPU (what an export on a CPU host reproduces);

and prints, for each, the fraction of elements that differ and the largest difference in
quantization steps. Then, on a small random transformer (QLoRA's targets quantized), the
logits' change when the base is re-quantized on the CPU instead of the accelerator, against
bfloat16's own noise (the same model computed in bfloat16 and in float32).

  python benchmarks/requantize_devices.py [--quick]

It needs qwix (the `test` extra); on an accelerator host, carry it with the wheels
(benchmarks/accelerator_wheels.sh, plus qwix and flax).
"""

from __future__ import annotations

import argparse
import itertools
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
import qwix

from orbax_tunix.reading import quantized

QTYPES = {'int8': jnp.int8, 'int4': jnp.int4, 'float8_e4m3fn': jnp.float8_e4m3fn, 'nf4': 'nf4'}


def _qwix(w, qtype, calibration, tile):
  """qwix's quantize then dequantize of a (in, out) kernel contracted on axis 0 (per output
  channel; tiled on the contracting axis), as its LoRA provider quantizes a dot_general's."""
  q = qwix.quantize(w, QTYPES[qtype], channelwise_axes=[1],
                    tiled_axes={0: tile} if tile else None, calibration_method=calibration)
  return qwix.dequantize(q)


def _ours(w, qtype, calibration, tile):
  recipe = quantized.Recipe(qtype=qtype, tile_size=tile, calibration=calibration)
  return quantized.requantize(w, recipe, (0,))


def _steps(a, b, ref) -> tuple[float, float]:
  """Fraction of elements of `a` and `b` that differ; largest difference in steps of `ref`'s
  per-channel resolution (its smallest nonzero gap)."""
  a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
  diff = a != b
  if not diff.any():
    return 0.0, 0.0
  col = np.sort(np.asarray(ref, np.float32), axis=0)
  gaps = np.diff(col, axis=0)
  step = np.where(gaps > 0, gaps, np.inf).min(axis=0)
  return float(diff.mean()), float((np.abs(a - b) / step).max())


def compare(device, cpu, shape, quick) -> list[dict]:
  rows = []
  rng = np.random.default_rng(0)
  host = rng.normal(0, 0.02, shape).astype(np.float32)
  cases = itertools.product(('bfloat16', 'float32'), QTYPES, ('absmax', 'minmax'),
                            (None, 128))
  for dtype, qtype, calibration, tile in cases:
    if calibration == 'minmax' and qtype in ('float8_e4m3fn', 'nf4'):
      continue  # qwix calibrates minmax only for integer types
    if quick and (tile or calibration == 'minmax'):
      continue
    w = jax.device_put(host.astype(dtype), device)
    ref = _qwix(w, qtype, calibration, tile)  # eager, as apply_lora_to_model runs it
    jitted = jax.jit(lambda x, q=qtype, c=calibration, t=tile: _qwix(x, q, c, t))(w)
    on_cpu = _qwix(jax.device_put(host.astype(dtype), cpu), qtype, calibration, tile)
    err = ''
    try:
      ours = _ours(w, qtype, calibration, tile)
      ours_jit = jax.jit(lambda x, q=qtype, c=calibration, t=tile: _ours(x, q, c, t))(w)
    except Exception as e:  # noqa: BLE001 - an experiment: the row says what failed
      ours = ours_jit = None
      err = f'{type(e).__name__}: {e}'
    row = {'dtype': dtype, 'qtype': qtype, 'calibration': calibration, 'tile': tile}
    for name, got in (('qwix_jit', jitted), ('ours', ours), ('ours_jit', ours_jit),
                      ('cpu', on_cpu)):
      row[name] = err if got is None else _steps(got, ref, ref)
    rows.append(row)
    print(json.dumps(row), flush=True)
  return rows


def _model(key, layers, d, f, vocab):
  ks = jax.random.split(key, 4 * layers + 1)
  p = {'embed': jax.random.normal(ks[0], (vocab, d)) * 0.02}
  for i in range(layers):
    k = ks[1 + 4 * i:5 + 4 * i]
    p[f'{i}'] = {'qkv': jax.random.normal(k[0], (d, 3 * d)) * d ** -0.5,
                 'o': jax.random.normal(k[1], (d, d)) * d ** -0.5,
                 'up': jax.random.normal(k[2], (d, 2 * f)) * d ** -0.5,
                 'down': jax.random.normal(k[3], (f, d)) * f ** -0.5}
  return p


def _forward(p, tokens, layers, dtype):
  x = p['embed'][tokens].astype(dtype)
  n = x.shape[-1]
  heads = max(1, n // 128)
  for i in range(layers):
    w = p[f'{i}']
    h = x / jnp.sqrt(jnp.mean(jnp.square(x.astype(jnp.float32)), -1, keepdims=True) + 1e-6
                     ).astype(dtype)
    q, k, v = jnp.split(h @ w['qkv'].astype(dtype), 3, -1)
    q, k, v = (t.reshape(*t.shape[:-1], heads, -1) for t in (q, k, v))
    logits = jnp.einsum('qnh,knh->nqk', q[0], k[0]) / jnp.sqrt(q.shape[-1]).astype(dtype)
    mask = jnp.tril(jnp.ones(logits.shape[-2:], bool))
    att = jax.nn.softmax(jnp.where(mask, logits, -1e9).astype(jnp.float32), -1).astype(dtype)
    x = x + (jnp.einsum('nqk,knh->qnh', att, v[0]).reshape(1, -1, n) @ w['o'].astype(dtype))
    h = x / jnp.sqrt(jnp.mean(jnp.square(x.astype(jnp.float32)), -1, keepdims=True) + 1e-6
                     ).astype(dtype)
    g, u = jnp.split(h @ w['up'].astype(dtype), 2, -1)
    x = x + (jax.nn.silu(g) * u) @ w['down'].astype(dtype)
  return (x @ p['embed'].T.astype(dtype)).astype(jnp.float32)


def logits_effect(device, cpu, layers, d, f, vocab, qtype, tile) -> dict:
  """The logits' change when the MLP base is re-quantized on the CPU rather than `device`,
  against bfloat16's noise (the device-quantized model in bfloat16 vs in float32)."""
  p = jax.device_put(_model(jax.random.key(1), layers, d, f, vocab), device)
  p = jax.tree.map(lambda a: a.astype(jnp.bfloat16), p)
  tokens = jax.device_put(jnp.arange(64)[None] % vocab, device)

  def quantize(params, on):
    out = dict(params)
    for i in range(layers):
      out[f'{i}'] = {k: (jax.device_put(_qwix(jax.device_put(v, on), qtype, 'absmax', tile),
                                        device) if k in ('up', 'down') else v)
                     for k, v in params[f'{i}'].items()}
    return out

  run = quantize(p, device)
  cpu_base = quantize(p, cpu)
  differ = np.mean([np.mean(np.asarray(run[f'{i}'][k], np.float32)
                            != np.asarray(cpu_base[f'{i}'][k], np.float32))
                    for i in range(layers) for k in ('up', 'down')])
  f32 = _forward(run, tokens, layers, jnp.float32)
  bf16 = _forward(run, tokens, layers, jnp.bfloat16)
  other = _forward(cpu_base, tokens, layers, jnp.float32)
  other_bf16 = _forward(cpu_base, tokens, layers, jnp.bfloat16)
  return {'qtype': qtype, 'tile': tile, 'layers': layers, 'd': d, 'f': f,
          'elements_differ': float(differ),
          'max_abs_logit': float(jnp.abs(f32).max()),
          'cpu_requant_vs_run_f32': float(jnp.abs(other - f32).max()),
          'cpu_requant_vs_run_bf16': float(jnp.abs(other_bf16 - bf16).max()),
          'bf16_noise': float(jnp.abs(bf16 - f32).max())}


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  ap.add_argument('--quick', action='store_true')
  args = ap.parse_args()
  device = jax.devices()[0]
  cpu = jax.devices('cpu')[0]
  print(json.dumps({'backend': jax.default_backend(), 'device': str(device.device_kind),
                    'jax': jax.__version__, 'qwix': getattr(qwix, '__version__', '?')}))
  t = time.time()
  compare(device, cpu, (512, 384) if args.quick else (2048, 1536), args.quick)
  for qtype, tile in (('int8', None), ('int4', 128), ('nf4', 128), ('float8_e4m3fn', None)):
    dims = (2, 256, 512, 512) if args.quick else (4, 1024, 2816, 2048)
    print(json.dumps(logits_effect(device, cpu, *dims, qtype, tile)), flush=True)
  print(json.dumps({'seconds': time.time() - t}))


if __name__ == '__main__':
  main()

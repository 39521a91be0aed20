"""What XLA's effort costs and gives for the package's kind of device programs, on this backend.

Per square size N and per program, each compiled at XLA's default effort and at the lowest
(`mapping/effort.py`'s options, which the package passes on a TPU), side by side in one process
(one compile first, unmeasured: a process's first compile also starts the compiler):

  merge      a LoRA merge of a bfloat16 NxN weight, rank 16, scale 2 (`merge.combine`)
  qmerge     the same onto an int8 weight dequantized by its per-channel scale
             (`dequantize.dequantize`, then `merge.combine`: a QLoRA merge)
  requant    `quantized.requantize` of a bfloat16 NxN weight (int8, per channel): the base an
             adapters-only QLoRA merge re-quantizes

The formulas are the package's own; each effort's options are `effort.options_for`'s.

Reported: the compile's wall at each effort (best of `--reps`, each a fresh jit) and their
ratio, the compiled program's run time at each, and whether the two give the same bits.
What it explains: why the package compiles at the lowest effort on a TPU and not on the CPU
(BENCHMARKS §31).

  python benchmarks/compile_effort.py [--sizes 1024,2048,4096] [--reps 2]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..'))


def _programs(n: int, rng):
  """name -> (function, arguments) for size `n` (see the module)."""
  import ml_dtypes  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top

  from orbax_tunix.mapping import dequantize, lora, merge  # pylint: disable=g-import-not-at-top
  from orbax_tunix.reading import quantized  # pylint: disable=g-import-not-at-top

  bf16 = ml_dtypes.bfloat16
  recipe = quantized.Recipe('int8')
  w = rng.standard_normal((n, n)).astype(bf16)
  a, b = rng.standard_normal((n, 16)).astype(bf16), rng.standard_normal((16, n)).astype(bf16)
  merged = merge.combine(lora.contraction(w.shape, a.shape, b.shape), 2.0)

  def qmerge(q, s, a, b):
    return merged(dequantize.dequantize(q, s), a, b)

  def requant(w):
    return quantized.requantize(w, recipe, (0,)).astype(w.dtype)

  q = rng.integers(-127, 128, (n, n)).astype(np.int8)
  s = (rng.random((1, n)) / 100).astype(bf16)
  return {'merge': (merged, (w, a, b)), 'qmerge': (qmerge, (q, s, a, b)),
          'requant': (requant, (w,))}


def _renamed(fn, name: str):
  """`fn` under another name: a program of another name, which no cache of JAX's holds."""
  def renamed(*args):
    return fn(*args)
  renamed.__name__ = renamed.__qualname__ = name
  return renamed


def measure(sizes, reps: int) -> list[dict]:
  """One row per size and program (see the module)."""
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top

  from orbax_tunix.mapping import effort  # pylint: disable=g-import-not-at-top

  sharding = [jax.sharding.SingleDeviceSharding(jax.devices()[0])]  # Where the programs run.
  efforts = {e: dict(effort.options_for(e, sharding)) or None for e in ('default', 'low')}
  jax.config.update('jax_enable_compilation_cache', False)  # Every compile measured whole.
  jax.jit(lambda x: x + 1).lower(np.float32(0)).compile()  # The compiler started, unmeasured.
  rows = []
  rng = np.random.default_rng(0)
  for n in sizes:
    for name, (fn, host) in _programs(n, rng).items():
      args = [jax.device_put(x) for x in host]
      compile_s = {e: [] for e in efforts}
      run_s, bits = {}, {}
      for rep in range(reps):
        order = list(efforts) if rep % 2 == 0 else list(efforts)[::-1]
        for e in order:
          lowered = jax.jit(_renamed(fn, f'{name}_{n}_{rep}_{e}'),
                            compiler_options=efforts[e]).lower(*args)
          t = time.perf_counter()
          compiled = lowered.compile()
          compile_s[e].append(time.perf_counter() - t)
          out = compiled(*args).block_until_ready()
          t = time.perf_counter()
          for _ in range(5):
            out = compiled(*args)
          out.block_until_ready()
          run_s[e] = min(run_s.get(e, np.inf), (time.perf_counter() - t) / 5)
          bits[e] = np.asarray(out).tobytes()
      best = {e: min(v) for e, v in compile_s.items()}
      rows.append({'size': n, 'program': name, **{f'compile_{e}_s': best[e] for e in efforts},
                   **{f'run_{e}_s': run_s[e] for e in efforts},
                   'same_bits': bits['default'] == bits['low']})
  return rows


def main(argv=None) -> None:
  import jax  # pylint: disable=g-import-not-at-top

  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--sizes', default='1024,2048,4096')
  parser.add_argument('--reps', type=int, default=2)
  args = parser.parse_args(argv)
  device = jax.devices()[0]  # The backend JAX_PLATFORMS picks; its first device.
  print(f'Command: `python benchmarks/compile_effort.py --sizes {args.sizes} --reps {args.reps}`')
  print(f'Backend: {device.platform} ({device.device_kind}); compiles best of {args.reps}'
        ', runs best of 5 per compile')
  print('\n| N | program | compile, default | compile, lowest | default / lowest '
        '| run, default | run, lowest | same bits |')
  print('|---|---|---|---|---|---|---|---|')
  for r in measure([int(s) for s in args.sizes.split(',')], args.reps):
    print(f"| {r['size']} | {r['program']} | {r['compile_default_s'] * 1e3:.0f} ms "
          f"| {r['compile_low_s'] * 1e3:.0f} ms "
          f"| {r['compile_default_s'] / r['compile_low_s']:.2f} "
          f"| {r['run_default_s'] * 1e3:.2f} ms | {r['run_low_s'] * 1e3:.2f} ms "
          f"| {'yes' if r['same_bits'] else 'NO'} |", flush=True)


if __name__ == '__main__':
  main()

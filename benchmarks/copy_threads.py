"""The safetensors sink's copy of transposed matrices into C order, on one thread and on many.

Each thread copies matrices of its own, stored `ROWSxCOLS` and written transposed (as a
Hugging Face kernel of a Tunix weight is), in the sink's blocks of rows
(`writer.row_pieces`, `memory.COPY_BUFFER_BYTES`) into a buffer of one block, as the sink's
threads do, side by side:

  sink    `writer.copy_rows`: a block's strips in one numpy call (the GIL released throughout)
  loop    the copy before 00e2c01: one numpy copy per strip of `writer.STRIP` columns, from a
          Python loop (the GIL taken back for every strip)

Every copy is checked against numpy's own. Reported: GB/s (the matrices' bytes over the
slowest thread's wall, the best of `--reps`) per shape, dtype and thread count. What it
explains: on a many-core host the loop's threads copied slower together than one alone
(BENCHMARKS §30).

  python benchmarks/copy_threads.py [--shapes 4096x12288,12288x4096] [--threads 1,13] [--reps 3]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import sys
import time

import ml_dtypes
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..'))
from orbax_tunix.reading import memory  # noqa: E402
from orbax_tunix.writing import writer  # noqa: E402


def loop(part: np.ndarray, out: np.ndarray) -> None:
  """The copy before 00e2c01: a Python loop of one numpy copy per strip."""
  src, dst = writer._raw(part), writer._raw(out)  # noqa: SLF001  (the sink's own view)
  for col in range(0, part.shape[1], writer.STRIP):
    dst[:, col:col + writer.STRIP] = src[:, col:col + writer.STRIP]


CONTENDERS = {'sink': writer.copy_rows, 'loop': loop}


def copy_all(copy, stored: np.ndarray, out: np.ndarray) -> None:
  """`stored.T` into `out` block by block, through one block's buffer, as the sink does."""
  view = stored.T
  buffer = np.empty(writer.row_pieces(view, memory.COPY_BUFFER_BYTES)[0][1].shape, view.dtype)
  for first, piece in writer.row_pieces(view, memory.COPY_BUFFER_BYTES):
    block = buffer[:piece.shape[0]]
    copy(piece, block)
    out[first:first + piece.shape[0]] = block


def measure(shape: tuple[int, int], dtype: np.dtype, threads: int, reps: int) -> dict[str, float]:
  """GB/s of each contender: `threads` threads, each copying a matrix of its own."""
  stored = [np.random.default_rng(i).random(shape, np.float32).astype(dtype)
            for i in range(threads)]
  outs = [np.empty(shape[::-1], dtype) for _ in stored]
  best: dict[str, float] = {}
  with concurrent.futures.ThreadPoolExecutor(threads) as pool:
    for _ in range(reps):
      for name, copy in CONTENDERS.items():
        for out in outs:
          out.fill(0)
        start = time.perf_counter()
        list(pool.map(lambda i, c=copy: copy_all(c, stored[i], outs[i]), range(threads)))
        seconds = time.perf_counter() - start
        for s, out in zip(stored, outs, strict=True):
          if not np.array_equal(writer._raw(s.T), writer._raw(out)):  # noqa: SLF001
            raise SystemExit(f'{name}: the copy of {shape} {dtype} differs from numpy\'s')
        best[name] = min(best.get(name, float('inf')), seconds)
  nbytes = sum(s.nbytes for s in stored)
  return {name: nbytes / seconds / 1e9 for name, seconds in best.items()}


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--shapes', default='4096x12288,12288x4096',
                      help='stored shapes, ROWSxCOLS, comma-separated')
  parser.add_argument('--dtypes', default='float32,bfloat16')
  parser.add_argument('--threads', default=f'1,{memory.host_threads()}',
                      help="thread counts, comma-separated (default: 1 and the writer's threads'"
                      ' bound, `memory.host_threads`)')
  parser.add_argument('--reps', type=int, default=3)
  args = parser.parse_args(argv)
  shapes = [tuple(int(n) for n in s.split('x')) for s in args.shapes.split(',')]
  dtypes = [np.dtype(getattr(ml_dtypes, d, d)) for d in args.dtypes.split(',')]
  counts = [int(n) for n in args.threads.split(',')]
  print(f'Command: `python benchmarks/copy_threads.py --shapes {args.shapes} --dtypes '
        f'{args.dtypes} --threads {args.threads} --reps {args.reps}` on {memory.host_threads()} CPUs'
        ' (this process may use)\n')
  print('| stored | dtype | threads | sink GB/s | loop GB/s | sink / loop |')
  print('|---|---|---|---|---|---|')
  for shape in shapes:
    for dtype in dtypes:
      for threads in counts:
        got = measure(shape, dtype, threads, args.reps)
        print(f'| {shape[0]} x {shape[1]} | {dtype.name} | {threads} | {got["sink"]:.2f} | '
              f'{got["loop"]:.2f} | {got["sink"] / got["loop"]:.2f} |', flush=True)


if __name__ == '__main__':
  main()

"""Peak memory and time of planning one adapter's PEFT factors (`mapping/peft.py`), at Llama-3-8B's
shapes, one case per process (the peak is the process's):

    python benchmarks/peft_planning.py mlp|q|llama

mlp: an MLP kernel (D, F) transposed; q: an attention kernel (D, N, H) as `IN_PROJ`; llama:
MaxText's llama query (deinterleaved head_dim, then `IN_PROJ`). No array is read.
"""

import resource
import sys
import time

from orbax_tunix.mapping import huggingface as hf
from orbax_tunix.mapping import lora, peft
from orbax_tunix.mapping.transforms import chain, deinterleave, transpose

D, F, N, H, R = 4096, 14336, 32, 128, 16
CASES = {
    'mlp': (lora.Contraction((D, F), False, (0, 1)), transpose(), (D, R), (R, F)),
    'q': (lora.Contraction((D, N, H), False, (0, 1, 2)), hf.IN_PROJ, (D, R), (R, N, H)),
    'llama': (lora.Contraction((D, N, H), False, (0, 1, 2)), chain(deinterleave(-1), hf.IN_PROJ),
              (D, R), (R, N, H)),
}


def main(name: str) -> None:
  contraction, transform, a, b = CASES[name]
  before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
  start = time.perf_counter()
  found = peft.Factors.of(contraction, transform, a, b)
  assert not isinstance(found, str), found
  peak = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
  print(f'{name}: {time.perf_counter() - start:.2f} s, peak RSS +{peak:.0f} MiB')


if __name__ == '__main__':
  main(sys.argv[1])

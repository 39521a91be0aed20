"""Peak memory and time of planning one adapter's PEFT factors (`mapping/peft.py`), at Llama-3-8B's
shapes, one case per process (the peak is the process's):

    python benchmarks/peft_planning.py mlp|q|llama [--devices N]

mlp: an MLP kernel (D, F) transposed; q: an attention kernel (D, N, H) as `IN_PROJ`; llama:
MaxText's llama query (deinterleaved head_dim, then `IN_PROJ`). No array is read. The peak
is above the RSS before the planning (`harness.measure`; n/a where the host has no counter).
"""

import argparse

import harness  # sibling module; the script's directory is on sys.path

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


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('case', choices=CASES)
  harness.add_flags(parser, cpu_default=1)
  args = parser.parse_args(argv)
  devices = harness.use_devices(args.devices, cpu_default=1)
  contraction, transform, a, b = CASES[args.case]
  found, figures = harness.measure(lambda: peft.Factors.of(contraction, transform, a, b), devices)
  assert not isinstance(found, str), found
  print(f'{args.case}: {figures["wall_s"]:.2f} s, peak RSS +{harness.mib(figures["peak_rss_bytes"])}'
        f' MiB, device peak {harness.mib(figures["device_peak_bytes"])} MiB'
        f' ({harness.describe_line(harness.describe(devices))})')


if __name__ == '__main__':
  main()

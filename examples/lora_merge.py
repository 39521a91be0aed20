"""Restores a LoRA run's weights merged into its base, on a simulated 8-device mesh.

  python examples/lora_merge.py [LORA_RUN BASE] [--alpha A]

By default: the committed fixtures written by the real google-tunix,
tests/data/tunix/lora_qwix (qwix LoRA, rank 2, alpha 4; adapters only, as
Tunix's PeftTrainer saves them) and tests/data/tunix/lora_base (the model
that run started from). The target is the plain model's weights in bfloat16,
split over a (data=4, model=2) mesh where they divide; it is built here from
the base checkpoint's canonical metadata (a trainer would use its own model's
abstract state).
"""

from __future__ import annotations

import os
import sys

# Eight CPU devices; this must happen before jax is imported.
os.environ['XLA_FLAGS'] = (
    os.environ.get('XLA_FLAGS', '') + ' --xla_force_host_platform_device_count=8'
).strip()
os.environ.setdefault('JAX_PLATFORMS', 'cpu')

import argparse  # noqa: E402
import pathlib  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

import orbax_tunix  # noqa: E402

DATA = pathlib.Path(__file__).resolve().parent.parent / 'tests' / 'data' / 'tunix'


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('paths', nargs='*', default=[DATA / 'lora_qwix', DATA / 'lora_base'])
  parser.add_argument('--alpha', type=float, default=4.0)
  args = parser.parse_args(argv)
  lora_run, base = args.paths
  mesh = jax.make_mesh((4, 2), ('data', 'model'))

  def sharded(meta):
    spec = [None] * len(meta.shape)
    if len(meta.shape) == 2 and meta.shape[1] % 2 == 0:
      spec[1] = 'model'
    return jax.ShapeDtypeStruct(meta.shape, jnp.bfloat16,
                                sharding=NamedSharding(mesh, PartitionSpec(*spec)))

  step_dir = orbax_tunix.detect(base).step_dir
  meta = orbax_tunix.TunixPyTreeHandler().metadata(step_dir / 'model_params')
  target = jax.tree.map(sharded, meta.tree)
  merged = orbax_tunix.restore_merged_lora(lora_run, target, lora_alpha=args.alpha, base=base)
  leaves = jax.tree_util.tree_flatten_with_path(merged)[0]
  print(f'merged {lora_run} into {base}: {len(leaves)} weights')
  for path, value in leaves:
    name = '/'.join(str(getattr(k, 'key', k)) for k in path)
    print(f'  {name:<32} {value.dtype} {tuple(value.shape)} {value.sharding.spec}')


if __name__ == '__main__':
  main(sys.argv[1:])

"""A QLoRA run: its quantized base read dequantized, and its adapters merged, on 8 devices.

  python examples/qlora.py [QLORA_RUN] [--alpha A]

By default the committed fixture written by the real google-tunix and qwix,
tests/data/tunix/hf_gemma3_qlora_int8 (Tunix's Gemma3 class, its einsums and MLP frozen as int8
in tiles of 4 with minmax calibration, qwix LoRA rank 2, alpha 3, saved in full). The targets
are built here from the run's canonical metadata, in bfloat16, split over a (data=4, model=2)
mesh where the weights divide (a trainer would use its own model's abstract state).
"""

from __future__ import annotations

import os

# Eight CPU devices; this must happen before jax is imported.
os.environ['XLA_FLAGS'] = (
    os.environ.get('XLA_FLAGS', '') + ' --xla_force_host_platform_device_count=8'
).strip()
os.environ.setdefault('JAX_PLATFORMS', 'cpu')

import argparse  # noqa: E402
import pathlib  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

import orbax_tunix  # noqa: E402

DATA = pathlib.Path(__file__).resolve().parent.parent / 'tests' / 'data' / 'tunix'


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('run', nargs='?', default=DATA / 'hf_gemma3_qlora_int8')
  parser.add_argument('--alpha', type=float, default=3.0)
  args = parser.parse_args(argv)
  mesh = jax.make_mesh((4, 2), ('data', 'model'))

  def sharded(meta):
    spec = [None] * len(meta.shape)
    if meta.shape and meta.shape[-1] % 2 == 0:
      spec[-1] = 'model'
    return jax.ShapeDtypeStruct(meta.shape, jnp.bfloat16,
                                sharding=NamedSharding(mesh, PartitionSpec(*spec)))

  step_dir = orbax_tunix.detect(args.run).step_dir
  meta = orbax_tunix.TunixPyTreeHandler().metadata(step_dir / 'model_params')
  # The canonical view: each quantized weight is one float weight (in its scale's dtype).
  weights = jax.tree.map(sharded, meta.tree)
  restored = ocp.Checkpointer(orbax_tunix.TunixAwareHandler()).restore(
      step_dir, args=ocp.args.Composite(model_params=ocp.args.PyTreeRestore(item=weights)))
  w = restored['model_params']['layers']['0']['mlp']['up_proj']['kernel']
  print(f'dequantized layers/0/mlp/up_proj/kernel: {w.dtype} {tuple(w.shape)} {w.sharding.spec}')
  # The model that was trained: the adapters merged onto the dequantized base (no `base`).
  merged = orbax_tunix.restore_merged_lora(args.run, plain(weights), lora_alpha=args.alpha)
  leaves = jax.tree_util.tree_flatten_with_path(merged)[0]
  print(f'merged {step_dir}: {len(leaves)} weights of the plain model, e.g.')
  for path, value in leaves[:4]:
    name = '/'.join(str(getattr(k, 'key', k)) for k in path)
    print(f'  {name:<36} {value.dtype} {tuple(value.shape)} {value.sharding.spec}')


def plain(tree):
  """The plain model's weights: the LoRA adapters left out."""
  if not isinstance(tree, dict):
    return tree
  return {k: plain(v) for k, v in tree.items() if not k.endswith(('_lora_a', '_lora_b'))}


if __name__ == '__main__':
  main()

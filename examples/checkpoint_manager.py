"""Restore Tunix steps through ocp.CheckpointManager, into a sharded target.

  python examples/checkpoint_manager.py [ROOT]

Uses 8 simulated CPU devices so the sharding is real on any machine.
"""

import os

os.environ.setdefault('XLA_FLAGS', '--xla_force_host_platform_device_count=8')

import pathlib  # noqa: E402
import sys  # noqa: E402

import jax  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import orbax_tunix  # noqa: E402

DEFAULT = pathlib.Path(__file__).resolve().parents[1] / 'tests/data/tunix/sft_full'


def main(root: pathlib.Path) -> None:
  # read_only: a restore never writes, locks or cleans anything under the source.
  mngr = ocp.CheckpointManager(
      root.resolve(),
      options=ocp.CheckpointManagerOptions(read_only=True),
      handler_registry=orbax_tunix.handler_registry(),
  )
  step = mngr.latest_step()
  print(f'{root}: steps {mngr.all_steps()}, restoring {step}')

  # A canonical target for the weights: shapes from the canonical metadata,
  # the first axis sharded over 'data' where it divides, stored as bfloat16.
  mesh = jax.make_mesh((4, 2), ('data', 'model'))
  meta = orbax_tunix.TunixPyTreeHandler().metadata(root / str(step) / 'model_params').tree

  def target(m):
    spec = P('data') if m.shape and m.shape[0] % 4 == 0 else P()
    return jax.ShapeDtypeStruct(m.shape, jax.numpy.bfloat16, sharding=NamedSharding(mesh, spec))

  abstract = jax.tree.map(target, meta)
  restored = mngr.restore(step, args=ocp.args.Composite(
      model_params=ocp.args.PyTreeRestore(item=abstract)))
  for keypath, leaf in jax.tree_util.tree_leaves_with_path(restored['model_params'])[:5]:
    print(f'  {jax.tree_util.keystr(keypath)}  {leaf.dtype}{list(leaf.shape)}  {leaf.sharding.spec}')
  everything = mngr.restore(step)  # no arguments: both items, canonical
  print('items restored without arguments:', sorted(everything.keys()))
  mngr.close()


if __name__ == '__main__':
  main(pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT)

"""Quickstart: restore a Tunix checkpoint with plain Orbax calls.

  python examples/quickstart.py [PATH]

PATH defaults to a tiny checkpoint written by the real google-tunix package
(shipped in tests/data/tunix). Prints what it found and what it restored.
"""

import pathlib
import sys

import jax
import orbax.checkpoint as ocp

import orbax_tunix

DEFAULT = pathlib.Path(__file__).resolve().parents[1] / 'tests/data/tunix/adapter_inject_clip'


def main(path: pathlib.Path) -> None:
  found = orbax_tunix.detect(path)
  print(f'{path}: {found.kind} checkpoint, step {found.step} ({found.step_dir})')
  for item, rules in found.rewrites.items():
    print(f'  {item}: rewrites {", ".join(rules) or "none"}')

  # The drop-in: one Orbax Checkpointer. Its metadata is the canonical trees;
  # the restore target says where each array goes (here: this machine's first
  # device), so the restore does not depend on the topology it was saved on.
  ckptr = ocp.Checkpointer(orbax_tunix.TunixAwareHandler())
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  trees = ckptr.metadata(found.step_dir).item_metadata
  args = {
      item: ocp.args.PyTreeRestore(item=jax.tree.map(
          lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device), tree))
      for item, tree in trees.items()
  }
  state = ckptr.restore(found.step_dir, args=ocp.args.Composite(**args))
  for item, tree in state.items():
    leaves = jax.tree_util.tree_leaves_with_path(tree)
    nbytes = sum(leaf.nbytes for _, leaf in leaves)
    print(f'restored {item}: {len(leaves)} arrays, {nbytes} bytes')
    for keypath, leaf in leaves[:4]:
      print(f'  {jax.tree_util.keystr(keypath)}  {leaf.dtype}{list(leaf.shape)}')
  for shell, values in orbax_tunix.hyperparameters(found.step_dir).items():
    print(f'hyperparameters at {shell}: ' + ', '.join(f'{k}={float(v):g}' for k, v in sorted(values.items())))


if __name__ == '__main__':
  main(pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT)

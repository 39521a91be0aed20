"""Orbax v1: load a Tunix step with ocp.v1 after one registration call.

  python examples/v1_load.py [STEP_DIR]
"""

import pathlib
import sys

import jax
import orbax.checkpoint as ocp

import orbax_tunix

DEFAULT = pathlib.Path(__file__).resolve().parents[1] / 'tests/data/tunix/v1_writer/2'


def main(step_dir: pathlib.Path) -> None:
  # Any trainer can pick up every installed Orbax plugin this way; or call
  # orbax_tunix.register() directly.
  print('plugins loaded:', orbax_tunix.load_plugins())
  state = ocp.v1.load_checkpointables(step_dir.resolve())
  for item, tree in sorted(state.items()):
    paths = [jax.tree_util.keystr(kp) for kp, _ in jax.tree_util.tree_leaves_with_path(tree)]
    print(f'{item}: {len(paths)} leaves, e.g. {paths[0]}')


if __name__ == '__main__':
  main(pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT)

"""The hyperparameters held by an `optax.inject_hyperparams` shell.

The canonical view leaves the shell out; its scalars stay readable here. Only
those scalars are read.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from orbax_tunix import rules
from orbax_tunix.detect import detect
from orbax_tunix.tree_paths import Path, flat_dict, fmt, nest


def _hyperparam_name(path: Path, shells: frozenset[Path]) -> tuple[Path, str] | None:
  """(shell path, name) for a leaf `<shell>/hyperparams/<name>[/value]`."""
  for shell in shells:
    n = len(shell)
    if path[:n] == shell and path[n : n + 1] == ('hyperparams',) and len(path) > n + 1:
      return shell, path[n + 1]
  return None


def hyperparameters(path: epath.PathLike) -> dict[str, dict[str, Any]]:
  """Reads the hyperparameters of every inject_hyperparams shell of a step.

  Args:
    path: a Tunix root, step or item directory.

  Returns:
    Shell location (canonical, e.g. 'opt_state' or 'opt_state/1') ->
    {name: value} with numpy scalars (e.g. {'learning_rate': 1e-3, 'b1': 0.9}).
    Empty when the optimizer has no shell.

  Raises:
    TunixCheckpointError subclasses, as `detect()`.
  """
  detection = detect(path)
  layout = detection.layouts.get(rules.OPTIMIZER_ITEM)
  if layout is None:
    return {}
  shell_rewrites = [r for r in layout.rewrites if r.rule is rules.INJECT_SHELL]
  if not shell_rewrites:
    return {}
  shells = shell_rewrites[0].anchors
  wanted = {}
  for disk in sorted(layout.side_paths):
    # Shell anchors are in the coordinates the shell rule saw (e.g. without
    # the nnx value level); match each leaf in those.
    found = _hyperparam_name(layout.path_before(rules.INJECT_SHELL, disk), shells)
    if found is not None:
      wanted[disk] = found
  if not wanted:
    return {}
  item_dir = detection.step_dir / rules.OPTIMIZER_ITEM
  restored = ocp.PyTreeCheckpointHandler().restore(
      item_dir,
      args=ocp.args.PyTreeRestore(
          item=nest((d, 0) for d in wanted),
          restore_args=nest((d, ocp.RestoreArgs(restore_type=np.ndarray)) for d in wanted),
          partial_restore=True,
      ),
  )
  values = flat_dict(restored)
  out: dict[str, dict[str, Any]] = {}
  for disk, (shell, name) in wanted.items():
    out.setdefault(fmt(_canonical_shell(shell, shells)), {})[name] = np.asarray(values[disk])[()]
  return out


def _canonical_shell(shell: Path, shells: frozenset[Path]) -> Path:
  """A shell's location with the inner_state levels of enclosing shells removed."""
  return tuple(
      k for i, k in enumerate(shell) if not (k == 'inner_state' and shell[:i] in shells)
  )

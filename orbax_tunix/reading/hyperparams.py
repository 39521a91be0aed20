"""The hyperparameters held by an `optax.inject_hyperparams` shell.

The canonical view leaves the shell out; its scalars stay readable here: the
hyperparameters by name (`hyperparameters`), and every leaf the view leaves
out, the shell's `count` and hyperparameter states too (`side_leaves`, which
`diff` compares). Only those scalars are read.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from orbax_tunix import conventions
from orbax_tunix.keypaths import Path, fmt
from orbax_tunix.reading.planned_item import Reads
from orbax_tunix.view import rules
from orbax_tunix.view.detection import Detection, detect

# How a scalar is read: to the host, as saved.
AS_NUMPY = ocp.RestoreArgs(restore_type=np.ndarray)
# Where a step `convert` wrote records its source's side leaves (under
# `checksums.RECORD_KEY` of its custom metadata): {label: `checksums.as_record` value}.
RECORD_KEY = 'inject_hyperparams'


def _hyperparam_name(path: Path, shells: frozenset[Path]) -> tuple[Path, str] | None:
  """(shell path, name) for a leaf `<shell>/hyperparams/<name>[/value]`."""
  for shell in shells:
    n = len(shell)
    if path[:n] == shell and path[n : n + 1] == ('hyperparams',) and len(path) > n + 1:
      return shell, path[n + 1]
  return None


def hyperparameters(path: epath.PathLike, *, step: int | None = None) -> dict[str, dict[str, Any]]:
  """Reads the hyperparameters of every inject_hyperparams shell of a step.

  Args:
    path: a Tunix root, step or item directory (or an optimizer item saved on
      its own).
    step: the step wanted under a root (None: the latest committed one).

  Returns:
    Shell location (canonical, e.g. 'opt_state' or 'opt_state/1') ->
    {name: value} with numpy scalars (e.g. {'learning_rate': 1e-3, 'b1': 0.9}).
    Empty when the optimizer has no shell.

  Raises:
    MissingItemError: the step records an optimizer item that is not on disk.
    TunixCheckpointError subclasses, as `detect()`.
  """
  detection = detect(path, step=step, roles=(conventions.OPTIMIZER_ITEM,))
  found = hyperparameter_leaves(detection)
  if found is None:
    return {}
  item, wanted = found
  return by_shell(wanted, read_side_leaves(detection, {d: (item, d) for d in wanted}))


def hyperparameter_leaves(detection: Detection) -> tuple[str, dict[Path, tuple[str, str]]] | None:
  """Where the hyperparameters of a detected step sit; nothing is read.

  Returns:
    (item, {on-disk path: (canonical shell location, name)}) for the item
    holding inject_hyperparams shells, or None when none holds any.
  """
  for name, cmap in detection.maps.items():
    shells = next((r.anchors for r in cmap.rewrites if r.rule is rules.INJECT_SHELL), None)
    if shells is None:
      continue
    wanted = {}
    for disk in sorted(cmap.side_paths):
      # Shell anchors are in the coordinates the shell rule saw (e.g. without
      # the nnx value level); match each leaf in those.
      found = _hyperparam_name(cmap.path_before(rules.INJECT_SHELL, disk), shells)
      if found is not None:
        shell, key = found
        wanted[disk] = (fmt(rules.INJECT_SHELL.to_canonical(shell, shells)), key)
    if wanted:
      return name, wanted
  return None


def by_shell(wanted: Mapping[Path, tuple[str, str]], values: Mapping[Path, Any]) -> dict[str, dict[str, Any]]:
  """The values read for `hyperparameter_leaves`, as `hyperparameters` returns them."""
  out: dict[str, dict[str, Any]] = {}
  for disk, (shell, key) in wanted.items():
    out.setdefault(shell, {})[key] = np.asarray(values[disk])[()]
  return out


def side_leaves(detection: Detection) -> dict[str, tuple[str, Path]]:
  """Every leaf the canonical view leaves out, under a label; nothing is read.

  The label is `<item>/<shell>/<field>/...`, the shell at its canonical
  location and the field as the shell holds it, e.g.
  `optimizer_state/opt_state/hyperparams/learning_rate` and
  `optimizer_state/opt_state/count`; empty nodes (`hyperparams_states: {}`)
  are structure and left out.

  Returns:
    label -> (item, on-disk path).
  """
  out = {}
  for name, cmap in detection.maps.items():
    meta = detection.item_meta(name)
    shells = next((r.anchors for r in cmap.rewrites if r.rule is rules.INJECT_SHELL), None)
    for disk in sorted(cmap.side_paths):
      if meta.by_path[disk].is_empty:
        continue
      where = disk
      before = cmap.path_before(rules.INJECT_SHELL, disk) if shells else None
      shell = next((s for s in shells if before[:len(s)] == s), None) if before else None
      if shell is not None:
        where = rules.INJECT_SHELL.to_canonical(shell, shells) + before[len(shell):]
      out[fmt((name, *where))] = (name, disk)
  return out


def read_side_leaves(
    detection: Detection, leaves: Mapping[str, tuple[str, Path]]
) -> dict[str, Any]:
  """The values of `side_leaves` (or some of them): one read per item holding them."""
  reads = Reads()
  for item, disk in leaves.values():
    reads.want(detection, item, disk, (0, AS_NUMPY))
  reads.read(on_disk=True)
  return {label: reads.got(detection, item, disk) for label, (item, disk) in leaves.items()}


def hyperparameters_of(
    detection: Detection, side: Mapping[str, Any], leaves: Mapping[str, tuple[str, Path]]
) -> dict[str, dict[str, Any]]:
  """`hyperparameters`, from side leaves already read (`read_side_leaves`)."""
  found = hyperparameter_leaves(detection)
  if found is None:
    return {}
  item, wanted = found
  by_disk = {where: side[label] for label, where in leaves.items()}
  return by_shell(wanted, {d: by_disk[(item, d)] for d in wanted})

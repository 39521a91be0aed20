"""Checking the target's weights against the checkpoint's, before any read.

Besides listing weights found on one side only, it recognises the two cases that
explain a whole set of them at once: a LoRA-only checkpoint, and scanned vs
unscanned layers of a naming no layer form knows (MaxText's are re-laid:
`maxtext/layers.py`), inferred from paths and shapes for the message.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping, Sequence

from etils import epath

from orbax_tunix import conventions, errors
from orbax_tunix.keypaths import Path, fmt
from orbax_tunix.mapping import lora
from orbax_tunix.mapping.patterns import Mapped
from orbax_tunix.maxtext.view import CheckpointView, Shape


def check_weights(
    view: CheckpointView,
    target: Mapping[Path, Path],
    target_shapes: Mapping[Path, Shape | None],
    relaid: Mapping[Path, Mapped],
    aux: Collection[Path],
) -> list[str]:
  """Checks the target's weights against the checkpoint's.

  Args:
    view: the checkpoint.
    target: canonical weight path -> target leaf path.
    target_shapes: target leaf path -> shape.
    relaid: the checkpoint's weights in the target's layer form (`layers.relayout`).
    aux: canonical paths of non-weight variables (never required).

  Returns:
    Message sections for a generic mismatch (empty when all is well).

  Raises:
    LoraOnlyCheckpointError, LayerScanMismatchError: those two cases, which
      explain a whole set of missing leaves at once.
  """
  used = {s for w in target if w in relaid for s in relaid[w].sources}
  missing = [w for w in target if w not in relaid and w not in view.model]
  extra = sorted(w for w in view.model if w not in used and w not in aux) if target else []
  sections = []
  if missing or extra:
    disk_weights = sorted(w for w in view.model if w not in aux)
    needed_full = [w for w in missing if not lora.is_adapter(w)]
    if disk_weights and all(lora.is_adapter(w) for w in disk_weights) and needed_full:
      raise errors.LoraOnlyCheckpointError(
          f'{view.step_dir}: the checkpoint holds only LoRA adapter weights'
          f' ({len(disk_weights)} leaves), but the target needs full weights:'
          f' {len(needed_full)} target weights are not in it, e.g.\n'
          f'{errors.list_paths([fmt(target[w]) for w in needed_full])}\n'
          f'The checkpoint has:\n{errors.list_paths([fmt(w) for w in disk_weights])}\n'
          'A Tunix LoRA run saves only the adapters. Merge them into the base'
          ' weights the run started from: `restore_train_state(path, abstract,'
          ' params_only=True, merge_lora=True, lora_alpha=ALPHA, lora_base=BASE)`.'
      )
    # (name for messages, shape) of the leaves found on one side only.
    extra_shapes = view.shapes(conventions.MODEL_ITEM, extra)
    disk_only = {w: (fmt(w), extra_shapes.get(w)) for w in extra}
    target_only = {w: (fmt(target[w]), target_shapes[target[w]]) for w in missing}
    scanned_target = _stackings(disk_only, target_only)
    scanned_disk = _stackings(target_only, disk_only)
    if scanned_target or scanned_disk:
      raise errors.LayerScanMismatchError(
          _scan_message(view.step_dir, scanned_target, scanned_disk, len(missing), len(extra))
      )
    if missing:
      sections.append(
          f'{len(missing)} target weights are not in the checkpoint:\n'
          + errors.list_paths([f'{fmt(target[w])} (checkpoint path {fmt(w)})' for w in missing])
      )
    if extra:
      sections.append(
          f'{len(extra)} weights in the checkpoint are not in the target:\n'
          + errors.list_paths(
              [f'{fmt(w)} (stored as {view.stored(conventions.MODEL_ITEM, w)})' for w in extra])
      )
      if all(lora.is_adapter(w) for w in extra):
        sections.append(
            'They are LoRA adapters: pass `params_only=True, merge_lora=True,'
            ' lora_alpha=ALPHA` to restore the weights with the adapters merged.'
        )
    sections.append(
        'Build the abstract state from the model the checkpoint was trained'
        ' with (same parameter names; target params/params/<w> is the'
        " checkpoint's <w>); `orbax_tunix.detect(path).maps` lists the"
        " checkpoint's canonical paths."
    )
  return sections


def _scan_message(
    step_dir: epath.Path,
    scanned_target: Sequence[str],
    scanned_disk: Sequence[str],
    n_missing: int,
    n_extra: int,
) -> str:
  """The `LayerScanMismatchError` message: the stacked leaves of each side, and the fix."""
  parts = [
      f'{step_dir}: scanned vs unscanned layers. Tunix records neither; this is'
      ' inferred from the paths and shapes.'
  ]
  for scanned, unscanned, stackings in (
      ('target', 'checkpoint', scanned_target),
      ('checkpoint', 'target', scanned_disk),
  ):
    if stackings:
      parts.append(
          f'The {scanned} is SCANNED (one array per weight holding every layer) and'
          f' the {unscanned} UNSCANNED (one array per layer): {len(stackings)}'
          f' {scanned} weights ({scanned} <-> {unscanned}):\n'
          + errors.list_paths(list(stackings))
      )
  parts.append(
      f'In all, {n_missing} target weights are not in the checkpoint and'
      f' {n_extra} checkpoint weights not in the target. Build the abstract'
      ' state with the same layer layout as the checkpoint (MaxText:'
      f' scan_layers={"False" if scanned_target else "True"}), or convert the'
      ' checkpoint first.'
  )
  return '\n'.join(parts)


# A layer index as a key of its own ('layers/0/...', nnx.List) or a name suffix
# ('layers_0/...', Linen's unscanned layers).
_INDEXED_NAME = re.compile(r'(.+)_(\d+)')


def _unindexed(path: Path) -> tuple[Path, int] | None:
  """The path without its first layer index, and that index ('layers/0' or 'layers_0')."""
  for i, key in enumerate(path):
    if key.isdigit():
      return path[:i] + path[i + 1:], int(key)
    if m := _INDEXED_NAME.fullmatch(key):
      return path[:i] + (m.group(1),) + path[i + 1:], int(m.group(2))
  return None


def _stackings(per_layer: Mapping[Path, tuple[str, Shape | None]],
               stacked: Mapping[Path, tuple[str, Shape | None]]) -> list[str]:
  """Each stacked leaf with the per-layer leaves that would make it, for people: its
  shape, theirs, and the axis holding them (path -> (name, shape) on each side)."""
  groups: dict[Path, list[tuple[int, Path]]] = {}
  for path in per_layer:
    if (found := _unindexed(path)) is not None:
      groups.setdefault(found[0], []).append((found[1], path))
  pairs = []
  for path, (name, shape) in sorted(stacked.items()):
    layers = sorted(groups.get(path, ()))
    if layers:
      one = per_layer[layers[0][1]][1]
      axis = next((a for a, size in enumerate(shape or ()) if size == len(layers)
                   and one is not None and shape[:a] + shape[a + 1:] == one), None)
      pairs.append(f'{name} {shape} <-> {len(layers)} per-layer leaves'
                   f' {per_layer[layers[0][1]][0]}, ... {one} ('
                   + ('no layer axis fits' if axis is None else f'layer axis {axis}') + ')')
  return pairs

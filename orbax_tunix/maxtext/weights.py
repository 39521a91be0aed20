"""Checking the target's weights against the checkpoint's, before any read.

Besides listing weights found on one side only, it recognises the two cases that
explain a whole set of them at once: scanned vs unscanned layers (inferred from
paths and shapes: `mapping.stacks.stackings`) and a LoRA-only checkpoint.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

from etils import epath

from orbax_tunix import conventions, errors
from orbax_tunix.keypaths import Path, fmt
from orbax_tunix.mapping import lora, stacks
from orbax_tunix.maxtext.view import CheckpointView, Shape


def check_weights(
    view: CheckpointView,
    target: Mapping[Path, Path],
    target_shapes: Mapping[Path, Shape | None],
    aux: Collection[Path],
) -> list[str]:
  """Checks the target's weights against the checkpoint's.

  Args:
    view: the checkpoint.
    target: canonical weight path -> target leaf path.
    target_shapes: target leaf path -> shape.
    aux: canonical paths of non-weight variables (never required).

  Returns:
    Message sections for a generic mismatch (empty when all is well).

  Raises:
    LoraOnlyCheckpointError, LayerScanMismatchError: those two cases, which
      explain a whole set of missing leaves at once.
  """
  missing = [w for w in target if w not in view.model]
  extra = sorted(w for w in view.model if w not in target and w not in aux) if target else []
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
    scanned_target = stacks.stackings(disk_only, target_only)
    scanned_disk = stacks.stackings(target_only, disk_only)
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
    scanned_target: Sequence[stacks.Stacking],
    scanned_disk: Sequence[stacks.Stacking],
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
          + errors.list_paths([str(s) for s in stackings])
      )
  parts.append(
      f'In all, {n_missing} target weights are not in the checkpoint and'
      f' {n_extra} checkpoint weights not in the target. Build the abstract'
      ' state with the same layer layout as the checkpoint (MaxText:'
      f' scan_layers={"False" if scanned_target else "True"}), or convert the'
      ' checkpoint first.'
  )
  return '\n'.join(parts)

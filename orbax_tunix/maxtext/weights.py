"""Checking the target's weights against the checkpoint's, before any read.

Besides listing weights found on one side only, it recognises a LoRA-only checkpoint,
which explains a whole set of them at once. (Layers in the other form than the target's
are re-laid, or refused, by their `LayerForm`: `mapping/step_layers.py`.)
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from orbax_tunix import conventions, errors
from orbax_tunix.keypaths import Path, fmt
from orbax_tunix.mapping import lora
from orbax_tunix.mapping.patterns import Mapped
from orbax_tunix.reading import reader


def check_weights(
    source: reader.Source,
    target: Mapping[Path, Path],
    relaid: Mapping[Path, Mapped],
    aux: Collection[Path],
) -> list[str]:
  """Checks the target's weights against the checkpoint's.

  Args:
    source: the checkpoint, opened.
    target: canonical weight path -> target leaf path.
    relaid: the checkpoint's weights in the target's layer form (`step_layers.relayout`).
    aux: canonical paths of non-weight variables (never required).

  Returns:
    Message sections for a generic mismatch (empty when all is well).

  Raises:
    LoraOnlyCheckpointError: the checkpoint holds adapters alone, and the target needs
      the weights.
  """
  model = source.paths(conventions.MODEL_ITEM)
  used = {s for w in target if w in relaid for s in relaid[w].sources}
  missing = [w for w in target if w not in relaid and w not in model]
  extra = sorted(w for w in model if w not in used and w not in aux) if target else []
  sections = []
  if missing or extra:
    disk_weights = sorted(w for w in model if w not in aux)
    needed_full = [w for w in missing if not lora.is_adapter(w)]
    if disk_weights and all(lora.is_adapter(w) for w in disk_weights) and needed_full:
      raise errors.LoraOnlyCheckpointError(
          f'{source.step_dir}: the checkpoint holds only LoRA adapter weights'
          f' ({len(disk_weights)} leaves), but the target needs full weights:'
          f' {len(needed_full)} target weights are not in it, e.g.\n'
          f'{errors.list_paths([fmt(target[w]) for w in needed_full])}\n'
          f'The checkpoint has:\n{errors.list_paths([fmt(w) for w in disk_weights])}\n'
          'A Tunix LoRA run saves only the adapters. Merge them into the base'
          ' weights the run started from: `restore_train_state(path, abstract,'
          ' params_only=True, merge_lora=True, lora_alpha=ALPHA, base=BASE)`.'
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
              [f'{fmt(w)} (stored as {source.stored(conventions.MODEL_ITEM, w)})' for w in extra])
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


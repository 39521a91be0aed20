"""LoRA adapters among the weights, as their writers name them.

qwix (Tunix's LoRA) puts `<weight>_lora_a` / `<weight>_lora_b` beside the
weight they adapt; flax's `nnx.LoRA` and `nnx.LoRALinear` keep `lora_a` /
`lora_b` in the adapter module.
"""

from __future__ import annotations

from collections.abc import Iterable

from orbax_tunix.keypaths import Path

QWIX_SUFFIXES = ('_lora_a', '_lora_b')
FLAX_KEYS = frozenset({'lora_a', 'lora_b'})


def is_adapter(path: Path) -> bool:
  """Whether a weight path is a LoRA adapter leaf (either writer's naming)."""
  return any(key.endswith(QWIX_SUFFIXES) or key in FLAX_KEYS for key in path)


def adapters_only(paths: Iterable[Path]) -> bool:
  """Whether there are weights and every one is an adapter (a LoRA-only save)."""
  paths = list(paths)
  return bool(paths) and all(is_adapter(p) for p in paths)

"""The names other libraries give things, in one place.

Tunix's items and nnx's levels, MaxText's item and collection, and how each
tells model weights from other state. The rules, the handlers, the MaxText
view and the tools all take these names from here.
"""

from __future__ import annotations

from collections.abc import Collection

from orbax_tunix.keypaths import Path

# The two items every Tunix trainer writes (tunix/sft/checkpoint_manager.py).
MODEL_ITEM = 'model_params'
OPTIMIZER_ITEM = 'optimizer_state'
TUNIX_ITEMS = (MODEL_ITEM, OPTIMIZER_ITEM)
# The top-level keys of `nnx.state(optimizer, nnx.optimizer.OptState)`.
OPTIMIZER_KEYS = frozenset({'opt_state', 'step'})
# The record a step written by this package keeps in its custom metadata (its source, its
# checksums, a LoRA merge it holds): `tools/pipeline.py` writes it.
PROVENANCE_KEY = 'orbax_tunix'

# The optimizer's own step counter in Tunix's optimizer item (canonical path).
OPTIMIZER_STEP: Path = ('step',)

# nnx saves each Variable under its `value` attribute.
NNX_VALUE = 'value'
# nnx keeps RNG state (`rngs/<stream>/{count,key}`, `dropout/rngs/...`) among
# the weights; any path with this key is RNG state, not a weight.
RNG_KEY = 'rngs'
# MaxText's adapter (TunixMaxTextAdapter) puts the whole model under `base`.
ADAPTER_KEY = 'base'
# qwix saves a quantized weight (`QArray`, a QLoRA run's frozen base) as
# `<w>/array/{qvalue, scale[, zero_point]}`: the value first, then the rest.
QARRAY_KEY = 'array'
QVALUE, SCALE, ZERO_POINT = 'qvalue', 'scale', 'zero_point'
QARRAY_PARTS = (QVALUE, SCALE, ZERO_POINT)
# qwix names a weight `<w>`'s LoRA adapters `<w>_lora_a` and `<w>_lora_b`, beside it.
QWIX_LORA_A = '_lora_a'

# MaxText keeps one item, a Linen TrainState (MaxText 0.2.5 writes its NNX state
# in that layout): `params/params/<weights>` (the Linen `params` collection),
# `opt_state` (the optax chain's states as a list, `None` where one is empty),
# `step`, and `nnx_aux` for RNG and other non-weight variables (under nnx's
# `model` level in MaxText's `to_checkpoint_dict`).
MAXTEXT_ITEM = 'items'
MAXTEXT_PARAMS: Path = ('params', 'params')
MAXTEXT_OPT_STATE = 'opt_state'
MAXTEXT_STEP = 'step'
MAXTEXT_NNX_AUX = 'nnx_aux'
MAXTEXT_NNX_AUX_MODEL = 'model'
MAXTEXT_KEYS = (MAXTEXT_PARAMS[0], MAXTEXT_OPT_STATE, MAXTEXT_STEP, MAXTEXT_NNX_AUX)

# RL trainers nest each model's steps one level deeper: <root>/actor/<step>.
RL_ROLES = ('actor', 'critic')


def is_rng_state(path: Path) -> bool:
  """True for nnx RNG state (a path with an `rngs` key), which is no weight."""
  return RNG_KEY in path


# MaxText's AQT quantization keeps its state among the weights (`aqt` variables,
# `AqtEinsum_0`/`AqtDotGeneral_0` modules): no weight of the model either.
AQT_KEY = 'aqt'
AQT_MODULE_PREFIX = 'Aqt'


def is_quantization_state(path: Path) -> bool:
  """True for AQT's state in a MaxText model (an `aqt` key or an `Aqt...` module)."""
  return any(k == AQT_KEY or k.startswith(AQT_MODULE_PREFIX) for k in path)


def role(item: str, top_keys: Collection[str]) -> str | None:
  """Which Tunix item an item plays: by its name, else by its top-level keys.

  An item saved on its own (under any name) is the optimizer state when its
  keys are the optimizer's (`opt_state`, `step`), else the model.

  Returns:
    MODEL_ITEM, OPTIMIZER_ITEM, or None for an item that is neither (a step's
    third item, e.g. JSON metadata).
  """
  if item in TUNIX_ITEMS:
    return item
  keys = frozenset(top_keys)
  if keys and keys <= OPTIMIZER_KEYS and 'opt_state' in keys:
    return OPTIMIZER_ITEM
  return MODEL_ITEM

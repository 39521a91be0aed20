#!/usr/bin/env python3
"""Writes tiny Tunix checkpoints used as test fixtures.

Every fixture is written by the real ``google-tunix`` package (its
``tunix.sft.checkpoint_manager.CheckpointManager``), except ``v1_writer``, see
below. The script must run in a separate environment that has Tunix installed,
not in the project's own venv::

    python3 -m venv /work/tunix-venv
    /work/tunix-venv/bin/pip install "google-tunix==0.1.7" "jax==0.10.2" \\
        "flax==0.12.8" "optax==0.2.8" "orbax-checkpoint==0.12.8" "qwix==0.1.8"
    JAX_PLATFORMS=cpu /work/tunix-venv/bin/python scripts/make_tunix_fixtures.py

Each fixture is one checkpoint root directory under ``--out`` (deleted and
recreated on every run). ``--out/MANIFEST.json`` records, for each fixture, the
library versions, the optimizer and, for each saved item, every leaf's on-disk
key path ("a/b/c"), shape and dtype. The manifest is computed from the
in-memory trees handed to Tunix, not by reading the checkpoint back, so tests
can use it as ground truth independent of Orbax.

Fixtures:
  sft_full             full fine-tune, adamw, steps 1 and 2.
  lora_qwix            qwix LoRA on q_proj/k_proj; Tunix saves only LoRA params
                       (``save_only_lora_params=True``, as PeftTrainer does
                       whenever the model holds an ``nnx.LoRAParam``).
  adapter_inject       model wrapped as ``Adapter.base`` (MaxText's
                       TunixMaxTextAdapter pattern); inject_hyperparams(adamw)
                       with a learning-rate schedule.
  chain_clip           chain(clip_by_global_norm, adamw).
  grad_accum           MultiSteps(inject_hyperparams(adamw), every_k_schedule=2).
  adapter_inject_clip  adapter + chain(clip, inject_hyperparams(adamw)).
  own_base_module      a model with its own submodule named ``base`` (not an
                       adapter level), adamw.
  v1_writer            same as sft_full, written through the Orbax v1
                       ``training.Checkpointer.save_checkpointables`` the way
                       unreleased Tunix head does. Tunix 0.1.7 has no v1 path,
                       so this one fixture calls Orbax v1 directly with the
                       checkpointables Tunix head builds.
  rl_actor             RL layout: steps under ``<root>/actor/<step>/`` (Tunix's
                       RLCluster roots the actor's CheckpointManager there),
                       with the RL custom metadata.
  rng_vars             a model holding ``nnx.Rngs`` (and a Dropout with its own
                       RNG stream), so RNG variables sit among the weights.
  lora_base            the TinyLM lora_qwix starts from (same seed), saved in
                       full before any LoRA: the base of an adapters-only merge.
  lora_qwix_full       the same run as lora_qwix, saved in full
                       (``save_only_lora_params=False``): base weights and
                       adapters side by side.
  lora_flax            a model with flax's ``nnx.LoRALinear`` and
                       ``nnx.LoRA(base_module=nnx.Linear)``, adapters trained,
                       saved in full.

``--out/lora_reference.json`` holds, for each LoRA fixture, the tokens and the
logits the LoRA model itself computes on them (qwix or flax in the loop): what
a plain model with the merged weights must reproduce.

Hugging Face export fixtures (``hf_*``): Tunix's own model classes
(``tunix.models.{qwen3,llama3,gemma3}.model``), tiny, every dim distinct
(vocab 96, embed 40, mlp 56, heads 4, kv heads 2, head dim 12; embed != heads
and != kv heads, which gemma3's safetensors loader needs to tell its layouts
apart), float32. Every Param is replaced by seeded normals (Tunix initialises
MLP kernels to zeros and norms to constants), then trained by real
``optax.adamw`` steps; saved by the same CheckpointManager. Their manifest
entries add ``family``, ``model_config`` (the ModelConfig keyword arguments;
``*dtype`` values are dtype names), ``tokens`` (fixed (2, 7) tokens the tests
compute logits on) and, for LoRA, ``lora`` (rank, alpha, qwix module_path,
the adapted weights, the base fixture and step, and two figures measured when
the fixture was made: how far the adapters move the logits and how far a
float32 merge of them lands from the LoRA model's own logits).
  hf_qwen3             Qwen3, untied lm_head, q/k norms; adamw, step 1, with
                       the optimizer state.
  hf_llama3            Llama3, tied embeddings; steps 1 and 2 (one update
                       each), model only.
  hf_gemma3            Gemma3, 6 layers (5 sliding-window, 1 global: the
                       fixed Tunix pattern), GQA 4:2 (q_einsum + kv_einsum);
                       model only.
  hf_gemma3_fused      Gemma3, heads == kv heads (qkv_einsum), 2 layers;
                       model only.
  hf_qwen3_lora        hf_qwen3's step 1 (read back from disk) + qwix LoRA
                       (Tunix's usual targets: q/k/v/o_proj and
                       gate/up/down_proj; rank 2, alpha 3), adapters trained
                       three adamw steps, saved in full at step 3.
  hf_qwen3_lora_only   the same run, adapters only (as PeftTrainer saves);
                       its base is hf_qwen3 step 1.
  hf_qwen2, hf_qwen2_lora, hf_qwen3_moe, hf_qwen3_moe_lora, hf_gemma2,
  hf_gemma2_lora, hf_gemma, hf_gemma4, hf_gemma4_moe, hf_gemma_lora,
  hf_gemma4_lora, hf_gemma4_moe_lora
                       issue 29's families (tests/data/tunix/README.md says
                       what each holds); model only (the *_lora ones: qwix
                       LoRA on a base above, saved in full with the optimizer).

QLoRA fixtures (issue 45): a float base above read back, a qwix LoraRule with
``weight_qtype`` (rank 2, alpha 3), ``qwix.apply_lora_to_model`` (which quantizes
the adapted weights while it runs the model once, eagerly), adapters trained
three adamw(3e-2) steps, saved by Tunix's CheckpointManager. A compact matrix:
every qtype, calibration, tiling, save kind and family at least once.
  name                       base             qtype          tile cal.   save
  hf_qwen3_qlora_int8        hf_qwen3         int8           -    absmax full+opt
  hf_qwen3_qlora_int4_only   hf_qwen3         int4           4    absmax adapters
  hf_qwen3_qlora_nf4_only    hf_qwen3         nf4            4    absmax adapters+opt
  hf_qwen3_bf16_qlora        hf_qwen3_bf16    int4           4    minmax full
  hf_qwen3_bf16_qlora_only   hf_qwen3_bf16    int4           4    minmax adapters
  hf_gemma3_qlora_int8       hf_gemma3        int8           4    minmax full
  hf_gemma3_qlora_int4_only  hf_gemma3        int4           -    minmax adapters
  hf_gemma3_fused_qlora_fp8  hf_gemma3_fused  float8_e4m3fn  -    absmax full
  hf_qwen3_bf16              hf_qwen3 step 1 cast to bfloat16 (dtype and
                             param_dtype), model only: the bf16 runs' base.
qwen3 runs quantize the MLP (Tunix 0.1.7's qwen3 Einsum casts its weight with
jnp.astype, which fails on qwix's quantized weight at every forward after the
first); hf_qwen3_qlora_int8 adapts the attention with a second, plain LoRA rule.
nf4 runs are adapters-only: Orbax cannot save nf4's uint4 qvalue. The script
asserts, per quantized weight, that qwix.quantize of the float base with the
run's recipe (the axes qwix's einsum/dot_general choose) gives the live model's
qvalue, scale and zero point bit for bit, eagerly and under jit. Manifest
entries add ``qlora`` (recipe, rank, alpha, rules, targets, each quantized
weight's axes, base fixture and step, figures measured when the fixture was
made: how far the live QLoRA model's logits are from the float-base merge and
from the dequantized-base merge, in the run's dtype and in float32) and a
``lora`` record shaped as the LoRA fixtures'; ``lora_reference.json`` holds the
tokens and the live QLoRA model's logits (qwix in the loop).

The hf_* fixtures import Tunix's model modules, which set flax's
``flax_always_shard_variable`` to False process-wide: they are written after
the others (and each lora one after its base, whose files it reads). The
committed ones were written in /work/tunix-venv (the full install above); the
test venv with scripts/tunix_pkgs.sh's directory on PYTHONPATH writes the same
arrays and manifest entries (checked), without the full install::

    JAX_PLATFORMS=cpu PYTHONPATH="$(PYTHON=.venv/bin/python scripts/tunix_pkgs.sh | tail -1)" \
        .venv/bin/python scripts/make_tunix_fixtures.py --only hf_qwen3 hf_llama3 \
        hf_gemma3 hf_gemma3_fused hf_qwen3_lora hf_qwen3_lora_only hf_qwen2 hf_qwen2_lora \
        hf_qwen3_moe hf_qwen3_moe_lora hf_gemma2 hf_gemma2_lora hf_gemma hf_gemma4 hf_gemma4_moe \
        hf_gemma_lora hf_gemma4_lora hf_gemma4_moe_lora

The QLoRA fixtures were written this second way (their bases must exist in ``--out``)::

    JAX_PLATFORMS=cpu PYTHONPATH="$(PYTHON=.venv/bin/python scripts/tunix_pkgs.sh | tail -1)" \
        .venv/bin/python scripts/make_tunix_fixtures.py --only hf_qwen3_bf16 \
        hf_qwen3_qlora_int8 hf_qwen3_qlora_int4_only hf_qwen3_qlora_nf4_only \
        hf_qwen3_bf16_qlora hf_qwen3_bf16_qlora_only hf_gemma3_qlora_int8 \
        hf_gemma3_qlora_int4_only hf_gemma3_fused_qlora_fp8
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import qwix  # noqa: E402
from fixture_trees import describe_tree, flat, key_str  # noqa: E402  (beside this script)
from flax import nnx  # noqa: E402
from orbax.checkpoint import v1 as ocp_v1  # noqa: E402
from qwix._src.core import dot_general as qwix_dot_general  # noqa: E402  (qwix's own choice of
from qwix._src.core import einsum as qwix_einsum  # noqa: E402  axes, not public in qwix 0.1.8)
from tunix.sft import checkpoint_manager as tunix_ckpt  # noqa: E402
from tunix.sft import utils as tunix_sft_utils  # noqa: E402

# The models are the tests' own (one definition): the tests run them again.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.tunix_models import (  # noqa: E402
  BATCH,
  DIM,
  SEQ,
  VOCAB,
  FlaxLoraLM,
  TinyLM,
)

PACKAGES = ["google-tunix", "jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "qwix"]


# --------------------------------------------------------------------------- #
# Tiny models
# --------------------------------------------------------------------------- #
class Adapter(nnx.Module):
  """MaxText's TunixMaxTextAdapter pattern: the whole model under ``base``."""

  def __init__(self, model: nnx.Module):
    self.base = model

  def __call__(self, tokens):
    return self.base(tokens)


class OwnBaseModel(nnx.Module):
  """A model with a submodule of its own literally named ``base``."""

  def __init__(self, *, rngs: nnx.Rngs):
    self.embedder = nnx.Embed(VOCAB, DIM, rngs=rngs)
    self.base = nnx.Linear(DIM, DIM, rngs=rngs)
    self.head = nnx.Linear(DIM, VOCAB, rngs=rngs)

  def __call__(self, tokens):
    return self.head(jax.nn.gelu(self.base(self.embedder(tokens))))


class RngModel(nnx.Module):
  """Keeps the ``nnx.Rngs`` as an attribute and has a Dropout with its own stream."""

  def __init__(self, *, rngs: nnx.Rngs):
    self.embedder = nnx.Embed(VOCAB, DIM, rngs=rngs)
    self.proj = nnx.Linear(DIM, DIM, rngs=rngs)
    self.dropout = nnx.Dropout(0.1, rngs=rngs)
    self.head = nnx.Linear(DIM, VOCAB, rngs=rngs)
    self.rngs = rngs

  def __call__(self, tokens):
    x = self.dropout(self.proj(self.embedder(tokens)))
    return self.head(x)


# --------------------------------------------------------------------------- #
# Training helpers
# --------------------------------------------------------------------------- #
def batch(seed: int):
  tokens = jax.random.randint(jax.random.key(1000 + seed), (BATCH, SEQ + 1), 0, VOCAB)
  return tokens[:, :-1], tokens[:, 1:]


def train_step(model: nnx.Module, optimizer: nnx.Optimizer, seed: int, lora: bool) -> None:
  """One real optimizer update (so mu/nu/acc_grads are non-zero)."""
  inputs, targets = batch(seed)

  def loss_fn(m):
    logits = m(inputs)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

  wrt = nnx.DiffState(0, nnx.LoRAParam) if lora else nnx.DiffState(0, nnx.Param)
  grads = nnx.grad(loss_fn, argnums=wrt)(model)
  optimizer.update(model, grads)


def items_for(model, optimizer, lora: bool) -> dict[str, Any]:
  """The exact trees Tunix's CheckpointManager.save hands to Orbax."""
  params = nnx.state(model, nnx.LoRAParam) if lora else nnx.state(model)
  items = {"model_params": describe_tree(params)}
  if optimizer is not None:
    items["optimizer_state"] = describe_tree(nnx.state(optimizer, nnx.optimizer.OptState))
  return items


# --------------------------------------------------------------------------- #
# Fixture builders
# --------------------------------------------------------------------------- #
def build(kind: str, seed: int):
  """Returns (model_to_save, optimizer, lora, optimizer description)."""
  rngs = nnx.Rngs(params=seed, dropout=seed + 1)
  lora = False
  if kind in ("sft_full", "v1_writer", "rl_actor"):
    model = TinyLM(rngs=rngs)
    tx, desc = optax.adamw(1e-3), "optax.adamw(1e-3)"
  elif kind in ("lora_qwix", "lora_qwix_full"):
    base = TinyLM(rngs=rngs)
    provider = qwix.LoraProvider(module_path=".*q_proj|.*k_proj", rank=2, alpha=4.0)
    model = qwix.apply_lora_to_model(base, provider, jnp.zeros((BATCH, SEQ), jnp.int32),
                                     rngs=nnx.Rngs(seed + 2))
    lora = True
    # A large step, so the merged adapters change the logits measurably.
    tx, desc = optax.adamw(3e-2), "optax.adamw(3e-2), wrt=nnx.LoRAParam"
  elif kind == "lora_base":
    model = TinyLM(rngs=rngs)
    tx, desc = optax.adamw(1e-3), "optax.adamw(1e-3) (not trained, not saved)"
  elif kind == "lora_flax":
    model = FlaxLoraLM(rngs=rngs)
    lora = True
    tx, desc = optax.adamw(1e-2), "optax.adamw(1e-2), wrt=nnx.LoRAParam"
  elif kind == "adapter_inject":
    model = Adapter(TinyLM(rngs=rngs))
    tx = optax.inject_hyperparams(optax.adamw)(
        learning_rate=optax.linear_schedule(1e-3, 1e-4, transition_steps=10),
        weight_decay=1e-4,
    )
    desc = ("optax.inject_hyperparams(optax.adamw)(learning_rate="
            "optax.linear_schedule(1e-3, 1e-4, transition_steps=10), weight_decay=1e-4)")
  elif kind == "chain_clip":
    model = TinyLM(rngs=rngs)
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
    desc = "optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))"
  elif kind == "grad_accum":
    model = TinyLM(rngs=rngs)
    tx = optax.MultiSteps(optax.inject_hyperparams(optax.adamw)(learning_rate=1e-3),
                          every_k_schedule=2)
    desc = ("optax.MultiSteps(optax.inject_hyperparams(optax.adamw)(learning_rate=1e-3), "
            "every_k_schedule=2)")
  elif kind == "adapter_inject_clip":
    model = Adapter(TinyLM(rngs=rngs))
    tx = optax.chain(optax.clip_by_global_norm(1.0),
                     optax.inject_hyperparams(optax.adamw)(learning_rate=1e-3))
    desc = ("optax.chain(optax.clip_by_global_norm(1.0), "
            "optax.inject_hyperparams(optax.adamw)(learning_rate=1e-3))")
  elif kind == "own_base_module":
    model = OwnBaseModel(rngs=rngs)
    tx, desc = optax.adamw(1e-3), "optax.adamw(1e-3)"
  elif kind == "rng_vars":
    model = RngModel(rngs=rngs)
    tx, desc = optax.adamw(1e-3), "optax.adamw(1e-3)"
  else:
    raise ValueError(kind)
  # Tunix's PeftTrainer decides LoRA the same way (tunix.sft.utils.is_lora_enabled).
  assert tunix_sft_utils.is_lora_enabled(model) == lora
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.LoRAParam if lora else nnx.Param)
  return model, optimizer, lora, desc


FIXTURES: dict[str, dict[str, Any]] = {
    "sft_full": {"steps": [1, 2]},
    "lora_qwix": {"steps": [1]},
    "adapter_inject": {"steps": [1]},
    "chain_clip": {"steps": [1]},
    "grad_accum": {"steps": [1]},
    "adapter_inject_clip": {"steps": [1]},
    "own_base_module": {"steps": [1]},
    "v1_writer": {"steps": [1, 2], "writer": "orbax_v1"},
    "rl_actor": {"steps": [1], "subdir": "actor",
                 "custom_metadata": lambda step: {"global_step": step + 1, "role": "actor"}},
    "rng_vars": {"steps": [1]},
    # The base of lora_qwix: saved untrained, model only.
    "lora_base": {"steps": [1], "train": False, "optimizer": False},
    "lora_qwix_full": {"steps": [1], "lora_only": False},
    "lora_flax": {"steps": [1], "lora_only": False},
}
LORA_REFERENCE = "lora_reference.json"



def make_fixture(name: str, root: Path, seed: int, reference: dict[str, Any]) -> dict[str, Any]:
  spec = FIXTURES[name]
  if root.exists():
    shutil.rmtree(root)
  root.mkdir(parents=True)
  ckpt_dir = root / spec["subdir"] if "subdir" in spec else root
  model, optimizer, lora, desc = build(name, seed)

  meta_fn: Callable[[int], dict] = spec.get("custom_metadata", lambda step: {})
  writer = spec.get("writer", "tunix_v0")
  if writer == "tunix_v0":
    # Tunix's own defaults (no options) — force=True bypasses the 180 s policy.
    manager = tunix_ckpt.CheckpointManager(str(ckpt_dir))
  else:
    # What Tunix head's CheckpointManager does: ocp.v1.training.Checkpointer
    # with its default policies, save_checkpointables({'model_params': ...,
    # 'optimizer_state': ...}). Saved synchronously here (async only changes
    # timing, not the files).
    checkpointer = ocp_v1.training.Checkpointer(
        str(ckpt_dir),
        save_decision_policy=ocp_v1.training.save_decision_policies.ContinuousCheckpointingPolicy(
            minimum_interval_secs=180),
        preservation_policy=ocp_v1.training.preservation_policies.LatestN(n=3),
        step_name_format=ocp_v1.path.step.standard_name_format(),
    )

  steps_info = {}
  for i, step in enumerate(spec["steps"]):
    # One real update before each saved step, so mu/nu are non-zero.
    # MultiSteps(every_k=2) gets three micro-steps: the inner adamw updates once
    # (mu/nu non-zero) and acc_grads holds one pending, non-zero gradient.
    # LoRA gets three updates: lora_b starts at zero, so lora_a's first gradient
    # (and its mu/nu) is zero.
    micro = {"grad_accum": 3, "lora_qwix": 3, "lora_qwix_full": 3, "lora_flax": 3}.get(name, 1)
    for j in range(micro if spec.get("train", True) else 0):
      train_step(model, optimizer, seed=100 * i + j, lora=lora)
    custom_metadata = meta_fn(step)
    only_lora = lora and spec.get("lora_only", True)
    if writer == "tunix_v0":
      saved = manager.save(step, model, optimizer if spec.get("optimizer", True) else None,
                           save_only_lora_params=only_lora,
                           force=True, custom_metadata=custom_metadata)
    else:
      params = nnx.state(model, nnx.LoRAParam) if lora else nnx.state(model)
      saved = checkpointer.save_checkpointables(
          step,
          {"model_params": params,
           "optimizer_state": nnx.state(optimizer, nnx.optimizer.OptState)},
          force=True, custom_metadata=custom_metadata)
    assert saved, f"{name}: step {step} not saved"
    items = items_for(model, optimizer, only_lora)
    if not spec.get("optimizer", True):
      items.pop("optimizer_state")  # not saved
    steps_info[str(step)] = {"items": items, "custom_metadata": custom_metadata}
    if lora:
      tokens, _ = batch(seed=999)
      reference[name] = {"tokens": np.asarray(tokens).tolist(),
                         "logits": np.asarray(model(tokens)).tolist()}
  if writer == "tunix_v0":
    manager.close()
  else:
    checkpointer.close()

  return {
      "writer": ("tunix.sft.checkpoint_manager.CheckpointManager (Orbax v0 API)"
                 if writer == "tunix_v0" else
                 "orbax.checkpoint.v1.training.Checkpointer.save_checkpointables "
                 "(as unreleased Tunix head; Tunix 0.1.7 has no v1 path)"),
      "step_dir": (spec["subdir"] + "/<step>") if "subdir" in spec else "<step>",
      "steps": spec["steps"],
      "model": type(model).__name__,
      "lora": lora,
      "optimizer": desc,
      "optimizer_wrt": "nnx.LoRAParam" if lora else "nnx.Param",
      "step_items": steps_info,
  }


# --------------------------------------------------------------------------- #
# Hugging Face export fixtures: Tunix's own Qwen3 / Llama3 / Gemma3 classes
# --------------------------------------------------------------------------- #
HF_TOKENS = np.random.default_rng(123).integers(0, 96, size=(2, 7)).astype(np.int32)
HF_TRAIN_TOKENS = np.random.default_rng(7).integers(0, 96, size=(2, 8)).astype(np.int32)
_HF_DIMS = {"embed_dim": 40, "hidden_dim": 56, "num_heads": 4, "head_dim": 12, "num_kv_heads": 2}
HF_LORA_MODULE_PATH = ".*q_proj|.*k_proj|.*v_proj|.*o_proj|.*gate_proj|.*up_proj|.*down_proj"
# Gemma's attention einsums and MLP, as Tunix's Gemma LoRA examples target them.
HF_GEMMA_LORA_MODULE_PATH = (".*q_einsum|.*kv_einsum|.*k_einsum|.*attn_vec_einsum|.*gate_proj"
                             "|.*up_proj|.*down_proj")
# qwix's adapters of an einsum: a holds the weight's axes the input shares (in order) and the
# rank, b the rank and the rest, so a.b has the weight's shape when the shared axes lead;
# Gemma's q/kv/k/qkv einsums (N, D, H), (C, K, D, H), (K, D, H), (S, N, D, H) have D inside (by
# module name).
HF_LORA_EINSUMS = {"q_einsum": "dr,rnh->ndh", "kv_einsum": "dr,rckh->ckdh",
                   "k_einsum": "dr,rkh->kdh", "qkv_einsum": "dr,rsnh->sndh"}
HF_LORA_RANK, HF_LORA_ALPHA = 2, 3.0  # scale alpha / rank = 1.5, distinct from both

_HF_QWEN3_CONFIG = {"num_layers": 2, "vocab_size": 96, **_HF_DIMS, "rope_theta": 1_000_000,
                    "norm_eps": 1e-6, "use_tied_embedding": False}
# Issue 45 (QLoRA). Tunix 0.1.7's qwen3 Einsum casts its weight (`jnp.astype(self.w.value, ...)`),
# which fails on qwix's quantized weight: qwen3 QLoRA runs quantize the MLP (plain LoRA may still
# adapt the attention, by a second rule without weight_qtype).
QWEN3_MLP_MODULE_PATH = ".*gate_proj|.*up_proj|.*down_proj"
QWEN3_ATTN_MODULE_PATH = ".*q_proj|.*k_proj|.*v_proj|.*o_proj"

HF_FIXTURES: dict[str, dict[str, Any]] = {
    "hf_qwen3": {"family": "qwen3", "steps": [1], "optimizer": True, "config": _HF_QWEN3_CONFIG},
    "hf_llama3": {
        "family": "llama3", "steps": [1, 2], "optimizer": False,
        "config": {"num_layers": 2, "vocab_size": 96, **_HF_DIMS, "rope_theta": 500_000,
                   "norm_eps": 1e-5, "weight_tying": True},
    },
    "hf_gemma3": {
        "family": "gemma3", "steps": [1], "optimizer": False,
        "config": {"num_layers": 6, "num_embed": 96, **_HF_DIMS, "sliding_window_size": 4,
                   "local_base_frequency": 10_000, "global_base_frequency": 1_000_000,
                   "param_dtype": "float32"},
    },
    "hf_gemma3_fused": {
        "family": "gemma3", "steps": [1], "optimizer": False,
        "config": {"num_layers": 2, "num_embed": 96, **_HF_DIMS, "num_kv_heads": 4,
                   "sliding_window_size": 4, "local_base_frequency": 10_000,
                   "global_base_frequency": 1_000_000, "param_dtype": "float32"},
    },
    "hf_qwen3_lora": {"family": "qwen3", "lora_of": "hf_qwen3", "lora_only": False, "steps": [3]},
    "hf_qwen3_lora_only": {"family": "qwen3", "lora_of": "hf_qwen3", "lora_only": True,
                           "steps": [3]},
    # Issue 29: Tunix's other families. "family" is the tunix.models package.
    "hf_qwen2": {
        "family": "qwen2", "steps": [1], "optimizer": False,
        "config": {"num_layers": 2, "vocab_size": 96, **_HF_DIMS, "rope_theta": 1_000_000,
                   "norm_eps": 1e-6, "use_tied_embedding": True},
    },
    "hf_qwen2_lora": {"family": "qwen2", "lora_of": "hf_qwen2", "lora_only": False, "steps": [3]},
    "hf_qwen3_moe": {  # 3 experts, 2 per token, expert width 20 (hidden_dim)
        "family": "qwen3", "steps": [1], "optimizer": False,
        "config": {"num_layers": 2, "vocab_size": 96, **_HF_DIMS, "hidden_dim": 20,
                   "rope_theta": 1_000_000, "norm_eps": 1e-6, "use_tied_embedding": False,
                   "num_experts": 3, "num_experts_per_tok": 2},
    },
    # qwix adapts the attention einsums; the experts are bare Params (no module to adapt).
    "hf_qwen3_moe_lora": {"family": "qwen3", "lora_of": "hf_qwen3_moe", "lora_only": False,
                          "steps": [3]},
    "hf_gemma2": {  # local then global, soft caps, the post norms
        "family": "gemma", "steps": [1], "optimizer": False,
        "config": {"num_layers": 2, "num_embed": 96, **_HF_DIMS, "final_logit_softcap": 30.0,
                   "use_post_attn_norm": True, "use_post_ffw_norm": True,
                   "attention_types": ["LOCAL_SLIDING", "GLOBAL"], "attn_logits_soft_cap": 50.0,
                   "sliding_window_size": 4},
    },
    "hf_gemma2_lora": {"family": "gemma", "lora_of": "hf_gemma2", "lora_only": False,
                       "steps": [3], "module_path": HF_GEMMA_LORA_MODULE_PATH},
    "hf_gemma": {  # Gemma 1: no post norms, one kv head (as gemma-2b)
        "family": "gemma", "steps": [1], "optimizer": False,
        "config": {"num_layers": 2, "num_embed": 96, **_HF_DIMS, "num_kv_heads": 1,
                   "final_logit_softcap": None, "use_post_attn_norm": False,
                   "use_post_ffw_norm": False, "attention_types": ["GLOBAL", "GLOBAL"]},
    },
    "hf_gemma4": {  # E2B-like: per-layer inputs (10), layers 3-5 reuse 1/2's kv (double MLP)
        "family": "gemma4", "steps": [1], "optimizer": False,
        "config": {"num_layers": 6, "num_embed": 96, **_HF_DIMS, "sliding_window_size": 4,
                   "per_layer_input_dim": 10, "global_key_size": 16, "frac_shared_layers": 0.5,
                   "override_kv_shared_ffw_hidden": 112,
                   "attention_pattern": ["LOCAL_SLIDING", "LOCAL_SLIDING", "GLOBAL"],
                   "param_dtype": "float32", "dtype": "float32"},
    },
    "hf_gemma4_moe": {  # 26B-A4B-like: MoE (3 experts, 2 per token, width 20), k_eq_v global
        "family": "gemma4", "steps": [1], "optimizer": False,
        "config": {"num_layers": 2, "num_embed": 96, **_HF_DIMS, "sliding_window_size": 4,
                   "global_key_size": 16, "num_global_kv_heads": 1, "k_eq_v_global": True,
                   "enable_moe": True, "num_experts": 3, "num_experts_per_tok": 2,
                   "expert_dim": 20, "moe_dense_hidden_dim": 56,
                   "attention_pattern": ["LOCAL_SLIDING", "GLOBAL"],
                   "param_dtype": "float32", "dtype": "float32"},
    },
    # The Gemma targets on Gemma 1 (one kv head: kv_einsum (2, 1, D, H)) and Gemma 4. qwix adapts
    # only the einsums a forward pass calls: Gemma 4's kv-shared layers (3-5) read layers 1-2's
    # cache, so their kv_einsum gets no adapter; hf_gemma4_moe's global layer has k_einsum, and
    # its experts are bare Params (no module to adapt), its dense MLP is adapted.
    "hf_gemma_lora": {"family": "gemma", "lora_of": "hf_gemma", "lora_only": False,
                      "steps": [3], "module_path": HF_GEMMA_LORA_MODULE_PATH},
    "hf_gemma4_lora": {"family": "gemma4", "lora_of": "hf_gemma4", "lora_only": False,
                       "steps": [3], "module_path": HF_GEMMA_LORA_MODULE_PATH},
    "hf_gemma4_moe_lora": {"family": "gemma4", "lora_of": "hf_gemma4_moe", "lora_only": False,
                           "steps": [3], "module_path": HF_GEMMA_LORA_MODULE_PATH},
    # Issue 45: QLoRA. A compact matrix: every qtype, calibration, tiling, save kind and family at
    # least once (the docstring's table). "qlora" is the quantizing LoraRule's recipe (qwix's
    # names); "plain_module_path" adds a second rule without weight_qtype (plain LoRA).
    "hf_qwen3_bf16": {  # hf_qwen3 step 1 read back, every Param cast to bfloat16 (not trained)
        "family": "qwen3", "cast_of": "hf_qwen3", "steps": [1], "optimizer": False,
        "config": {**_HF_QWEN3_CONFIG, "dtype": "bfloat16", "param_dtype": "bfloat16"},
    },
    "hf_qwen3_qlora_int8": {
        "family": "qwen3", "lora_of": "hf_qwen3", "lora_only": False, "steps": [3],
        "optimizer": True, "module_path": QWEN3_MLP_MODULE_PATH,
        "plain_module_path": QWEN3_ATTN_MODULE_PATH,
        "qlora": {"weight_qtype": "int8", "tile_size": None, "weight_calibration_method": "absmax"},
    },
    "hf_qwen3_qlora_int4_only": {
        "family": "qwen3", "lora_of": "hf_qwen3", "lora_only": True, "steps": [3],
        "optimizer": False, "module_path": QWEN3_MLP_MODULE_PATH,
        "qlora": {"weight_qtype": "int4", "tile_size": 4, "weight_calibration_method": "absmax"},
    },
    # nf4's qvalue is uint4, which Orbax cannot save: nf4 runs exist only as adapters-only saves.
    "hf_qwen3_qlora_nf4_only": {
        "family": "qwen3", "lora_of": "hf_qwen3", "lora_only": True, "steps": [3],
        "optimizer": True, "module_path": QWEN3_MLP_MODULE_PATH,
        "qlora": {"weight_qtype": "nf4", "tile_size": 4, "weight_calibration_method": "absmax"},
    },
    "hf_qwen3_bf16_qlora": {
        "family": "qwen3", "lora_of": "hf_qwen3_bf16", "lora_only": False, "steps": [3],
        "optimizer": False, "module_path": QWEN3_MLP_MODULE_PATH,
        "qlora": {"weight_qtype": "int4", "tile_size": 4, "weight_calibration_method": "minmax"},
    },
    "hf_qwen3_bf16_qlora_only": {
        "family": "qwen3", "lora_of": "hf_qwen3_bf16", "lora_only": True, "steps": [3],
        "optimizer": False, "module_path": QWEN3_MLP_MODULE_PATH,
        "qlora": {"weight_qtype": "int4", "tile_size": 4, "weight_calibration_method": "minmax"},
    },
    # Gemma3's einsums quantize: q_einsum (N, D, H), kv_einsum (C, K, D, H), attn_vec (N, H, D).
    "hf_gemma3_qlora_int8": {
        "family": "gemma3", "lora_of": "hf_gemma3", "lora_only": False, "steps": [3],
        "optimizer": False, "module_path": HF_GEMMA_LORA_MODULE_PATH,
        "qlora": {"weight_qtype": "int8", "tile_size": 4, "weight_calibration_method": "minmax"},
    },
    "hf_gemma3_qlora_int4_only": {
        "family": "gemma3", "lora_of": "hf_gemma3", "lora_only": True, "steps": [3],
        "optimizer": False, "module_path": HF_GEMMA_LORA_MODULE_PATH,
        "qlora": {"weight_qtype": "int4", "tile_size": None, "weight_calibration_method": "minmax"},
    },
    # `.*kv_einsum` also matches qkv_einsum (heads == kv heads).
    "hf_gemma3_fused_qlora_fp8": {
        "family": "gemma3", "lora_of": "hf_gemma3_fused", "lora_only": False, "steps": [3],
        "optimizer": False, "module_path": HF_GEMMA_LORA_MODULE_PATH,
        "qlora": {"weight_qtype": "float8_e4m3fn", "tile_size": None,
                  "weight_calibration_method": "absmax"},
    },
}
# ModelConfig fields holding AttentionType values, recorded by name.
HF_ENUM_FIELDS = ("attention_types", "attention_pattern")


# family -> its Tunix model class (`tunix.models.<family>.model.<class>`).
TUNIX_MODEL_CLASSES = {"qwen3": "Qwen3", "llama3": "Llama3", "gemma3": "Gemma3", "qwen2": "Qwen2",
                       "gemma": "Gemma", "gemma4": "Gemma4"}


def _tunix_model_module(family: str):
  # Imported here, not at the top: importing a Tunix model module flips
  # flax_always_shard_variable process-wide, and the other fixtures are made without that.
  m = importlib.import_module(f"tunix.models.{family}.model")
  return m, getattr(m, TUNIX_MODEL_CLASSES[family])


def hf_model_config(family: str, kwargs: dict[str, Any]):
  m, _ = _tunix_model_module(family)
  kw = {k: (jnp.dtype(v) if k.endswith("dtype") else
            tuple(m.AttentionType[n] for n in v) if k in HF_ENUM_FIELDS else v)
        for k, v in kwargs.items()}
  return m.ModelConfig(**kw)


def hf_forward(model, tokens):
  """Logits of a Tunix Qwen3/Llama3/Gemma3 on tokens (B, T): positions 0.., causal mask."""
  tokens = jnp.asarray(tokens, jnp.int32)
  b, t = tokens.shape
  positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  mask = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), dtype=jnp.bool_)), (b, t, t))
  logits, _ = model(tokens, positions, None, mask)
  return logits


def _perturb(model, seed: int) -> None:
  """Every Param replaced by seeded normals: vectors 1 + 0.1 n, matrices 0.3 n."""
  state = nnx.state(model, nnx.Param)
  leaves, treedef = jax.tree_util.tree_flatten(state)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  new = []
  for k, x in zip(keys, leaves, strict=True):
    r = jax.random.normal(k, x.shape, jnp.float32)
    new.append(((1.0 + 0.1 * r) if x.ndim == 1 else 0.3 * r).astype(x.dtype))
  nnx.update(model, jax.tree_util.tree_unflatten(treedef, new))


def _hf_train_step(model, optimizer, lora: bool) -> None:
  inputs, targets = HF_TRAIN_TOKENS[:, :-1], HF_TRAIN_TOKENS[:, 1:]

  def loss_fn(m):
    logits = hf_forward(m, inputs).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

  wrt = nnx.DiffState(0, nnx.LoRAParam) if lora else nnx.DiffState(0, nnx.Param)
  optimizer.update(model, nnx.grad(loss_fn, argnums=wrt)(model))


def _lora_targets(model) -> list[str]:
  """'/'-joined paths of the weights qwix gave adapters ('layers/0/attn/q_proj/w')."""
  out = set()
  for path, _ in jax.tree_util.tree_flatten_with_path(nnx.state(model, nnx.LoRAParam))[0]:
    keys = [key_str(k) for k in path]
    assert keys[-1] == "value" and keys[-2].endswith(("_lora_a", "_lora_b")), keys
    out.add("/".join(keys[:-2] + [keys[-2].rsplit("_lora_", 1)[0]]))
  return sorted(out)


def _hand_merged_state(model, scale: float):
  """The plain model's Params with every adapter merged in float32 (numpy): W + s * a.b."""
  # nnx.LoRAParam is a subclass of nnx.Param: the plain weights are Params that are not LoRA.
  pure = nnx.state(model, nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam))).to_pure_dict()
  lora = nnx.state(model, nnx.LoRAParam).to_pure_dict()

  def walk(p, lo):
    for k, v in lo.items():
      if isinstance(v, dict) and not any(str(x).endswith(("_lora_a", "_lora_b")) for x in v):
        walk(p[k], v)
      else:
        for w in {str(x).rsplit("_lora_", 1)[0] for x in v}:
          a, b = np.asarray(v[f"{w}_lora_a"]), np.asarray(v[f"{w}_lora_b"])
          delta = (np.einsum(HF_LORA_EINSUMS[k], a, b) if k in HF_LORA_EINSUMS else
                   np.tensordot(a, b, axes=([-1], [0])))
          p[k][w] = np.asarray(p[k][w]) + scale * delta
  walk(pure, lora)
  return pure


def _read_base(name: str, base_name: str, out: Path, seed: int):
  """(base model, step): fixture `base_name`'s last step read back from `out` by Tunix."""
  spec = HF_FIXTURES[base_name]
  cfg = hf_model_config(spec["family"], spec["config"])
  _, model_cls = _tunix_model_module(spec["family"])
  base_root, base_step = out / base_name, spec["steps"][-1]
  if not (base_root / str(base_step) / "commit_success.txt").exists():
    raise SystemExit(f"{name} starts from {base_name} step {base_step}: write it first"
                     f" (--only {base_name} {name})")
  base = nnx.eval_shape(lambda: model_cls(cfg, rngs=nnx.Rngs(params=seed)))
  restored_step, _ = tunix_ckpt.CheckpointManager(str(base_root)).maybe_restore(
      base, step=base_step)
  assert restored_step == base_step
  return base, base_step


def make_hf_fixture(name: str, root: Path, out: Path, seed: int) -> dict[str, Any]:
  spec = HF_FIXTURES[name]
  family = spec["family"]
  cfg_kwargs = spec.get("config") or HF_FIXTURES[spec["lora_of"]]["config"]
  cfg = hf_model_config(family, cfg_kwargs)
  _, model_cls = _tunix_model_module(family)
  if root.exists():
    shutil.rmtree(root)
  root.mkdir(parents=True)
  entry: dict[str, Any] = {"family": family, "model_config": cfg_kwargs,
                           "tokens": HF_TOKENS.tolist()}
  lora = "lora_of" in spec
  if "cast_of" in spec:
    # The float base read back and cast: trained as its source was, not again.
    source, source_step = _read_base(name, spec["cast_of"], out, seed)
    model = nnx.eval_shape(lambda: model_cls(cfg, rngs=nnx.Rngs(params=seed)))
    nnx.update(model, jax.tree.map(
        lambda x: x.astype(cfg.param_dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x,
        nnx.state(source)))
    tx = optax.adamw(1e-2)
    desc = (f"none (not trained: {spec['cast_of']} step {source_step} cast to "
            f"{jnp.dtype(cfg.param_dtype).name})")
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    saved_optimizer = False
    only_lora = False
  elif not lora:
    model = model_cls(cfg, rngs=nnx.Rngs(params=seed))
    _perturb(model, seed=42 + seed)
    tx, desc = optax.adamw(1e-2), "optax.adamw(1e-2), params perturbed first"
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    saved_optimizer = spec["optimizer"]
    only_lora = False
  else:
    base_name = spec["lora_of"]
    base, base_step = _read_base(name, base_name, out, seed)
    base_logits = np.asarray(hf_forward(base, HF_TOKENS))
    module_path = spec.get("module_path", HF_LORA_MODULE_PATH)
    provider = qwix.LoraProvider(module_path=module_path, rank=HF_LORA_RANK,
                                 alpha=HF_LORA_ALPHA)
    model = qwix.apply_lora_to_model(base, provider, **base.get_model_input(),
                                     rngs=nnx.Rngs(seed + 2))
    tx, desc = optax.adamw(3e-2), "optax.adamw(3e-2), wrt=nnx.LoRAParam"
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.LoRAParam)
    saved_optimizer = True
    only_lora = spec["lora_only"]
  assert tunix_sft_utils.is_lora_enabled(model) == lora

  manager = tunix_ckpt.CheckpointManager(str(root))
  steps_info = {}
  done = 0
  for step in spec["steps"]:
    updates = step - done if lora else 0 if "cast_of" in spec else 1  # LoRA: 3 (lora_b is 0)
    for _ in range(updates):
      _hf_train_step(model, optimizer, lora)
    done = step
    saved = manager.save(step, model, optimizer if saved_optimizer else None,
                         save_only_lora_params=only_lora, force=True)
    assert saved, f"{name}: step {step} not saved"
    items = items_for(model, optimizer, only_lora)
    if not saved_optimizer:
      items.pop("optimizer_state")
    steps_info[str(step)] = {"items": items, "custom_metadata": {}}
  manager.close()

  # The checkpoint gives back the model: restored onto an abstract model, same logits.
  logits = np.asarray(hf_forward(model, HF_TOKENS))
  if not lora:
    again = nnx.eval_shape(lambda: model_cls(cfg, rngs=nnx.Rngs(params=seed + 1)))
    tunix_ckpt.CheckpointManager(str(root)).maybe_restore(again)
    assert np.array_equal(np.asarray(hf_forward(again, HF_TOKENS)), logits), name
  else:
    scale = HF_LORA_ALPHA / HF_LORA_RANK
    plain = nnx.eval_shape(lambda: model_cls(cfg, rngs=nnx.Rngs(params=seed)))
    state = nnx.state(plain, nnx.Param)
    nnx.replace_by_pure_dict(state, _hand_merged_state(model, scale))
    nnx.update(plain, state)
    merged_logits = np.asarray(hf_forward(plain, HF_TOKENS))
    effect = float(np.abs(logits - base_logits).max())
    merge_err = float(np.abs(merged_logits - logits).max())
    assert effect > 100 * max(merge_err, 1e-7), (effect, merge_err)
    entry["lora"] = {
        "rank": HF_LORA_RANK, "alpha": HF_LORA_ALPHA, "scale": scale,
        "module_path": module_path, "targets": _lora_targets(model),
        "base": spec["lora_of"], "base_step": base_step,
        "saved": "adapters only (save_only_lora_params=True)" if only_lora else
                 "base and adapters (save_only_lora_params=False)",
        "logits_max_abs_change_by_adapters": effect,
        "logits_max_abs_diff_float32_hand_merge": merge_err,
        "logits_max_abs": float(np.abs(logits).max()),
    }
  entry.update({
      "writer": "tunix.sft.checkpoint_manager.CheckpointManager (Orbax v0 API)",
      "step_dir": "<step>",
      "steps": spec["steps"],
      "model": model_cls.__name__ if not lora else f"qwix LoRA on {model_cls.__name__}",
      "lora": entry.get("lora", False),
      "optimizer": desc + ("" if saved_optimizer else " (not saved)"),
      "optimizer_wrt": "nnx.LoRAParam" if lora else "nnx.Param",
      "step_items": steps_info,
  })
  return entry


# --------------------------------------------------------------------------- #
# QLoRA fixtures (issue 45): qwix LoRA rules with weight_qtype on Tunix's models
# --------------------------------------------------------------------------- #
def _unboxed(x):
  """A QArray field as a plain jax.Array (qwix keeps the Param box around each one)."""
  if x is None:
    return None
  return jnp.asarray(x.get_value() if isinstance(x, nnx.Variable) else x)


def _modules(model) -> dict[str, nnx.Module]:
  return {"/".join(str(k) for k in path): m for path, m in nnx.iter_modules(model)}


def _quantized_weights(model) -> dict[str, qwix.QArray]:
  """Each weight qwix quantized, by '/'-joined path, as a QArray of plain arrays (with qtype)."""
  out = {}
  for mpath, module in _modules(model).items():
    for attr, v in vars(module).items():
      q = getattr(v, "array", None)
      if isinstance(q, qwix.QArray):
        out[f"{mpath}/{attr}" if mpath else attr] = qwix.QArray(
            qvalue=_unboxed(q.qvalue), scale=_unboxed(q.scale),
            zero_point=_unboxed(q.zero_point), qtype=q.qtype)
  return dict(sorted(out.items()))


def _how(module, weight: jax.Array, recipe: dict[str, Any]):
  """qwix's own choice of axes for a weight of `module` (the rhs of its einsum or dot_general)."""
  kw = {"for_lhs": False, "tile_size": recipe["tile_size"], "qtype": recipe["weight_qtype"],
        "calibration_method": recipe["weight_calibration_method"]}
  einsum_str = getattr(module, "einsum_str", None)
  if einsum_str is not None:  # a Tunix Einsum: jnp.einsum(einsum_str, x, w)
    lhs = einsum_str.split("->")[0].split(",")[0]
    return qwix_einsum.get_how_to_quantize(einsum_str=einsum_str,
                                           ndims=(len(lhs), weight.ndim), **kw)
  assert isinstance(module, nnx.Linear), type(module)  # x (B, T, in) . kernel (in, out)
  return qwix_dot_general.get_how_to_quantize(dimension_numbers=(((2,), (0,)), ((), ())),
                                              ndims=(3, 2), **kw)


def _same_bits(a, b) -> bool:
  a, b = (None if x is None else np.asarray(x) for x in (a, b))
  if a is None or b is None:
    return a is None and b is None
  return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def _requantized(base, model, quantized, recipe) -> dict[str, dict[str, Any]]:
  """Re-quantizes each float base weight with the run's recipe (qwix.quantize with the axes
  qwix's einsum/dot_general chooses), eagerly and under jit; asserts both reproduce the live
  model's qvalue, scale and zero_point bit for bit. Returns each weight's axes."""
  base_modules, modules = _modules(base), _modules(model)
  how_by_weight = {}
  for path, q in quantized.items():
    mpath, attr = path.rsplit("/", 1)
    w = _unboxed(getattr(base_modules[mpath], attr))
    how = _how(modules[mpath], w, recipe)

    def requantize(x, how=how):
      return qwix.quantize(x, recipe["weight_qtype"], channelwise_axes=how.channelwise_axes,
                           tiled_axes=how.tiled_axes,
                           calibration_method=recipe["weight_calibration_method"])

    for again in (requantize(w), jax.jit(requantize)(w)):
      for field in ("qvalue", "scale", "zero_point"):
        assert _same_bits(getattr(again, field), getattr(q, field)), (path, field)
    assert qwix.dequantize(q).dtype == q.scale.dtype, path  # the scale's dtype
    how_by_weight[path] = {"channelwise_axes": sorted(how.channelwise_axes),
                           "tiled_axes": {str(k): v for k, v in sorted(how.tiled_axes.items())}}
  return how_by_weight


def _lora_deltas(model) -> dict[str, np.ndarray]:
  """Each adapted weight's a.b in float32, laid out as the weight, by '/'-joined path."""
  lora = nnx.state(model, nnx.LoRAParam).to_pure_dict()
  flat_lora = {"/".join(key_str(k) for k in p): np.asarray(x, np.float32)
               for p, x in jax.tree_util.tree_flatten_with_path(lora)[0]}
  out = {}
  for target in _lora_targets(model):
    a, b = flat_lora[f"{target}_lora_a"], flat_lora[f"{target}_lora_b"]
    module = target.split("/")[-2]
    out[target] = (np.einsum(HF_LORA_EINSUMS[module], a, b) if module in HF_LORA_EINSUMS else
                   np.tensordot(a, b, axes=([-1], [0])))
  return out


def _plain_logits(model_cls, cfg, base, weights: dict[str, np.ndarray], seed: int) -> np.ndarray:
  """Logits of the plain (unadapted, unquantized) model of `cfg`: the float base's Params with
  `weights` (float32, by path) put in, all cast to cfg's param dtype."""
  pure = nnx.state(base, nnx.Param).to_pure_dict()
  leaves, treedef = jax.tree_util.tree_flatten_with_path(pure)
  new = []
  for p, x in leaves:
    x = weights.get("/".join(key_str(k) for k in p), x)
    new.append(jnp.asarray(x, cfg.param_dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x)
  plain = nnx.eval_shape(lambda: model_cls(cfg, rngs=nnx.Rngs(params=seed)))
  state = nnx.state(plain, nnx.Param)
  nnx.replace_by_pure_dict(state, jax.tree_util.tree_unflatten(treedef, new))
  nnx.update(plain, state)
  return np.asarray(hf_forward(plain, HF_TOKENS), np.float32)


def _full_save_error(model) -> str:
  """What Tunix's full save of `model` raises (into a scratch directory), or '' if none."""
  errors = []
  with tempfile.TemporaryDirectory() as scratch:
    manager = tunix_ckpt.CheckpointManager(str(Path(scratch) / "run"))
    for stage, call in (("save", lambda: manager.save(1, model, None, force=True)),
                        ("close", manager.close)):
      try:
        call()
      except Exception as e:  # noqa: BLE001  (recorded, whatever it is)
        errors.append(f"{type(e).__name__} (in CheckpointManager.{stage}): {e}")
  return "; ".join(errors)


def _quantized_attention_error(base, seed: int) -> str:
  """Tunix 0.1.7's qwen3 attention with a quantizing rule: qwix quantizes q/k/v/o_proj while it
  traces the model, then every forward fails. Returns the forward's error."""
  provider = qwix.LoraProvider(module_path=QWEN3_ATTN_MODULE_PATH, rank=HF_LORA_RANK,
                               alpha=HF_LORA_ALPHA, weight_qtype="int8")
  model = qwix.apply_lora_to_model(base, provider, **base.get_model_input(),
                                   rngs=nnx.Rngs(seed + 2))
  assert "layers/0/attn/q_proj/w" in _quantized_weights(model)
  try:
    hf_forward(model, HF_TOKENS)
  except TypeError as e:
    return f"{type(e).__name__}: {e}"
  raise AssertionError("Tunix's qwen3 attention ran quantized: the docstring is out of date")


def make_qlora_fixture(name: str, root: Path, out: Path, seed: int,
                       reference: dict[str, Any]) -> dict[str, Any]:
  """A QLoRA run: the float base read back, qwix LoRA with a quantizing rule, adapters trained
  three adamw steps, saved by Tunix; the live model's logits go to `reference`."""
  spec = HF_FIXTURES[name]
  family, base_name, recipe = spec["family"], spec["lora_of"], spec["qlora"]
  cfg_kwargs = HF_FIXTURES[base_name]["config"]
  cfg = hf_model_config(family, cfg_kwargs)
  _, model_cls = _tunix_model_module(family)
  if root.exists():
    shutil.rmtree(root)
  root.mkdir(parents=True)
  base, base_step = _read_base(name, base_name, out, seed)
  rules = [qwix.LoraRule(module_path=spec["module_path"], rank=HF_LORA_RANK, alpha=HF_LORA_ALPHA,
                         **recipe)]
  if "plain_module_path" in spec:
    rules.append(qwix.LoraRule(module_path=spec["plain_module_path"], rank=HF_LORA_RANK,
                               alpha=HF_LORA_ALPHA))
  model = qwix.apply_lora_to_model(base, qwix.LoraProvider(rules), **base.get_model_input(),
                                   rngs=nnx.Rngs(seed + 2))
  assert tunix_sft_utils.is_lora_enabled(model)
  quantized = _quantized_weights(model)
  assert quantized, name
  how = _requantized(base, model, quantized, recipe)
  tx, desc = optax.adamw(3e-2), "optax.adamw(3e-2), wrt=nnx.LoRAParam"
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.LoRAParam)

  only_lora, step = spec["lora_only"], spec["steps"][-1]
  for _ in range(step):  # lora_b starts at zero: three updates move both adapters
    _hf_train_step(model, optimizer, lora=True)
  after = _quantized_weights(model)  # training leaves the quantized base alone
  assert all(_same_bits(getattr(after[p], f), getattr(q, f))
             for p, q in quantized.items() for f in ("qvalue", "scale", "zero_point")), name
  manager = tunix_ckpt.CheckpointManager(str(root))
  assert manager.save(step, model, optimizer if spec["optimizer"] else None,
                      save_only_lora_params=only_lora, force=True), f"{name}: step not saved"
  manager.close()
  items = items_for(model, optimizer, only_lora)
  if not spec["optimizer"]:
    items.pop("optimizer_state")

  # What a merge must reproduce: the live QLoRA model (qwix in the loop), against the plain
  # model with (a) the float base + s.a.b (wrong) and (b) the dequantized base + s.a.b (right).
  scale = HF_LORA_ALPHA / HF_LORA_RANK
  logits = np.asarray(hf_forward(model, HF_TOKENS), np.float32)
  float_w = {p: np.asarray(w, np.float32) for p, w in flat(nnx.state(base, nnx.Param)
                                                           .to_pure_dict()).items()}
  deq = {p: np.asarray(qwix.dequantize(q), np.float32) for p, q in quantized.items()}
  deltas = _lora_deltas(model)
  targets = sorted(deltas)
  assert set(deq) <= set(targets), (name, set(deq) - set(targets))

  def diff(weights, config=cfg):
    return float(np.abs(_plain_logits(model_cls, config, base, weights, seed) - logits).max())

  float_merge = diff({p: float_w[p] + scale * d for p, d in deltas.items()})
  right = {p: deq.get(p, float_w[p]) + scale * d for p, d in deltas.items()}
  deq_merge = diff(right)
  # The same merge kept in float32 (weights and compute), as a float32 export would run it.
  cfg32 = hf_model_config(family, {**cfg_kwargs, "param_dtype": "float32",
                                   **({"dtype": "float32"} if "dtype" in cfg_kwargs else {})})
  deq_merge32 = diff(right, cfg32)
  deq_base = diff(deq)  # the quantized base, no adapters: what the adapters add
  float_base = diff({})
  # The difference must matter: both figures well above the right merge's (float32: by 1e4 and
  # more; bfloat16, whose right merge rounds the merged weights: by ~10).
  assert min(float_merge, deq_base) > 5 * max(deq_merge, 1e-6), (name, float_merge, deq_merge)
  assert min(float(np.abs(x).max()) for p, x in
             flat(nnx.state(model, nnx.LoRAParam).to_pure_dict()).items()
             if p.endswith("_lora_b")) > 1e-3, name  # trained: b moved off zero
  reference[name] = {"tokens": HF_TOKENS.tolist(), "logits": logits.tolist()}

  dtype = jnp.dtype(cfg.param_dtype).name
  saved = ("adapters only (save_only_lora_params=True)" if only_lora else
           "base and adapters (save_only_lora_params=False)")
  module_path = "|".join(r.module_path for r in rules)
  qlora = {
      "qtype": recipe["weight_qtype"], "tile_size": recipe["tile_size"],
      "calibration": recipe["weight_calibration_method"], "dtype": dtype,
      "rank": HF_LORA_RANK, "alpha": HF_LORA_ALPHA, "scale": scale,
      "module_path": spec["module_path"],
      "plain_lora_module_path": spec.get("plain_module_path"),
      "rules": [{"module_path": r.module_path, "weight_qtype": r.weight_qtype,
                 "tile_size": r.tile_size, "weight_calibration_method":
                 r.weight_calibration_method if r.weight_qtype else None} for r in rules],
      "targets": targets, "quantized": how,
      "base": base_name, "base_step": base_step, "saved": saved,
      "reference": f"{LORA_REFERENCE} (tokens, and the live QLoRA model's logits on them)",
      "logits_max_abs": float(np.abs(logits).max()),
      "logits_max_abs_diff_float_base_merge": float_merge,
      "logits_max_abs_diff_dequantized_merge": deq_merge,
      "logits_max_abs_diff_dequantized_merge_float32": deq_merge32,
      "logits_max_abs_diff_dequantized_base": deq_base,
      "logits_max_abs_diff_float_base": float_base,
      "requantize_bit_exact": {"eager": True, "jit": True},
      "dequantize_dtype": dtype,
  }
  if recipe["weight_qtype"] == "nf4":  # why this run has no full save
    qlora["full_save_error"] = _full_save_error(model)
    assert "uint4" in qlora["full_save_error"], qlora["full_save_error"]
  if family == "qwen3" and "plain_module_path" in spec:
    qlora["quantized_attention_error"] = _quantized_attention_error(base, seed)
  return {
      "family": family, "model_config": cfg_kwargs, "tokens": HF_TOKENS.tolist(),
      "lora": {"rank": HF_LORA_RANK, "alpha": HF_LORA_ALPHA, "scale": scale,
               "module_path": module_path, "targets": targets, "base": base_name,
               "base_step": base_step, "saved": saved},
      "qlora": qlora,
      "writer": "tunix.sft.checkpoint_manager.CheckpointManager (Orbax v0 API)",
      "step_dir": "<step>",
      "steps": spec["steps"],
      "model": f"qwix QLoRA on {model_cls.__name__}",
      "optimizer": desc + ("" if spec["optimizer"] else " (not saved)"),
      "optimizer_wrt": "nnx.LoRAParam",
      "step_items": {str(step): {"items": items, "custom_metadata": {}}},
  }


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--out", default="tests/data/tunix", help="output directory")
  parser.add_argument("--only", nargs="*", choices=sorted([*FIXTURES, *HF_FIXTURES]),
                      help="subset to write")
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args(argv)

  out = Path(args.out).resolve()  # Orbax (OCDBT) requires absolute paths.
  out.mkdir(parents=True, exist_ok=True)
  versions = {p: importlib.metadata.version(p) for p in PACKAGES}
  manifest_path = out / "MANIFEST.json"
  manifest = {"versions": versions, "fixtures": {}}
  reference_path = out / LORA_REFERENCE
  reference: dict[str, Any] = {}
  if args.only and manifest_path.exists():
    manifest["fixtures"] = json.loads(manifest_path.read_text())["fixtures"]
    if reference_path.exists():
      reference = json.loads(reference_path.read_text())
  # The hf_* fixtures last (their imports change a flax flag), in HF_FIXTURES' order.
  order = [*FIXTURES, *HF_FIXTURES]
  for name in sorted(args.only or order, key=order.index):
    print(f"writing {name}", file=sys.stderr)
    if "qlora" in HF_FIXTURES.get(name, {}):
      entry = make_qlora_fixture(name, out / name, out, args.seed, reference)
    elif name in HF_FIXTURES:
      entry = make_hf_fixture(name, out / name, out, args.seed)
    else:
      entry = make_fixture(name, out / name, args.seed, reference)
    entry["versions"] = versions
    manifest["fixtures"][name] = entry
  manifest["fixtures"] = dict(sorted(manifest["fixtures"].items()))
  manifest_path.write_text(json.dumps(manifest, indent=1, sort_keys=False) + "\n")
  reference_path.write_text(json.dumps(dict(sorted(reference.items()))) + "\n")
  return 0


if __name__ == "__main__":
  sys.exit(main())

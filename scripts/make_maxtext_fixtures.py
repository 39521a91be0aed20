#!/usr/bin/env python3
"""Writes Tunix checkpoints of MaxText's own model, post-trained by the real Tunix.

The model is MaxText 0.2.5's tiny llama2 decoder (the config below), built the
way MaxText's post-training hands a model to Tunix:
``model_creation_utils.from_pretrained(config, wrap_with_tunix_adapter=True)``,
which wraps it in ``TunixMaxTextAdapter`` (the model sits under ``base``). The
optimizer is MaxText's own (``optimizers.get_optimizer`` with
``maxtext_utils.create_learning_rate_schedule``: ``optax.adamw(<warmup-cosine
schedule>, b1=0.9, b2=0.95, weight_decay=0.1)``, as ``train_sft.py`` builds
it). Training is Tunix's ``tunix.sft.peft_trainer.PeftTrainer`` (which makes
``nnx.Optimizer(model, tx, wrt=nnx.Param)``) with its default loss, two steps on
fixed tokens; the trainer saves step 2 with its
``tunix.sft.checkpoint_manager.CheckpointManager``. The RNG keys are jax's
default threefry keys: MaxText's post-training entry points (train_sft.py,
train_rl.py) do not switch to unsafe_rbg the way pre-training's train.py does.

Run it in the MaxText venv with Tunix on top (not the project's venv)::

    PY=$(scripts/maxtext_venv.sh --with-tunix)
    $PY scripts/make_maxtext_fixtures.py            # writes tests/data/maxtext/

Fixtures (each a Tunix checkpoint root holding step 2):
  tunix_llama2_scan     scan_layers=True  (layers stacked on axis 1)
  tunix_llama2_unscan   scan_layers=False (decoder/layers_<i>)

``--out/MANIFEST.json`` records the versions, the MaxText config argv, the
optimizer, and for each item every leaf's on-disk key path, shape and dtype,
computed from the in-memory trees the trainer saved (not read back). The
script then reads every item back with plain Orbax and checks the tree and the
values against memory (the ``verified`` entry).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from fixture_trees import describe_tree, flat  # noqa: E402  (beside this script)
from flax import nnx  # noqa: E402
from flax.linen import partitioning as nn_partitioning  # noqa: E402
from maxtext.configs import pyconfig  # noqa: E402
from maxtext.optimizers import optimizers  # noqa: E402
from maxtext.utils import maxtext_utils, model_creation_utils  # noqa: E402
from tunix.sft import peft_trainer  # noqa: E402
from tunix.sft import utils as tunix_sft_utils  # noqa: E402

PACKAGES = ["maxtext", "google-tunix", "jax", "jaxlib", "flax", "optax", "orbax-checkpoint"]
STEPS = 2  # optimizer updates; the saved step is the last one (Tunix's step = updates done)

# MaxText's tiny llama2 (tests/maxtext_client.py's TINY_MODEL holds the same keys).
TINY_MODEL = [
    "hardware=cpu",
    "skip_jax_distributed_system=True",
    "dataset_type=synthetic",
    "per_device_batch_size=1",
    "max_target_length=16",
    "base_emb_dim=16",
    "base_num_query_heads=4",
    "base_num_kv_heads=2",
    "head_dim=8",
    "base_mlp_dim=48",
    "base_num_decoder_layers=3",
    "vocab_size=64",
    "attention=dot_product",
]
# TunixMaxTextAdapter looks model_name up in MaxText's HF configs, which have no entry for the
# default name ('default') nor any llama2: llama3.1-8b is the nearest one with the llama2 decoder
# block. Its model yml sets only dims (overridden above, hence override_model_config) and
# rope_max_timescale=500000 / enable_dropout=false, set back here to base.yml's values, so the
# network is exactly the tiny llama2 of the notes (no key here changes a weight's path or shape).
ADAPTER_KEYS = [
    "model_name=llama3.1-8b",
    "override_model_config=True",
    "rope_max_timescale=10000",
    "enable_dropout=True",
]
# learning_rate=1e-2 so the trained weights differ visibly from init; the schedule spans 10
# steps (warmup 1: step 0's rate is 0, step 1's is 1e-2).
TRAIN_KEYS = [
    "learning_rate=1e-2",
    "steps=10",
    "enable_checkpointing=False",  # MaxText's own checkpointing: Tunix saves here
    "run_name=tunix_fixture",
    "base_output_directory=/tmp/orbax_tunix_maxtext_fixture_unused",
]

FIXTURES = {"tunix_llama2_scan": True, "tunix_llama2_unscan": False}


def config_argv(scan: bool) -> list[str]:
  return [*TINY_MODEL, *ADAPTER_KEYS, *TRAIN_KEYS, f"scan_layers={scan}"]


def make_config(scan: bool):
  base_yml = Path(pyconfig.__file__).resolve().parent / "base.yml"
  return pyconfig.initialize(["make_maxtext_fixtures", str(base_yml), *config_argv(scan)])


# --------------------------------------------------------------------------- #
# Trees
# --------------------------------------------------------------------------- #
def as_numpy(leaf: Any) -> np.ndarray:
  if isinstance(leaf, jax.Array) and jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
    leaf = jax.random.key_data(leaf)  # Orbax stores a typed key as its uint32 data
  return np.asarray(leaf)


# --------------------------------------------------------------------------- #
# Training
# --------------------------------------------------------------------------- #
def batches(config, n: int) -> list[peft_trainer.TrainingInput]:
  """n fixed batches of [per_device_batch_size * devices, max_target_length] tokens."""
  rng = np.random.default_rng(0)
  shape = (config.global_batch_size_to_train_on, config.max_target_length)
  out = []
  for _ in range(n):
    tokens = rng.integers(1, config.vocab_size, size=shape, dtype=np.int32)
    out.append(peft_trainer.TrainingInput(input_tokens=tokens, input_mask=np.ones(shape, bool)))
  return out


def model_input(x: peft_trainer.TrainingInput) -> dict[str, Any]:
  """What Tunix's default loss takes: the inputs plus positions and a causal mask from the mask."""
  return {
      "input_tokens": x.input_tokens,
      "input_mask": x.input_mask,
      "positions": tunix_sft_utils.build_positions_from_mask(x.input_mask),
      "attention_mask": tunix_sft_utils.make_causal_attn_mask(x.input_mask),
  }


def make_fixture(name: str, scan: bool, root: Path) -> dict[str, Any]:
  if root.exists():
    shutil.rmtree(root)
  root.mkdir(parents=True)
  config = make_config(scan)
  t0 = time.time()
  model, mesh = model_creation_utils.from_pretrained(config, wrap_with_tunix_adapter=True)
  assert type(model).__name__ == "TunixMaxTextAdapter", type(model)
  init_weights = {p: np.array(v) for p, v in flat(nnx.state(model, nnx.Param)).items()}
  schedule = maxtext_utils.create_learning_rate_schedule(config)
  tx = optimizers.get_optimizer(config, schedule)
  training_config = peft_trainer.TrainingConfig(
      eval_every_n_steps=1000,
      max_steps=STEPS,
      checkpoint_root_directory=str(root),
      # As train_sft.get_tunix_config builds them (checkpoint_period=2, async_checkpointing=False),
      # plus max_to_keep=1: Orbax also saves the first step (1), and only the last is kept.
      checkpointing_options=ocp.CheckpointManagerOptions(
          save_interval_steps=STEPS, enable_async_checkpointing=False, max_to_keep=1),
      data_sharding_axis=tuple(config.data_sharding),
  )
  data = batches(config, STEPS)
  with jax.set_mesh(mesh), nn_partitioning.axis_rules(config.logical_axis_rules):
    trainer = peft_trainer.PeftTrainer(model, tx, training_config)
    trainer = trainer.with_gen_model_input_fn(model_input)
    loss_before = float(peft_trainer._default_loss_fn(trainer.model, **model_input(data[0])))
    trainer.train(data)
    loss_after = float(peft_trainer._default_loss_fn(trainer.model, **model_input(data[0])))
  seconds = time.time() - t0
  assert trainer.train_steps == STEPS, trainer.train_steps
  steps = sorted(int(p.name) for p in root.iterdir() if p.name.isdigit())
  assert steps == [STEPS], f"{name}: Tunix saved steps {steps}, expected [{STEPS}]"

  # The exact trees Tunix's CheckpointManager.save handed to Orbax at the last step.
  params = nnx.state(trainer.model)
  opt_state = nnx.state(trainer.optimizer, nnx.optimizer.OptState)
  items = {"model_params": params, "optimizer_state": opt_state}
  trained = {p: np.array(v) for p, v in flat(nnx.state(trainer.model, nnx.Param)).items()}
  change = {p: float(np.max(np.abs(trained[p] - init_weights[p]))) for p in trained}
  assert min(change.values()) > 1e-4, f"{name}: a weight barely moved: {change}"
  verified = verify(root / str(STEPS), items)
  print(f"{name}: trained {STEPS} steps in {seconds:.1f} s, loss {loss_before:.4f} -> "
        f"{loss_after:.4f}; {verified}", file=sys.stderr)
  return {
      "writer": ("tunix.sft.peft_trainer.PeftTrainer.train -> "
                 "tunix.sft.checkpoint_manager.CheckpointManager.save (Orbax v0 API)"),
      "model": ("maxtext.integration.tunix.tunix_adapter.TunixMaxTextAdapter(base="
                "maxtext.models.models.Transformer), from "
                "model_creation_utils.from_pretrained(config, wrap_with_tunix_adapter=True)"),
      "scan_layers": scan,
      "config_argv": config_argv(scan),
      "optimizer": ("maxtext.optimizers.optimizers.get_optimizer(config, "
                    "maxtext_utils.create_learning_rate_schedule(config)) = optax.adamw("
                    "warmup_cosine(peak 1e-2, 10 steps, warmup 1), b1=0.9, b2=0.95, eps=1e-8, "
                    "weight_decay=0.1); nnx.Optimizer(model, tx, wrt=nnx.Param) made by PeftTrainer"),
      "schedule": [float(schedule(i)) for i in range(STEPS + 1)],
      "loss": ("tunix.sft.peft_trainer._default_loss_fn (next-token NLL) on "
               f"{STEPS} fixed batches (numpy default_rng(0), tokens in [1, vocab))"),
      "loss_before_after_on_batch_0": [loss_before, loss_after],
      "weights_max_abs_change_from_init": dict(sorted(change.items())),
      "jax_default_prng_impl": str(jax.config.jax_default_prng_impl),
      "step_dir": "<step>",
      "steps": [STEPS],
      "step_items": {str(STEPS): {"items": {k: describe_tree(v) for k, v in items.items()},
                                  "custom_metadata": {}}},
      "verified": verified,
  }


def verify(step_dir: Path, items: dict[str, Any]) -> str:
  """Reads each item with plain Orbax and checks it against the in-memory tree."""
  for item, tree in items.items():
    want = {p: as_numpy(v) for p, v in flat(tree).items()}
    restored = ocp.PyTreeCheckpointHandler().restore(step_dir / item)
    got = {p: as_numpy(v) for p, v in flat(restored).items()}
    assert sorted(got) == sorted(want), (item, sorted(set(got) ^ set(want)))
    for path, value in want.items():
      assert path.endswith("/value"), (item, path)
      assert got[path].dtype == value.dtype and got[path].shape == value.shape, (item, path)
      np.testing.assert_array_equal(got[path], value, err_msg=f"{item}/{path}")
  weights = [p for p in flat(items["model_params"])]
  assert all(p.startswith("base/") for p in weights), "the adapter's base level is missing"
  rng = [p for p in weights if "/rngs/" in p]
  keys = [p for p in rng if p.endswith("/key/value")]
  key_shapes = {tuple(as_numpy(flat(items["model_params"])[p]).shape) for p in keys}
  assert keys and all(s[-1] == 2 for s in key_shapes), key_shapes  # threefry key data
  return (f"plain Orbax read back {sum(len(flat(t)) for t in items.values())} leaves equal to "
          f"memory; every path ends in 'value'; model_params under 'base/'; {len(rng)} RNG "
          f"leaves ({len(keys)} threefry keys, uint32[..., 2])")


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--out", default="tests/data/maxtext", help="output directory")
  parser.add_argument("--only", nargs="*", choices=sorted(FIXTURES), help="subset to write")
  args = parser.parse_args(argv)
  out = Path(args.out).resolve()  # Orbax (OCDBT) requires absolute paths.
  out.mkdir(parents=True, exist_ok=True)
  versions = {p: importlib.metadata.version(p) for p in PACKAGES}
  manifest_path = out / "MANIFEST.json"
  manifest = {"versions": versions, "fixtures": {}}
  if args.only and manifest_path.exists():
    manifest["fixtures"] = json.loads(manifest_path.read_text())["fixtures"]
  for name in args.only or FIXTURES:
    print(f"writing {name}", file=sys.stderr)
    entry = make_fixture(name, FIXTURES[name], out / name)
    entry["versions"] = versions
    manifest["fixtures"][name] = entry
  manifest["fixtures"] = dict(sorted(manifest["fixtures"].items()))
  manifest_path.write_text(json.dumps(manifest, indent=1) + "\n")
  return 0


if __name__ == "__main__":
  sys.exit(main())

"""Writes small Tunix-layout checkpoints with the real Orbax, flax nnx and optax.

The trees are what Tunix's checkpoint manager saves: `nnx.state(model)` as
`model_params` and `nnx.state(optimizer, nnx.optimizer.OptState)` as
`optimizer_state`, through Orbax's composite handler.
"""

from __future__ import annotations

import pathlib

import jax
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx


class Block(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.attn = nnx.Linear(8, 8, rngs=rngs)
    self.mlp = nnx.Linear(8, 16, rngs=rngs)


class Model(nnx.Module):
  """A tiny transformer-shaped model: layers/<i>/{attn,mlp}, head."""

  def __init__(self, rngs: nnx.Rngs, n_layers: int = 2):
    self.layers = nnx.List([Block(rngs) for _ in range(n_layers)])
    self.head = nnx.Linear(8, 4, rngs=rngs)

  def __call__(self, x):
    for block in self.layers:
      x = block.attn(x)
    return self.head(x)


class OwnBase(nnx.Module):
  """A model with a module of its own called `base` (not an adapter level)."""

  def __init__(self, rngs: nnx.Rngs):
    self.base = nnx.Linear(8, 8, rngs=rngs)
    self.head = nnx.Linear(8, 4, rngs=rngs)

  def __call__(self, x):
    return self.head(self.base(x))


class Adapter(nnx.Module):
  """MaxText's TunixMaxTextAdapter pattern: the model under `base`."""

  def __init__(self, model: nnx.Module):
    self.base = model

  def __call__(self, x):
    return self.base(x)


def train_step(model: nnx.Module, optimizer: nnx.Optimizer) -> None:
  """One real update, so that mu/nu and counts are not all zeros."""

  def loss(m):
    return (m(np.ones((2, 8), np.float32)) ** 2).mean()

  grads = nnx.grad(loss)(model)
  optimizer.update(model, grads)


def make(model: nnx.Module, tx: optax.GradientTransformation, steps: int = 1):
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  for _ in range(steps):
    train_step(model, optimizer)
  return model, optimizer


def save_tunix(root: pathlib.Path, step: int, model: nnx.Module, optimizer=None) -> pathlib.Path:
  """Saves one step as Tunix's CheckpointManager does; returns the step dir."""
  items = {'model_params': ocp.args.PyTreeSave(nnx.state(model))}
  if optimizer is not None:
    items['optimizer_state'] = ocp.args.PyTreeSave(nnx.state(optimizer, nnx.optimizer.OptState))
  step_dir = pathlib.Path(root) / str(step)
  with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckptr:
    ckptr.save(step_dir, args=ocp.args.Composite(**items))
  return step_dir


def spy_restores(monkeypatch) -> list[tuple[str, list[str]]]:
  """Records each restore Orbax's PyTree handler is asked for from now on: (item
  directory name, the leaves asked for, placeholders left out)."""
  from orbax_tunix.keypaths import flatten, fmt  # pylint: disable=g-import-not-at-top

  calls: list[tuple[str, list[str]]] = []
  original = ocp.PyTreeCheckpointHandler.restore

  def spy(self, directory, *args, **kwargs):
    leaves = [fmt(p) for p, leaf in flatten(kwargs['args'].item)[0] if leaf is not ocp.PLACEHOLDER]
    calls.append((pathlib.Path(directory).name, leaves))
    return original(self, directory, *args, **kwargs)

  monkeypatch.setattr(ocp.PyTreeCheckpointHandler, 'restore', spy)
  return calls


def raw_leaves(item_dir: pathlib.Path) -> dict[str, np.ndarray]:
  """Every leaf of an item read with plain Orbax, as {'a/b/c': numpy array}."""
  tree = ocp.PyTreeCheckpointHandler().restore(pathlib.Path(item_dir))
  flat, _ = jax.tree_util.tree_flatten_with_path(tree)
  return {
      '/'.join(str(getattr(k, 'key', getattr(k, 'idx', k))) for k in kp): _numpy(v)
      for kp, v in flat
  }


def edited_copy(step: pathlib.Path, root: pathlib.Path, edit) -> dict[str, np.ndarray]:
  """A step's model item read by plain Orbax (`raw_leaves`), changed by `edit` (in place,
  on {'a/b/c': array}), and saved by plain Orbax as Tunix saves it (one Composite item) at
  `root/<the step's name>`: a hostile copy of a real run. Returns the leaves saved."""
  from orbax_tunix.keypaths import nest  # pylint: disable=g-import-not-at-top

  raw = raw_leaves(pathlib.Path(step) / 'model_params')
  edit(raw)
  with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckptr:
    ckptr.save(pathlib.Path(root) / pathlib.Path(step).name, args=ocp.args.Composite(
        model_params=ocp.args.PyTreeSave(nest((tuple(k.split('/')), v) for k, v in raw.items()))))
  return raw


def _numpy(value) -> np.ndarray:
  if jax.dtypes.issubdtype(getattr(value, 'dtype', np.float32), jax.dtypes.prng_key):
    value = jax.random.key_data(value)  # RNG keys are stored as their uint32 data.
  return np.asarray(value)

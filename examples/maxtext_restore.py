"""Restores a Tunix checkpoint as MaxText's train state, on a simulated 8-device mesh.

  python examples/maxtext_restore.py [PATH] [--params-only]

PATH is a Tunix root, step or RL root; by default the committed fixture
tests/data/tunix/adapter_inject_clip, written by the real google-tunix with
MaxText's adapter (`base` level), `inject_hyperparams` and a clipping chain.

MaxText is not on the package index, so the abstract train state is built here
the way MaxText builds it: a Linen model with the checkpoint's parameter names
(the fixtures' TinyLM), `TrainState.create` with
`optax.chain(clip_by_global_norm, adamw(schedule))`, `jax.eval_shape`, and a
sharding per leaf on a (data=4, model=2) mesh. Another checkpoint needs its own
model here; the error then says which weights differ.
"""

from __future__ import annotations

import os
import sys

# Eight CPU devices; this must happen before jax is imported.
os.environ['XLA_FLAGS'] = (
    os.environ.get('XLA_FLAGS', '') + ' --xla_force_host_platform_device_count=8'
).strip()
os.environ.setdefault('JAX_PLATFORMS', 'cpu')

import argparse  # noqa: E402
import logging  # noqa: E402
import pathlib  # noqa: E402

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from flax.training import train_state  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

import orbax_tunix  # noqa: E402
from orbax_tunix import maxtext  # noqa: E402
from orbax_tunix.keypaths import flatten, fmt  # noqa: E402

DEFAULT = pathlib.Path(__file__).resolve().parent.parent / 'tests/data/tunix/adapter_inject_clip'


class QProj(nn.Module):
  """A projection whose weight is called `w`, as in the fixtures."""

  @nn.compact
  def __call__(self, x):
    return x @ self.param('w', nn.initializers.lecun_normal(), (8, 8))


class Attn(nn.Module):
  @nn.compact
  def __call__(self, x):
    return QProj(name='q_proj')(x) + nn.Dense(8, use_bias=False, name='k_proj')(x)


class Mlp(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(8, name='down_proj')(nn.Dense(16, name='up_proj')(x))


class Layer(nn.Module):
  @nn.compact
  def __call__(self, x):
    return Mlp(name='mlp')(Attn(name='attn')(x))


class Layers(nn.Module):
  """Unscanned layers named '0', '1', ... as Tunix's nnx.List keys them."""

  n_layers: int = 2

  @nn.compact
  def __call__(self, x):
    for i in range(self.n_layers):
      x = Layer(name=str(i))(x)
    return x


class TinyLM(nn.Module):
  """The fixtures' model in Linen: embedder, layers/<i>/{attn,mlp}, final_norm."""

  @nn.compact
  def __call__(self, tokens):
    x = nn.Embed(16, 8, name='embedder')(tokens)
    return nn.RMSNorm(name='final_norm')(Layers(name='layers')(x))


def sharded(tree, mesh: jax.sharding.Mesh):
  """Gives each abstract leaf a sharding: mesh axes on the dims they divide."""

  def one(leaf):
    axes, spec = list(mesh.axis_names), []
    for dim in leaf.shape:
      if axes and dim % mesh.shape[axes[0]] == 0:
        spec.append(axes.pop(0))
      else:
        spec.append(None)
    sharding = NamedSharding(mesh, PartitionSpec(*spec))
    return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)

  return jax.tree.map(one, tree)


def abstract_train_state(mesh: jax.sharding.Mesh):
  """MaxText's abstract state: Linen params, chain(clip, adamw(schedule)), int32 step."""
  model = TinyLM()
  schedule = optax.warmup_cosine_decay_schedule(0.0, 1e-3, 10, 100)
  tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule))

  def init():
    params = model.init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))
    return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)

  return sharded(jax.eval_shape(init), mesh)


def main(argv: list[str]) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('path', nargs='?', default=str(DEFAULT), help='Tunix root, step or RL root')
  parser.add_argument('--params-only', action='store_true', help='restore the weights alone')
  args = parser.parse_args(argv)
  logging.basicConfig(level=logging.WARNING, format='%(levelname)s %(name)s: %(message)s')
  logging.getLogger('orbax_tunix').setLevel(logging.INFO)

  mesh = jax.make_mesh((4, 2), ('data', 'model'))
  abstract = abstract_train_state(mesh)
  try:
    plan = maxtext.plan_restore(args.path, abstract, params_only=args.params_only)
  except orbax_tunix.TunixCheckpointError as e:
    print(f'Cannot restore {args.path} into the TinyLM train state:\n{e}', file=sys.stderr)
    return 1
  print(plan.describe())
  # The same as maxtext.restore_train_state(args.path, abstract), plan kept.
  state = maxtext.execute_plan(plan, abstract)

  print(f'\nrestored a {type(state).__name__} on {mesh.devices.size} devices:')
  for path, leaf in flatten(state)[0]:
    if not isinstance(leaf, jax.Array):
      continue
    spec = leaf.sharding.spec if isinstance(leaf.sharding, NamedSharding) else leaf.sharding
    value = f'  = {leaf.item()}' if leaf.ndim == 0 else ''
    print(f'  {fmt(path):55s} {str(leaf.shape):9s} {leaf.dtype!s:8s} {spec}{value}')
  return 0


if __name__ == '__main__':
  sys.exit(main(sys.argv[1:]))

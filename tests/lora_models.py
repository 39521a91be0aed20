"""Small models with LoRA, built with the real qwix and flax nnx, and their plain twins.

`QwixLM` has einsum weights in the layouts qwix sees in real models (Qwen3's
`q_proj` (D, N, H) and `o_proj` (N, H, D), an interleaved (N, D, H) one) and
`nnx.Linear` kernels; qwix's `LoraProvider` adds `<w>_lora_a/_lora_b` beside
them. `FlaxLM` uses `nnx.LoRALinear` and `nnx.LoRA(base_module=...)`, and
`FlaxPlainLM` is the same network without adapters.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import qwix
from flax import nnx

D, N, H, F, V = 8, 2, 4, 16, 32
RANK, ALPHA = 2, 4.0
TOKENS = np.arange(2 * 5).reshape(2, 5) % V


class Einsum(nnx.Module):
  def __init__(self, eq: str, shape, *, rngs: nnx.Rngs):
    self.eq = eq
    self.w = nnx.Param(nnx.initializers.normal(0.3)(rngs.params(), shape))

  def __call__(self, x):
    return jnp.einsum(self.eq, x, self.w[...])


class Block(nnx.Module):
  def __init__(self, *, rngs: nnx.Rngs):
    self.q_proj = Einsum('btd,dnh->btnh', (D, N, H), rngs=rngs)
    self.v_proj = Einsum('btd,ndh->btnh', (N, D, H), rngs=rngs)  # interleaved
    self.o_proj = Einsum('btnh,nhd->btd', (N, H, D), rngs=rngs)
    self.up = nnx.Linear(D, F, rngs=rngs)
    self.down = nnx.Linear(F, D, rngs=rngs)

  def __call__(self, x):
    x = x + self.o_proj(jnp.tanh(self.q_proj(x)) * self.v_proj(x))
    return x + self.down(jax.nn.gelu(self.up(x)))


class QwixLM(nnx.Module):
  def __init__(self, *, rngs: nnx.Rngs):
    self.embedder = nnx.Embed(V, D, rngs=rngs)
    self.layers = nnx.List([Block(rngs=rngs) for _ in range(2)])

  def __call__(self, tokens):
    x = self.embedder(tokens)
    for layer in self.layers:
      x = layer(x)
    return self.embedder.attend(x)


class FlaxLM(nnx.Module):
  def __init__(self, *, rngs: nnx.Rngs):
    self.embedder = nnx.Embed(V, D, rngs=rngs)
    self.fc1 = nnx.LoRALinear(D, F, lora_rank=RANK, rngs=rngs)
    self.fc2 = nnx.LoRA(F, RANK, D, base_module=nnx.Linear(F, D, rngs=rngs), rngs=rngs)

  def __call__(self, tokens):
    return self.embedder.attend(self.fc2(jax.nn.gelu(self.fc1(self.embedder(tokens)))))


class FlaxPlainLM(nnx.Module):
  def __init__(self, *, rngs: nnx.Rngs):
    self.embedder = nnx.Embed(V, D, rngs=rngs)
    self.fc1 = nnx.Linear(D, F, rngs=rngs)
    self.fc2 = nnx.Linear(F, D, rngs=rngs)

  def __call__(self, tokens):
    return self.embedder.attend(self.fc2(jax.nn.gelu(self.fc1(self.embedder(tokens)))))


def with_qwix_lora(base: QwixLM, **quantized) -> nnx.Module:
  """qwix LoRA on every projection, as Tunix applies it (`apply_lora_to_model`); QLoRA with
  `weight_qtype=...` (and `tile_size`, `weight_calibration_method`): the base frozen quantized."""
  provider = qwix.LoraProvider(module_path='.*(q_proj|v_proj|o_proj|up|down)', rank=RANK,
                               alpha=ALPHA, **quantized)
  return qwix.apply_lora_to_model(base, provider, jnp.asarray(TOKENS))


def train(model: nnx.Module, steps: int = 3) -> nnx.Module:
  """A few real updates of the adapters only, so that `a` and `b` are non-zero."""
  optimizer = nnx.Optimizer(model, optax.adam(3e-2), wrt=nnx.LoRAParam)
  targets = jnp.asarray((TOKENS + 1) % V)

  def loss(m):
    return optax.softmax_cross_entropy_with_integer_labels(m(jnp.asarray(TOKENS)), targets).mean()

  for _ in range(steps):
    grads = nnx.grad(loss, argnums=nnx.DiffState(0, nnx.LoRAParam))(model)
    optimizer.update(model, grads)
  return model


def flax_plain_weights(model: FlaxLM) -> dict:
  """The weights of `FlaxPlainLM` that `model` starts from (its layers, no adapters)."""
  def layer(linear):
    return {'kernel': np.asarray(linear.kernel[...]), 'bias': np.asarray(linear.bias[...])}

  return {'embedder': {'embedding': np.asarray(model.embedder.embedding[...])},
          'fc1': layer(model.fc1), 'fc2': layer(model.fc2.base_module)}

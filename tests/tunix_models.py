"""The small nnx models of the committed fixtures, and the plain twins of the LoRA ones.

`scripts/make_tunix_fixtures.py` builds the fixtures from these classes (in an
environment with google-tunix and qwix); the tests run the plain models on the
merged weights. Only flax is needed here.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

VOCAB = 16
DIM = 8
HIDDEN = 16
NUM_LAYERS = 2
SEQ = 4
BATCH = 2


class Einsum(nnx.Module):
  """Einsum layer with a weight named ``w`` (as in Tunix's Gemma models)."""

  def __init__(self, eq: str, shape: tuple[int, ...], *, rngs: nnx.Rngs):
    self.eq = eq
    self.w = nnx.Param(nnx.initializers.normal(0.1)(rngs.params(), shape))

  def __call__(self, x):
    return jnp.einsum(self.eq, x, self.w[...])


class Attention(nnx.Module):
  """Stand-in attention: q_proj is an Einsum (``w``), k_proj an nnx.Linear (``kernel``)."""

  def __init__(self, *, rngs: nnx.Rngs):
    self.q_proj = Einsum("btd,dh->bth", (DIM, DIM), rngs=rngs)
    self.k_proj = nnx.Linear(DIM, DIM, use_bias=False, rngs=rngs)

  def __call__(self, x):
    q = self.q_proj(x)
    k = self.k_proj(x)
    scores = jnp.einsum("bqh,bkh->bqk", q, k) / np.sqrt(DIM)
    return jnp.einsum("bqk,bkd->bqd", jax.nn.softmax(scores, axis=-1), x)


class Mlp(nnx.Module):
  def __init__(self, *, rngs: nnx.Rngs):
    self.up_proj = nnx.Linear(DIM, HIDDEN, rngs=rngs)
    self.down_proj = nnx.Linear(HIDDEN, DIM, rngs=rngs)

  def __call__(self, x):
    return self.down_proj(jax.nn.gelu(self.up_proj(x)))


class Block(nnx.Module):
  def __init__(self, *, rngs: nnx.Rngs):
    self.attn = Attention(rngs=rngs)
    self.mlp = Mlp(rngs=rngs)

  def __call__(self, x):
    x = x + self.attn(x)
    return x + self.mlp(x)


class TinyLM(nnx.Module):
  """Embedding, ``NUM_LAYERS`` blocks in an ``nnx.List``, tied output head."""

  def __init__(self, *, rngs: nnx.Rngs):
    self.embedder = nnx.Embed(VOCAB, DIM, rngs=rngs)
    self.layers = nnx.List([Block(rngs=rngs) for _ in range(NUM_LAYERS)])
    self.final_norm = nnx.RMSNorm(DIM, rngs=rngs)

  def __call__(self, tokens):
    x = self.embedder(tokens)
    for layer in self.layers:
      x = layer(x)
    return self.embedder.attend(self.final_norm(x))


class FlaxLoraLM(nnx.Module):
  """flax's own LoRA: an ``nnx.LoRALinear`` and an ``nnx.LoRA`` wrapping a Linear."""

  def __init__(self, *, rngs: nnx.Rngs):
    self.embedder = nnx.Embed(VOCAB, DIM, rngs=rngs)
    self.up_proj = nnx.LoRALinear(DIM, HIDDEN, lora_rank=2, rngs=rngs)
    self.down_proj = nnx.LoRA(HIDDEN, 2, DIM, base_module=nnx.Linear(HIDDEN, DIM, rngs=rngs),
                              rngs=rngs)

  def __call__(self, tokens):
    x = self.embedder(tokens)
    return self.embedder.attend(x + self.down_proj(jax.nn.gelu(self.up_proj(x))))


class FlaxPlainLM(nnx.Module):
  """`FlaxLoraLM` without its adapters: what its merged weights load into."""

  def __init__(self, *, rngs: nnx.Rngs):
    self.embedder = nnx.Embed(VOCAB, DIM, rngs=rngs)
    self.up_proj = nnx.Linear(DIM, HIDDEN, rngs=rngs)
    self.down_proj = nnx.Linear(HIDDEN, DIM, rngs=rngs)

  def __call__(self, tokens):
    x = self.embedder(tokens)
    return self.embedder.attend(x + self.down_proj(jax.nn.gelu(self.up_proj(x))))

"""How hard XLA optimizes this package's device programs: least on a TPU, where its compile is
what a first call waits for.

The programs (`transforms.on_devices`: casts, re-layouts, LoRA merges, QLoRA dequantization
and re-quantization) are a few elementwise operations and small matmuls over arrays just read:
memory-bound, they run in a millisecond or less. On a TPU v5e XLA compiles each 2.3-5x faster
at its lowest effort than at its default (0.09-0.22 s against 0.23-1.1 s), with the same bits
out and runs still under a millisecond (BENCHMARKS.md §31): the compiles are what a first call
with a cold cache waits for. On the CPU the effort changes neither compile time nor bits (§31),
so there XLA's default stays.

  ORBAX_TUNIX_COMPILE_EFFORT   auto (the default): lowest on a TPU, XLA's default elsewhere;
                               low: lowest everywhere; default: XLA's default everywhere

The options are part of a program's key (`transforms.Program.key`), so the programs kept
across processes (`executables`) and JAX's own cache tell the efforts apart.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax

from orbax_tunix import options

VARIABLE = 'ORBAX_TUNIX_COMPILE_EFFORT'
CHOICES = ('auto', 'low', 'default')
# XLA's optimization level O0 (jax.CompilerEffortLevel.O0; JAX 0.10 has the level under another
# name, the same value): a compile option every JAX this package supports takes.
_LOWEST = (('optimization_level', 9),)


def _choice() -> str:
  """The variable's value (`options.from_environment`).

  Raises:
    ValueError: a value other than `CHOICES`.
  """
  return options.from_environment(VARIABLE, CHOICES, 'the lowest effort on a TPU')


def compiler_options(shardings: Sequence[jax.sharding.Sharding]) -> tuple[tuple[str, Any], ...]:
  """`options_for` the effort `ORBAX_TUNIX_COMPILE_EFFORT` chooses.

  Raises:
    ValueError: `ORBAX_TUNIX_COMPILE_EFFORT` holds an unknown value.
  """
  return options_for(_choice(), shardings)


def options_for(choice: str, shardings: Sequence[jax.sharding.Sharding]
                ) -> tuple[tuple[str, Any], ...]:
  """XLA's options for a program whose outputs are in `shardings`, at effort `choice` (one of
  `CHOICES`), as (name, value) pairs (part of the program's key); () for XLA's defaults."""
  if choice == 'default':
    return ()
  if choice == 'low':
    return _LOWEST
  platforms = {d.platform for s in shardings for d in s.device_set}
  return _LOWEST if platforms == {'tpu'} else ()

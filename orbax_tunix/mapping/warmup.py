"""XLA's compiler started when a restore begins, on a TPU where no program is kept yet: a
process's first compile there is slow, and slower beside a read.

On a TPU v5e the first program a process compiles takes 0.51-0.64 s, the next 0.06-0.13 s (the
compiler's own start); begun while a restore reads, the first compile took 1.6-1.7 s, and a
LoRA merge's first call with a cold compilation cache waited for it: 1.39-1.55x the plain
restore (BENCHMARKS.md §34). A trivial program compiled on a thread when the restore begins,
before its planning, leaves the compiler started, or nearly, when the restore's own programs
compile: 1.07-1.12x. Where programs are kept (`executables.any_kept`: JAX's cache is on and
holds this package's programs), they are loaded, not compiled, and the warm-up only competes
with the read (a QLoRA first call 1.17-1.25x the raw read without it, 1.31-1.42x with it): it is
not started. Elsewhere a first compile costs tens of milliseconds: nothing is started.

  ORBAX_TUNIX_WARM_COMPILER   auto (the default): on a TPU, where no program is kept;
                              1: always; 0: never

Once per process and platform. It never starts a backend: only a device that the caller's
target already names is used. A warm-up that fails only loses its head start.
"""

from __future__ import annotations

import threading
from typing import Any

import jax
import jax.numpy as jnp

from orbax_tunix import options
from orbax_tunix.mapping import effort, executables

VARIABLE = 'ORBAX_TUNIX_WARM_COMPILER'
CHOICES = ('auto', '1', '0')
_DECIDED: set[str] = set()  # Platforms this process has warmed, or decided not to.
_LOCK = threading.Lock()
_LOOKED_AT = 64  # Nodes `_device` looks at, at most.
_END = object()


def _choice() -> str:
  """The variable's value (`options.from_environment`).

  Raises:
    ValueError: a value other than `CHOICES`.
  """
  return options.from_environment(VARIABLE, CHOICES, 'on a TPU where no program is kept')


def _device(tree: Any) -> Any:
  """A device of the first leaf of `tree` with a sharding (an array's, a `jax.ShapeDtypeStruct`'s
  or an Orbax restore arg's), or None: none among its first `_LOOKED_AT` nodes (walked lazily,
  depth first, so that a large target costs no flattening: a restore's planning at 50k leaves is
  about 2 s, BENCHMARKS §4)."""
  stack, looked = [iter((tree,))], 0
  while stack and looked < _LOOKED_AT:
    node = next(stack[-1], _END)
    if node is _END:
      stack.pop()
      continue
    looked += 1
    sharding = getattr(node, 'sharding', None)
    if isinstance(sharding, jax.sharding.Sharding):
      return min(sharding.device_set, key=lambda d: d.id)
    if isinstance(node, dict):
      stack.append(iter(node.values()))
    elif isinstance(node, list | tuple):
      stack.append(iter(node))
    else:  # Another pytree node (e.g. flax's State): one level of it; a leaf: itself.
      children = jax.tree_util.tree_flatten(node, is_leaf=lambda x, node=node: x is not node)[0]
      if not (len(children) == 1 and children[0] is node):
        stack.append(iter(children))
  return None


def _compile(device: Any) -> None:
  """Compiles a trivial program for `device` at the package's effort (what its programs ask)."""
  sharding = jax.sharding.SingleDeviceSharding(device)
  try:
    jax.jit(lambda x: x + 1).lower(jax.ShapeDtypeStruct((8, 128), jnp.float32, sharding=sharding)
                                 ).compile(dict(effort.compiler_options([sharding])) or None)
  except Exception:  # pylint: disable=broad-except
    pass  # A head start only: the restore's own compiles raise what is wrong.


def start(target: Any) -> threading.Thread | None:
  """Starts the compiler on a thread for a device of `target` (see the module).

  Args:
    target: a restore's target, a pytree (of arrays, `jax.ShapeDtypeStruct`s, restore args;
      leaves without a sharding are passed over).

  Returns:
    The thread compiling, or None: nothing started (not asked for here, decided already in
    this process for the device's platform, or no device named among the target's first
    nodes).

  Raises:
    ValueError: `ORBAX_TUNIX_WARM_COMPILER` holds an unknown value.
  """
  choice = _choice()
  device = None if choice == '0' else _device(target)
  if device is None:
    return None
  with _LOCK:  # Decided once per process and platform: a restore after it looks no further.
    if device.platform in _DECIDED:
      return None
    _DECIDED.add(device.platform)
  if choice == 'auto' and (device.platform != 'tpu' or executables.any_kept()):
    return None
  # Not a daemon: a process that ends at once waits for the compile rather than leaving XLA
  # running while the interpreter shuts down.
  thread = threading.Thread(target=_compile, args=(device,), name='orbax_tunix-warm-compiler')
  thread.start()
  return thread

"""A QLoRA merge in a process of its own, with JAX's persistent compilation cache on, as a
command runs it: `python -m tests.merge_in_a_process STEP_ROOT CACHE_DIR OUT.npz`.

On 8 simulated CPU devices and the (4, 2) mesh of the tests, it restores the merged weights of
`lora_models.QwixLM` (`restore_merged_lora`) into `test_lora_merge.abstract_weights`, writes them
to OUT.npz and prints one JSON line: how many programs it lowered (`transforms.Program.lower`:
a program loaded from `executables` is not) and whether each weight came in its target's
sharding and dtype.
"""

import os
import sys

os.environ['XLA_FLAGS'] = '--xla_force_host_platform_device_count=8'

# pylint: disable=g-import-not-at-top,wrong-import-position
import json  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import orbax_tunix as ot  # noqa: E402
from orbax_tunix.keypaths import flatten, fmt  # noqa: E402
from orbax_tunix.mapping import transforms  # noqa: E402
from tests import lora_models as lm  # noqa: E402
from tests.test_lora_merge import abstract_weights  # noqa: E402


def main(step_root: str, cache: str, out: str) -> None:
  lowered = []
  lower = transforms.Program.lower
  transforms.Program.lower = lambda self, *abstract: (lowered.append(self.key),
                                                      lower(self, *abstract))[1]
  jax.config.update('jax_enable_compilation_cache', True)
  jax.config.update('jax_compilation_cache_dir', cache)
  mesh = jax.make_mesh((4, 2), ('data', 'model'))
  abstract = abstract_weights('qwix', mesh, jnp.float32)
  target = dict(flatten(abstract)[0])
  got = dict(flatten(ot.restore_merged_lora(step_root, abstract, alpha=lm.ALPHA))[0])
  np.savez(out, **{fmt(p): np.asarray(v) for p, v in got.items()})
  print(json.dumps({
      'lowered': len(lowered),
      'as_targets': all(v.sharding == target[p].sharding and v.dtype == target[p].dtype
                        for p, v in got.items()),
  }))


if __name__ == '__main__':
  main(*sys.argv[1:])

"""Runs the orbax-tunix CLI, sending itself a real signal while an Orbax save writes.

`python tests/signal_mid_write.py SIGNAL N convert SRC DST ...`: the process sends itself
SIGNAL (a number) once the N-th array save of the conversion has started its writes (its
`async_save` returned: Orbax's threads write on), so the signal lands mid-write.
"""

import os
import runpy
import sys

from orbax.checkpoint._src.handlers import base_pytree_checkpoint_handler as _base

_real = _base.BasePyTreeCheckpointHandler.async_save
_saves = []
_SIGNAL, _AT = int(sys.argv[1]), int(sys.argv[2])


async def _async_save(self, *args, **kwargs):
  futures = await _real(self, *args, **kwargs)
  _saves.append(1)
  if len(_saves) == _AT:
    os.kill(os.getpid(), _SIGNAL)  # Handled at the next bytecode, writes running.
  return futures


_base.BasePyTreeCheckpointHandler.async_save = _async_save
sys.argv = ['orbax-tunix', *sys.argv[3:]]
runpy.run_module('orbax_tunix.cli', run_name='__main__')

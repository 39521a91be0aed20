"""Runs the orbax-tunix CLI, pausing while an Orbax save writes until told to go on.

`python tests/pause_mid_write.py GO N convert SRC DST ...`: once the N-th array save of the
conversion has started its writes, the process creates `GO.paused` and waits until the file
GO exists (another run can then be started against the same destination), then goes on.
"""

import os
import pathlib
import runpy
import sys
import time

from orbax.checkpoint._src.handlers import base_pytree_checkpoint_handler as _base

_real = _base.BasePyTreeCheckpointHandler.async_save
_saves = []
_GO, _AT = pathlib.Path(sys.argv[1]), int(sys.argv[2])


async def _async_save(self, *args, **kwargs):
  futures = await _real(self, *args, **kwargs)
  _saves.append(1)
  if len(_saves) == _AT:
    pathlib.Path(f'{_GO}.paused').write_text(str(os.getpid()))
    while not _GO.exists():
      time.sleep(0.1)
  return futures


_base.BasePyTreeCheckpointHandler.async_save = _async_save
sys.argv = ['orbax-tunix', *sys.argv[3:]]
runpy.run_module('orbax_tunix.cli', run_name='__main__')

"""`orbax-tunix`: inspect, convert, export and diff checkpoints from the command line.

  commands.py  the commands, and `main`: errors shown as this command's flags
  parser.py    the argument parser: the top level and each command's flags
  flags.py     flags made from the library's options; its messages with flags
  pipes.py     the output streams guarded (a closed pipe, a full disk), libraries quieted
  display.py   tables, aligned text and JSON for people and scripts
  progress.py  progress bars and lines; signals that stop a conversion cleanly

The work is done by the library (`inspection`, `convert`, `export`, `diff`).
"""

import gc
import sys

from orbax_tunix.cli.commands import main

__all__ = ['console', 'main']


def console() -> None:
  """The `orbax-tunix` command (and `python -m orbax_tunix.cli`): `main`, then exit with its
  status.

  What the command made is frozen out of the cyclic GC first (`gc.freeze`): the interpreter's
  shutdown then does not walk every object JAX, Orbax and the command made (about 0.2 s of a
  2.5 s export; BENCHMARKS.md, issue 48). Everything the command writes is closed and committed
  before `main` returns; objects are still released as their references go.
  """
  code = main()
  gc.freeze()
  sys.exit(code)

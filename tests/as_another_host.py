"""Runs a test script, or a module, as a process on another host would run it.

`python tests/as_another_host.py SCRIPT ARGS...` or `... -m MODULE ARGS...`: this package's
idea of its host (`commit._host`) is another host's, so a run on this machine cannot look the
process up (as across machines): its claims are judged by their age alone, which is what a
second host sees.
"""

import runpy
import sys

from orbax_tunix.writing import commit

commit._host = lambda: 'elsewhere/another-boot/pid:[4026531836]'  # pylint: disable=protected-access
if sys.argv[1] == '-m':
  sys.argv = [sys.argv[2], *sys.argv[3:]]
  runpy.run_module(sys.argv[0], run_name='__main__', alter_sys=True)
else:
  sys.argv = sys.argv[1:]
  runpy.run_path(sys.argv[0], run_name='__main__')

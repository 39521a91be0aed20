"""Runs the orbax-tunix CLI, sending itself a real signal at one point of a bucket commit.

`python tests/signal_in_commit.py SIGNAL WHERE convert SRC DST ...`: the process sends
itself SIGNAL (a number) just before one storage call of the commit, named by WHERE:
`copy:N` the N-th copy of an entry into DST (the new step complete beside it, DST emptied),
`empty` the first removal of an entry of the old DST (DST just made unfinished), `cleanup`
the removal of the staging copy, or on a local disk of the old step moved aside (DST
already committed). The signal lands there, between
two storage calls, as a preemption's SIGTERM or a Ctrl-C would.
"""

import os
import runpy
import sys

import gcsfs

from orbax_tunix.writing import commit

_SIGNAL, _WHERE = int(sys.argv[1]), sys.argv[2]
_DST = sys.argv[5].rstrip('/')
_copies, _sent = [], []


def _signal() -> None:
  if not _sent:  # Once, as one preemption or one Ctrl-C.
    _sent.append(1)
    os.kill(os.getpid(), _SIGNAL)  # Handled at the next bytecode: before the call below.


_real_copy = gcsfs.GCSFileSystem.copy


def _copy(self, *args, **kwargs):
  _copies.append(1)
  if _WHERE == f'copy:{len(_copies)}':
    _signal()
  return _real_copy(self, *args, **kwargs)


_real_remove = commit.remove_tree


def _remove(path):
  text = os.fspath(path)
  inside = text.startswith(_DST + '/')
  if (_WHERE == 'empty' and inside) or (
      _WHERE == 'cleanup' and (commit.NEW_MARKER in text or commit.OLD_MARKER in text)):
    _signal()
  return _real_remove(path)


gcsfs.GCSFileSystem.copy = _copy
commit.remove_tree = _remove
sys.argv = ['orbax-tunix', *sys.argv[3:]]
runpy.run_module('orbax_tunix.cli', run_name='__main__')

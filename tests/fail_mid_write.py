"""A process of a multi-process job whose writes fail part way, as a full disk fails them.

Run as `python tests/fail_mid_write.py PYTHON -m orbax_tunix.cli ARGV...` (the command line
`tests/test_distributed.py` starts, after this script): a sink's first write raises ENOSPC
(the staging is open and the other process writing), then the command runs as the CLI runs it. The test checks what every process of
the job says and leaves when one of them fails this way.
"""

import errno
import os
import sys

from orbax_tunix.cli import commands
from orbax_tunix.writing import writer


def _full(self, batch):
  del self, batch
  raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


for sink in (writer.OrbaxItemSink, writer.SafetensorsSink):
  sink.write = _full
assert sys.argv[2:4] == ['-m', 'orbax_tunix.cli'], sys.argv
sys.exit(commands.main(sys.argv[4:]))

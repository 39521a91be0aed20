"""Calls across the boundary between orbax_tunix and Orbax during one restore.

Counts, with `sys.setprofile` on every thread, each call whose nearest caller
in either package is in the other one: Orbax calling into orbax_tunix (by the
orbax_tunix function called) and orbax_tunix calling into Orbax. The restore
runs once to warm up, then once counted.

  python benchmarks/crossings.py tests/data/tunix/sft_full/2   # a step, TunixAwareHandler
  python benchmarks/crossings.py --plain-item                    # a plain item Orbax's Standard
                                                                 # handler wrote: TunixPyTreeHandler,
                                                                 # StandardRestore()
  PYTHONPATH=<other tree> python benchmarks/crossings.py ...   # another revision's package

The restores run on the first `--devices N` of JAX's devices (8 simulated CPU devices
by default; `harness.py`).
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile
import threading

import harness  # sibling module; the script's directory is on sys.path


def _side(frame) -> str | None:
  name = frame.f_code.co_filename
  if f'{os.sep}orbax_tunix{os.sep}' in name:
    return 'orbax_tunix'
  if f'{os.sep}orbax{os.sep}checkpoint{os.sep}' in name:
    return 'orbax'
  return None


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('path', nargs='?', help='a step to restore whole')
  parser.add_argument('--plain-item', action='store_true',
                      help='instead, an item written here by Orbax\'s StandardCheckpointHandler')
  harness.add_flags(parser, cpu_default=8)
  args = parser.parse_args(argv)
  devices = harness.use_devices(args.devices, cpu_default=8)
  import numpy as np  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

  import orbax_tunix  # pylint: disable=g-import-not-at-top

  if args.plain_item:
    item = os.path.join(tempfile.mkdtemp(prefix='crossings-'), 'state')
    with ocp.Checkpointer(ocp.StandardCheckpointHandler()) as writer:
      writer.save(item, args=ocp.args.StandardSave({'a': {'w': np.ones((4, 4))},
                                                     'b': np.arange(3)}))
    ckptr = ocp.Checkpointer(orbax_tunix.TunixPyTreeHandler())

    def restore():
      return ckptr.restore(item, args=ocp.args.StandardRestore())
  else:
    ckptr = ocp.Checkpointer(orbax_tunix.TunixAwareHandler())

    def restore():
      return ckptr.restore(args.path)

  restore()  # Warm: imports and compilations are not counted.
  counts: collections.Counter[str] = collections.Counter()

  def profile(frame, event, _):
    me = _side(frame) if event == 'call' else None
    if me is None:
      return
    caller = frame.f_back
    while caller is not None and _side(caller) is None:
      caller = caller.f_back
    if caller is not None and _side(caller) != me:
      counts[f'orbax -> orbax_tunix {frame.f_code.co_name}' if me == 'orbax_tunix'
             else 'orbax_tunix -> orbax'] += 1

  sys.setprofile(profile)
  threading.setprofile(profile)
  try:
    restore()
  finally:
    sys.setprofile(None)
    threading.setprofile(None)
  print(f'package: {os.path.dirname(orbax_tunix.__file__)}; devices:'
        f' {harness.describe_line(harness.describe(devices))}')
  for name, n in sorted(counts.items()):
    print(f'  {n:4d}  {name}')
  into_ours = sum(n for k, n in counts.items() if k.startswith('orbax -> '))
  print(f'  Orbax -> orbax_tunix: {into_ours}; orbax_tunix -> Orbax:'
        f' {counts["orbax_tunix -> orbax"]}')


if __name__ == '__main__':
  main()

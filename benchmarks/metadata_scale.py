"""`detect` and `inspect` on a very large `_METADATA`: time and peak memory.

Writes a step whose `model_params` item records LEAVES arrays under nnx's
`value` level in its `_METADATA` (written directly, as Orbax lays it out; with
`--data` the arrays exist too, else the item holds metadata only, as a
checkpoint whose writer died after the metadata does). Then, each in a fresh
process: `orbax_tunix.detect(step)` and `orbax-tunix inspect --json step`
(which, without array data, must end in its error, exit 2). Reported: wall
time and peak RSS of each process (sampled; n/a where it cannot be read). `--devices N`
sets how many CPU devices their JAX simulates; JAX_PLATFORMS passes through (`harness.py`).

  python benchmarks/metadata_scale.py [--leaves 1000000]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shutil
import sys
import tempfile

import harness  # sibling module; the script's directory is on sys.path

PYTREE = 'orbax.checkpoint._src.handlers.pytree_checkpoint_handler.PyTreeCheckpointHandler'


def write(step: pathlib.Path, leaves: int) -> int:
  item = step / 'model_params'
  item.mkdir(parents=True)
  tree = {}
  for i in range(leaves):
    keys = ('layers', str(i // 8), f'w{i % 8}', 'value')
    tree[repr(keys)] = {
        'key_metadata': [{'key': k, 'key_type': 2} for k in keys],
        'value_metadata': {'value_type': 'jax.Array', 'skip_deserialize': False,
                           'write_shape': [4]},
    }
  text = json.dumps({'tree_metadata': tree, 'use_ocdbt': True, 'use_zarr3': False,
                     'store_array_data_equal_to_fill_value': True, 'custom_metadata': None})
  (item / '_METADATA').write_text(text)
  (step / '_CHECKPOINT_METADATA').write_text(json.dumps(
      {'item_handlers': {'model_params': PYTREE}, 'metrics': {}, 'performance_metrics': {},
       'init_timestamp_nsecs': 0, 'commit_timestamp_nsecs': 1, 'custom_metadata': {}}))
  return len(text)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--leaves', type=int, default=1_000_000)
  harness.add_flags(parser, cpu_default=None)
  args = parser.parse_args(argv)
  env = harness.child_env(args.devices)
  work = pathlib.Path(tempfile.mkdtemp(prefix='metadata-scale-'))
  try:
    size = write(work / '1', args.leaves)
    rows = []
    for name, command in (
        ('detect', [sys.executable, '-c',
                    f'import orbax_tunix; orbax_tunix.detect({str(work / "1")!r})']),
        ('inspect --json', [sys.executable, '-m', 'orbax_tunix.cli', 'inspect', '--json',
                            str(work / '1')]),
    ):
      peak, seconds, status = harness.sampled_peak_rss(command, env, interval=0.01)
      rows.append((name, seconds, peak, status))
      print(rows[-1], flush=True)
    print(f'\nCommand: `python benchmarks/metadata_scale.py --leaves {args.leaves}'
          + (f' --devices {args.devices}`' if args.devices else '`')
          + f' (_METADATA of {size / 2**20:.0f} MiB, no array data);'
          f' {harness.commands_line(args.devices)}\n')
    print('| | wall s | peak RSS | exit |')
    print('|---|---|---|---|')
    for name, seconds, peak, status in rows:
      shown = 'n/a' if peak is None else f'{peak / 2**30:.2f} GiB'
      print(f'| {name} | {seconds:.1f} | {shown} | {status} |')
  finally:
    shutil.rmtree(work, ignore_errors=True)


if __name__ == '__main__':
  main()

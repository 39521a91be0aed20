"""The argument parser of `orbax-tunix` (`build_parser`): the top level, and each command's
flags (`flags`: the options' flags come from the library's options).
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from typing import Any

from orbax_tunix import layouts
from orbax_tunix.cli.flags import (
  add_layout_options,
  add_merge_options,
  add_switches,
  atol,
  default,
  parse_dtype,
  parse_size,
  step_number,
)
from orbax_tunix.mapping import huggingface
from orbax_tunix.reading import memory
from orbax_tunix.tools import convert as convert_lib

_EPILOG = (
    'examples:\n'
    '  orbax-tunix inspect gs://bucket/run/checkpoints\n'
    '  orbax-tunix convert run/checkpoints out/1000 --step 1000\n'
    '  orbax-tunix diff run/checkpoints/1000 out/1000\n'
    '  orbax-tunix convert run/checkpoints mt/1000 --layout maxtext --params-only\n'
    '  orbax-tunix diff run/checkpoints mt/1000 --params-only\n'
    '  orbax-tunix export run/checkpoints hf/ --model qwen3 --hf-config Qwen3-0.6B/\n'
    '\n'
    'sizes (--memory-budget, --max-shard-size): bytes, or KB, MB, GB (powers of\n'
    '1000, as transformers), KiB, MiB, GiB or K, M, G (powers of 1024)\n'
    '\n'
    'exit status: 0 success (diff: match), 1 diff found differences (inspect\n'
    '--verify: damaged arrays), 2 error, 130 interrupted; a closed output pipe\n'
    '(| head -1) drops the rest of the output, never changes the status'
)
_DESCRIPTION = (
    'Inspect, convert, diff and export Tunix checkpoints (and any Orbax PyTree\n'
    'checkpoint) without writing Python: convert writes plain Orbax or MaxText steps,\n'
    'export a Hugging Face safetensors folder. A path may be a root (the latest\n'
    'committed step is used), a step directory or an item directory, on a local disk\n'
    'or in a bucket.'
)


@dataclasses.dataclass(frozen=True)
class Parents:
  """The flag sets commands share (argparse parents).

  Attributes:
    common: every command's (--debug, --plain, --no-compilation-cache).
    hosts: a writing command's multi-process flags (`job.JobOptions`).
  """

  common: argparse.ArgumentParser
  hosts: argparse.ArgumentParser


def _common_flags() -> argparse.ArgumentParser:
  """--debug, --plain and --no-compilation-cache, on the top level and every command."""
  common = argparse.ArgumentParser(add_help=False)
  common.add_argument(
      '--debug', action='store_true', default=argparse.SUPPRESS,
      help='show tracebacks, warnings and Orbax logs',
  )
  common.add_argument(
      '--plain', action='store_true', default=argparse.SUPPRESS,
      help='plain text even on a terminal (no tables drawn with rich)',
  )
  common.add_argument(
      '--no-compilation-cache', action='store_true', default=argparse.SUPPRESS,
      help='compile without JAX\'s persistent compilation cache (kept by default in'
      ' $JAX_COMPILATION_CACHE_DIR, else under the user\'s cache directory; also off with'
      ' JAX_ENABLE_COMPILATION_CACHE=false)',
  )
  return common


def _host_flags() -> argparse.ArgumentParser:
  """The 'across hosts' group (`job.JobOptions`) of the commands that write."""
  hosts = argparse.ArgumentParser(add_help=False)
  group = hosts.add_argument_group(
      'across hosts', 'run the same command once per host (JAX\'s multi-controller runtime);'
      ' without these, JAX\'s own cluster detection (TPU pods, Slurm, Open MPI) is used when'
      ' it finds a job of several processes, else one process does everything')
  group.add_argument('--coordinator-address', metavar='HOST:PORT',
                     help="process 0's address and a free port, the same on every process")
  group.add_argument('--num-processes', type=int, metavar='N',
                     help='how many processes (1: one process, whatever cluster is detected)')
  group.add_argument('--process-id', type=int, metavar='I', help="this process's index, 0 to N-1")
  group.add_argument('--initialization-timeout', type=int, metavar='SECONDS',
                     help='how long to wait (above 0) for every process to join, and for a silent'
                     ' process before it is taken for dead (default 300 with these flags, 60'
                     ' for a job JAX\'s cluster detection finds)')
  return hosts


def _add_inspect(sub: Any, parents: Parents) -> None:
  """`orbax-tunix inspect PATH`."""
  p = sub.add_parser(
      'inspect', parents=[parents.common],
      help='what a checkpoint holds, from metadata only',
      description=(
          'Show the steps, the layout and the rewrites that apply, the canonical'
          ' tree (shape, dtype, bytes per leaf), totals, LoRA adapters, the'
          ' optimizer structure and the hyperparameters. Reads metadata only (and'
          ' the hyperparameter scalars), never the arrays.'
      ),
  )
  p.add_argument('path', metavar='PATH')
  p.add_argument('--step', type=step_number, help='the step to show (default: the latest committed)')
  p.add_argument('--json', action='store_true', help='print one JSON document')
  p.add_argument('--item', dest='items', action='append', metavar='NAME',
                 help='only this item of the step (repeatable; default: every item)')
  p.add_argument('--verify', action='store_true',
                 help='read every array and check it against the checksums orbax-tunix'
                 ' convert recorded (exit 1 if one differs)')
  p.add_argument('--memory-budget', type=parse_size, default=memory.DEFAULT_MEMORY_BUDGET,
                 metavar='SIZE', help='memory --verify may use (default 1G = 1GiB)')
  group = p.add_mutually_exclusive_group()
  group.add_argument('--full', dest='collapse', action='store_false', default=None,
                     help='list every leaf (the default when piped)')
  group.add_argument('--collapse', dest='collapse', action='store_true',
                     help='fold identical numbered layers into one row (the default on a terminal)')


def _convert_layouts() -> tuple[str, ...]:
  """The layouts `convert --layout` takes: every one of its destinations'."""
  return tuple(n for d in layouts.destinations('convert') for n in layouts.named(d))


def _add_convert(sub: Any, parents: Parents) -> None:
  """`orbax-tunix convert SRC DST`: its layouts and their flags are the step layouts'."""
  p = sub.add_parser(
      'convert', parents=[parents.common, parents.hosts],
      help='write an ordinary Orbax checkpoint (canonical, or MaxText\'s own step)',
      description=(
          'Write SRC as an ordinary Orbax checkpoint that plain Orbax restores'
          ' without this package. DST is the step directory to create; name it by'
          ' its step number (out/1000) to make its parent a root that'
          ' ocp.CheckpointManager reads. Layouts (--layout): '
          + '; '.join(f'{n}: {layouts.get(n).description}'
                      for n in _convert_layouts())
          + '. Streams in batches within --memory-budget;'
          ' written beside DST and renamed at the end, so a failure leaves no DST.'
          ' Check the result with: orbax-tunix diff SRC DST.'
      ),
  )
  p.add_argument('src', metavar='SRC')
  p.add_argument('dst', metavar='DST')
  p.add_argument('--step', type=step_number, help='the source step (default: the latest committed)')
  p.add_argument('--params-only', action='store_true',
                 help='write the model weights only (no optimizer state, no RNG state)')
  p.add_argument('--layout', choices=_convert_layouts(),
                 default=convert_lib.DEFAULT_LAYOUT,
                 help=f'the layout to write (default {convert_lib.DEFAULT_LAYOUT}; see above)')
  for destination in layouts.destinations('convert'):
    add_layout_options(p, destination)
  p.add_argument('--dtype', type=parse_dtype,
                 help='cast floating leaves to this dtype (e.g. bfloat16); '
                 'integer and RNG leaves keep theirs')
  p.add_argument('--memory-budget', type=parse_size, default=memory.DEFAULT_MEMORY_BUDGET,
                 metavar='SIZE',
                 help='memory the streaming may use above start-up, e.g. 512M or 4G (default'
                 ' 1G = 1GiB; budgets under ~128M cannot be met); an array too large for one batch'
                 ' is copied alone and needs about 3x its size')
  p.add_argument('--force', action='store_true',
                 help='replace an existing DST (only once the new one is complete)')
  p.add_argument('--json', action='store_true', help='print the summary as JSON')
  p.add_argument('--timings', action='store_true',
                 help='print on stderr where the time went: planning, reading, making,'
                 ' writing (on how many threads) and committing')
  p.add_argument('--item', dest='items', action='append', metavar='NAME',
                 help='convert only this source item (repeatable; default: every item)')
  add_merge_options(p, 'merge the LoRA adapters into the weights (writes weights only)')


def _add_diff(sub: Any, parents: Parents) -> None:
  """`orbax-tunix diff A B`."""
  p = sub.add_parser(
      'diff', parents=[parents.common],
      help='compare two checkpoints in canonical form',
      description=(
          'Compare A and B in canonical form (Tunix or not): paths only in A, only'
          ' in B, shape and dtype differences, and value differences (largest'
          ' absolute difference per leaf), streaming. Exit status 0 when they'
          ' match, 1 when they differ, 2 on error.'
      ),
  )
  p.add_argument('a', metavar='A')
  p.add_argument('b', metavar='B')
  p.add_argument('--atol', type=atol, default=0.0,
                 help='values match when they differ by at most this (default 0: equal)')
  p.add_argument('--params-only', action='store_true',
                 help='compare the model weights only (matches a --layout maxtext conversion)')
  p.add_argument('--ignore-dtype', action='store_true',
                 help='do not count dtype differences (check a --dtype conversion with --atol)')
  p.add_argument('--memory-budget', type=parse_size, default=memory.DEFAULT_MEMORY_BUDGET,
                 metavar='SIZE', help='memory the streaming may use (default 1G = 1GiB)')
  p.add_argument('--json', action='store_true', help='print one JSON document')
  p.add_argument('--item', dest='items', action='append', metavar='NAME',
                 help='compare only this item (repeatable; default: every item)')


def _add_export(sub: Any, parents: Parents) -> None:
  """`orbax-tunix export SRC OUT_DIR --model FAMILY`: its families and flags are the folder
  layouts' (`--peft`: the adapter layouts')."""
  p = sub.add_parser(
      'export', parents=[parents.common, parents.hosts],
      help='write a Hugging Face safetensors folder ('
      + ', '.join(layouts.named(default('export'))) + ')',
      description=(
          'Write the weights of SRC (a Tunix run of a tunix.models family or of a MaxText'
          ' model, or MaxText\'s own step) as a'
          ' Hugging Face folder that transformers, vLLM and Tunix\'s own loaders read:'
          ' model.safetensors, or model-0000i-of-0000n.safetensors shards with'
          ' model.safetensors.index.json, tensor names and layouts as Hugging Face has'
          ' them for the family. Streams in batches within --memory-budget; written'
          ' beside OUT_DIR and moved at the end, so a failure leaves nothing. Without'
          ' --hf-config no config.json (and no tokenizer) is written: transformers and vLLM'
          ' need one, so pass the base model\'s folder or add them yourself. With --peft,'
          ' a LoRA run\'s adapters as a PEFT adapter instead (adapter_config.json,'
          ' adapter_model.safetensors) to serve on its base model.'
      ),
  )
  p.add_argument('src', metavar='SRC')
  p.add_argument('out_dir', metavar='OUT_DIR')
  p.add_argument('--model', required=True, choices=huggingface.choices(),
                 help='the model family')
  p.add_argument('--step', type=step_number, help='the source step (default: the latest committed)')
  p.add_argument('--dtype', type=parse_dtype,
                 help='cast the weights to this dtype (bfloat16, float16, float32); default: as'
                 ' stored')
  add_merge_options(p, 'export the LoRA adapters merged into the weights (no adapter tensors)')
  add_switches(p, 'export')
  add_layout_options(p, default('export'))
  p.add_argument('--memory-budget', type=parse_size, default=memory.DEFAULT_MEMORY_BUDGET,
                 metavar='SIZE', help='memory the streaming may use above start-up (default 1G ='
                 ' 1GiB)')
  p.add_argument('--force', action='store_true',
                 help='replace an existing export folder (only once the new one is complete)')
  p.add_argument('--json', action='store_true', help='print the summary as JSON')
  p.add_argument('--timings', action='store_true',
                 help='print on stderr where the time went: planning, reading, making,'
                 ' writing (on how many threads) and committing')


# The commands, in the order `--help` lists them: each adds its sub-parser.
COMMANDS: tuple[Callable[[Any, Parents], None], ...] = (
    _add_inspect, _add_convert, _add_diff, _add_export)


def build_parser() -> argparse.ArgumentParser:
  """The argument parser of `orbax-tunix`: the top level, then each of `COMMANDS`."""
  common = _common_flags()
  parser = argparse.ArgumentParser(
      prog='orbax-tunix', formatter_class=argparse.RawDescriptionHelpFormatter,
      epilog=_EPILOG, description=_DESCRIPTION, parents=[common])
  parents = Parents(common, _host_flags())
  sub = parser.add_subparsers(dest='command', required=True, metavar='COMMAND')
  for add in COMMANDS:
    add(sub, parents)
  return parser


# Libraries that log (tracebacks included) about failures this command reports

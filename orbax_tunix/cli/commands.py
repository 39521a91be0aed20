"""`orbax-tunix`: inspect, convert, diff and export Tunix checkpoints from the command line.

Each command's flags are in its `--help` (`build_parser`). The layouts a command
writes and their flags come from the layout values (`layouts`): convert's are the
step layouts, export's the Hugging Face families.

This module only parses arguments and draws results; the work is done by
`inspection`, `convert`, `diff` and `export`. On a terminal, results are tables (with
`rich` when it is installed: `pip install orbax-tunix[cli]`) and long runs
show a progress bar; piped, output is plain aligned text (or one JSON
document with `--json`) and progress is a line every few seconds on stderr.

The exit status is `main`'s (an error: 2, with one message saying what to do and
no traceback unless `--debug`).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
import re
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from orbax_tunix import errors, layouts, sizes
from orbax_tunix.cli import display, jax_cache
from orbax_tunix.cli import progress as progress_lib
from orbax_tunix.cli.display import Printer, format_bytes, format_duration, is_tty
from orbax_tunix.mapping import huggingface, merge_options
from orbax_tunix.options import Option
from orbax_tunix.reading import memory, timing
from orbax_tunix.tools import convert as convert_lib
from orbax_tunix.tools import diff as diff_lib
from orbax_tunix.tools import export as export_lib
from orbax_tunix.tools import inspection
from orbax_tunix.writing import checksums, distributed

EXIT_OK = 0
EXIT_DIFFER = 1
EXIT_ERROR = 2
EXIT_INTERRUPTED = 130


def _parsed(parse: Callable[[str], Any]) -> Callable[[str], Any]:
  """An option's parser as argparse's type: its ValueError's message said as is."""

  def parse_flag(text: str) -> Any:
    try:
      return parse(text)
    except ValueError as e:
      raise argparse.ArgumentTypeError(str(e) if str(e).startswith(repr(text)) else
                                       f'{text!r}: {e}') from None
  return parse_flag


# Bytes from a size option (`sizes.parse_size`: '512M', '5GB', '1.5GiB', '1000000'); text
# that is not a size raises argparse.ArgumentTypeError.
parse_size = _parsed(sizes.parse_size_text)


def parse_dtype(name: str) -> np.dtype:
  """The floating dtype `--dtype` names (e.g. 'bfloat16').

  Raises:
    argparse.ArgumentTypeError: not a floating dtype.
  """
  try:
    dtype = np.dtype(jnp.dtype(name))
  except TypeError:
    raise argparse.ArgumentTypeError(
        f'{name!r} is not a dtype: use a floating dtype such as bfloat16, float16 or float32.'
    ) from None
  if not jnp.issubdtype(dtype, jnp.floating):
    raise argparse.ArgumentTypeError(
        f'{name!r}: expected a floating dtype (bfloat16, float16, float32); only floating'
        ' leaves are cast, integer and RNG leaves always keep their dtype.'
    )
  return dtype


# --- the commands -------------------------------------------------------------


def cmd_inspect(args: argparse.Namespace, out: Printer) -> int:
  """`orbax-tunix inspect`: draws the report (or prints its JSON).

  Returns 0; with --verify, 1 when some array does not match its checksum.
  """
  report = inspection.inspect_checkpoint(args.path, args.step, args.items)
  verification = None
  if args.verify:
    progress = progress_lib.make_progress(sys.stderr, out.fancy or args.fancy_progress)
    verification = checksums.verify(
        report.checkpoint, memory_budget=args.memory_budget, progress=progress
    )
    if verification is None:
      raise errors.UnsupportedLayoutError(
          f'{report.detection.step_dir}: records no checksums, so its data cannot be'
          ' verified: only checkpoints written by orbax-tunix convert record them.'
          ' TensorStore checks the OCDBT index, not the array data; diff it against'
          ' a trusted copy instead.'
      )
  if args.json:
    document = display.inspect_json(report)
    if verification is not None:
      document['verify'] = dataclasses.asdict(verification) | {
          'step_dir': str(verification.step_dir), 'ok': verification.ok}
    print(display.dumps(document, indent=1), file=out.stream)
  else:
    display.show_inspect(out, report, collapse=args.collapse)
    if verification is not None:
      display.show_verification(out, verification)
  return EXIT_OK if verification is None or verification.ok else EXIT_DIFFER


def _stream(run: Callable[[Any, Any], Any], plan: Any, notes: Sequence[str],
            args: argparse.Namespace, out: Printer) -> Any:
  """Prints a plan's notes, then `run(plan, progress)` with progress on stderr.

  SIGINT and SIGTERM stop it between batches (what was written is removed);
  one landing inside a read, which Orbax re-raises as its own error, is still
  an interruption.
  """
  for note in notes:
    print(f'note: {as_flags(note)}', file=sys.stderr)
  progress = progress_lib.Interruptible(
      progress_lib.make_progress(sys.stderr, out.fancy or args.fancy_progress))
  with progress_lib.signals_stop(progress):
    try:
      return run(plan, progress)
    except Exception as e:
      if progress.stop.is_set():  # Keeping what the destination holds, when it was said.
        raise KeyboardInterrupt(*filter(None, [getattr(e, 'state', None)])) from None
      raise


@contextlib.contextmanager
def _timed(args: argparse.Namespace) -> Iterator[None]:
  """With --timings, the phases of the command inside recorded (`timing`) and printed on
  stderr once it ended well (after its summary), with the seconds it took in all (the
  process's start-up and exit aside)."""
  if not args.timings:
    yield
    return
  start = time.monotonic()
  with timing.recorded() as timings:
    yield
  timings.add('in all', time.monotonic() - start)
  print(display.timings_line(timings), file=sys.stderr)


def cmd_convert(args: argparse.Namespace, out: Printer) -> int:
  """`orbax-tunix convert`: plans, streams with progress, prints the summary; returns 0."""
  with _timed(args):
    with timing.phase('set-up'):
      _join(args)
    return _convert(args, out)


def _plan_convert(args: argparse.Namespace) -> convert_lib.ConvertPlan:
  """The conversion the flags ask for."""
  return convert_lib.plan_convert(
      args.src,
      args.dst,
      step=args.step,
      layout=args.layout,
      params_only=args.params_only,
      dtype=args.dtype,
      memory_budget=args.memory_budget,
      force=args.force,
      items=args.items,
      **_merge_keywords(args),
      **_layout_options(args, _destination(args, 'convert')),
  )


def _convert(args: argparse.Namespace, out: Printer) -> int:
  """`cmd_convert` once the job is joined."""
  with timing.phase('plan'):
    plan = _plan_convert(args)
  result = _stream(convert_lib.run_convert, plan, plan.notes, args, out)
  source = plan.source.detection
  rate = result.bytes_read / max(result.seconds, 1e-9)
  if args.json:
    print(
        display.dumps(
            {
                'source': str(source.step_dir),
                'source_step': source.step,
                'dst': str(result.dst),
                'layout': plan.layout,
                'params_only': plan.params_only,
                'dtype': None if plan.dtype is None else plan.dtype.name,
                'items': result.items,
                'num_leaves': result.num_leaves,
                'bytes': result.bytes_read,
                'seconds': round(result.seconds, 3),
                'replaced': result.replaced,
                'notes': list(plan.notes),
            }
        ),
        file=out.stream,
    )
    return EXIT_OK
  items = ', '.join(f'{name} ({n} leaves)' for name, n in result.items.items())
  replaced = ' (replaced the old one)' if result.replaced else ''
  out.text(
      f'converted {source.step_dir} -> {result.dst}{replaced}: {items},'
      f' {format_bytes(result.bytes_read)} in {format_duration(result.seconds)}'
      f' ({format_bytes(int(rate))}/s), layout {plan.layout}'
  )
  return EXIT_OK


def _destination(args: argparse.Namespace, command: str) -> layouts.Destination:
  """The destination a command writes: the one whose switch was given (`export --peft`),
  else the command's default (`_default`).

  Raises:
    InvalidOptionError: two switches given.
  """
  chosen = [d for d in layouts.destinations(command)
            if d.switch is not None and getattr(args, d.switch.option.name)]
  if len(chosen) > 1:
    flags = ' and '.join(flag_of(d.switch.option) for d in chosen)
    raise errors.InvalidOptionError(f'{flags}: each writes another kind of output; pass one.')
  return chosen[0] if chosen else _default(command)


def _check_switches(args: argparse.Namespace, command: str) -> layouts.Destination:
  """The destination the flags choose, refusing those that do not go with it: a switch's
  refused flags (`Switch.refuses`), or an option of a switch's layouts without the switch.
  Nothing is read.

  Raises:
    InvalidOptionError: naming the flag and why.
  """
  destination = _destination(args, command)
  switch = destination.switch
  mine = layouts.options(destination)
  if switch is not None:
    # Its refusals say why; another layout option it does not take is refused plainly.
    others = {n: f'the {destination.name} layouts do not take it'
              for d in layouts.destinations(command) for n in layouts.options(d)
              if n not in mine and n not in _MERGE}
    reasons = {**switch.refuses, **{n: why for n, why in others.items() if n not in switch.refuses}}
    given = [name for name in reasons if getattr(args, name, None) not in (None, False)]
    if given:
      flag = _flag(given[0])
      raise errors.InvalidOptionError(
          f'{flag_of(switch.option)} with {flag}: {reasons[given[0]]}. Leave {flag} out, or'
          f' {switch.instead}.')
    return destination
  for other in (d for d in layouts.destinations(command) if d.switch is not None):
    switch = flag_of(other.switch.option)
    for name, option in layouts.options(other).items():
      value = getattr(args, name, None)
      if name not in mine and name not in _MERGE and value not in (None, False):
        alone = other.switch.alone.get(name, f'it is an option of {switch}; add {switch}')
        raise errors.InvalidOptionError(f'{flag_of(option)} {value}: {alone}, or leave'
                                        f' {flag_of(option)} out.')
  return destination


def cmd_export(args: argparse.Namespace, out: Printer) -> int:
  """`orbax-tunix export`: plans, streams with progress, prints the summary; returns 0."""
  with _timed(args):
    with timing.phase('set-up'):
      destination = _check_switches(args, 'export')
      _join(args)
    return _export(args, out, destination)


def _export(args: argparse.Namespace, out: Printer, destination: layouts.Destination) -> int:
  """`cmd_export` once the job is joined."""
  with timing.phase('plan'):
    plan = export_lib.plan_to(
        destination, args.src, args.out_dir, model=args.model, step=args.step, dtype=args.dtype,
        memory_budget=args.memory_budget, force=args.force,
        **(_merge_keywords(args) if destination.merges else {}),
        **_layout_options(args, destination))
  result = _stream(export_lib.run_export, plan, plan.notes, args, out)
  if args.json:
    print(display.dumps({**export_lib.describe(plan), 'seconds': round(result.seconds, 3),
                      'replaced': result.replaced}), file=out.stream)
    return EXIT_OK
  replaced = ' (replaced the old one)' if result.replaced else ''
  out.text(
      f'exported {plan.source.step_dir} -> {result.out_dir}{replaced}: {plan.layout},'
      f' {result.tensors} tensors in {len(result.files)} file(s),'
      f' {format_bytes(result.total_size)} in {format_duration(result.seconds)}'
  )
  return EXIT_OK


def _layout_options(args: argparse.Namespace, destination: layouts.Destination
                    ) -> dict[str, Any]:
  """The layout options' flags as given (unset: their `Option.default`), by the options'
  names (the merge's among them, where the layouts take them: `export --peft --lora-alpha`)."""
  return {name: getattr(args, name) for name in layouts.options(destination)}


def _merge_keywords(args: argparse.Namespace) -> dict[str, Any]:
  """The LoRA merge's flags as given, as the library's keywords (`merge_options.OPTIONS`)."""
  return {name: getattr(args, name) for name in _MERGE}


def _join(args: argparse.Namespace) -> None:
  """Joins the multi-process job the flags (or JAX's cluster detection) describe, if any."""
  distributed.initialize(distributed.JobOptions(
      coordinator_address=args.coordinator_address, num_processes=args.num_processes,
      process_id=args.process_id, initialization_timeout=args.initialization_timeout))


def cmd_diff(args: argparse.Namespace, out: Printer) -> int:
  """`orbax-tunix diff`: compares with progress; returns 0 on a match, else 1."""
  progress = progress_lib.make_progress(sys.stderr, out.fancy or args.fancy_progress)
  result = diff_lib.diff_checkpoints(
      args.a,
      args.b,
      atol=args.atol,
      params_only=args.params_only,
      ignore_dtype=args.ignore_dtype,
      memory_budget=args.memory_budget,
      progress=progress,
      items=args.items,
  )
  if args.json:
    print(display.dumps(display.diff_json(result)), file=out.stream)
  else:
    limit = display.DIFF_ROWS if out.fancy else None
    display.show_diff(out, result, limit, display.diff_hint(result, args.params_only))
  return EXIT_OK if result.match else EXIT_DIFFER


# --- arguments and main -----------------------------------------------------

def flag_of(option: Option) -> str:
  """The flag of an option (`orbax_tunix.options.Option`): `--` and its name with dashes."""
  return _dashed(option.name)


def _dashed(name: str) -> str:
  return '--' + name.replace('_', '-')


# The merge's options (`merge_options.OPTIONS`): every command that merges takes their flags.
_MERGE = merge_options.OPTIONS.names()

# The library's parameters, as its messages name them (in backquotes), and the
# flags that set them here: `memory_budget` is --memory-budget, the others as listed.
# The options (the layouts', their switches', the merge's) have their own flags (`flag_of`).
_FLAGS = {
    **{name: _dashed(name) for name in (
        'force', 'params_only', 'layout', 'dtype', 'memory_budget', 'step', 'atol',
        'ignore_dtype', 'model', 'coordinator_address', 'num_processes', 'process_id',
        'initialization_timeout')},
    **{o.name: flag_of(o) for o in merge_options.OPTIONS.values()},
    **{name: flag_of(o) for name, o in layouts.options().items()},
    **{d.switch.option.name: flag_of(d.switch.option) for d in layouts.destinations() if d.switch},
    'dst': 'DST',
    'src': 'SRC',
    'out_dir': 'OUT_DIR',
    'items': '--item',
    'export_peft_adapter': 'export --peft',
}
_PARAMETER = re.compile(r'`(\w+)(=[^`]*)?`')


def _flag(name: str) -> str:
  """The flag that sets the library parameter `name` (`_FLAGS`, else its own spelling)."""
  return _FLAGS.get(name, _dashed(name))


def as_flags(message: str) -> str:
  """A library message with its parameters named as this command's flags.

  `force=True` becomes --force, `step=3` --step 3, `dst` DST; other
  backquoted names are left as they are.
  """

  def flag(m: re.Match[str]) -> str:
    name, value = m.group(1), m.group(2)
    if name not in _FLAGS:
      return m.group(0)
    if value is None or value == '=True':
      return _FLAGS[name]
    return f'{_FLAGS[name]} {value[1:]}'

  return _PARAMETER.sub(flag, message)


def _number(convert: Callable[[str], Any], what: str, ok: Callable[[Any], bool],
            why: str) -> Callable[[str], Any]:
  """A number flag's argparse type: `convert(text)` where `ok` accepts it, else an error
  saying the text is not `what`, or `why` not."""

  def parse(text: str) -> Any:
    try:
      value = convert(text)
    except ValueError:
      raise argparse.ArgumentTypeError(f'{text!r} is not {what}.') from None
    if not ok(value):
      raise argparse.ArgumentTypeError(f'{text!r}: {why}')
    return value
  return parse


_step = _number(int, 'a step number', lambda value: value >= 0,
                'step numbers are not negative.')
_atol = _number(float, 'a number', lambda value: value >= 0, 'the tolerance must be >= 0.')


def _add_option(p: Any, option: Option, said: str = '', help: str | None = None) -> None:
  """One option's flag, made from the option (`orbax_tunix.options.Option`): a switch's
  (`Option.switch`) takes no value; one of a few names (`Option.choices`) is one of them;
  another's text is `Option.parse`d. Its help is `said`, then `help` (else the option's)."""
  text = said + (option.help if help is None else help)
  if option.switch:
    p.add_argument(flag_of(option), action='store_true', help=text)
  elif option.choices is not None:
    p.add_argument(flag_of(option), choices=option.choices, metavar=option.metavar, help=text)
  else:
    p.add_argument(flag_of(option), type=_parsed(option.parse), metavar=option.metavar,
                   help=text)


def _add_layout_options(p: argparse.ArgumentParser, destination: layouts.Destination) -> None:
  """The flags of the options a destination's layouts take (`layouts.Option`s, their data);
  one some of them take says which."""
  every = layouts.named(destination)
  for option in layouts.options(destination).values():
    takers = [n for n in every if layouts.get(n).takes(option.name)]
    _add_option(p, option, '' if takers == list(every) else f'{" and ".join(takers)}: ')


def _add_switches(p: argparse.ArgumentParser, command: str) -> None:
  """The flags that choose a command's other destinations (`layouts.Switch`: `export
  --peft`), each with the flags of the options only its layouts take."""
  default = _default(command)
  for destination in layouts.destinations(command):
    if destination.switch is None:
      continue
    _add_option(p, destination.switch.option)
    for name, option in layouts.options(destination).items():
      if name not in layouts.options(default) and name not in _MERGE:
        _add_option(p, option, f'{flag_of(destination.switch.option)}: ')


def _add_merge_options(p: argparse.ArgumentParser, merge_help: str) -> None:
  """The LoRA merge's flags (`merge_options.OPTIONS`), one set for every command that merges
  (convert, export): `merge_help` says what `--merge-lora` does there; the scaling's two
  (`merge_options.SCALING`) exclude each other."""
  scaling = p.add_mutually_exclusive_group()
  for option in merge_options.OPTIONS.values():
    _add_option(scaling if option in merge_options.SCALING else p, option,
                help=merge_help if option is merge_options.MERGE_LORA else None)


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
class _Parents:
  """The flag sets commands share (argparse parents).

  Attributes:
    common: every command's (--debug, --plain, --no-compilation-cache).
    hosts: a writing command's multi-process flags (`distributed.JobOptions`).
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
  """The 'across hosts' group (`distributed.JobOptions`) of the commands that write."""
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


def _add_inspect(sub: Any, parents: _Parents) -> None:
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
  p.add_argument('--step', type=_step, help='the step to show (default: the latest committed)')
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
  p.set_defaults(handler=cmd_inspect)


def _default(command: str) -> layouts.Destination:
  """The destination a command writes unless a switch chooses another."""
  return next(d for d in layouts.destinations(command) if d.switch is None)


def _convert_layouts() -> tuple[str, ...]:
  """The layouts `convert --layout` takes: every one of its destinations'."""
  return tuple(n for d in layouts.destinations('convert') for n in layouts.named(d))


def _add_convert(sub: Any, parents: _Parents) -> None:
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
  p.add_argument('--step', type=_step, help='the source step (default: the latest committed)')
  p.add_argument('--params-only', action='store_true',
                 help='write the model weights only (no optimizer state, no RNG state)')
  p.add_argument('--layout', choices=_convert_layouts(),
                 default=convert_lib.DEFAULT_LAYOUT,
                 help=f'the layout to write (default {convert_lib.DEFAULT_LAYOUT}; see above)')
  for destination in layouts.destinations('convert'):
    _add_layout_options(p, destination)
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
  _add_merge_options(p, 'merge the LoRA adapters into the weights (writes weights only)')
  p.set_defaults(handler=cmd_convert)


def _add_diff(sub: Any, parents: _Parents) -> None:
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
  p.add_argument('--atol', type=_atol, default=0.0,
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
  p.set_defaults(handler=cmd_diff)


def _add_export(sub: Any, parents: _Parents) -> None:
  """`orbax-tunix export SRC OUT_DIR --model FAMILY`: its families and flags are the folder
  layouts' (`--peft`: the adapter layouts')."""
  p = sub.add_parser(
      'export', parents=[parents.common, parents.hosts],
      help='write a Hugging Face safetensors folder ('
      + ', '.join(layouts.named(_default('export'))) + ')',
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
  p.add_argument('--step', type=_step, help='the source step (default: the latest committed)')
  p.add_argument('--dtype', type=parse_dtype,
                 help='cast the weights to this dtype (bfloat16, float16, float32); default: as'
                 ' stored')
  _add_merge_options(p, 'export the LoRA adapters merged into the weights (no adapter tensors)')
  _add_switches(p, 'export')
  _add_layout_options(p, _default('export'))
  p.add_argument('--memory-budget', type=parse_size, default=memory.DEFAULT_MEMORY_BUDGET,
                 metavar='SIZE', help='memory the streaming may use above start-up (default 1G ='
                 ' 1GiB)')
  p.add_argument('--force', action='store_true',
                 help='replace an existing export folder (only once the new one is complete)')
  p.add_argument('--json', action='store_true', help='print the summary as JSON')
  p.add_argument('--timings', action='store_true',
                 help='print on stderr where the time went: planning, reading, making,'
                 ' writing (on how many threads) and committing')
  p.set_defaults(handler=cmd_export)


# The commands, in the order `--help` lists them: each adds its sub-parser.
COMMANDS: tuple[Callable[[Any, _Parents], None], ...] = (
    _add_inspect, _add_convert, _add_diff, _add_export)


def build_parser() -> argparse.ArgumentParser:
  """The argument parser of `orbax-tunix`: the top level, then each of `COMMANDS`."""
  common = _common_flags()
  parser = argparse.ArgumentParser(
      prog='orbax-tunix', formatter_class=argparse.RawDescriptionHelpFormatter,
      epilog=_EPILOG, description=_DESCRIPTION, parents=[common])
  parents = _Parents(common, _host_flags())
  sub = parser.add_subparsers(dest='command', required=True, metavar='COMMAND')
  for add in COMMANDS:
    add(sub, parents)
  return parser


# Libraries that log (tracebacks included) about failures this command reports
# itself: Orbax, JAX, asyncio, and the bucket clients (gcsfs logs each retry).
_NOISY_LOGGERS = ('absl', 'jax', 'orbax', 'asyncio', 'gcsfs', 'fsspec', 'google', 'aiohttp',
                  'urllib3')


@contextlib.contextmanager
def _quiet(debug: bool) -> Iterator[None]:
  """Silences Orbax's and JAX's warnings and logs, unless debugging.

  Their errors are silenced too: every failure reaches `main` as an
  exception, which prints one message saying what to do.
  """
  if debug:
    yield
    return
  loggers = [logging.getLogger(name) for name in _NOISY_LOGGERS]
  levels = [lg.level for lg in loggers]
  with warnings.catch_warnings():
    warnings.simplefilter('ignore')
    for lg in loggers:
      lg.setLevel(logging.CRITICAL)
    try:
      yield
    finally:
      for lg, level in zip(loggers, levels, strict=True):
        lg.setLevel(level)


# What Python reports, with a traceback, about Orbax's asyncio loop when a
# command stops midway: callbacks still queued on a loop that closed, a loop
# collected while running or half made, and (after Ctrl-C or a signal) the interrupt
# landing in a callback whose exceptions Python ignores. The command itself
# stops cleanly either way (see `progress.Interruptible`).
_LOOP_NOISE = ('Event loop is closed', 'Cannot close a running event loop')


def _is_shutdown_noise(exc: BaseException | None) -> bool:
  return isinstance(exc, KeyboardInterrupt) or (
      isinstance(exc, RuntimeError) and str(exc) in _LOOP_NOISE)


def _silence_shutdown_noise() -> None:
  """Drops Python's reports of asyncio noise at a command's end (see `_LOOP_NOISE`).

  Every other report is kept; --debug keeps them all.
  """
  if getattr(sys.unraisablehook, 'orbax_tunix', False):
    return  # Already installed (main may run many times in one process).
  unraisable, in_thread = sys.unraisablehook, threading.excepthook
  warnings.filterwarnings('ignore', message='coroutine .* was never awaited', category=RuntimeWarning)

  def on_unraisable(report: Any) -> None:
    # An interrupted loop's own finalizer may fail too (it was half made).
    in_loop_finalizer = getattr(report.object, '__qualname__', '') == 'BaseEventLoop.__del__'
    if not (_is_shutdown_noise(report.exc_value) or in_loop_finalizer):
      unraisable(report)

  def on_thread_error(report: Any) -> None:
    if not _is_shutdown_noise(report.exc_value):
      in_thread(report)

  on_unraisable.orbax_tunix = True
  sys.unraisablehook, threading.excepthook = on_unraisable, on_thread_error


class ClosedPipeGuard:
  """A text stream whose reader may go away (`orbax-tunix diff A B | head -1`), or whose
  file may fail (a log on a full disk: `> /dev/full`).

  A write or flush that fails points the stream's file descriptor at /dev/null
  (so that Python's own flush at exit succeeds too) and drops that output and
  all that follows; the command itself goes on, and its exit status is its
  result's (see `main`). A failure other than a closed pipe is kept in
  `failed`, for `main` to tell. Everything else is the wrapped stream's.
  """

  def __init__(self, stream: Any):
    self._stream = stream
    self.closed_pipe = False
    self.failed: OSError | None = None

  def write(self, text: str) -> int:
    if not self.closed_pipe:
      try:
        return self._stream.write(text)
      except OSError as e:
        self._drop(e)
    return len(text)

  def flush(self) -> None:
    if not self.closed_pipe:
      try:
        self._stream.flush()
      except OSError as e:
        self._drop(e)

  def _drop(self, error: OSError) -> None:
    self.closed_pipe = True
    if not isinstance(error, BrokenPipeError):
      self.failed = error
    with contextlib.suppress(OSError, ValueError, AttributeError):
      devnull = os.open(os.devnull, os.O_WRONLY)
      try:
        os.dup2(devnull, self._stream.fileno())
      finally:
        os.close(devnull)

  def __getattr__(self, name: str) -> Any:
    return getattr(self._stream, name)


@contextlib.contextmanager
def _guarded_output() -> Iterator[ClosedPipeGuard]:
  """stdout and stderr wrapped in `ClosedPipeGuard`s for the command, then flushed
  (a closed pipe found then is dropped too) and put back; yields stdout's guard."""
  saved = sys.stdout, sys.stderr
  sys.stdout, sys.stderr = ClosedPipeGuard(sys.stdout), ClosedPipeGuard(sys.stderr)
  guard = sys.stdout
  try:
    yield guard
  finally:
    for each in (sys.stdout, sys.stderr):
      each.flush()
    sys.stdout, sys.stderr = saved


# Commands whose work is what they write at DST: their status is the work's, and a
# summary that could not be printed is a note. The others' result is their output.
_WRITERS = ('convert', 'export')


def _output_failed(command: str | None, failed: OSError, code: int) -> int:
  """Tells (on stderr) that stdout could not be written, and returns the status: the
  work's for a command that writes DST; else an error where the result was all fine."""
  words = failed.strerror or str(failed) or type(failed).__name__
  if command in _WRITERS and code == EXIT_OK:
    message = (f'orbax-tunix: note: the summary could not be written to stdout ({words});'
               ' the work itself is done: DST is complete.')
  else:
    message = f'orbax-tunix: error: the output could not be written to stdout ({words}).'
    code = EXIT_ERROR if code == EXIT_OK else code
  with contextlib.suppress(OSError, ValueError):
    print(message, file=sys.stderr, flush=True)
  return code


def _use_cpu() -> None:
  """Keeps JAX off accelerators: the tools only move bytes through the host.

  A training job may hold the TPU or GPU; unless the user chose platforms
  with JAX_PLATFORMS, this process stays on the CPU.
  """
  if 'JAX_PLATFORMS' in os.environ:
    return
  import jax  # pylint: disable=g-import-not-at-top

  with contextlib.suppress(Exception):  # Backends already up (e.g. in tests).
    jax.config.update('jax_platforms', 'cpu')


@contextlib.contextmanager
def _x64() -> Iterator[None]:
  """JAX's 64-bit mode for the command, so float64 and int64 leaves keep 64 bits.

  Restored afterwards: `main` may run inside a caller's process.
  """
  import jax  # pylint: disable=g-import-not-at-top

  previous = jax.config.jax_enable_x64
  jax.config.update('jax_enable_x64', True)
  try:
    yield
  finally:
    jax.config.update('jax_enable_x64', previous)


def main(argv: Sequence[str] | None = None) -> int:
  """Runs `orbax-tunix`; returns the exit status.

  Args:
    argv: the arguments (default: `sys.argv[1:]`).

  Returns:
    0 success or match, 1 differences found, 2 error, 130 interrupted. The
    status is the result's whatever happens to the output: when the reader
    of stdout (or stderr) goes away (`| head -1`), the rest of the output is
    dropped and the command still finishes, so `diff` still exits 1 when the
    checkpoints differ and `inspect --verify` 1 when an array is damaged.
  """
  ran: list[str] = []  # The command, once parsed.
  with _guarded_output() as stdout:
    code = _main(argv, ran)
  if stdout.failed is not None:
    code = _output_failed(ran[0] if ran else None, stdout.failed, code)
  if code == EXIT_ERROR and distributed.is_initialized():
    distributed.leave(code)  # Not JAX's shutdown barrier: peers may be gone or late.
  return code


def _main(argv: Sequence[str] | None, ran: list[str]) -> int:
  parser = build_parser()
  try:
    args = parser.parse_args(argv)
  except SystemExit as e:  # Usage errors (argparse printed them), --help.
    return e.code if isinstance(e.code, int) else EXIT_ERROR
  ran.append(args.command)
  debug = getattr(args, 'debug', False)
  plain = getattr(args, 'plain', False)
  out = Printer(sys.stdout, fancy=not plain and is_tty(sys.stdout))
  args.fancy_progress = not plain
  if args.command == 'inspect' and args.collapse is None:
    args.collapse = out.fancy or is_tty(sys.stdout)
  _use_cpu()
  memory.return_freed_memory()
  if not debug:
    _silence_shutdown_noise()
  try:
    with _quiet(debug), _x64(), jax_cache.kept(not getattr(args, 'no_compilation_cache', False)):
      return args.handler(args, out)
  except KeyboardInterrupt as e:
    # What the destination holds when the interruption came once it was written to
    # (`commit.staged`), else nothing was written there.
    print(f'orbax-tunix: interrupted; {str(e) or "nothing was written at the destination"}.',
          file=sys.stderr)
    return EXIT_INTERRUPTED
  except Exception as e:  # pylint: disable=broad-except
    if debug:
      traceback.print_exc()
    if isinstance(e, errors.TunixCheckpointError):
      print(f'orbax-tunix: error: {as_flags(str(e))}', file=sys.stderr)
    elif isinstance(e, OSError):
      where = f' ({e.filename})' if getattr(e, 'filename', None) else ''
      print(
          f'orbax-tunix: error: {e.strerror or e}{where}. Check the path and its permissions.',
          file=sys.stderr,
      )
    elif not debug:
      print(
          f'orbax-tunix: error: {type(e).__name__}: {e}\n(run again with --debug for the'
          ' traceback, and report it if the checkpoint looks sound)',
          file=sys.stderr,
      )
    return EXIT_ERROR


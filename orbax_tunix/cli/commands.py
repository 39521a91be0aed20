"""`orbax-tunix`: inspect, convert, diff and export Tunix checkpoints from the command line.

Each command's flags are in its `--help` (`build_parser`). The layouts a command
writes and their flags come from the layout values (`layouts`): convert's are the
step layouts, export's the Hugging Face families.

This module runs the commands and draws results (their flags: `parser`, `flags`; the
streams around them: `pipes`); the work is done by
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
import os
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from orbax_tunix import errors, layouts
from orbax_tunix.cli import display, jax_cache, pipes
from orbax_tunix.cli import progress as progress_lib
from orbax_tunix.cli.display import Printer, format_bytes, format_duration, is_tty
from orbax_tunix.cli.flags import MERGE, as_flags, default, flag_named, flag_of
from orbax_tunix.cli.parser import build_parser
from orbax_tunix.reading import memory, timing
from orbax_tunix.tools import convert as convert_lib
from orbax_tunix.tools import diff as diff_lib
from orbax_tunix.tools import export as export_lib
from orbax_tunix.tools import inspection
from orbax_tunix.writing import checksums, job

EXIT_OK = 0
EXIT_DIFFER = 1
EXIT_ERROR = 2
EXIT_INTERRUPTED = 130


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
  return chosen[0] if chosen else default(command)


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
              if n not in mine and n not in MERGE}
    reasons = {**switch.refuses, **{n: why for n, why in others.items() if n not in switch.refuses}}
    given = [name for name in reasons if getattr(args, name, None) not in (None, False)]
    if given:
      flag = flag_named(given[0])
      raise errors.InvalidOptionError(
          f'{flag_of(switch.option)} with {flag}: {reasons[given[0]]}. Leave {flag} out, or'
          f' {switch.instead}.')
    return destination
  for other in (d for d in layouts.destinations(command) if d.switch is not None):
    switch = flag_of(other.switch.option)
    for name, option in layouts.options(other).items():
      value = getattr(args, name, None)
      if name not in mine and name not in MERGE and value not in (None, False):
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
  return {name: getattr(args, name) for name in MERGE}


def _join(args: argparse.Namespace) -> None:
  """Joins the multi-process job the flags (or JAX's cluster detection) describe, if any."""
  job.initialize(job.JobOptions(
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


# Each command's handler, by the name `build_parser` gives it.
HANDLERS: dict[str, Callable[[argparse.Namespace, Printer], int]] = {
    'inspect': cmd_inspect, 'convert': cmd_convert, 'diff': cmd_diff, 'export': cmd_export}


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
  with pipes.guarded_output() as stdout:
    code = _main(argv, ran)
  if stdout.failed is not None:
    code = pipes.output_failed(ran[0] if ran else None, stdout.failed, code)
  if code == EXIT_ERROR and job.is_initialized():
    job.leave(code)  # Not JAX's shutdown barrier: peers may be gone or late.
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
    pipes.silence_shutdown_noise()
  try:
    with pipes.quiet(debug), _x64(), jax_cache.kept(not getattr(args, 'no_compilation_cache', False)):
      return HANDLERS[args.command](args, out)
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

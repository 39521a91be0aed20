"""`orbax-tunix`: inspect, convert and diff Tunix checkpoints from the command line.

  orbax-tunix inspect PATH [--step N] [--json] [--full]
  orbax-tunix convert SRC DST [--step N] [--params-only] [--layout canonical|maxtext]
                      [--dtype bfloat16] [--memory-budget 1G] [--force] [--json]
  orbax-tunix diff A B [--atol X] [--params-only] [--ignore-dtype] [--json]

This module only parses arguments and draws results; the work is done by
`inspection`, `convert` and `diff`. On a terminal, results are tables (with
`rich` when it is installed: `pip install orbax-tunix[cli]`) and long runs
show a progress bar; piped, output is plain aligned text (or one JSON
document with `--json`) and progress is a line every few seconds on stderr.

Exit status: 0 success (diff: the checkpoints match), 1 diff found
differences, 2 error (the message says what is wrong and what to do; no
traceback unless `--debug`), 130 interrupted.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import os
import re
import signal
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Iterator, Sequence
from typing import Any, TextIO

import numpy as np

from orbax_tunix import checksums, errors, inspection, reader
from orbax_tunix import convert as convert_lib
from orbax_tunix import diff as diff_lib
from orbax_tunix.inspection import format_bytes
from orbax_tunix.tree_paths import fmt

try:  # rich is optional: without it the output is plain text.
  import rich.box
  import rich.console
  import rich.padding
  import rich.progress
  import rich.table
  import rich.text
except ImportError:  # pragma: no cover - exercised by hiding rich in a test.
  rich = None

EXIT_OK = 0
EXIT_DIFFER = 1
EXIT_ERROR = 2
EXIT_INTERRUPTED = 130

# Rows shown per section of a diff on a terminal; --json lists them all.
DIFF_ROWS = 50
# Seconds between progress lines when stderr is not a terminal.
LOG_INTERVAL = 10.0

_SIZE = re.compile(r'^\s*(\d+(?:\.\d*)?)\s*([kmgt]?)(?:i?b)?\s*$', re.IGNORECASE)


def parse_size(text: str) -> int:
  """Bytes from '512M', '1G', '1.5GiB' or '1000000' (binary units).

  Raises:
    argparse.ArgumentTypeError: the text is not a size.
  """
  m = _SIZE.match(text)
  if not m:
    raise argparse.ArgumentTypeError(
        f'{text!r} is not a size: use bytes or a number with K, M, G or T (e.g. 512M, 2G).'
    )
  factor = 1024 ** ' kmgt'.index((m.group(2) or ' ').lower())
  value = int(float(m.group(1)) * factor)
  if value < 1:
    raise argparse.ArgumentTypeError(f'{text!r}: the size must be positive.')
  return value


def format_duration(seconds: float) -> str:
  """'1h02m', '3m05s', '4.2s'."""
  if seconds < 60:
    return f'{seconds:.1f}s'
  minutes, secs = divmod(int(seconds), 60)
  if minutes < 60:
    return f'{minutes}m{secs:02d}s'
  hours, minutes = divmod(minutes, 60)
  return f'{hours}h{minutes:02d}m'


def _is_tty(stream: TextIO) -> bool:
  try:
    return stream.isatty()
  except (AttributeError, ValueError):
    return False


# --- output -----------------------------------------------------------------


class Output:
  """Where results go: rich tables on a terminal, aligned plain text otherwise.

  Args:
    stream: the stream written to (stdout).
    fancy: draw with rich (only when it is installed).
  """

  def __init__(self, stream: TextIO, fancy: bool):
    self.stream = stream
    self.fancy = fancy and rich is not None
    self._console = rich.console.Console(file=stream, highlight=False) if self.fancy else None

  def text(self, line: str = '') -> None:
    if self._console is not None:
      self._console.print(rich.text.Text(line), soft_wrap=True)
    else:
      print(line, file=self.stream)

  def title(self, line: str) -> None:
    if self._console is not None:
      self._console.print()
      self._console.print(rich.text.Text(line, style='bold'))
    else:
      print(f'\n{line}', file=self.stream)

  def fields(self, pairs: Sequence[tuple[str, str]]) -> None:
    """'Key  value' lines, keys aligned."""
    width = max((len(k) for k, _ in pairs), default=0)
    for key, value in pairs:
      if self._console is not None:
        self._console.print(rich.text.Text.assemble((f'{key:<{width}}  ', 'cyan'), value))
      else:
        print(f'{key:<{width}}  {value}', file=self.stream)

  def table(
      self,
      columns: Sequence[str],
      rows: Sequence[Sequence[str]],
      right: Sequence[int] = (),
      indent: int = 2,
  ) -> None:
    """A table; `right` lists the columns aligned right (numbers)."""
    if self._console is not None:
      table = rich.table.Table(box=rich.box.SIMPLE_HEAD, pad_edge=False, show_edge=False)
      for i, column in enumerate(columns):
        table.add_column(column, justify='right' if i in right else 'left', overflow='fold')
      for row in rows:
        table.add_row(*(rich.text.Text(str(cell)) for cell in row))
      self._console.print(rich.padding.Padding(table, (0, 0, 0, indent), expand=False))
      return
    cells = [list(columns)] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    for row in cells:
      parts = [
          cell.rjust(w) if i in right else cell.ljust(w)
          for i, (cell, w) in enumerate(zip(row, widths, strict=True))
      ]
      print(' ' * indent + '  '.join(parts).rstrip(), file=self.stream)


# --- progress ---------------------------------------------------------------


class _RichProgress:
  """A progress bar with bytes done, throughput and time left (rich)."""

  def __init__(self, stream: TextIO):
    self._progress = rich.progress.Progress(
        rich.progress.TextColumn('{task.description}'),
        rich.progress.BarColumn(),
        rich.progress.DownloadColumn(binary_units=True),
        rich.progress.TransferSpeedColumn(),
        rich.progress.TimeRemainingColumn(),
        console=rich.console.Console(file=stream),
        transient=True,
    )
    self._task = None

  def start(self, total_bytes: int, description: str) -> None:
    self._progress.start()
    self._task = self._progress.add_task(description, total=max(total_bytes, 1))

  def advance(self, nbytes: int) -> None:
    self._progress.advance(self._task, nbytes)

  def finish(self) -> None:
    self._progress.stop()


class _LineProgress:
  """Progress as text: one rewritten line on a terminal, else a line every LOG_INTERVAL s."""

  def __init__(self, stream: TextIO, rewrite: bool):
    self._stream = stream
    self._rewrite = rewrite
    self._total = 1
    self._done = 0
    self._start = 0.0
    self._last = 0.0
    self._description = ''

  def start(self, total_bytes: int, description: str) -> None:
    self._total, self._done = max(total_bytes, 1), 0
    self._start = self._last = time.monotonic()
    self._description = description

  def line(self) -> str:
    elapsed = max(time.monotonic() - self._start, 1e-9)
    rate = self._done / elapsed
    left = (self._total - self._done) / rate if rate > 0 else 0.0
    return (
        f'{self._description}: {format_bytes(self._done)} / {format_bytes(self._total)}'
        f' ({100 * self._done / self._total:.0f}%), {format_bytes(int(rate))}/s,'
        f' {format_duration(left)} left'
    )

  def advance(self, nbytes: int) -> None:
    self._done += nbytes
    now = time.monotonic()
    if self._rewrite:
      if now - self._last < 0.1 and self._done < self._total:
        return
    elif now - self._last < LOG_INTERVAL:
      return  # In a log, a quick run shows only its summary.
    self._last = now
    if self._rewrite:
      self._stream.write('\r\x1b[2K' + self.line())
    else:
      self._stream.write(self.line() + '\n')
    self._stream.flush()

  def finish(self) -> None:
    if self._rewrite:
      self._stream.write('\r\x1b[2K')
      self._stream.flush()


def make_progress(stream: TextIO, fancy: bool) -> Any:
  """The progress display suited to `stream` (stderr)."""
  if _is_tty(stream):
    if fancy and rich is not None:
      return _RichProgress(stream)
    return _LineProgress(stream, rewrite=True)
  return _LineProgress(stream, rewrite=False)


# --- inspect ----------------------------------------------------------------


def _shape(shape: Any) -> str:
  return '-' if shape is None else str(tuple(shape))


def _steps_text(report: inspection.Report) -> str:
  if not report.steps:
    return '-'
  committed = [str(s.step) for s in report.steps if s.committed]
  unfinished = [str(s.step) for s in report.steps if not s.committed]
  text = ', '.join(committed) or 'none committed'
  if unfinished:
    text += f'  (unfinished: {", ".join(unfinished)})'
  return text


def show_inspect(out: Output, report: inspection.Report, collapse: bool) -> None:
  """Draws an inspect report."""
  d = report.detection
  kind = {'tunix': 'Tunix', 'maxtext': 'MaxText', 'orbax': 'plain Orbax'}.get(d.kind, d.kind)
  out.fields(
      [
          ('checkpoint', str(d.path)),
          ('kind', f'{kind} (written with the Orbax {d.writer} API)'),
          ('step', f'{d.step if d.step is not None else "-"}  ({d.step_dir})'),
          ('steps', _steps_text(report)),
          ('size', f'{format_bytes(report.nbytes)} in {report.num_leaves} leaves'),
      ]
      + [('note', note) for note in report.notes]
      + [('skipped', f'{name}: {why}') for name, why in sorted(report.skipped.items())]
  )
  out.title('Layout')
  rows = []
  for item in report.items:
    rewrites = item.rewrites or (('(none)', 'read as it is'),)
    for i, (name, description) in enumerate(rewrites):
      rows.append([item.name if i == 0 else '', name, description])
  out.table(['item', 'rewrite', 'what it undoes'], rows)
  for item in report.items:
    side = f', {len(item.side_leaves)} side leaves left out' if item.side_leaves else ''
    out.title(f'{item.name}: {len(item.leaves)} leaves, {format_bytes(item.nbytes)}{side}')
    if collapse:
      rows = [
          [r.path, f'x{r.count}' if r.count > 1 else '', _shape(r.shape), str(r.dtype), format_bytes(r.nbytes)]
          for r in inspection.collapse(item.leaves)
      ]
      out.table(['path', 'layers', 'shape', 'dtype', 'bytes'], rows, right=(1, 4))
    else:
      rows = [
          [fmt(leaf.path), _shape(leaf.shape), str(leaf.dtype), str(leaf.nbytes)]
          for leaf in item.leaves
      ]
      out.table(['path', 'shape', 'dtype', 'bytes'], rows, right=(3,))
  out.title('Totals')
  rows = [
      [item.name, str(len(item.leaves)), format_bytes(item.nbytes), str(len(item.side_leaves))]
      for item in report.items
  ]
  rows.append(['all', str(report.num_leaves), format_bytes(report.nbytes), ''])
  out.table(['item', 'leaves', 'bytes', 'side leaves'], rows, right=(1, 2, 3))
  if report.lora is not None:
    lora = report.lora
    out.title('LoRA')
    out.fields(
        [
            ('style', lora.style),
            ('rank', ', '.join(str(r) for r in lora.ranks) or '-'),
            ('adapted', f'{len(lora.targets)} weights ({lora.num_leaves} leaves, {format_bytes(lora.nbytes)})'),
            ('base weights', 'saved too' if lora.base_weights else 'not saved (adapters only)'),
        ]
    )
    for target in _fold_targets(lora.targets, collapse):
      out.text(f'  {target}')
  if report.optimizer:
    out.title(f'Optimizer state ({report.optimizer_item})')
    for row in report.optimizer:
      label = '  ' * row.depth + row.path[-1] + ('' if row.leaf else '/')
      out.text(f'  {label:<32} {row.text}'.rstrip())
  if report.hyperparameters:
    out.title('Hyperparameters (inject_hyperparams)')
    rows = [
        [shell, name, _scalar_text(value)]
        for shell, values in report.hyperparameters.items()
        for name, value in sorted(values.items())
    ]
    out.table(['shell', 'name', 'value'], rows)


def _scalar_text(value: Any) -> str:
  """A hyperparameter as people write it: 0.001, not 0.0009999999 (float32)."""
  value = np.asarray(value)[()]
  if isinstance(value, np.floating):
    return f'{float(value):.6g}'
  return str(value)


def _fold_targets(targets: Sequence[str], collapse: bool) -> list[str]:
  """LoRA targets, numbered layers folded on a terminal."""
  if not collapse:
    return list(targets)
  folded: dict[str, list[str]] = {}
  for target in targets:
    parts = target.split('/')
    key = '/'.join('*' if p.isdigit() else p for p in parts)
    folded.setdefault(key, []).append(target)
  return [
      key if len(members) == 1 else f'{key}  (x{len(members)})' for key, members in folded.items()
  ]


def cmd_inspect(args: argparse.Namespace, out: Output) -> int:
  """`orbax-tunix inspect`: draws the report (or prints its JSON).

  Returns 0; with --verify, 1 when some array does not match its checksum.
  """
  report = inspection.inspect_checkpoint(args.path, args.step)
  verification = None
  if args.verify:
    progress = make_progress(sys.stderr, out.fancy or args.fancy_progress)
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
    document = inspection.to_json(report)
    if verification is not None:
      document['verify'] = dataclasses.asdict(verification) | {
          'step_dir': str(verification.step_dir), 'ok': verification.ok}
    print(json.dumps(document, indent=1), file=out.stream)
  else:
    show_inspect(out, report, collapse=args.collapse)
    if verification is not None:
      show_verification(out, verification)
  return EXIT_OK if verification is None or verification.ok else EXIT_DIFFER


def show_verification(out: Output, verification: checksums.Verification) -> None:
  """Draws what `inspect --verify` found."""
  out.title('Verify (checksums recorded by orbax-tunix convert)')
  for title, paths in (
      ('damaged: data does not match its checksum', verification.damaged),
      ('recorded but missing from the step', verification.missing),
      ('no checksum recorded (not checked)', verification.unrecorded),
  ):
    if paths:
      out.text(f'  {title}: {len(paths)}')
      for path in paths[:DIFF_ROWS]:
        out.text(f'    {path}')
  verdict = 'ok' if verification.ok else 'FAILED'
  out.text(f'  {verdict}: {verification.checked} arrays checked')


# --- convert ----------------------------------------------------------------


class _Interruptible:
  """A `Progress` that stops the conversion at the next batch once signalled.

  A KeyboardInterrupt raised by a signal handler can land in a callback whose
  exceptions Python ignores (e.g. XLA's garbage-collection hook) and be lost;
  the flag makes the stop certain, at the latest after the current batch.
  """

  def __init__(self, inner: reader.Progress):
    self._inner = inner
    self.stop = threading.Event()

  def start(self, total_bytes: int, description: str) -> None:
    self._inner.start(total_bytes, description)

  def advance(self, nbytes: int) -> None:
    self._inner.advance(nbytes)
    if self.stop.is_set():
      raise KeyboardInterrupt

  def finish(self) -> None:
    self._inner.finish()


@contextlib.contextmanager
def _signals_stop(progress: _Interruptible) -> Iterator[None]:
  """SIGINT, SIGTERM and SIGHUP stop the conversion, so its temporary files are removed."""

  def handler(signum: int, frame: Any) -> None:
    del signum, frame
    progress.stop.set()
    raise KeyboardInterrupt

  try:
    previous = {
        sig: signal.signal(sig, handler)
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    }
  except ValueError:  # Not the main thread: leave signals alone.
    yield
    return
  try:
    yield
  finally:
    for sig, old in previous.items():
      signal.signal(sig, old)


def cmd_convert(args: argparse.Namespace, out: Output) -> int:
  """`orbax-tunix convert`: plans, streams with progress, prints the summary; returns 0."""
  plan = convert_lib.plan_convert(
      args.src,
      args.dst,
      step=args.step,
      layout=args.layout,
      params_only=args.params_only,
      dtype=convert_lib.parse_dtype(args.dtype),
      memory_budget=args.memory_budget,
      force=args.force,
  )
  for note in plan.notes:
    print(f'note: {as_flags(note)}', file=sys.stderr)
  for leftover in convert_lib.leftover_temporaries(plan.dst):
    print(
        f'note: {leftover} is left from an interrupted conversion; remove it'
        ' when no conversion is running.',
        file=sys.stderr,
    )
  progress = _Interruptible(make_progress(sys.stderr, out.fancy or args.fancy_progress))
  with _signals_stop(progress):
    result = convert_lib.run_convert(plan, progress)
  source = plan.source.detection
  rate = result.bytes_read / max(result.seconds, 1e-9)
  if args.json:
    print(
        json.dumps(
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


# --- diff -------------------------------------------------------------------


def _diff_json(result: diff_lib.DiffResult) -> dict[str, Any]:
  return {
      'a': str(result.a),
      'b': str(result.b),
      'match': result.match,
      'damaged_a': list(result.damaged_a),
      'damaged_b': list(result.damaged_b),
      'only_a': list(result.only_a),
      'only_b': list(result.only_b),
      'shape': [{'path': m.path, 'a': m.a, 'b': m.b} for m in result.shape],
      'dtype': [{'path': m.path, 'a': m.a, 'b': m.b} for m in result.dtype],
      'values': [
          {'path': v.path, 'max_abs_diff': v.max_abs_diff, 'differing': v.differing, 'size': v.size}
          for v in result.values
      ],
      'compared': result.compared,
      'bytes_compared': result.bytes_compared,
      'atol': result.atol,
      'max_abs_diff': result.max_abs_diff,
      'ignore_dtype': result.ignore_dtype,
  }


def _limited(rows: list[list[str]], limit: int | None) -> tuple[list[list[str]], int]:
  if limit is None or len(rows) <= limit:
    return rows, 0
  return rows[:limit], len(rows) - limit


def show_diff(out: Output, result: diff_lib.DiffResult, limit: int | None, hint: str | None) -> None:
  """Draws a diff result, then its one-line verdict."""
  sections = [
      (
          f'Damaged in A ({result.a}): data does not match its recorded checksum',
          ['path'], [[p] for p in result.damaged_a], (),
      ),
      (
          f'Damaged in B ({result.b}): data does not match its recorded checksum',
          ['path'], [[p] for p in result.damaged_b], (),
      ),
      (f'Only in A ({result.a})', ['path'], [[p] for p in result.only_a], ()),
      (f'Only in B ({result.b})', ['path'], [[p] for p in result.only_b], ()),
      ('Shapes differ', ['path', 'A', 'B'], [[m.path, m.a, m.b] for m in result.shape], ()),
      (
          'Dtypes differ' + (' (ignored)' if result.ignore_dtype else ''),
          ['path', 'A', 'B'],
          [[m.path, m.a, m.b] for m in result.dtype],
          (),
      ),
      (
          f'Values differ (atol {result.atol:g})',
          ['path', 'max abs diff', 'elements differing'],
          [[v.path, f'{v.max_abs_diff:.6g}', f'{v.differing} / {v.size}'] for v in result.values],
          (1, 2),
      ),
  ]
  for title, columns, rows, right in sections:
    if not rows:
      continue
    shown, more = _limited(rows, limit)
    out.title(f'{title}: {len(rows)}')
    out.table(columns, shown, right=right)
    if more:
      out.text(f'  ... and {more} more (--json lists them all)')
  if hint:
    out.text()
    out.text(f'hint: {hint}')
  out.text()
  if result.match:
    out.text(
        f'match: {result.compared} leaves ({format_bytes(result.bytes_compared)}) compared,'
        f' max abs diff {result.max_abs_diff:g} (atol {result.atol:g})'
    )
  else:
    out.text(
        f'differ: {len(result.damaged_a) + len(result.damaged_b)} damaged,'
        f' {len(result.only_a)} only in A, {len(result.only_b)} only in B,'
        f' {len(result.shape)} shapes, {len(result.dtype)} dtypes,'
        f' {len(result.values)} values (max abs diff {result.max_abs_diff:g}, atol'
        f' {result.atol:g}); {result.compared} leaves compared'
    )


def _diff_hint(result: diff_lib.DiffResult, params_only: bool) -> str | None:
  if params_only or not (result.only_a and result.only_b):
    return None
  items_a = {p.split('/')[0] for p in result.only_a}
  items_b = {p.split('/')[0] for p in result.only_b}
  if items_a.isdisjoint(items_b):
    return (
        f'the two sides hold different items ({", ".join(sorted(items_a))} vs'
        f' {", ".join(sorted(items_b))}); to compare the model weights alone (e.g.'
        ' against a --layout maxtext conversion), add --params-only.'
    )
  return None


def cmd_diff(args: argparse.Namespace, out: Output) -> int:
  """`orbax-tunix diff`: compares with progress; returns 0 on a match, else 1."""
  progress = make_progress(sys.stderr, out.fancy or args.fancy_progress)
  result = diff_lib.diff_checkpoints(
      args.a,
      args.b,
      atol=args.atol,
      params_only=args.params_only,
      ignore_dtype=args.ignore_dtype,
      memory_budget=args.memory_budget,
      progress=progress,
  )
  if args.json:
    print(json.dumps(_diff_json(result)), file=out.stream)
  else:
    limit = DIFF_ROWS if out.fancy else None
    show_diff(out, result, limit, _diff_hint(result, args.params_only))
  return EXIT_OK if result.match else EXIT_DIFFER


# --- arguments and main -----------------------------------------------------

# The library's parameters, as its messages name them (in backquotes), and the
# flags that set them here.
_FLAGS = {
    'force': '--force',
    'params_only': '--params-only',
    'layout': '--layout',
    'dtype': '--dtype',
    'memory_budget': '--memory-budget',
    'step': '--step',
    'atol': '--atol',
    'ignore_dtype': '--ignore-dtype',
    'dst': 'DST',
    'src': 'SRC',
}
_PARAMETER = re.compile(r'`(\w+)(=[^`]*)?`')


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



def _step(text: str) -> int:
  try:
    value = int(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f'{text!r} is not a step number.') from None
  if value < 0:
    raise argparse.ArgumentTypeError(f'{text!r}: step numbers are not negative.')
  return value


def _atol(text: str) -> float:
  try:
    value = float(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f'{text!r} is not a number.') from None
  if not value >= 0:
    raise argparse.ArgumentTypeError(f'{text!r}: the tolerance must be >= 0.')
  return value


def build_parser() -> argparse.ArgumentParser:
  """The argument parser of `orbax-tunix`."""
  common = argparse.ArgumentParser(add_help=False)
  common.add_argument(
      '--debug', action='store_true', default=argparse.SUPPRESS,
      help='show tracebacks, warnings and Orbax logs',
  )
  common.add_argument(
      '--plain', action='store_true', default=argparse.SUPPRESS,
      help='plain text even on a terminal (no tables drawn with rich)',
  )
  parser = argparse.ArgumentParser(
      prog='orbax-tunix',
      formatter_class=argparse.RawDescriptionHelpFormatter,
      epilog=(
          'examples:\n'
          '  orbax-tunix inspect gs://bucket/run/checkpoints\n'
          '  orbax-tunix convert run/checkpoints out/1000 --step 1000\n'
          '  orbax-tunix diff run/checkpoints/1000 out/1000\n'
          '  orbax-tunix convert run/checkpoints mt/1000 --layout maxtext --params-only\n'
          '  orbax-tunix diff run/checkpoints mt/1000 --params-only\n'
          '\n'
          'exit status: 0 success (diff: match), 1 diff found differences, 2 error,'
          ' 130 interrupted'
      ),
      description=(
          'Inspect, convert and diff Tunix checkpoints (and any Orbax PyTree checkpoint)\n'
          'without writing Python. A path may be a root (the latest committed step is\n'
          'used), a step directory or an item directory, on a local disk or in a bucket\n'
          '(convert writes to a local disk).'
      ),
      parents=[common],
  )
  sub = parser.add_subparsers(dest='command', required=True, metavar='COMMAND')

  p = sub.add_parser(
      'inspect', parents=[common],
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
  p.add_argument('--verify', action='store_true',
                 help='read every array and check it against the checksums orbax-tunix'
                 ' convert recorded (exit 1 if one differs)')
  p.add_argument('--memory-budget', type=parse_size, default=convert_lib.DEFAULT_MEMORY_BUDGET,
                 metavar='SIZE', help='memory --verify may use (default 1G)')
  group = p.add_mutually_exclusive_group()
  group.add_argument('--full', dest='collapse', action='store_false', default=None,
                     help='list every leaf (the default when piped)')
  group.add_argument('--collapse', dest='collapse', action='store_true',
                     help='fold identical numbered layers into one row (the default on a terminal)')
  p.set_defaults(handler=cmd_inspect)

  p = sub.add_parser(
      'convert', parents=[common],
      help='write an ordinary Orbax checkpoint (canonical, or MaxText parameters)',
      description=(
          'Write SRC as an ordinary Orbax checkpoint that plain Orbax restores'
          ' without this package. DST is the step directory to create; name it by'
          ' its step number (out/1000) to make its parent a root that'
          ' ocp.CheckpointManager reads. canonical: one item per source item,'
          ' canonical (model_params, optimizer_state). maxtext --params-only: item'
          ' "items" holding {"params": {"params": <weights>}} without RNG state;'
          ' point MaxText\'s load_parameters_path at DST/items. Streams in batches'
          ' within --memory-budget; written beside DST and renamed at the end, so'
          ' a failure leaves no DST. Check the result with: orbax-tunix diff SRC DST.'
      ),
  )
  p.add_argument('src', metavar='SRC')
  p.add_argument('dst', metavar='DST')
  p.add_argument('--step', type=_step, help='the source step (default: the latest committed)')
  p.add_argument('--params-only', action='store_true',
                 help='write the model weights only (no optimizer state, no RNG state)')
  p.add_argument('--layout', choices=convert_lib.LAYOUTS, default=convert_lib.CANONICAL,
                 help='canonical (default) or maxtext (needs --params-only)')
  p.add_argument('--dtype', help='cast floating leaves to this dtype (e.g. bfloat16); '
                 'integer and RNG leaves keep theirs')
  p.add_argument('--memory-budget', type=parse_size, default=convert_lib.DEFAULT_MEMORY_BUDGET,
                 metavar='SIZE',
                 help='memory the streaming may use above start-up, e.g. 512M or 4G (default'
                 ' 1G; budgets under ~128M cannot be met); an array too large for one batch'
                 ' is copied alone and needs about 3x its size')
  p.add_argument('--force', action='store_true',
                 help='replace an existing DST (only once the new one is complete)')
  p.add_argument('--json', action='store_true', help='print the summary as JSON')
  p.set_defaults(handler=cmd_convert)

  p = sub.add_parser(
      'diff', parents=[common],
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
  p.add_argument('--memory-budget', type=parse_size, default=diff_lib.DEFAULT_MEMORY_BUDGET,
                 metavar='SIZE', help='memory the streaming may use (default 1G)')
  p.add_argument('--json', action='store_true', help='print one JSON document')
  p.set_defaults(handler=cmd_diff)
  return parser


@contextlib.contextmanager
def _quiet(debug: bool) -> Iterator[None]:
  """Silences Orbax's and JAX's warnings and logs, unless debugging.

  Their errors are silenced too: every failure reaches `main` as an
  exception, which prints one message saying what to do.
  """
  if debug:
    yield
    return
  loggers = [logging.getLogger(name) for name in ('absl', 'jax', 'orbax', 'asyncio')]
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


def _is_closed_loop_noise(exc: BaseException | None) -> bool:
  return isinstance(exc, RuntimeError) and str(exc) == 'Event loop is closed'


def _silence_closed_loop_noise() -> None:
  """Drops "Event loop is closed" reports of TensorStore's and Orbax's late callbacks.

  When a command stops (an error, Ctrl-C, the end), callbacks still queued on
  Orbax's event loop may fire after it closed; Python then prints a traceback
  that says nothing about the command. Every other report is kept.
  """
  if getattr(sys.unraisablehook, 'orbax_tunix', False):
    return  # Already installed (main may run many times in one process).
  unraisable, in_thread = sys.unraisablehook, threading.excepthook

  def on_unraisable(report: Any) -> None:
    if not _is_closed_loop_noise(report.exc_value):
      unraisable(report)

  def on_thread_error(report: Any) -> None:
    if not _is_closed_loop_noise(report.exc_value):
      in_thread(report)

  on_unraisable.orbax_tunix = True
  sys.unraisablehook, threading.excepthook = on_unraisable, on_thread_error


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
    0 success or match, 1 differences found, 2 error, 130 interrupted.
  """
  parser = build_parser()
  args = parser.parse_args(argv)
  debug = getattr(args, 'debug', False)
  plain = getattr(args, 'plain', False)
  out = Output(sys.stdout, fancy=not plain and _is_tty(sys.stdout))
  args.fancy_progress = not plain
  if args.command == 'inspect' and args.collapse is None:
    args.collapse = out.fancy or _is_tty(sys.stdout)
  _use_cpu()
  if not debug:
    _silence_closed_loop_noise()
  try:
    with _quiet(debug), _x64():
      return args.handler(args, out)
  except KeyboardInterrupt:
    print('orbax-tunix: interrupted; nothing was written at the destination.', file=sys.stderr)
    return EXIT_INTERRUPTED
  except BrokenPipeError:
    # The reader went away (`| head`): stop quietly, as other tools do.
    with contextlib.suppress(OSError):
      os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return EXIT_OK
  except errors.TunixCheckpointError as e:
    if debug:
      traceback.print_exc()
    print(f'orbax-tunix: error: {as_flags(str(e))}', file=sys.stderr)
    return EXIT_ERROR
  except OSError as e:
    if debug:
      traceback.print_exc()
    where = f' ({e.filename})' if getattr(e, 'filename', None) else ''
    print(
        f'orbax-tunix: error: {e.strerror or e}{where}. Check the path and its permissions.',
        file=sys.stderr,
    )
    return EXIT_ERROR
  except Exception as e:  # pylint: disable=broad-except
    if debug:
      traceback.print_exc()
    else:
      print(
          f'orbax-tunix: error: {type(e).__name__}: {e}\n(run again with --debug for the'
          ' traceback, and report it if the checkpoint looks sound)',
          file=sys.stderr,
      )
    return EXIT_ERROR


if __name__ == '__main__':
  sys.exit(main())

"""Drawing results for people: tables on a terminal, aligned text in a log, JSON.

`Printer` writes to a stream: with `rich` on a terminal (`pip install
'orbax-tunix[cli]'`), plain aligned text otherwise. The `show_*` functions draw
the library's results (`inspection.Report`, `diff.DiffResult`, ...); the
`*_json` functions give the same as one JSON document.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from typing import Any, TextIO

import numpy as np

from orbax_tunix.keypaths import Path, fmt, natural_key, nest
from orbax_tunix.mapping import huggingface
from orbax_tunix.mapping import lora as lora_lib
from orbax_tunix.reading import reader, timing
from orbax_tunix.tools import diff as diff_lib
from orbax_tunix.tools import inspection
from orbax_tunix.writing import checksums

try:  # rich is optional: without it the output is plain text.
  import rich.box
  import rich.console
  import rich.padding
  import rich.table
  import rich.text
except ImportError:  # pragma: no cover - exercised by hiding rich in a test.
  rich = None

# Rows shown per section of a diff on a terminal; --json lists them all.
DIFF_ROWS = 50


def is_tty(stream: TextIO) -> bool:
  try:
    return stream.isatty()
  except (AttributeError, ValueError):
    return False


def format_duration(seconds: float) -> str:
  """'1h02m', '3m05s', '4.2s'."""
  if seconds < 60:
    return f'{seconds:.1f}s'
  minutes, secs = divmod(int(seconds), 60)
  if minutes < 60:
    return f'{minutes}m{secs:02d}s'
  hours, minutes = divmod(minutes, 60)
  return f'{hours}h{minutes:02d}m'


def timings_line(timings: timing.Timings) -> str:
  """`--timings`: where a command's time went, in one line ('timings: set-up 0.01 s, plan
  0.21 s, read 3.10 s in 22 batches (waited for 0.40 s), made 0.01 s, written 2.20 s on 8
  threads, committed 0.02 s; 5.90 s in all'). The reads go ahead of the writes, so the phases
  overlap; set-up is the flags checked and a job joined (JAX's cluster detection)."""
  seconds, counts = timings.seconds, timings.counts
  parts = [f'{name} {seconds[name]:.2f} s' for name in ('set-up', 'plan') if name in seconds]
  if 'read' in seconds:
    waited = f' (waited for {seconds["waited"]:.2f} s)' if 'waited' in seconds else ''
    parts.append(f'read {seconds["read"]:.2f} s in {counts["read"]} batches{waited}')
  if 'made' in seconds:
    parts.append(f'made {seconds["made"]:.2f} s')
  if 'written' in seconds:
    threads = timings.facts.get('threads')
    parts.append(f'written {seconds["written"]:.2f} s'
                 + (f' on {threads} threads' if threads else ''))
  if 'committed' in seconds:
    parts.append(f'committed {seconds["committed"]:.2f} s')
  return 'timings: ' + ', '.join(parts) + (
      f'; {seconds["in all"]:.2f} s in all' if 'in all' in seconds else '')


@dataclasses.dataclass(frozen=True)
class Row:
  """One display row: a leaf, or identical leaves of numbered layers folded.

  Attributes:
    path: e.g. 'layers/[0-27]/attn/q_proj/w'.
    count: how many leaves it stands for.
    shape: each leaf's shape.
    dtype: each leaf's dtype.
    nbytes: bytes of all `count` leaves.
  """

  path: str
  count: int
  shape: tuple[int, ...] | None
  dtype: np.dtype | None
  nbytes: int


def _range_label(keys: Sequence[str]) -> str:
  """'[0-3,7]' for ['0', '1', '2', '3', '7']."""
  numbers = sorted(int(k) for k in keys)
  spans = [[numbers[0], numbers[0]]]
  for n in numbers[1:]:
    if n == spans[-1][1] + 1:
      spans[-1][1] = n
    else:
      spans.append([n, n])
  return '[' + ','.join(f'{a}' if a == b else f'{a}-{b}' for a, b in spans) + ']'


def _signature(node: Any) -> Any:
  if isinstance(node, reader.LeafInfo):
    return (node.shape, str(node.dtype), node.kind)
  return tuple(sorted((k, _signature(v)) for k, v in node.items()))


def _collapse(node: Any) -> list[tuple[Path, int, reader.LeafInfo]]:
  if isinstance(node, reader.LeafInfo):
    return [((), 1, node)]
  groups: dict[Any, list[str]] = {}
  for key in node:
    if key.isdigit():
      groups.setdefault(_signature(node[key]), []).append(key)
  out, done = [], set()
  for key in sorted(node, key=natural_key):
    if key in done:
      continue
    members = groups.get(_signature(node[key])) if key.isdigit() else None
    if members and len(members) > 1:
      done.update(members)
      label, factor = _range_label(members), len(members)
    else:
      label, factor = key, 1
    out += [((label,) + p, n * factor, leaf) for p, n, leaf in _collapse(node[key])]
  return out


def collapse_rows(leaves: Sequence[reader.LeafInfo]) -> list[Row]:
  """Folds numbered siblings with identical subtrees (layers) into one row each.

  `layers/0/...` to `layers/27/...` become `layers/[0-27]/...` when every
  layer holds the same leaves with the same shapes and dtypes; layers that
  differ are grouped by kind (`layers/[0,2-5]`, `layers/[1]`). Optimizer
  chain positions (a lone `0`) stay as they are.

  Args:
    leaves: canonical leaves of one item.

  Returns:
    Display rows, in natural order.
  """
  tree = nest((leaf.path, leaf) for leaf in leaves)
  return [
      Row(fmt(path), count, leaf.shape, leaf.dtype, leaf.nbytes * count)
      for path, count, leaf in _collapse(tree)
  ]


def format_bytes(n: int) -> str:
  """'1.5 MiB': sizes for people (binary units)."""
  value = float(n)
  for unit in ('B', 'KiB', 'MiB', 'GiB'):
    if value < 1024:
      return f'{int(value)} {unit}' if unit == 'B' else f'{value:.1f} {unit}'
    value /= 1024
  return f'{value:.1f} TiB'


def _leaf_json(leaf: reader.LeafInfo) -> dict[str, Any]:
  return {
      'shape': None if leaf.shape is None else list(leaf.shape),
      'dtype': None if leaf.dtype is None else str(leaf.dtype),
      'bytes': leaf.nbytes,
  }


def outline_text(row: inspection.OutlineRow, num_weights: int) -> str:
  """What an optimizer outline row says, for people."""
  if row.leaf is not None:
    return f'{row.leaf.shape} {row.leaf.dtype}'
  if row.mirrored is not None:
    n, nbytes = row.mirrored
    return f'mirrors the weights ({n} of {num_weights} leaves, {format_bytes(nbytes)})'
  notes = []
  if row.shell:
    notes.append('inject_hyperparams shell (its hyperparameters are listed below)')
  if row.chain:
    notes.append('optax chain: one entry per transform with state')
  elif row.states:
    same = f'; {len(row.states) - 1} other optax states have these fields' if len(row.states) > 1 else ''
    notes.append(f'optax {row.states[0]} fields{same}')
  return '; '.join(notes)


def inspect_json(report: inspection.Report) -> dict[str, Any]:
  """The report as one JSON document.

  A nested document: `items` maps each item to its handler, rewrites,
  counts and `leaves`, a map of canonical path (keys joined by '/', a key
  holding '/' written as a JSON string, see `keypaths.fmt`) to
  {shape, dtype, bytes}; then `lora`, `optimizer` and `hyperparameters`.
  """
  d = report.detection
  return {
      'path': str(d.path),
      'step_dir': str(d.step_dir),
      'step': d.step,
      'state_step': report.state_step,
      'kind': d.kind,
      'writer': d.writer,
      'steps': [
          {'step': s.step, 'committed': s.committed, 'empty': s.empty,
           'unreadable': s.unreadable or None, 'path': str(s.path)}
          for s in report.steps
      ],
      'items': {
          item.name: {
              'handler': item.handler,
              'rewrites': [{'rule': n, 'description': t} for n, t in item.rewrites],
              'num_leaves': len(item.leaves),
              'bytes': item.nbytes,
              'side_leaves': [fmt(p) for p in item.side_leaves],
              'leaves': {fmt(leaf.path): _leaf_json(leaf) for leaf in item.leaves},
          }
          for item in report.items
      },
      'json_items': list(report.json_items),
      'num_leaves': report.num_leaves,
      'bytes': report.nbytes,
      'lora': None if report.lora is None else dataclasses.asdict(report.lora),
      'quantized': None if report.quantized is None else {
          'schemes': {k: list(v) for k, v in report.quantized.schemes.items()},
          'stored_bytes': report.quantized.stored_bytes,
          'dequantized_bytes': report.quantized.dequantized_bytes},
      'weights': report.source,
      'layers': None if report.layers is None else dataclasses.asdict(report.layers),
      'optimizer': {
          'item': report.optimizer_item,
          'outline': [
              {
                  'path': fmt(r.path),
                  'depth': r.depth,
                  'leaf': r.leaf is not None,
                  'optax_states': list(r.states),
                  'description': outline_text(r, report.num_weights),
              }
              for r in report.optimizer
          ],
      },
      'hyperparameters': {
          shell: {k: reader.json_scalar(v) for k, v in values.items()}
          for shell, values in report.hyperparameters.items()
      },
      'notes': list(report.notes),
  }


# --- output ---------------------------------------------------------------


class Printer:
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


# --- inspect --------------------------------------------------------------


def _shape(shape: Any) -> str:
  return '-' if shape is None else str(tuple(shape))


def _steps_text(report: inspection.Report) -> str:
  if not report.steps:
    return '-'
  text = ', '.join(str(s.step) for s in report.steps if s.usable) or 'none committed'
  for state in ('unfinished', 'empty'):
    skipped = [s.path.name if state == 'empty' else str(s.step)
               for s in report.steps if s.state == state]
    if skipped:
      text += f'  ({state}: {", ".join(skipped)})'
  return text


def show_inspect(out: Printer, report: inspection.Report, collapse: bool) -> None:
  """Draws an inspect report."""
  d = report.detection
  out.fields(
      [
          ('checkpoint', str(d.path)),
          ('kind', f'{d.source_kind.title} (written with the Orbax {d.writer} API)'),
          ('step', f'{d.step if d.step is not None else "-"}  ({d.step_dir})'),
          ('steps', _steps_text(report)),
          ('size', f'{format_bytes(report.nbytes)} in {report.num_leaves} leaves'),
      ]
      + [('weights', report.source)] * bool(report.source)
      + ([('state step', f'{report.state_step} (the optimizer\'s own counter)')]
         if report.state_step is not None and report.state_step != d.step else [])
      + [('json items', ', '.join(report.json_items))] * bool(report.json_items)
      + [('note', note) for note in report.notes]
  )
  out.title('Layout')
  rows = [[item.name if i == 0 else '', name, description]
          for item in report.items
          for i, (name, description) in enumerate(item.rewrites or (('(none)', 'read as it is'),))]
  out.table(['item', 'rewrite', 'what it undoes'], rows)
  for item in report.items:
    side = f', {len(item.side_leaves)} side leaves left out' if item.side_leaves else ''
    out.title(f'{item.name}: {len(item.leaves)} leaves, {format_bytes(item.nbytes)}{side}')
    if collapse:
      rows = [
          [r.path, f'x{r.count}' if r.count > 1 else '', _shape(r.shape), str(r.dtype), format_bytes(r.nbytes)]
          for r in collapse_rows(item.leaves)
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
  if any(item.side_leaves for item in report.items):
    out.text(
        '  side leaves: on-disk leaves outside the canonical view (an inject_hyperparams'
        ' shell\'s count and hyperparameters, shown below); convert keeps their values in'
        ' the custom metadata.'
    )
  if report.layers is not None:
    form, count, axis = report.layers.form, report.layers.count, report.layers.axis
    how = (f'decoder/layers/<w>, stacked on axis {"?" if axis is None else axis}'
           ' (scan_layers=True)' if form == 'scanned'
           else 'decoder/layers_<i>/<w> (scan_layers=False)')
    out.title('MaxText layers')
    out.fields([('form', f'{form}: {how}'),
                ('layers', '? (the stacked weights are not one decoder: see the note)'
                 if count is None else str(count))])
  if report.lora is not None:
    lora = report.lora
    out.title('LoRA')
    out.fields(
        [
            ('style', lora.style),
            ('rank', ', '.join(str(r) for r in lora.ranks) or '-'),
            ('adapted', f'{len(lora.targets)} weights ({lora.num_leaves} leaves, {format_bytes(lora.nbytes)})'),
            ('base weights', 'saved too' if lora.base_weights else 'not saved (adapters only)'),
            ('export', _lora_uses(lora)),
        ]
    )
    for target, rank in _fold_targets(lora.targets, lora.target_ranks, collapse):
      out.text(f'  {target}  rank {rank}')
  if report.quantized is not None:
    show_quantized(out, report.quantized, collapse)
  if report.optimizer:
    out.title(f'Optimizer state ({report.optimizer_item})')
    for row in report.optimizer:
      label = '  ' * row.depth + row.path[-1] + ('' if row.leaf is not None else '/')
      out.text(f'  {label:<32} {outline_text(row, report.num_weights)}'.rstrip())
  if report.hyperparameters:
    out.title('Hyperparameters (inject_hyperparams)')
    rows = [
        [shell, name, _scalar_text(value)]
        for shell, values in report.hyperparameters.items()
        for name, value in sorted(values.items())
    ]
    out.table(['shell', 'name', 'value'], rows)


def show_quantized(out: Printer, quantized: inspection.QuantizedReport, collapse: bool) -> None:
  """The weights saved quantized: how, which, and the bytes it saves."""
  count = sum(len(paths) for paths in quantized.schemes.values())
  saved = quantized.dequantized_bytes - quantized.stored_bytes
  out.title('Quantized weights (QLoRA base)')
  out.fields([
      ('weights', f'{count}, read dequantized (qwix\'s dequantize, in their scale\'s dtype)'),
      ('stored', f'{format_bytes(quantized.stored_bytes)} (dequantized'
                 f' {format_bytes(quantized.dequantized_bytes)}: {format_bytes(saved)} saved)'),
  ])
  for how, paths in quantized.schemes.items():
    out.text(f'  {how}: {len(paths)} weights')
    for path, _ in _fold_targets(paths, (0,) * len(paths), collapse):
      out.text(f'    {path}')


def _scalar_text(value: Any) -> str:
  """A hyperparameter as people write it: 0.001, not 0.0009999999 (float32)."""
  value = np.asarray(value)[()]
  if isinstance(value, np.floating):
    return f'{float(value):.6g}'
  return str(value)


# What a LoRA save is good for, by whether its base weights are saved too (`inspect`); `{alpha}`
# is the scaling flag qwix's adapters need (flax's have no alpha: none), `{base_model}` the
# flag adapters saved alone may need (`_lora_uses`).
LORA_USES = {
    True: 'export --peft{alpha} (a PEFT adapter) and --base-only (its base model), or'
          ' export/convert --merge-lora{alpha} (the merged model)',
    False: 'export --peft{alpha}{base_model} (a PEFT adapter of the base the run started from),'
           ' or export/convert --merge-lora{alpha} --base BASE (the merged model)',
}


def _lora_uses(lora: inspection.LoraReport) -> str:
  """`LORA_USES` for these adapters: `--lora-alpha A` unless every one is flax's (which
  have no alpha: the merge and --peft refuse one); a MaxText model's adapters alone take
  their kernels' shapes from the base model's config (qwix flattened them), so --peft needs
  --base-model FOLDER there."""
  alpha = '' if lora.style == lora_lib.FLAX else ' --lora-alpha A'
  needs_config = not lora.base_weights and huggingface.adapters_need_config(
      [tuple(t.split('/')) for t in lora.targets])
  return LORA_USES[lora.base_weights].format(
      alpha=alpha, base_model=' --base-model FOLDER' if needs_config else '')


def _fold_targets(targets: Sequence[str], ranks: Sequence[int], collapse: bool
                  ) -> list[tuple[str, str]]:
  """LoRA targets and their ranks, numbered layers folded on a terminal."""
  if not collapse:
    return [(t, str(r)) for t, r in zip(targets, ranks, strict=True)]
  folded: dict[str, list[int]] = {}
  for target, rank in zip(targets, ranks, strict=True):
    key = '/'.join('*' if p.isdigit() else p for p in target.split('/'))
    folded.setdefault(key, []).append(rank)
  return [
      (key if len(found) == 1 else f'{key}  (x{len(found)})',
       ', '.join(str(r) for r in sorted(set(found))))
      for key, found in folded.items()
  ]


def show_verification(out: Printer, verification: checksums.Verification) -> None:
  """Draws what `inspect --verify` found."""
  out.title('Verify (checksums recorded by orbax-tunix convert)')
  for title, paths in (
      ('damaged: data does not match its checksum', verification.damaged),
      ('damaged: stored data missing or unreadable', verification.unreadable),
      ('recorded but missing from the step', verification.missing),
      ('no checksum recorded (not checked)', verification.unrecorded),
  ):
    if paths:
      out.text(f'  {title}: {len(paths)}')
      for path in paths[:DIFF_ROWS]:
        out.text(f'    {path}')
  verdict = 'ok' if verification.ok else 'FAILED'
  out.text(f'  {verdict}: {verification.checked} arrays checked')


# --- diff -----------------------------------------------------------------


def strict_json(value: Any) -> Any:
  """A document with every non-finite float written as a string ('inf', '-inf',
  'nan'), so that strict JSON parsers read it (`json.dumps(..., allow_nan=False)`)."""
  if isinstance(value, float) and not math.isfinite(value):
    return 'nan' if math.isnan(value) else ('inf' if value > 0 else '-inf')
  if isinstance(value, dict):
    return {k: strict_json(v) for k, v in value.items()}
  if isinstance(value, list | tuple):
    return [strict_json(v) for v in value]
  return value


def dumps(document: Any, **kwargs: Any) -> str:
  """One strict JSON document (see `strict_json`)."""
  return json.dumps(strict_json(document), allow_nan=False, **kwargs)


def diff_json(result: diff_lib.DiffResult) -> dict[str, Any]:
  """The diff as one JSON document; an infinite difference (a NaN against a
  number, strings that differ) is written as "inf" (see `strict_json`)."""
  return {
      'a': str(result.a),
      'b': str(result.b),
      'match': result.match,
      'damaged_a': list(result.damaged_a),
      'damaged_b': list(result.damaged_b),
      'only_a': list(result.only_a),
      'only_b': list(result.only_b),
      'shape': [dataclasses.asdict(m) for m in result.shape],
      'dtype': [dataclasses.asdict(m) for m in result.dtype],
      'values': [dataclasses.asdict(v) for v in result.values],
      'json': [dataclasses.asdict(m) for m in result.json],
      'hyperparameters': [dataclasses.asdict(m) for m in result.hyperparameters],
      'compared': result.compared,
      'bytes_compared': result.bytes_compared,
      'atol': result.atol,
      'max_abs_diff': result.max_abs_diff,
      'ignore_dtype': result.ignore_dtype,
      'notes': list(result.notes),
  }


def show_diff(out: Printer, result: diff_lib.DiffResult, limit: int | None, hint: str | None) -> None:
  """Draws a diff result, then its one-line verdict."""
  pair = ['path', 'A', 'B']

  def pairs(found: Sequence[diff_lib.Mismatch]) -> list[list[str]]:
    return [[m.path, m.a, m.b] for m in found]

  sections = [
      *((f'Damaged in {side} ({where}): data does not match its recorded checksum, or'
         ' cannot be read', ['path'], [[p] for p in damaged], ())
        for side, where, damaged in (('A', result.a, result.damaged_a),
                                     ('B', result.b, result.damaged_b))),
      (f'Only in A ({result.a})', ['path'], [[p] for p in result.only_a], ()),
      (f'Only in B ({result.b})', ['path'], [[p] for p in result.only_b], ()),
      ('Shapes differ', pair, pairs(result.shape), ()),
      ('Dtypes differ' + (' (ignored)' if result.ignore_dtype else ''), pair,
       pairs(result.dtype), ()),
      (
          f'Values differ (atol {result.atol:g})',
          ['path', 'max abs diff', 'elements differing'],
          [[v.path, f'{v.max_abs_diff:.6g}', f'{v.differing} / {v.size}'] for v in result.values],
          (1, 2),
      ),
      ('JSON values differ', pair, pairs(result.json), ()),
      ('Hyperparameters differ (inject_hyperparams values and counts, outside the'
       ' canonical view)', pair, pairs(result.hyperparameters), ()),
  ]
  for title, columns, rows, right in sections:
    if not rows:
      continue
    out.title(f'{title}: {len(rows)}')
    out.table(columns, rows[:limit], right=right)
    if limit is not None and len(rows) > limit:
      out.text(f'  ... and {len(rows) - limit} more (--json lists them all)')
  if hint:
    out.text()
    out.text(f'hint: {hint}')
  for note in result.notes:
    out.text()
    out.text(f'note: {note}')
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
        f' {result.atol:g}), {len(result.json)} JSON values,'
        f' {len(result.hyperparameters)} hyperparameters; {result.compared} leaves compared'
    )


def diff_hint(result: diff_lib.DiffResult, params_only: bool) -> str | None:
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

#!/usr/bin/env python3
"""Hops: how one public call moves between orbax_tunix's modules, following one parameter.

A code-review proxy for "following a parameter through the calls", measured on the committed
fixtures:

    .venv/bin/python scripts/hops.py [--json FILE] [--cold] [--skip-full-export]

What is recorded. `sys.setprofile` is on for exactly one call (its arguments built before it
starts), on the calling thread only (work handed to worker threads is not followed: threads
interleave and make no single sequence). Each `call` event of a Python function whose code lies
under orbax_tunix/ is one call, named by its module (`reading/reader`, `layouts/huggingface`,
`__init__` for the package's own). Not recorded: frames whose code is in another package (even
when called from ours, and whatever they call back is recorded in its turn), a generator's
resumption (only its first entry is a call), a module's own top-level code (an import).

Figures, from the calls' modules in order. Consecutive calls in one module collapse into one
*visit*. A *hop* is a change of module between consecutive visits (hops = visits - 1). A
*return* is a hop into a module visited before (already left), so returns = visits - distinct
modules. *Entries* are the visits per module; the summary names the most entered one. The
visits are printed in order, a block repeated back to back written once with its count
(`(a > b) x3`; display only, the figures count every visit).

Three views of the same calls:
  * all: every call recorded.
  * no leaf utilities: the calls into keypaths, errors, store/fileio, store/names and
    writing/checksums dropped before collapsing (generic helpers hit from everywhere).
  * data-flow: only the calls that receive the followed value. A call receives it when one of
    its arguments (`self`, *args and **kwargs included) carries it: a str or os.PathLike
    (epath.Path, pathlib.Path) equal to the value as given, or whose absolute form is the
    value's or lies under it (a step or item directory found from it); or a tuple, list or dict
    of at most 16 entries holding a carrier; or an object of an orbax_tunix class with a field
    that carries it, searched through at most 4 such objects (a `reader.Source` -> its
    `Detection` -> its `Location` -> `path`; a `MergePlan` -> its `Source` -> ...).

Scenarios (each measured on its second identical call, the first unmeasured, so that one-time
work: lazy imports, caches filled, jit compilation, is not counted; `--cold` measures the
first):
  1. `orbax_tunix.restore_merged_lora(path, target, lora_alpha=4.0, base=...)` on
     tests/data/tunix/lora_qwix onto tests/data/tunix/lora_base (README's "Merge LoRA"), the
     target built from the base's metadata beforehand; following `path`.
  2. The layout half of the Hugging Face export of tests/data/tunix/hf_qwen3 with
     `model='qwen3'`: `tools.export.plan_export`, which decides every output from metadata
     only (nothing read or written); following `src`. Also the layout's own
     `layouts/huggingface.lay_out` alone (the calls inside it during that same plan_export),
     and for reference the full `export_to_hf` into a temporary folder (plan, read, write).
"""

from __future__ import annotations

import argparse
import dataclasses
import dis
import json
import os
import sys
import tempfile
import textwrap
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from types import CodeType, FrameType
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = os.fspath(ROOT / 'orbax_tunix') + os.sep
DATA = ROOT / 'tests' / 'data' / 'tunix'
LEAF_UTILITIES = frozenset({'keypaths', 'errors', 'store/fileio', 'store/names',
                            'writing/checksums'})
# How far `carries` looks: enough for MergePlan -> Source -> Detection -> Location -> path.
DEPTH = 4
MAX_ENTRIES = 16
FRESH_FLAGS = 0x20 | 0x80 | 0x200  # CO_GENERATOR, CO_COROUTINE, CO_ASYNC_GENERATOR


@dataclasses.dataclass(frozen=True)
class Call:
  module: str
  function: str
  carries: bool  # One of its arguments carries the followed value.
  window: bool  # Made while the window function (if any) was running.


class Follow:
  """Whether a value carries the followed path (see the module docstring)."""

  def __init__(self, value: str) -> None:
    self.text = value
    self.root = os.path.abspath(value)
    # (id, depth) -> (object, verdict): the object kept so that its id is not reused meanwhile;
    # the depth in the key, so that a verdict found deeper is not reused shallower.
    self._seen: dict[tuple[int, int], tuple[object, bool]] = {}

  def _path(self, value: object) -> bool:
    try:
      text = os.fspath(value)  # type: ignore[arg-type]
    except TypeError:
      return False
    if not isinstance(text, str):
      return False
    if text == self.text:
      return True
    absolute = os.path.abspath(text)
    return absolute == self.root or absolute.startswith(self.root + os.sep)

  def carries(self, value: object, depth: int = DEPTH) -> bool:
    if isinstance(value, str | os.PathLike):
      return self._path(value)
    if isinstance(value, tuple | list):
      return len(value) <= MAX_ENTRIES and any(self.carries(v, depth) for v in value)
    if isinstance(value, dict):
      return len(value) <= MAX_ENTRIES and any(self.carries(v, depth) for v in value.values())
    if depth == 0 or not type(value).__module__.startswith('orbax_tunix'):
      return False
    key = (id(value), depth)
    known = self._seen.get(key)
    if known is not None:
      return known[1]
    self._seen[key] = (value, False)  # A cycle reads as "not carried".
    verdict = any(self.carries(v, depth - 1) for v in _fields(value))
    self._seen[key] = (value, verdict)
    return verdict


def _fields(value: object) -> list[object]:
  """An object's own attributes, read without running any of its code (no properties)."""
  if dataclasses.is_dataclass(value):
    return [object.__getattribute__(value, f.name) for f in dataclasses.fields(value)
            if hasattr(value, f.name)]
  return list(getattr(value, '__dict__', {}).values())


def _arguments(frame: FrameType) -> list[object]:
  code = frame.f_code
  count = code.co_argcount + code.co_kwonlyargcount
  count += bool(code.co_flags & 0x04) + bool(code.co_flags & 0x08)  # *args, **kwargs
  local = frame.f_locals
  return [local[n] for n in code.co_varnames[:count] if n in local]


class Recorder:
  """The orbax_tunix calls made on this thread while it is active (a context manager)."""

  def __init__(self, follow: Follow, window: tuple[str, str] | None = None) -> None:
    self.follow = follow
    self.window = window  # (module, function): also mark the calls made inside it.
    self.calls: list[Call] = []
    self._open: FrameType | None = None
    self._modules: dict[CodeType, str | None] = {}
    self._first_resume: dict[CodeType, int] = {}

  def _module(self, code: CodeType) -> str | None:
    if code not in self._modules:
      name = code.co_filename
      inside = name.startswith(PACKAGE) and code.co_name != '<module>'
      self._modules[code] = name[len(PACKAGE):].removesuffix('.py') if inside else None
    return self._modules[code]

  def _fresh(self, frame: FrameType) -> bool:
    """False for a generator resumed: its frame is past its first RESUME."""
    code = frame.f_code
    if not code.co_flags & FRESH_FLAGS:
      return True
    if code not in self._first_resume:
      self._first_resume[code] = next(
          (i.offset for i in dis.get_instructions(code) if i.opname == 'RESUME'), 0)
    return frame.f_lasti <= self._first_resume[code]

  def _profile(self, frame: FrameType, event: str, arg: Any) -> None:
    if event == 'return' and frame is self._open:
      self._open = None
    if event != 'call':
      return
    module = self._module(frame.f_code)
    if module is None or not self._fresh(frame):
      return
    if self._open is None and (module, frame.f_code.co_name) == self.window:
      self._open = frame
    carries = any(self.follow.carries(a) for a in _arguments(frame))
    self.calls.append(Call(module, frame.f_code.co_name, carries, self._open is not None))

  def __enter__(self) -> Recorder:
    sys.setprofile(self._profile)
    return self

  def __exit__(self, *exc: object) -> None:
    sys.setprofile(None)


def figures(modules: Sequence[str]) -> dict[str, Any]:
  """Visits, hops, returns and entries of a sequence of calls' modules."""
  visits = [m for i, m in enumerate(modules) if i == 0 or modules[i - 1] != m]
  entries = Counter(visits)
  top = entries.most_common(1)[0] if entries else (None, 0)
  return {
      'calls': len(modules), 'hops': max(len(visits) - 1, 0), 'modules': len(entries),
      'returns': len(visits) - len(entries), 'most_entered': top[0], 'most_entered_count': top[1],
      'entries': dict(entries.most_common()), 'visits': visits,
  }


def views(calls: Sequence[Call]) -> dict[str, dict[str, Any]]:
  return {
      'all': figures([c.module for c in calls]),
      'no leaf utilities': figures([c.module for c in calls if c.module not in LEAF_UTILITIES]),
      'data-flow': figures([c.module for c in calls if c.carries]),
  }


def measure(call: Callable[[], object], follow: str, cold: bool,
            window: tuple[str, str] | None = None) -> list[Call]:
  if not cold:
    call()  # One-time work (imports, caches, jit) done here, outside the measurement.
  with Recorder(Follow(follow), window) as recorder:
    call()
  return recorder.calls


def restore_scenario() -> tuple[Callable[[], object], str]:
  import jax
  import jax.numpy as jnp

  import orbax_tunix

  path, base = os.fspath(DATA / 'lora_qwix'), os.fspath(DATA / 'lora_base')
  replicated = jax.sharding.NamedSharding(jax.make_mesh((jax.device_count(),), ('data',)),
                                          jax.sharding.PartitionSpec())
  meta = orbax_tunix.TunixPyTreeHandler().metadata(
      orbax_tunix.detect(base).step_dir / 'model_params').tree
  target = jax.tree.map(
      lambda m: jax.ShapeDtypeStruct(m.shape, jnp.bfloat16, sharding=replicated), meta)

  def call() -> object:
    merged = orbax_tunix.restore_merged_lora(path, target, lora_alpha=4.0, base=base)
    return jax.block_until_ready(merged)

  return call, path


def export_scenario(work: str, plan_only: bool) -> tuple[Callable[[], object], str]:
  import orbax_tunix
  from orbax_tunix.tools import export

  src = os.fspath(DATA / 'hf_qwen3')
  runs = iter(range(1_000_000))

  def call() -> object:
    out = os.path.join(work, f'qwen3-{next(runs)}')  # A fresh folder each time: no --force.
    if plan_only:
      return export.plan_export(src, out, model='qwen3')
    return orbax_tunix.export_to_hf(src, out, model='qwen3')

  return call, src


def compact(visits: Sequence[str], longest: int = 10) -> list[str]:
  """The visits for reading: a block of up to `longest` visits repeated back to back written
  once with its count, `(a > b) x3` for a > b > a > b > a > b (display only)."""
  out, i = [], 0
  while i < len(visits):
    period, reps = 1, 1
    for p in range(1, longest + 1):
      n = 1
      while visits[i + n * p:i + (n + 1) * p] == visits[i:i + p] and i + (n + 1) * p <= len(visits):
        n += 1
      if n > 1 and p * n > period * reps:  # The longest stretch covered; ties: the shorter block.
        period, reps = p, n
    block = ' > '.join(visits[i:i + period])
    out.append(block if reps == 1 else f'({block}) x{reps}' if period > 1 else f'{block} x{reps}')
    i += period * reps
  return out


def report(name: str, found: dict[str, dict[str, Any]], visits: bool) -> None:
  """A summary line per view; with `visits`, the modules entered more than once and the
  visits (the leaf-utility view's visits left out: the unfiltered list less a few names)."""
  for view, f in found.items():
    print(f"{name} [{view}]: {f['hops']} hops, {f['modules']} modules, {f['returns']} returns;"
          f" most entered {f['most_entered']} x{f['most_entered_count']}; {f['calls']} calls")
    if visits:
      many = ', '.join(f'{m} {n}' for m, n in f['entries'].items() if n > 1) or '-'
      print(textwrap.fill(f'entered more than once: {many}', 100, initial_indent='  ',
                          subsequent_indent='    '))
      if view != 'no leaf utilities':
        print(textwrap.fill('visits: ' + ' > '.join(compact(f['visits'])), 100,
                            initial_indent='  ', subsequent_indent='    ',
                            break_on_hyphens=False))


def main(argv: Sequence[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--json', type=Path, help='write every figure to this file')
  parser.add_argument('--cold', action='store_true', help='measure the first call')
  parser.add_argument('--skip-full-export', action='store_true',
                      help='leave out the full export (the reference figure)')
  args = parser.parse_args(argv)
  results: dict[str, dict[str, dict[str, Any]]] = {}

  call, follow = restore_scenario()
  results['restore_merged_lora(path)'] = views(measure(call, follow, args.cold))
  report('restore_merged_lora(path)', results['restore_merged_lora(path)'], True)

  with tempfile.TemporaryDirectory(prefix='hops-') as work:
    call, follow = export_scenario(work, plan_only=True)
    calls = measure(call, follow, args.cold, window=('layouts/huggingface', 'lay_out'))
    results['plan_export(src)'] = views(calls)
    results['lay_out(request)'] = views([c for c in calls if c.window])
    for name in ('plan_export(src)', 'lay_out(request)'):
      print()
      report(name, results[name], True)
    if not args.skip_full_export:
      call, follow = export_scenario(work, plan_only=False)
      results['export_to_hf(src)'] = views(measure(call, follow, args.cold))
      print()
      report('export_to_hf(src) (reference)', results['export_to_hf(src)'], False)

  if args.json:
    args.json.write_text(json.dumps(results, indent=1) + '\n')
    print(f'\nwrote {args.json}')


if __name__ == '__main__':
  main()

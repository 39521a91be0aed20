"""Convert: a checkpoint rewritten as an ordinary Orbax step, streamed and atomic.

What is written (DST is a step directory) is a step layout's (`layouts/`:
`canonical`, the canonical view; `maxtext`, the step MaxText 0.2.5 itself
writes), through the one pipeline into the step destination (`layouts/step.py`: what the
step records) as items plain Orbax (v0 and v1) restores without this package,
committed as Orbax commits (`commit.Staging`: a failure or interrupt removes
what was written; an existing DST is replaced, with `force`, only once the new
one is complete).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Unpack

import numpy as np
from etils import epath

from orbax_tunix import errors, layouts
from orbax_tunix.mapping import merge_options
from orbax_tunix.reading import memory, reader
from orbax_tunix.tools import pipeline

# The layout `plan_convert` writes unless told another (`layouts.names()`).
DEFAULT_LAYOUT = layouts.canonical.LAYOUT.name

# A conversion's plan and result are the pipeline's.
ConvertPlan = pipeline.Plan
ConvertResult = pipeline.Result


def plan_convert(
    src: epath.PathLike,
    dst: epath.PathLike,
    *,
    step: int | None = None,
    layout: str = DEFAULT_LAYOUT,
    params_only: bool = False,
    dtype: np.dtype | None = None,
    memory_budget: int | float | str = memory.DEFAULT_MEMORY_BUDGET,
    force: bool = False,
    items: Iterable[str] | None = None,
    scan_layers: bool | None = None,
    param_scan_axis: int | None = None,
    **merge: Unpack[merge_options.MergeKeywords],
) -> ConvertPlan:
  """Plans a conversion from metadata only; nothing is written.

  Args:
    src: the source: a root (latest committed step, or `step`), a step or an
      item directory.
    dst: the step directory to create.
    step: the source step (see `reader.resolve`).
    layout: a registered layout's name (`layouts.names()`: canonical, maxtext).
    params_only: write the weights only.
    dtype: cast floating leaves to this dtype.
    memory_budget: bytes the streaming may hold at once (an int, or a size such as
      '512M' or '4GB': `sizes.parse_size`).
    force: replace an existing DST (only if it is a checkpoint step).
    items: the source items to convert (default: every item the step records;
      a step holding items that are neither PyTrees nor JSON needs them named).
    scan_layers: the `maxtext` layout's form of the decoder's layers
      (True: scanned, stacked along `param_scan_axis`; False: one array per
      layer; None: as stored).
    param_scan_axis: MaxText's layer axis of scanned weights, of the side
      that is scanned: the written layers' when `scan_layers=True`, else the
      stored ones' (None: the stored step's own, recorded or told by its
      shapes; 1, MaxText's default, for layers stacked anew).
    **merge: the LoRA merge's options (`merge_options.MergeKeywords`): `merge_lora`
      writes the weights with the adapters merged (weights only, as `params_only`); the
      others as `orbax_tunix.restore_merged_lora` takes them.

  Returns:
    A `ConvertPlan`.

  Raises:
    InvalidOptionError: a `memory_budget` that is not a size >= 1; `scan_layers` or
      `param_scan_axis` for a layout that does not take them, or
      `param_scan_axis` without `scan_layers`.
    InvalidDestinationError: DST overlaps the source's run (symlinks
      resolved; see `places.overlap`) or is named like an unfinished step.
    TypeError: a keyword it does not take.
    LoraError: a merge's option without `merge_lora`, or a scaling that is not a finite
      number (before anything is read).
    DestinationExistsError: DST exists and not `force`.
    TunixCheckpointError subclasses: the source is not readable, or cannot be
      laid out as asked.
  """
  merge_options.check_keywords('plan_convert', merge, merge_options.OPTIONS.names())
  steps = [n for d in layouts.destinations('convert') for n in layouts.named(d)]
  if layout not in steps:
    folder = (f'; {layout} is a Hugging Face folder: export it (`export_to_hf`,'
              f' orbax-tunix export --model {layout})' if layout in layouts.names() else '')
    raise errors.UnsupportedLayoutError(
        f'`layout` {layout!r}: expected one of {", ".join(steps)}{folder}.')
  return pipeline.plan(
      src, dst, layout=layout, step=step, params_only=params_only, dtype=dtype,
      memory_budget=memory_budget, force=force, items=items, scan_layers=scan_layers,
      param_scan_axis=param_scan_axis, **merge)


def run_convert(plan: ConvertPlan, progress: reader.Progress | None = None) -> ConvertResult:
  """Executes a plan: streams every item into a new step, then commits it as Orbax does
  (`pipeline.run`).

  Raises:
    As `pipeline.run`: what was written is removed on any failure (and on
    KeyboardInterrupt), and an existing DST is untouched.
  """
  return pipeline.run(plan, progress)

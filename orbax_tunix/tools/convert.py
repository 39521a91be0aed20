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

import numpy as np
from etils import epath

from orbax_tunix import errors, layouts
from orbax_tunix.mapping import merge as merge_lib
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
    merge_lora: bool = False,
    lora_alpha: float | None = None,
    lora_scale: float | None = None,
    base: epath.PathLike | None = None,
    base_qtype: str | None = None,
    base_tile_size: int | None = None,
    base_calibration: str | None = None,
    scan_layers: bool | None = None,
    param_scan_axis: int | None = None,
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
    merge_lora: write the weights with the LoRA adapters merged (weights
      only, as `params_only`); see `orbax_tunix.restore_merged_lora`.
    lora_alpha, lora_scale, base: the merge's `alpha`, `scale` and `base`.
    base_qtype, base_tile_size, base_calibration: how a QLoRA run quantized
      `base` (an adapters-only save; see `restore_merged_lora`).
    scan_layers: the `maxtext` layout's form of the decoder's layers
      (True: scanned, stacked along `param_scan_axis`; False: one array per
      layer; None: as stored).
    param_scan_axis: MaxText's layer axis of scanned weights, of the side
      that is scanned: the written layers' when `scan_layers=True`, else the
      stored ones' (None: the stored step's own, recorded or told by its
      shapes; 1, MaxText's default, for layers stacked anew).

  Returns:
    A `ConvertPlan`.

  Raises:
    InvalidOptionError: a `memory_budget` that is not a size >= 1; `scan_layers` or
      `param_scan_axis` for a layout that does not take them, or
      `param_scan_axis` without `scan_layers`.
    InvalidDestinationError: DST overlaps the source's run (symlinks
      resolved; see `places.overlap`) or is named like an unfinished step.
    LoraError: `lora_alpha`, `lora_scale` or `base` without `merge_lora`,
      or a scaling that is not a finite number (before anything is read).
    DestinationExistsError: DST exists and not `force`.
    TunixCheckpointError subclasses: the source is not readable, or cannot be
      laid out as asked.
  """
  steps = [n for d in layouts.destinations('convert') for n in layouts.named(d)]
  if layout not in steps:
    folder = (f'; {layout} is a Hugging Face folder: export it (`export_to_hf`,'
              f' orbax-tunix export --model {layout})' if layout in layouts.names() else '')
    raise errors.UnsupportedLayoutError(
        f'`layout` {layout!r}: expected one of {", ".join(steps)}{folder}.')
  return pipeline.plan(
      src, dst, layout=layout, step=step, params_only=params_only, dtype=dtype,
      memory_budget=memory_budget, force=force, items=items,
      merge_options=merge_lib.MergeOptions.given(
          merge_lora, lora_alpha, lora_scale, base, base_qtype, base_tile_size,
          base_calibration),
      scan_layers=scan_layers, param_scan_axis=param_scan_axis,
  )


def run_convert(plan: ConvertPlan, progress: reader.Progress | None = None) -> ConvertResult:
  """Executes a plan: streams every item into a new step, then commits it as Orbax does
  (`pipeline.run`).

  Raises:
    As `pipeline.run`: what was written is removed on any failure (and on
    KeyboardInterrupt), and an existing DST is untouched.
  """
  return pipeline.run(plan, progress)

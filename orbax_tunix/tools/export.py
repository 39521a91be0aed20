"""Export: a Tunix run's (or a MaxText step's) weights as a Hugging Face safetensors folder.

This is the one pipeline (`pipeline.py`) with a family's layout
(`layouts/huggingface.py`, one per family of `mapping/huggingface.py`; `--peft`:
`layouts/peft.py`): the family's tensor names and layouts, in files as `transformers`
shards them, committed as `convert` commits a step (`commit.Staging`: a failure leaves
nothing half-written). `hf_config` copies the base model's config and tokenizer files
after checking the config against the weights.
"""

from __future__ import annotations

import os
from typing import Any, Unpack

from etils import epath

from orbax_tunix import layouts
from orbax_tunix.layouts.folder import DEFAULT_MAX_SHARD_SIZE, FOLDER
from orbax_tunix.layouts.peft import ADAPTER
from orbax_tunix.mapping import huggingface, merge_options
from orbax_tunix.reading import memory, reader
from orbax_tunix.tools import pipeline

# An export's plan and result are the pipeline's.
ExportPlan = pipeline.Plan
ExportResult = pipeline.Result


def plan_to(
    destination: layouts.Destination, src: epath.PathLike, out_dir: epath.PathLike, *,
    model: str, **kwargs: Any,
) -> ExportPlan:
  """Plans a family's output into one kind of destination (`layouts.destinations('export')`:
  a Hugging Face folder, a PEFT adapter folder, ...) from metadata only: `pipeline.plan` with
  the family's layout of it (`layouts.find`).

  Args:
    destination: the kind of destination.
    src, out_dir: the source and the folder to create.
    model: the Hugging Face family, by name or alias (`huggingface.choices()`).
    **kwargs: `pipeline.plan`'s (`step`, `dtype`, `memory_budget`, `force`), the layout's
      options and the merge's (`merge_options.MergeKeywords`).

  Raises:
    UnsupportedLayoutError: an unknown family, or one the destination has no layout of;
      and as `pipeline.plan`.
  """
  family = huggingface.get(model)
  return pipeline.plan(src, out_dir, layout=layouts.find(destination, family.name).name,
                       **kwargs)


def plan_export(
    src: epath.PathLike,
    out_dir: epath.PathLike,
    *,
    model: str,
    step: int | None = None,
    dtype: Any = None,
    max_shard_size: int | float | str = DEFAULT_MAX_SHARD_SIZE,
    hf_config: epath.PathLike | None = None,
    memory_budget: int | float | str = memory.DEFAULT_MEMORY_BUDGET,
    force: bool = False,
    param_scan_axis: int | None = None,
    base_only: bool = False,
    config_as_trained: bool = False,
    **merge: Unpack[merge_options.MergeKeywords],
) -> ExportPlan:
  """Plans an export from metadata only; nothing is read or written.

  Args:
    src: the Tunix run (a root: its latest committed step, or `step`; a step;
      a model item).
    out_dir: the folder to create.
    model: the Hugging Face family, by name or alias (`huggingface.choices()`, e.g. qwen3;
      `orbax-tunix export --help` lists them), for Tunix's own model classes or MaxText's
      models (a Tunix run of one, or MaxText's own step).
    step: the step under a root.
    dtype: cast floating weights to this dtype (bfloat16, float16, float32);
      None: as stored.
    max_shard_size: bytes per file: an int, or a size as `transformers` writes it
      ('5GB' is 5*10**9 bytes, '2GiB' 2*2**30; `sizes.parse_size`).
    hf_config: the base model's Hugging Face folder: its config.json (checked
      against the weights), generation_config.json and tokenizer files are
      copied; its weights never.
    memory_budget: bytes the streaming may hold at once (a size, as above).
    force: replace an existing export folder at `out_dir`.
    param_scan_axis: a scanned MaxText model's layer axis (MaxText's
      `param_scan_axis`); None: the one the step records (a converted step),
      else the one its shapes tell (1, MaxText's default, where several do).
      Checked against the stored weights; refused for weights that hold no
      stacked layers. The trainer (`mapping.trainers`) and layer form come from the weights'
      names.
    base_only: a full LoRA save's base weights alone (the adapters left out,
      not merged): the model a PEFT adapter of the run applies to, where the
      base has no Hugging Face folder of its own.
    config_as_trained: write into the config.json `hf_config` gives the values
      google-tunix trained with where its model class ignores the base
      config's (the family's `as_trained` facts, e.g. `rope_theta` for qwen3);
      without it such a difference is a note. Needs `hf_config`.
    **merge: the LoRA merge's options (`merge_options.MergeKeywords`): `merge_lora`
      exports the adapters merged into the weights (no adapter tensors; an adapters-only
      save also needs `base`); the others as `orbax_tunix.restore_merged_lora` takes them.

  Returns:
    An `ExportPlan`.

  Raises:
    UnsupportedLayoutError: an unknown family; weights that do not fit it; a
      config.json that disagrees with them.
    TypeError: a keyword it does not take.
    LoraOnlyCheckpointError: an adapters-only save without `merge_lora`.
    InvalidDestinationError: `out_dir` overlaps a source's run, or is (or
      holds) the `hf_config` folder; or cannot be reached.
    LoraError, DestinationExistsError, TunixCheckpointError subclasses: see
      their docstrings.
  """
  merge_options.check_keywords('plan_export', merge, merge_options.OPTIONS.names())
  return plan_to(
      FOLDER, src, out_dir, model=model, step=step, dtype=dtype, memory_budget=memory_budget,
      force=force, **merge, max_shard_size=max_shard_size, hf_config=hf_config,
      param_scan_axis=param_scan_axis, base_only=base_only, config_as_trained=config_as_trained,
  )


def run_export(plan: ExportPlan, progress: reader.Progress | None = None) -> ExportResult:
  """Executes a plan: streams every tensor into its file, then commits the folder
  (`pipeline.run`).

  Raises:
    As `pipeline.run`: what was written is removed on any failure (and on
    KeyboardInterrupt), and an existing folder is untouched.
  """
  return pipeline.run(plan, progress)


def export_to_hf(src: epath.PathLike, out_dir: epath.PathLike, **kwargs: Any) -> ExportResult:
  """Exports a Tunix run's weights as a Hugging Face safetensors folder.

  Example::

    orbax_tunix.export_to_hf('/ckpts/run', '/models/qwen3-sft', model='qwen3',
                             dtype='bfloat16', hf_config='/models/Qwen3-0.6B')

  Args:
    src, out_dir: as `plan_export`.
    **kwargs: `plan_export`'s keyword arguments (`model` is required).

  Returns:
    An `ExportResult` (the files written, their bytes).

  Raises:
    As `plan_export` and `run_export`; every check is made before any read.
  """
  return run_export(plan_export(src, out_dir, **kwargs))


def describe(plan: ExportPlan) -> dict[str, Any]:
  """The plan for people and `--json`: files, tensors per file, bytes."""
  return {
      'source': os.fspath(plan.source.step_dir),
      'out_dir': os.fspath(plan.dst),
      'model': plan.summary['model'],
      'architecture': plan.architecture,
      'files': {f.name: len(f.tensors) for f in plan.files},
      'total_size': sum(f.nbytes for f in plan.files),
      'config': plan.summary.get('config'),
      **({'adapter': plan.summary['adapter']} if 'adapter' in plan.summary else {}),
      'notes': list(plan.notes),
  }


def plan_peft_export(
    src: epath.PathLike,
    out_dir: epath.PathLike,
    *,
    model: str,
    lora_alpha: float | None = None,
    lora_scale: float | None = None,
    base_model: str | None = None,
    step: int | None = None,
    dtype: Any = None,
    memory_budget: int | float | str = memory.DEFAULT_MEMORY_BUDGET,
    force: bool = False,
    param_scan_axis: int | None = None,
    **old: Any,
) -> ExportPlan:
  """Plans a PEFT adapter export from metadata only; nothing is read or written.

  Args:
    src: the LoRA run (a root, a step, a model item), saved with or without its
      base weights.
    out_dir: the folder to create: `adapter_config.json` and
      `adapter_model.safetensors`.
    model: the Hugging Face family (as `plan_export`).
    lora_alpha: qwix's LoRA alpha of the run (PEFT's `lora_alpha`; the scale is
      alpha / rank); or `lora_scale`, the scale itself (`lora_alpha` is then
      scale * r). The merge's options (`merge_options.SCALING`).
    base_model: `base_model_name_or_path` of the config (a Hub name or a
      folder); None: null.
    step, dtype, memory_budget, force, param_scan_axis: as `plan_export`.
    **old: `alpha` and `scale`, the deprecated names of `lora_alpha` and `lora_scale`.

  Returns:
    An `ExportPlan`.

  Raises:
    TypeError: a keyword it does not take.
    LoraError: no adapters; no alpha or scale for qwix's adapters; both; one for
      flax's alone (they have none); adapters a PEFT adapter cannot express (every one
      named: export them merged instead).
    UnsupportedLayoutError, InvalidDestinationError, DestinationExistsError,
    TunixCheckpointError subclasses: as `plan_export`.
  """
  scaling = merge_options.renamed(
      'plan_peft_export', {**old, **{o.name: v for o, v in zip(
          merge_options.SCALING, (lora_alpha, lora_scale), strict=True) if v is not None}},
      _OLD_SCALING)
  merge_options.check_keywords('plan_peft_export', scaling,
                               [o.name for o in merge_options.SCALING])
  return plan_to(
      ADAPTER, src, out_dir, model=model, step=step, dtype=dtype, memory_budget=memory_budget,
      force=force, **scaling, base_model=base_model, param_scan_axis=param_scan_axis,
  )


# The scaling's keywords before they took their options' names (`merge_options.SCALING`).
_OLD_SCALING = {'alpha': merge_options.LORA_ALPHA, 'scale': merge_options.LORA_SCALE}


def export_peft_adapter(
    path: epath.PathLike, out_dir: epath.PathLike, *, model: str,
    lora_alpha: float | None = None, lora_scale: float | None = None,
    base_model: str | None = None, step: int | None = None, dtype: Any = None, **kwargs: Any,
) -> ExportResult:
  """Exports a LoRA run's adapters as a PEFT adapter folder (`adapter_config.json`,
  `adapter_model.safetensors`), reading the adapter arrays only.

  Example::

    orbax_tunix.export_peft_adapter('/ckpts/lora_run', '/adapters/run', model='qwen3',
                                    lora_alpha=16.0, base_model='Qwen/Qwen3-0.6B')

  Args:
    path, out_dir, model, lora_alpha, lora_scale, base_model, step, dtype: see
      `plan_peft_export`.
    **kwargs: `plan_peft_export`'s others (`memory_budget`, `force`, `param_scan_axis`;
      `alpha` and `scale`, deprecated).

  Returns:
    An `ExportResult`.

  Raises:
    As `plan_peft_export` and `run_export`; every check is made before any read, and a
    failure leaves nothing at `out_dir`.
  """
  return run_export(plan_peft_export(
      path, out_dir, model=model, lora_alpha=lora_alpha, lora_scale=lora_scale,
      base_model=base_model, step=step, dtype=dtype, **kwargs))

"""Restoring LoRA-merged weights, `W + scale * (a ⊗ b)`, straight into a target.

Everything is decided from metadata first (`plan_merge`, then the target
check in `read_merged`): which weights are adapted, where each base weight
comes from (the LoRA save itself, or another checkpoint), how each product is
arranged into its weight, the scale. Then each checkpoint is read once: the
weights into the target's shardings and dtypes, the (small) adapters to the
host in float32; and each adapted weight is merged on its devices, in float32,
in the target's sharding, one weight at a time, into the buffer it was read
into.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from typing import Any, Unpack

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from orbax_tunix import conventions, errors
from orbax_tunix.keypaths import Path, flatten, fmt
from orbax_tunix.mapping import device, lora, merge_options, transforms, warmup
from orbax_tunix.mapping.merge_options import (
    BASE,
    BASE_CALIBRATION,
    BASE_QTYPE,
    BASE_TILE_SIZE,
    RECIPE,
    MergeOptions,
    MergeSettings,
)
from orbax_tunix.mapping.outputs import Input, Output, copied
from orbax_tunix.mapping.transforms import Transform
from orbax_tunix.reading import quantized, reader
from orbax_tunix.store import fileio

PyTree = Any

# The scaling's keywords before they took their options' names (`merge_options.SCALING`).
_OLD_SCALING = {'alpha': merge_options.LORA_ALPHA, 'scale': merge_options.LORA_SCALE}


@dataclasses.dataclass(frozen=True)
class Merge:
  """One adapted weight: its base, its adapters, and how they combine.

  Attributes:
    requantize: (recipe, the weight's contracting axes): the base is a float
      base that the run quantized so before training (an adapters-only QLoRA
      save); it is quantized and dequantized as qwix did before the merge.
      None: the base as read (a quantized one is dequantized by the read).
  """

  adapter: lora.Adapter
  base: Input
  a: reader.LeafInfo
  b: reader.LeafInfo
  scale: float
  contraction: lora.Contraction
  requantize: tuple[quantized.Recipe, tuple[int, ...]] | None = None


@dataclasses.dataclass(frozen=True)
class MergePlan:
  """The plain model's weights, as a merge restores them.

  Attributes:
    lora: the checkpoint holding the adapters.
    base: the checkpoint holding the base weights (`lora` for a full save).
    weights: plain-model path -> where the weight is read (adapted ones:
      their base).
    merges: plain-model path -> its `Merge`, for the adapted weights.
    notes: what a person should know of the merge (a quantized base).
  """

  lora: reader.Source
  base: reader.Source
  weights: Mapping[Path, Input]
  merges: Mapping[Path, Merge]
  notes: tuple[str, ...] = ()

  def shapes(self) -> dict[Path, tuple[tuple[int, ...], np.dtype]]:
    """The merged model's weights: path -> (shape, dtype), as stored in the base."""
    return {p: (s.leaf.shape, s.leaf.dtype) for p, s in self.weights.items()}

  def describe(self) -> str:
    """The adapted weights, one per line (rank, scale, arrangement)."""
    lines = [
        f'{len(self.merges)} of {len(self.weights)} weights adapted; adapters from'
        f' {self.lora.step_dir}, base weights from {self.base.step_dir}'
    ]
    for path, m in sorted(self.merges.items()):
      how = 'reshape' if m.contraction.reshape else (
          'transpose' if m.contraction.permutation != tuple(sorted(m.contraction.permutation))
          else 'direct')
      if m.contraction.stacked:
        how += f' per layer (stacked on axes {m.contraction.stacked})'
      stored = m.base.leaf.quantized
      if stored is not None:
        how += f'; base stored quantized ({stored.describe()}), dequantized'
      elif m.requantize is not None:
        how += f'; base re-quantized with the recipe given ({m.requantize[0].describe()})'
      lines.append(f'  {fmt(path)}: {m.adapter.style}, rank {m.adapter.rank},'
                   f' scale {m.scale:g}, {how}')
    lines += [f'note: {n}' for n in self.notes]
    return '\n'.join(lines)


def plain_weights(weights: Mapping[Path, reader.LeafInfo], adapters: Mapping[Path, lora.Adapter]
           ) -> dict[Path, reader.LeafInfo]:
  """A LoRA model's weights under the plain model's paths, adapters left out.

  An `nnx.LoRA(base_module=...)` holds its layer one level down; the plain
  model holds it in its place.
  """
  lifted = {
      a.saved_base[:-1]: a.weight[:-1] for a in adapters.values() if a.saved_base != a.weight
  }
  out = {}
  for path, leaf in weights.items():
    if lora.is_adapter(path):
      continue
    for wrapped, module in lifted.items():
      if path[: len(wrapped)] == wrapped:
        path = module + path[len(wrapped):]
        break
    out[path] = leaf
  return out


# Where a step's record (`conventions.PROVENANCE_KEY`) lists the LoRA merges its weights hold:
# every one, oldest first (`MERGES`), and the one that wrote the step (`MERGE`; older records
# have only this).
MERGES = 'lora_merges'
MERGE = 'lora_merge'


def recorded_merges(custom_metadata: Mapping[str, Any]) -> list[Mapping[str, Any]]:
  """The LoRA merges a step's custom metadata records its weights hold (none: [])."""
  record = custom_metadata.get(conventions.PROVENANCE_KEY)
  if not isinstance(record, Mapping):
    return []
  merges = record.get(MERGES)
  if isinstance(merges, list):
    return [m for m in merges if isinstance(m, Mapping)]
  one = record.get(MERGE)
  return [one] if isinstance(one, Mapping) else []


def record(plan: MergePlan) -> dict[str, Any]:
  """What a step written from a merge records of it: where the adapters and the base
  came from, and each adapted weight's style, rank and scale."""
  return {
      'adapters': os.fspath(plan.lora.step_dir),
      'adapters_step': plan.lora.detection.step,
      'base': os.fspath(plan.base.step_dir),
      'adapted': {fmt(p): {'style': m.adapter.style, 'rank': m.adapter.rank, 'scale': m.scale}
                  for p, m in sorted(plan.merges.items())},
  }


def _refuse_merged_twice(lora_ckpt: reader.Source,
                         base_ckpt: reader.Source) -> None:
  """A base whose metadata records these adapters merged into it already: the same step,
  however either path spells it (links, `..`; a bucket's URL normalized: `fileio.same_place`).

  Raises:
    LoraError: they would be added a second time.
  """
  adapters = os.fspath(lora_ckpt.step_dir)
  for done in recorded_merges(base_ckpt.detection.source.custom_metadata):
    recorded = done.get('adapters')
    if isinstance(recorded, str) and fileio.same_place(recorded, adapters):
      named = adapters if recorded == adapters else f'{recorded} (here {adapters})'
      raise errors.LoraError(
          f'{base_ckpt.step_dir}: expected the base weights the LoRA run started from, found'
          f' weights its metadata records the adapters of {named} merged into already (from'
          f' the base {done.get("base")}): merging them again would add them twice. Pass as'
          ' `base` the checkpoint the run started from, or use this one as it is.'
      )


def checkpoints_read(
    source: reader.Source, merged: MergePlan | None
) -> list[reader.Source]:
  """Every checkpoint a plan reads: the source, and a merge's base."""
  return [source] if merged is None else [source, merged.base]


def _quantized_notes(lora_ckpt: reader.Source, base_ckpt: reader.Source,
                     merges: Mapping[Path, Merge], options: MergeOptions, adapters_only: bool
                     ) -> list[str]:
  """What a merge says of its bases, weight by weight: saved quantized (and on whose word they
  are the run's: the save's own, or a base named for adapters that cannot tell), re-quantized
  with a recipe given (which the adapters cannot confirm), or as stored where the run may have
  quantized them."""
  stored: dict[str, list[Path]] = {}
  for path, m in merges.items():
    if m.base.leaf.quantized is not None:
      stored.setdefault(m.base.leaf.quantized.describe(), []).append(path)
  requantized = sorted(p for p, m in merges.items() if m.requantize is not None)
  floats = sorted(p for p, m in merges.items()
                  if m.base.leaf.quantized is None and m.requantize is None)
  notes = []
  if lora_ckpt is base_ckpt:  # A full save: its own bases, as the run trained on them.
    notes += [f'{len(paths)} adapted weights have their base saved quantized ({how}, e.g.'
              f' {fmt(paths[0])}): merged onto it dequantized, the weights the run trained with'
              for how, paths in sorted(stored.items())]
    if stored and floats:
      notes.append(f'the other {len(floats)} adapted weights have their base saved in float'
                   f' (adapted by plain LoRA, e.g. {fmt(floats[0])}): merged onto it as stored')
    return notes
  notes += [f'the base {base_ckpt.step_dir} holds {len(paths)} adapted weights saved quantized'
            f' ({how}, e.g. {fmt(paths[0])}): merged onto them dequantized. {lora_ckpt.step_dir}'
            ' holds adapters only, which cannot tell the base they were trained on: these are'
            ' the weights the run trained with only if that base is the run\'s own save (not'
            ' another run\'s)' for how, paths in sorted(stored.items())]
  recipe = options.base_quantized
  if requantized:
    notes.append(
        f'{len(requantized)} adapted weights (e.g. {fmt(requantized[0])}) have their base from'
        f' {base_ckpt.step_dir} re-quantized with the recipe given ({recipe.describe()}:'
        f' {", ".join(o.named() for o in RECIPE)}) before the merge. {lora_ckpt.step_dir}'
        ' holds adapters only, which record no recipe and cannot confirm it: with the run\'s'
        ' own recipe and the float base it started from these are the weights it trained with;'
        ' another recipe (int8 for an int4 run) or base gives another model, with no error')
    notes.append(
        f're-quantized on {jax.devices()[0].device_kind} with jax {jax.__version__}: the run\'s'
        ' base bit for bit where the run quantized it on this kind of device (a CPU, a TPU)'
        ' with a jax that divides as this one does; on another kind, or jax 0.10 against 0.12,'
        ' a float32 base\'s scales differ in their last bit, and a bfloat16 int8 base is one'
        ' step off in about 1e-5 of the elements (docs/lora.md, QLoRA runs)')
    odd = sorted({(str(merges[p].base.leaf.dtype), str(merges[p].a.dtype)) for p in requantized
                  if merges[p].base.leaf.dtype != merges[p].a.dtype})
    notes += [f'the base is stored in {b} and the adapters in {a}: quantized in {a}, the dtype'
              ' qwix gives the adapters (the scale\'s, which the run quantized in)'
              for b, a in odd]
    if floats:
      notes.append(f'the other {len(floats)} adapted weights (flax\'s adapters, which no qwix'
                   f' run quantized: e.g. {fmt(floats[0])}) are merged onto the base as stored')
  elif (adapters_only and not stored
        and any(merges[p].adapter.style != lora.FLAX for p in floats)):
    notes.append(
        f'{lora_ckpt.step_dir} holds adapters only, which cannot tell whether the run trained'
        ' them on a quantized base (QLoRA): merged onto the base as stored. If the run'
        f' quantized it (qwix\'s weight_qtype), pass {BASE_QTYPE.named()} (and'
        f' {BASE_TILE_SIZE.named()}, {BASE_CALIBRATION.named()} as the run set them) to re-quantize it as the run did.')
  return notes


def _merges(adapters: Mapping[Path, lora.Adapter], lora_weights: Mapping[Path, reader.LeafInfo],
            base_weights: Mapping[Path, reader.LeafInfo], base_ckpt: reader.Source,
            options: MergeOptions
            ) -> tuple[dict[Path, Merge], list[str], list[str], dict[str, list[str]]]:
  """Each adapted weight's merge, from metadata: (merges, the weights the base lacks, the
  adapters that do not reproduce their weight's shape, the weights the recipe given does not
  fit: by the option at fault), one line per problem."""
  missing, bad, merges = [], [], {}
  unfit: dict[str, list[str]] = {}
  recipe = options.base_quantized
  for weight, adapter in sorted(adapters.items()):
    found = base_weights.get(weight)
    a, b = lora_weights[adapter.a], lora_weights[adapter.b]
    if found is None:
      looked = fmt(weight) if adapter.saved_base == weight else (
          f'{fmt(weight)} or {fmt(adapter.saved_base)}')
      missing.append(f'{fmt(weight)} (adapted by {fmt(adapter.a)}): no {looked} in the base;'
                     f' the adapter is {a.stored}')
      continue
    arranged = lora.contraction(found.shape, a.shape, b.shape)
    if arranged is None:
      bad.append(f'{fmt(weight)} {found.shape}: the base holds {found.stored} {found.shape};'
                 f' {a.stored} {a.shape} ⊗ {b.stored} {b.shape}')
      continue
    requantize = None
    if recipe is not None and adapter.style != lora.FLAX:  # flax's: no qwix run quantized.
      if found.quantized is not None:
        unfit.setdefault(BASE_QTYPE.name, []).append(
            f'{fmt(weight)}: {found.quantized.describe()}')
        continue
      axes = lora.contracting_axes(arranged, a.shape)
      try:
        recipe.tiled_axes(found.shape, axes)
      except ValueError as e:
        unfit.setdefault(BASE_TILE_SIZE.name, []).append(f'{fmt(weight)}: {e}')
        continue
      requantize = (recipe, axes)
    scale = lora.scale_of(adapter, options.alpha, options.scale)
    merges[weight] = Merge(adapter, Input(base_ckpt, found), a, b, scale, arranged, requantize)
  return merges, missing, bad, unfit


def _recipe_applies(lora_ckpt: reader.Source, adapters: Mapping[Path, lora.Adapter],
                    lora_weights: Mapping[Path, reader.LeafInfo], options: MergeOptions) -> None:
  """Refuses a QLoRA recipe (`base_qtype`...) where no QLoRA run could have trained the
  adapters: flax's (`nnx.LoRA`: no qwix run), or a save holding its base weights in float (a
  QLoRA run saves them quantized: its own base shows the run did not quantize them).

  Raises:
    LoraError: naming the options given and the adapters or bases that show it.
  """
  recipe = options.base_quantized
  if recipe is None:
    return
  given = BASE_QTYPE.named(recipe.qtype)
  drop = (f'Drop {BASE_QTYPE.named()} (and {BASE_TILE_SIZE.named()},'
          f' {BASE_CALIBRATION.named()})')
  if all(a.style == lora.FLAX for a in adapters.values()):
    first = next(iter(adapters.values()))
    raise errors.LoraError(
        f'{given} given, but these adapters are flax\'s (nnx.LoRA or nnx.LoRALinear: e.g.'
        f' {fmt(first.a)}), which no QLoRA run trained: the recipe says how qwix\'s'
        ' LoraProvider(weight_qtype=...) quantized a base, and flax\'s LoRA quantizes none.'
        f' {drop}: the merge adds a·b to {BASE.named()} as stored.')
  saved = sorted((w, lora_weights[a.saved_base]) for w, a in adapters.items()
                 if a.style != lora.FLAX and a.saved_base in lora_weights)
  if saved:
    weight, leaf = saved[0]
    raise errors.LoraError(
        f'{lora_ckpt.step_dir}: {given} given, but the save holds the base of {len(saved)}'
        f' adapted weights in float (e.g. {fmt(weight)} {leaf.shape} {leaf.dtype}): a QLoRA'
        ' run saves its base quantized, so this run did not quantize it, and no recipe'
        f' re-quantizes it. {drop}: the merge adds a·b to {BASE.named()} as stored'
        f' (or, without {BASE.named()}, to the save\'s own base).')


def _refuse_unfit(where: epath.Path, unfit: Mapping[str, list[str]], options: MergeOptions
                  ) -> None:
  """One message about the recipe's option that does not fit the base (`_merges`).

  Raises:
    LoraError: a base saved quantized already (`base_qtype`), or a tile size that does not
      divide a weight's last contracting axis (`base_tile_size`).
  """
  qtype, tile = BASE_QTYPE.named(), BASE_TILE_SIZE.named()
  if unfit.get(BASE_QTYPE.name):
    found = unfit[BASE_QTYPE.name]
    raise errors.LoraError(
        f'{where}: {qtype} given, but the base holds {len(found)} adapted weights quantized'
        f' already (a QLoRA save):\n{errors.list_paths(found)}\nIts quantization is read from'
        f' it, not re-done: drop {qtype} (and the recipe\'s other options) to merge onto it'
        ' dequantized (the weights the run trained with if this is the run\'s own save), or'
        f' pass as {BASE.named()} the float base the run started from.')
  if unfit.get(BASE_TILE_SIZE.name):
    found = unfit[BASE_TILE_SIZE.name]
    raise errors.LoraError(
        f'{where}: {BASE_TILE_SIZE.named(options.base_quantized.tile_size)} does not fit {len(found)}'
        f' adapted weights:\n{errors.list_paths(found)}\nqwix tiles a weight\'s last'
        ' contracting axis and takes no tile that does not divide it, so the run did not use'
        f' this one. Pass the run\'s tile_size, or leave {tile} out (one scale per channel).')


def plan_merge(
    path: epath.PathLike | reader.Source,
    options: MergeOptions = merge_options.NONE,
    *,
    step: int | None = None,
    base_step: int | None = None,
) -> MergePlan:
  """Plans a merge from metadata only; nothing is read.

  Args:
    path: the LoRA run's checkpoint (a root, step or model item, or the
      checkpoint already opened): a full save (base weights beside the
      adapters) or adapters only.
    options: the merge's `MergeOptions` (qwix's alpha is not stored in checkpoints: `alpha`
      or `scale` must be given for qwix adapters; `base` may be a Tunix save, a
      MaxText `items` step, or any Orbax checkpoint of canonical weights).
    step: the step under `path` (None: the latest committed).
    base_step: the step under `options.base`.

  Returns:
    A `MergePlan`.

  Raises:
    LoraError: no adapters; adapters without their pair or base weight; a
      base whose metadata records these adapters merged into it already;
      ranks or shapes that the contraction cannot reproduce; no alpha; an
      alpha or scale that is not a finite number, or whose scale float32
      cannot hold; an alpha or scale for flax adapters, which have none
      (before anything is read).
    TunixCheckpointError subclasses: a checkpoint is not readable.
  """
  alpha, scale, base = options.alpha, options.scale, options.base
  merge_options.check_scaling(alpha, scale)
  lora_ckpt = (path if isinstance(path, reader.Source)
               else reader.open_source(path, step, weights_only=True))
  lora_weights = {p: leaf for leaf, p in reader.weights(lora_ckpt)}
  adapters = lora.find_adapters({p: leaf.shape for p, leaf in lora_weights.items()})
  if not adapters:
    raise errors.LoraError(
        f'{lora_ckpt.step_dir}: expected LoRA adapters (<w>_lora_a/<w>_lora_b from qwix,'
        ' or lora_a/lora_b from flax), found none among its weights. Restore it'
        ' without merging.'
    )
  lora.check_scaling_applies(adapters, alpha, scale)
  saved_quantized = sorted(p for p in adapters if getattr(lora_weights.get(p), 'quantized', None))
  if saved_quantized and base is not None:
    how = lora_weights[saved_quantized[0]].quantized.describe()
    raise errors.LoraError(
        f'{lora_ckpt.step_dir}: a QLoRA save: it holds the base weights its adapters were'
        f' trained on, quantized ({how}: {len(saved_quantized)} adapted weights, e.g.'
        f' {fmt(saved_quantized[0])}); merging onto the float weights of {BASE.named()}'
        f' would give another model than the one trained. Drop'
        f' {BASE.named()}: the merge then uses the saved base, dequantized.')
  _recipe_applies(lora_ckpt, adapters, lora_weights, options)
  base_ckpt = lora_ckpt if base is None else reader.open_source(base, base_step, weights_only=True)
  _refuse_merged_twice(lora_ckpt, base_ckpt)
  base_weights = plain_weights({p: leaf for leaf, p in reader.weights(base_ckpt)}, adapters)
  merges, missing, bad, unfit = _merges(adapters, lora_weights, base_weights, base_ckpt, options)
  where = base_ckpt.step_dir
  if missing:
    fix = ('Pass `base`: the checkpoint the LoRA run started from (a Tunix save, a MaxText'
           ' items step, or canonical weights).') if base is None else (
               'Pass the base checkpoint the LoRA run started from.')
    raise errors.LoraError(
        f'{where}: expected the base weight of every adapter, found {len(missing)}'
        f' missing:\n{errors.list_paths(missing)}\n{fix}'
    )
  if bad:
    raise errors.LoraError(
        f'{where}: {len(bad)} adapters do not reproduce their weight\'s shape (a\'s'
        f" last axis contracted with b's first):\n{errors.list_paths(bad)}\nThe base"
        ' checkpoint is not the one these adapters were trained on, or the layer'
        ' arranges its weight in a way the shapes alone do not determine.'
    )
  _refuse_unfit(where, unfit, options)
  sources = {p: Input(base_ckpt, leaf) for p, leaf in base_weights.items()}
  notes = _quantized_notes(lora_ckpt, base_ckpt, merges, options,
                           lora.adapters_only(lora_weights))
  return MergePlan(lora_ckpt, base_ckpt, sources, merges, tuple(notes))


def combine(contraction: lora.Contraction, scale: float):
  """`(w, a, b) -> w + scale * (a ⊗ b)` arranged into `w`: float32 math, `w`'s dtype."""

  stacked = contraction.stacked
  front = tuple(range(len(stacked)))

  def merge(w, a, b):
    ops = transforms.xp(w, a, b)  # jax.numpy on the devices, numpy on the host.
    a, b = a.astype(np.float32), b.astype(np.float32)
    # One product per stacked layer (no stacked axes: one product), the layers in front
    # meanwhile.
    a, b = ops.moveaxis(a, stacked, front), ops.moveaxis(b, stacked, front)
    layers = a.shape[:len(stacked)]
    left, right = a.shape[len(stacked):-1], b.shape[len(stacked) + 1:]
    n = math.prod(layers)
    delta = ops.matmul(a.reshape(n, math.prod(left), a.shape[-1]),
                       b.reshape(n, b.shape[len(stacked)], math.prod(right)))
    delta = delta.reshape(n, *left, *right)
    one = tuple(d for i, d in enumerate(contraction.weight) if i not in stacked)
    if contraction.reshape:
      delta = delta.reshape(n, *one)
    elif contraction.permutation != tuple(range(len(one))):
      delta = delta.transpose(0, *(p + 1 for p in contraction.permutation))
    delta = ops.moveaxis(delta.reshape(*layers, *one), front, stacked)
    return (w.astype(np.float32) + np.float32(scale) * delta).astype(w.dtype)

  return merge


# How a merge's transform is named (its name starts so; `writer.check_range` tells a merge
# by it).
TRANSFORM_NAME = 'lora_merge'


def as_transform(merge: Merge) -> Transform:
  """One adapted weight's merge as a `Transform` of (W, a, b): `W` partitioned as the
  merged weight, its (small) adapters read to the host and put whole on every device."""
  fn = combine(merge.contraction, merge.scale)
  name = f'{TRANSFORM_NAME}(rank={merge.adapter.rank}, scale={merge.scale!r}, {merge.contraction}'
  whole: tuple[int, ...] = ()  # Axes of W each device holds whole.
  if merge.requantize is not None:  # The float base as the run quantized it, then merged.
    recipe, axes = merge.requantize
    merged = fn
    fn = lambda w, a, b: merged(quantized.requantize(w, recipe, axes), a, b)  # noqa: E731
    name += f', base re-quantized {recipe} on axes {axes}'
    # A tile's scale is computed within the tile: its axis split in tiles on each device.
    whole = tuple(recipe.tiled_axes(merge.contraction.weight, axes))
  return Transform(
      # The name says all it does (`Transform.computes`: one compiled program per name).
      name + ')',
      shape=lambda shapes: tuple(shapes[0]), apply=lambda xs: fn(*xs), arity=3,
      moves_only=False,
      source_specs=lambda spec, n: (
          tuple(None if i in whole else p for i, p in enumerate(spec)), None, None),
  )


def output(plan: MergePlan, path: Path, dtype: np.dtype | None, prefix: Path = ()) -> Output:
  """One weight of the merged model, made in `dtype`: as stored, or merged (its weight
  read in `dtype`, its adapters in float32)."""
  source = plan.weights[path]
  merge = plan.merges.get(path)
  if merge is None:
    return copied(source, prefix + path, dtype)
  # A base to re-quantize is read in the dtype the run quantized it in: its adapters' (qwix
  # makes them in the quantized weight's scale dtype, the model's).
  base_dtype = dtype if merge.requantize is None else merge.a.dtype
  return Output(
      path=prefix + path,
      inputs=(source, Input(plan.lora, merge.a), Input(plan.lora, merge.b)),
      transform=as_transform(merge), shape=source.leaf.shape, dtype=dtype,
      read_dtypes=(base_dtype, np.dtype(np.float32), np.dtype(np.float32)),
  )


def outputs(plan: MergePlan, prefix: Path, dtype: np.dtype | None) -> list[Output]:
  """The merged model's weights as writer outputs, under `prefix` (floating ones cast
  to `dtype`, None: as stored)."""
  return [output(plan, path, reader.cast_dtype(source.leaf, dtype), prefix)
          for path, source in sorted(plan.weights.items())]


def check_target(plan: MergePlan, targets: Mapping[Path, Any]) -> None:
  """Checks a plain-model target against the plan, before any read.

  Raises:
    TargetMismatchError: target leaves the merged model lacks (adapter leaves
      among them), or with another shape.
  """
  problems = []
  for path, leaf in targets.items():
    source = plan.weights.get(path)
    if source is None:
      why = 'an adapter: the target is the plain model' if lora.is_adapter(path) else 'not in the model'
      problems.append(f'{fmt(path)}: {why}')
    elif tuple(leaf.shape) != tuple(source.leaf.shape):
      problems.append(f'{fmt(path)}: target {tuple(leaf.shape)}, checkpoint {source.leaf.shape}'
                      f' ({source.leaf.stored})')
  if problems:
    raise errors.TargetMismatchError(
        f'{plan.base.step_dir}: the target does not match the merged weights:\n'
        f'{errors.list_paths(problems)}\nPass the plain model\'s abstract weights (no'
        ' LoRA leaves); `plan_merge(...).shapes()` lists what a merge restores.'
    )


def read_merged(plan: MergePlan, targets: Mapping[Path, Any]) -> dict[Path, jax.Array]:
  """Reads the target's weights, merged, each into its target sharding and dtype.

  The merged weights run on the device executor (`mapping.device`): one
  read per checkpoint item, each merge on the weight's devices in float32,
  into the buffer the weight was read into.

  Args:
    plan: from `plan_merge`.
    targets: plain-model path -> abstract leaf (`jax.ShapeDtypeStruct` or
      array; its sharding and dtype are the result's) or `device.Target`.

  Returns:
    path -> `jax.Array`.

  Raises:
    TargetMismatchError: leaves that are not arrays; see `check_target` (before any read).
    CorruptMetadataError: stored data is missing or damaged.
  """
  device.require_arrays(
      targets, f'{plan.base.step_dir}: the target', 'Pass the plain model\'s abstract weights,'
      ' e.g. nnx.state(nnx.eval_shape(...)) (or `ocp.PLACEHOLDER` for leaves not to restore).')
  resolved = {p: t if isinstance(t, device.Target) else device.Target.of(t)
              for p, t in targets.items()}
  check_target(plan, {p: t.abstract for p, t in resolved.items()})
  made = [output(plan, path, np.dtype(t.abstract.dtype)) for path, t in resolved.items()]
  return device.execute(made, resolved)


def restore_merged_lora(
    path: epath.PathLike,
    target: PyTree,
    *,
    step: int | None = None,
    base_step: int | None = None,
    **merge: Unpack[MergeSettings],
) -> PyTree:
  """Restores a LoRA run's weights merged into the base, into a plain-model target.

  Example::

    abstract = nnx.state(nnx.eval_shape(lambda: Model(rngs=nnx.Rngs(0))))  # no LoRA
    params = orbax_tunix.restore_merged_lora(lora_run, abstract_params, lora_alpha=16.0,
                                             base='/ckpts/pretrained')

  Each weight is `W + scale * (a ⊗ b)` where adapted (qwix: scale = alpha /
  rank; flax `nnx.LoRA`: 1), else `W`, in the target's sharding and dtype.
  The merge runs on the devices in float32; `W` is read in the target's dtype
  (so a narrower target rounds `W` once before the merge adds the adapters).
  A QLoRA run's full save merges onto its saved quantized base, dequantized;
  an adapters-only one onto `base` re-quantized as the run did, given its
  recipe (`merge_options.RECIPE`).

  Args:
    path: the LoRA run's checkpoint (root, step or model item).
    target: the plain model's canonical weight tree: `jax.ShapeDtypeStruct`s
      or arrays with shardings (a single local device when they have none);
      any subset of the weights (only that is read); `ocp.PLACEHOLDER` leaves
      are returned as they are.
    step, base_step: see `plan_merge`.
    **merge: the merge's options (`merge_options.MergeSettings`): `lora_alpha` (qwix's
      LoRA alpha of the run) or `lora_scale` (alpha / rank); `base` (the base weights'
      checkpoint, for an adapters-only save); and how a QLoRA run quantized `base` before
      training, for an adapters-only save: qwix's `weight_qtype` (int8, int4, nf4,
      float8_e4m3fn), `tile_size` and `weight_calibration_method` (absmax or minmax), by
      their options' names (`merge_options.RECIPE`). `alpha` and `scale` are the
      deprecated names of `lora_alpha` and `lora_scale`.

  Returns:
    A tree of `target`'s structure holding `jax.Array`s.

  Raises:
    TypeError: a keyword it does not take.
    LoraError, TargetMismatchError: before any array is read (see
      `plan_merge` and `check_target`).
  """
  warmup.start(target)  # The compiler starts while the merge is planned.
  given = merge_options.renamed('restore_merged_lora', dict(merge), _OLD_SCALING)
  merge_options.check_keywords('restore_merged_lora', given, MergeSettings.__annotations__)
  options = MergeOptions.given(given, merging=True)
  plan = plan_merge(path, options, step=step, base_step=base_step)
  pairs, treedef = flatten(target)
  wanted = {p: leaf for p, leaf in pairs if leaf is not ocp.PLACEHOLDER}
  values = read_merged(plan, wanted)
  return jax.tree_util.tree_unflatten(treedef, [values.get(p, leaf) for p, leaf in pairs])

"""The canonical layout: an ordinary Orbax step holding the canonical view.

One item per source PyTree item, each leaf under its canonical path (for
Tunix: `model_params` without the nnx `value` and adapter `base` levels,
`optimizer_state` without the inject_hyperparams shell), JSON items copied.
Weights only: `model_params` holding the weights, no RNG state (merged, for a
LoRA merge).
"""

from __future__ import annotations

from orbax_tunix import conventions, errors
from orbax_tunix.layouts.base import LaidOut, Layout, Request, register, weights
from orbax_tunix.layouts.step import STEP
from orbax_tunix.mapping.outputs import Input, ItemOutput, copied
from orbax_tunix.reading import reader


def weights_item(request: Request, name: str) -> ItemOutput:
  """The weights (merged for a LoRA merge) as item `name`; no RNG state."""
  return ItemOutput(name, tuple(o for _, o in sorted(weights(request).items())))


def rng_note(source: reader.Source) -> list[str]:
  dropped = [leaf for leaf in source.items.get(conventions.MODEL_ITEM, ())
             if conventions.is_rng_state(leaf.path)]
  if not dropped:
    return []
  return [f'left out {len(dropped)} RNG state leaves (paths with {conventions.RNG_KEY!r})']


def lay_out(request: Request) -> LaidOut:
  source = request.source
  if request.merge is not None or request.params_only:
    notes = rng_note(source) if request.merge is None else []
    return LaidOut((weights_item(request, conventions.MODEL_ITEM),), tuple(notes))
  items, notes = [], []
  for name in sorted(source.items):
    leaves = source.items[name]
    if not leaves:
      notes.append(f'skipped item {name!r}: it has no leaves')
      continue
    meta = source.detection.item_meta(name)
    # Written as it was read (no rewrite): the source's containers (lists, None) too.
    same = all(leaf.path == leaf.disk_path for leaf in leaves)
    items.append(ItemOutput(
        name,
        tuple(copied(Input(source, leaf), leaf.path, request.dtype) for leaf in leaves),
        key_types={leaf.path: leaf.key_types for leaf in meta.leaves} if same else None,
        empty=tuple((leaf.path, leaf.key_types, leaf.value_type)
                    for leaf in meta.leaves if leaf.is_empty)
        if same else (),
    ))
  items += [ItemOutput(name, json=(source, name)) for name in source.json_items]
  if not items:
    raise errors.UnsupportedLayoutError(
        f'{source.step_dir}: expected at least one PyTree item to convert,'
        f' found none ({"; ".join(notes) or "the step has no items"}).'
    )
  return LaidOut(tuple(items), tuple(notes))


LAYOUT = register(Layout(
    name='canonical',
    description='an ordinary Orbax step: each item in the canonical view (weights only: model_params)',
    lay_out=lay_out,
    destination=STEP,
    # It re-lays what was saved and claims no model: an adapters-only save converts as it is.
    adapters=True,
))

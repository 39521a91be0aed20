"""The kinds of step this package reads, as data: what each holds, and where.

A Tunix run (Tunix's wrapper levels: the rules apply), MaxText's own step
(one `items` item: the weights under `params/params`, the optimizer under
`opt_state`), and plain Orbax (any other step: weights in the model item).
`classify` picks the first kind whose test a step's maps pass; the readers
(`reader.weights`, inspect's optimizer outline) take the weights and the
optimizer state from where the kind says.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

from orbax_tunix import catalog, conventions
from orbax_tunix.keypaths import Path
from orbax_tunix.view.canonical_map import CanonicalMap


def _maxtext_step(maps: Mapping[str, CanonicalMap]) -> bool:
  items = maps.get(conventions.MAXTEXT_ITEM)
  n = len(conventions.MAXTEXT_PARAMS)
  return items is not None and any(
      p[:n] == conventions.MAXTEXT_PARAMS for p in items.disk_to_canonical)


@dataclasses.dataclass(frozen=True)
class SourceKind:
  """One kind of step.

  Attributes:
    name: how `Detection.kind` (and JSON) names it.
    title: how people read it (`inspect`).
    holds: `item name -> CanonicalMap` of a step -> whether it is of this kind.
    weights: (item, prefix) under which the model weights sit; item None: the
      step's model item (Tunix's `model_params`, a canonical step's, or its
      only item).
    optimizer: (item, prefix) of the optimizer state; item None: the item
      whose role is the optimizer's (`conventions.role`).
  """

  name: str
  title: str
  holds: Callable[[Mapping[str, CanonicalMap]], bool] = dataclasses.field(repr=False)
  weights: tuple[str | None, Path] = (None, ())
  optimizer: tuple[str | None, Path] = (None, ())


# In the order `classify` tries them.
KINDS: catalog.Catalog[SourceKind] = catalog.Catalog('source kind')
TUNIX = KINDS.register(
    SourceKind('tunix', 'Tunix', lambda maps: any(m.rewrites for m in maps.values())))
MAXTEXT = KINDS.register(SourceKind(
    'maxtext', 'MaxText', _maxtext_step,
    weights=(conventions.MAXTEXT_ITEM, conventions.MAXTEXT_PARAMS),
    optimizer=(conventions.MAXTEXT_ITEM, (conventions.MAXTEXT_OPT_STATE,)),
))
ORBAX = KINDS.register(SourceKind('orbax', 'plain Orbax', lambda maps: True))


def classify(maps: Mapping[str, CanonicalMap]) -> SourceKind:
  """The kind of a step, from its items' maps (metadata only)."""
  return next(kind for kind in KINDS.values() if kind.holds(maps))


def get(name: str) -> SourceKind:
  """The kind `Detection.kind` names."""
  return KINDS.get(name)

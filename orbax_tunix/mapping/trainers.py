"""The trainers whose model code names a family's weights, as values (a family's namings are
keyed by them: `hf_naming.Naming.trainer`).

A checkpoint's weights carry the names of the model code that trained them: Tunix's own model
classes (`tunix.models`: `embedder`, `layers`, ...) or MaxText's decoder (`decoder`,
`token_embedder`; a Tunix run of a MaxText model, or MaxText's own step). Which trainer's
names they are is told by their top-level keys (`of`). That is another thing than the kind of
step (`view.source_kinds`: a Tunix run, a MaxText step, plain Orbax), which says where the
weights sit: a Tunix run may hold either trainer's model. A third trainer is one more value in
`TRAINERS`, and its naming in each family it has (`hf_families.py`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection

from orbax_tunix import catalog
from orbax_tunix.keypaths import Path


@dataclasses.dataclass(frozen=True)
class Trainer:
  """A trainer's model code, as far as its weights' names tell it.

  Attributes:
    name: how the namings and the tables of maps (docs/huggingface.md) name it ('tunix', 'maxtext').
    title: how people read weights named by it (`inspect`, notes).
    heading: the first column's heading of its table of maps.
    roots: top-level weight keys only its models have (empty: the trainer taken when no
      other's roots are there; one trainer has none).
    scans: its models may hold their layers stacked (scanned): its weights are told by their
      layer form and count, whichever family they are.
  """

  name: str
  title: str
  heading: str
  roots: frozenset[str] = frozenset()
  scans: bool = False

  def names(self, paths: Collection[Path]) -> bool:
    """Whether weights at `paths` carry this trainer's names (its `roots`)."""
    return any(p and p[0] in self.roots for p in paths)


TRAINERS: catalog.Catalog[Trainer] = catalog.Catalog('trainer')
TUNIX = TRAINERS.register(Trainer('tunix', 'Tunix model (tunix.models)', 'Tunix (canonical)'))
MAXTEXT = TRAINERS.register(Trainer('maxtext', 'MaxText model', 'MaxText (per layer)',
                                    roots=frozenset({'decoder', 'token_embedder'}), scans=True))


def of(paths: Collection[Path]) -> Trainer:
  """The trainer whose names the weights at `paths` carry: the one whose `roots` they have,
  else the one without roots (Tunix's)."""
  return next((t for t in TRAINERS.values() if t.roots and t.names(paths)),
              next(t for t in TRAINERS.values() if not t.roots))


def get(name: str) -> Trainer:
  """The trainer `name` names.

  Raises:
    UnsupportedLayoutError: no such trainer (the message names them).
  """
  return TRAINERS.get(name)

"""MaxText's train state as it saves it, as data, and the rules that make it from a Tunix step.

MaxText keeps one item, `items`, holding a Linen `TrainState`: `params/params/<weights>`
(the Linen `params` collection), `opt_state` (the optax chain's states in chain order,
`None` where a state is empty), `step` and, for NNX models, `nnx_aux` (RNGs and other
non-weight variables). MaxText 0.2.5 (`opt_type=adamw`, its default) trains with
`optax.adamw(schedule)`: `chain(scale_by_adam, add_decayed_weights,
scale_by_learning_rate)`, saved as the list `[{count, mu: {params: <weights>}, nu:
{params: <weights>}}, None, {count}]`; `step` is int32.

The rules name each leaf's sources as `(item, *canonical path)` of the Tunix step:
`params/params/<w>` <- `model_params:<w>` (the decoder's layers in the state's form:
`mapping.stacks`), a matched optimizer field `opt_state/<s>/<field>[/params]/<w>` <-
`optimizer_state:opt_state/<s'>/<field>/<w>` (laid out as its weight), `nnx_aux[/model]/<v>`
<- `model_params:<v>`, `step` <- `optimizer_state:step`.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from orbax_tunix import conventions
from orbax_tunix.keypaths import Path
from orbax_tunix.mapping.optax_states import Chain, OptState
from orbax_tunix.mapping.patterns import Mapped

# The names the MaxText view uses (defined once, in `conventions`).
PARAMS, COLLECTION = conventions.MAXTEXT_PARAMS
OPT_STATE = conventions.MAXTEXT_OPT_STATE
STEP = conventions.MAXTEXT_STEP
MODEL, OPTIMIZER = conventions.MODEL_ITEM, conventions.OPTIMIZER_ITEM

# MaxText's adamw chain as saved: per position, its fields (those mirroring the
# weights marked), or None for an empty state.
ADAMW: tuple[tuple[tuple[str, bool], ...] | None, ...] = (
    (('count', False), ('mu', True), ('nu', True)),
    None,
    (('count', False),),
)
COUNT_DTYPE = np.dtype(np.int32)


def adamw() -> Chain:
  """MaxText's adamw chain (`ADAMW`) as the planner matches a Tunix optimizer to it."""
  states = [OptState((str(i),), fields) for i, fields in enumerate(ADAMW) if fields]
  return Chain(tuple(states), {
      (s.node, field): (OPT_STATE, *s.node, field, *((COLLECTION,) if mirrored else ()))
      for s in states for field, mirrored in s.fields})


def containers() -> tuple[frozenset[Path], tuple[tuple[Path, tuple[int, ...], str], ...]]:
  """(sequence nodes, empty nodes with their key types and value type) of the saved train state.

  MaxText's `opt_state` is a list (its positions are sequence keys) with
  `None` where a state is empty.
  """
  empty = tuple(((OPT_STATE, str(i)), (2, 1), 'None')
                for i, fields in enumerate(ADAMW) if fields is None)
  return frozenset({(OPT_STATE,)}), empty


def under(mapped: Mapping[Path, Mapped], source: Path, dest: Path) -> dict[Path, Mapped]:
  """Leaves made below one node from leaves below another (a model's weights inside
  `params`, or inside an optimizer's `mu`): each destination under `dest`, each
  source under `source`."""
  return {(*dest, *p): Mapped(tuple((*source, *s) for s in m.sources), m.transform, m.shape)
          for p, m in mapped.items()}

"""MaxText's train state as it saves it, as data: what a converted step must hold.

MaxText 0.2.5 (`opt_type=adamw`, its default) trains with
`optax.adamw(schedule)`: `chain(scale_by_adam, add_decayed_weights,
scale_by_learning_rate)`, saved as the list
`[{count, mu: {params: <weights>}, nu: {params: <weights>}}, None, {count}]`;
`step` is int32. `template` builds that train state's leaves for a given set
of weights; the MaxText view (`plan.make_plan`) maps a Tunix step onto it, as
it maps one onto an abstract state a caller gives, by the rules below: layout
rules (`mapping.patterns`) over the step's canonical leaves, each named
`(item, *canonical path)`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import jax
import numpy as np

from orbax_tunix import conventions
from orbax_tunix.keypaths import Path
from orbax_tunix.mapping import patterns, stacks
from orbax_tunix.mapping.patterns import LayoutRule

# The names the MaxText view uses (defined once, in `conventions`).
PARAMS, COLLECTION = conventions.MAXTEXT_PARAMS
OPT_STATE = conventions.MAXTEXT_OPT_STATE
STEP = conventions.MAXTEXT_STEP

# MaxText's adamw chain as saved: per position, its fields (those mirroring the
# weights marked), or None for an empty state.
ADAMW: tuple[tuple[tuple[str, bool], ...] | None, ...] = (
    (('count', False), ('mu', True), ('nu', True)),
    None,
    (('count', False),),
)
COUNT_DTYPE = np.dtype(np.int32)
STEP_DTYPE = np.dtype(np.int32)


def template(weights: Mapping[Path, jax.ShapeDtypeStruct]) -> dict[Path, jax.ShapeDtypeStruct]:
  """MaxText's train state for these weights, leaf by leaf (no `nnx_aux`); `ADAMW`'s
  mirroring fields take each weight's shape and dtype.

  Args:
    weights: weight path (no `params` level) -> its shape and dtype.

  Returns:
    leaf path -> `jax.ShapeDtypeStruct`.
  """
  out = {conventions.MAXTEXT_PARAMS + w: leaf for w, leaf in weights.items()}
  for position, fields in enumerate(ADAMW):
    for field, mirrored in fields or ():
      node = (OPT_STATE, str(position), field)
      if mirrored:
        out.update(((*node, COLLECTION) + w, leaf) for w, leaf in weights.items())
      else:
        out[node] = jax.ShapeDtypeStruct((), COUNT_DTYPE)
  out[(STEP,)] = jax.ShapeDtypeStruct((), STEP_DTYPE)
  return out


def containers() -> tuple[frozenset[Path], tuple[tuple[Path, tuple[int, ...], str], ...]]:
  """(sequence nodes, empty nodes with their key types and value type) of the saved train state.

  MaxText's `opt_state` is a list (its positions are sequence keys) with
  `None` where a state is empty.
  """
  empty = tuple(((OPT_STATE, str(i)), (2, 1), 'None')
                for i, fields in enumerate(ADAMW) if fields is None)
  return frozenset({(OPT_STATE,)}), empty


# --- the rules from a Tunix step ------------------------------------------------


def weight_rules(layers: Sequence[LayoutRule] = (stacks.AS_STORED,)) -> tuple[LayoutRule, ...]:
  """params/params/<w> <- model_params:<w>, the decoder's layers laid out by `layers`
  (`stacks.rules`: in the other form than stored, or as stored)."""
  return patterns.nested(layers, (conventions.MODEL_ITEM,), conventions.MAXTEXT_PARAMS)


def aux_rules(node: Path) -> tuple[LayoutRule, ...]:
  """<node>/<v> <- model_params:<v>: RNG and other non-weight variables (`nnx_aux[/model]`)."""
  return patterns.nested((stacks.AS_STORED,), (conventions.MODEL_ITEM,), node)


def state_rules(
    fields: Mapping[Path, Path], layers: Sequence[LayoutRule] = (stacks.AS_STORED,)
) -> tuple[LayoutRule, ...]:
  """opt_state/<state>/<field>[/params]/<w> <- optimizer_state:opt_state/<state'>/<field>/<w>:
  the fields of the optimizer states matched between the two sides, the weights
  they mirror (`mu`, `nu`) laid out by the weights' own `layers`.

  Args:
    fields: a field's node in the checkpoint (canonical, from `opt_state`) -> its
      node in the target (with MaxText's `params` level where the target has it).
  """
  return tuple(rule for source, dest in fields.items()
               for rule in patterns.nested(layers, (conventions.OPTIMIZER_ITEM, *source), dest))

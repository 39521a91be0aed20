"""MaxText's view: a Tunix checkpoint restored as MaxText's train state.

MaxText keeps one item, `items`, holding a Linen `TrainState` (as data: `train_state`);
Tunix writes `model_params` and `optimizer_state` in nnx's layout instead.

Nothing here knows an optimizer: optax states are matched by their fields in
chain order. MaxText's state is made by rules from a Tunix step's leaves (`plan.state_leaves`),
from metadata alone, every mismatch reported before any array is read; a restore's plan
(`RestorePlan`) is the executor's outputs, each needed array read once.

  restore_train_state(path, abstract_state)    the function
  ItemsHandler, ItemsRestore                   the same as an Orbax handler
  plan_restore(path, abstract_state)           the plan alone (RestorePlan), to inspect
  execute_plan(plan, abstract_state)           ... and to run
  LayerScanMismatchError, LoraOnlyCheckpointError

The flow, a module each: train_state (MaxText's key paths and rules) -> weights (checking
the target's against the step's; optimizer states matched by `mapping.optax_states`) -> plan
(on the step opened once, `reader.Source`; its decoder's layers re-laid in the target's form
by `mapping.step_layers.relayout`) -> execute -> handler. The `maxtext` layout
(`layouts/maxtext.py`) applies the same rules to write MaxText's own step. Its two errors
are `orbax_tunix.errors`'.
"""

from orbax_tunix.errors import LayerScanMismatchError, LoraOnlyCheckpointError
from orbax_tunix.maxtext.execute import execute_plan, restore_train_state
from orbax_tunix.maxtext.handler import ItemsHandler, ItemsRestore
from orbax_tunix.maxtext.plan import RestorePlan, plan_restore

__all__ = [
    'ItemsHandler',
    'ItemsRestore',
    'LayerScanMismatchError',
    'LoraOnlyCheckpointError',
    'RestorePlan',
    'execute_plan',
    'plan_restore',
    'restore_train_state',
]

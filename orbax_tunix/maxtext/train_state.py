"""MaxText's train state: the key paths a restore target has.

MaxText keeps one item, `items`, holding a Linen `TrainState`; these are its
top-level keys and the Linen collection its weights sit in.
"""

# MaxText's TrainState keys, and the Linen collection its weights sit in.
PARAMS = 'params'
COLLECTION = 'params'
OPT_STATE = 'opt_state'
STEP = 'step'
NNX_AUX = 'nnx_aux'
# MaxText's `to_checkpoint_dict` keeps nnx's `model` level inside `nnx_aux`.
NNX_AUX_MODEL = 'model'
TOP_KEYS = (PARAMS, OPT_STATE, STEP, NNX_AUX)

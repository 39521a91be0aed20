"""orbax_tunix: restore Tunix checkpoints with any Orbax restore.

The whole public API (`__all__`, and the table in docs/api.md)::

  detect(path) -> Detection              what a path holds, which rewrites apply
  TunixPyTreeHandler                     item handler (a PyTreeCheckpointHandler)
  TunixAwareHandler                      step handler (a CompositeCheckpointHandler)
  handler_registry()                     for ocp.CheckpointManager
  register(), load_plugins()             Orbax v1 and entry-point plugins
  hyperparameters(path)                  the inject_hyperparams values
  restore_merged_lora(path, target, ...) LoRA adapters merged into the weights
  export_to_hf(path, out_dir, model=...)  a Hugging Face safetensors folder
  export_peft_adapter(path, out_dir, model=..., alpha=...)  a LoRA run as a PEFT adapter
  to_canonical_tree, to_disk_tree        rewriting whole trees with a
  CanonicalMap                           ... step's planned map
  TunixCheckpointError                   the base of every error raised:
    NotACheckpointError, UncommittedStepError, CorruptMetadataError,
    UnsafeNameError, TargetMismatchError, MissingItemError, LoraOnlyCheckpointError,
    LoraError, UnsupportedLayoutError, InvalidOptionError,
    DestinationExistsError, InvalidDestinationError, DistributedError
  maxtext                                a Tunix step as MaxText's TrainState
"""

from orbax_tunix import maxtext
from orbax_tunix.errors import (
    CorruptMetadataError,
    DestinationExistsError,
    DistributedError,
    InvalidDestinationError,
    InvalidOptionError,
    LoraError,
    LoraOnlyCheckpointError,
    MissingItemError,
    NotACheckpointError,
    TargetMismatchError,
    TunixCheckpointError,
    UncommittedStepError,
    UnsafeNameError,
    UnsupportedLayoutError,
)
from orbax_tunix.handlers.composite_handler import TunixAwareHandler
from orbax_tunix.handlers.plugins import handler_registry, load_plugins, register
from orbax_tunix.handlers.pytree_handler import TunixPyTreeHandler
from orbax_tunix.mapping.merge import restore_merged_lora
from orbax_tunix.reading.hyperparams import hyperparameters
from orbax_tunix.tools.export import export_peft_adapter, export_to_hf
from orbax_tunix.version import __version__ as __version__
from orbax_tunix.view.canonical_map import CanonicalMap, to_canonical_tree, to_disk_tree
from orbax_tunix.view.detection import Detection, detect

__all__ = [
    'CanonicalMap',
    'CorruptMetadataError',
    'DestinationExistsError',
    'Detection',
    'DistributedError',
    'InvalidDestinationError',
    'InvalidOptionError',
    'LoraError',
    'LoraOnlyCheckpointError',
    'MissingItemError',
    'NotACheckpointError',
    'TargetMismatchError',
    'TunixAwareHandler',
    'TunixCheckpointError',
    'TunixPyTreeHandler',
    'UncommittedStepError',
    'UnsafeNameError',
    'UnsupportedLayoutError',
    'detect',
    'export_peft_adapter',
    'export_to_hf',
    'handler_registry',
    'hyperparameters',
    'load_plugins',
    'maxtext',
    'register',
    'restore_merged_lora',
    'to_canonical_tree',
    'to_disk_tree',
]


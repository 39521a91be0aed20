"""The errors orbax_tunix raises: one base class, one subclass per kind of failure.

Every message names the path it is about, what was expected, what was found and
what to do, so that a failed restore of a weeks-old run can be fixed from the
message alone.
"""

from __future__ import annotations

from collections.abc import Sequence


class TunixCheckpointError(ValueError):
  """Base class of every error raised by orbax_tunix."""


class NotACheckpointError(TunixCheckpointError, FileNotFoundError):
  """The path does not exist or holds no Orbax checkpoint.

  Also a `FileNotFoundError`, which is what Orbax's own handlers raise for a
  missing directory.
  """


class UncommittedStepError(TunixCheckpointError):
  """The step is unfinished (still being written, or its writer died)."""


class CorruptMetadataError(TunixCheckpointError):
  """A metadata file or an array's store is missing, truncated or unreadable."""


class UnsafeNameError(CorruptMetadataError):
  """A name read from a checkpoint (an item, a key, a file) would lead outside its folder.

  A checkpoint is a stranger's download: every name in it that becomes a path
  must be one plain name inside its folder. Raised before anything is read
  through the name or written with it.
  """


class TargetMismatchError(TunixCheckpointError):
  """The restore target disagrees with the checkpoint (paths, shapes, dtypes)."""


class MissingItemError(TargetMismatchError, KeyError):
  """An item asked for is not in the step.

  Also the `KeyError` Orbax's composite handler raises for it.
  """

  __str__ = TargetMismatchError.__str__  # KeyError would quote the message.


class LoraOnlyCheckpointError(TargetMismatchError):
  """The checkpoint holds only LoRA adapters; full weights were asked for."""


class LayerScanMismatchError(TargetMismatchError):
  """One side stacks the layers into one array per weight (scanned), the other not
  (exported as `maxtext.LayerScanMismatchError`)."""


class LoraError(TunixCheckpointError):
  """LoRA adapters cannot be merged as asked (raised before any array is read)."""


class UnsupportedLayoutError(TunixCheckpointError):
  """The checkpoint's layout is one this version cannot map."""


class InvalidOptionError(TunixCheckpointError):
  """An argument out of range, or arguments that do not go together (nothing was read)."""


class DestinationExistsError(TunixCheckpointError):
  """The destination exists and replacing it was not asked for."""


class InvalidDestinationError(TunixCheckpointError):
  """The destination overlaps the source, or cannot be written or replaced."""


class DistributedError(TunixCheckpointError):
  """A multi-process convert or export could not form its job, or a process failed.

  Raised on every process; nothing was committed.
  """


def list_paths(paths: Sequence[str], limit: int = 20) -> str:
  """Formats paths one per line, at most `limit` of them, then a count.

  Args:
    paths: already formatted paths (e.g. 'layers/0/attn/w').
    limit: how many to show before summarising the rest.

  Returns:
    An indented block of lines, ending in '... and N more' when cut.
  """
  shown = [f'  {p}' for p in paths[:limit]]
  if len(paths) > limit:
    shown.append(f'  ... and {len(paths) - limit} more')
  return '\n'.join(shown)

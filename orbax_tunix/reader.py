"""A checkpoint as canonical leaves: listed from metadata, read in bounded batches.

The command line's three tools (inspect, convert, diff) share one view of a
checkpoint: every PyTree item of one step, each leaf under its canonical path
(the Tunix rewrites applied; other checkpoints as they are) with its shape,
dtype and size, known from metadata alone. Reading is executing that listing
in batches whose bytes fit a budget, each batch one Orbax partial restore of
the named on-disk leaves, so no tool ever holds the whole checkpoint.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from orbax_tunix import errors, rules
from orbax_tunix.detect import (
    AGGREGATE_FILE,
    CHECKPOINT_METADATA,
    PYTREE_METADATA,
    RL_ROLES,
    Detection,
    StepInfo,
    as_path,
    detect,
    list_steps,
    read_json,
)
from orbax_tunix.tree_paths import Path, flat_dict, fmt, nest

# Leaf kinds, from the Orbax metadata class of each leaf.
ARRAY = 'array'
SCALAR = 'scalar'
STRING = 'string'

# Where the weights sit: Tunix's (and the canonical) model item, or MaxText's
# `items` item under its `params` collection level.
MAXTEXT_ITEM = 'items'
MAXTEXT_PARAMS = ('params', 'params')
# nnx keeps RNG state (`rngs/<stream>/{count,key}`, `dropout/rngs/...`) among
# the weights; any path with this key is RNG state, not a weight.
RNG_KEY = 'rngs'


class StepNotFoundError(errors.NotACheckpointError):
  """The step asked for is not under the given root."""


@dataclasses.dataclass(frozen=True)
class LeafInfo:
  """One leaf of one item, from metadata only.

  Attributes:
    item: the item it belongs to (e.g. 'model_params').
    path: its canonical path within the item.
    disk_path: its path on disk (equal to `path` unless Tunix rewrites apply).
    shape: its global shape (() for scalars, None for strings).
    dtype: its dtype (None for strings).
    kind: ARRAY, SCALAR or STRING.
  """

  item: str
  path: Path
  disk_path: Path
  shape: tuple[int, ...] | None
  dtype: np.dtype | None
  kind: str = ARRAY

  @property
  def nbytes(self) -> int:
    """Bytes of the array data (0 for strings)."""
    if self.shape is None or self.dtype is None:
      return 0
    return math.prod(self.shape) * self.dtype.itemsize

  @property
  def name(self) -> str:
    """'item/canonical/path', as the tools print it (one text per leaf)."""
    return fmt((self.item, *self.path))


@dataclasses.dataclass(frozen=True)
class CanonicalCheckpoint:
  """One step of a checkpoint, seen leaf by leaf in canonical form.

  Attributes:
    detection: what `detect()` found (kind, step directory, layouts, notes).
    items: item name -> its leaves, sorted by canonical path.
    side_leaves: item name -> on-disk paths left out of the canonical view
      (e.g. the inject_hyperparams scalars).
    skipped: item name -> why it is not listed (not a PyTree item).
  """

  detection: Detection
  items: Mapping[str, tuple[LeafInfo, ...]]
  side_leaves: Mapping[str, tuple[Path, ...]]
  skipped: Mapping[str, str]

  @property
  def step_dir(self) -> epath.Path:
    return self.detection.step_dir

  @property
  def leaves(self) -> tuple[LeafInfo, ...]:
    return tuple(leaf for item in sorted(self.items) for leaf in self.items[item])

  def total_bytes(self, item: str | None = None) -> int:
    leaves = self.leaves if item is None else self.items[item]
    return sum(leaf.nbytes for leaf in leaves)


def _roots(path: epath.Path) -> list[epath.Path]:
  """The directories whose children may be steps: the path, then RL roles."""
  return [path] + [path / role for role in RL_ROLES if (path / role).is_dir()]


def find_steps(path: epath.PathLike) -> list[StepInfo]:
  """Every step, committed or not, under a root (or the root of a step).

  Args:
    path: a root, an RL root (`actor/` is used), a step or an item directory.

  Returns:
    The steps found, by step number; empty when there are none.
  """
  path = as_path(path)
  if not path.is_dir():
    return []
  if (path / PYTREE_METADATA).exists() and (path.parent / CHECKPOINT_METADATA).exists():
    path = path.parent.parent
  elif (path / CHECKPOINT_METADATA).exists():
    path = path.parent
  for root in _roots(path):
    steps = list_steps(root)
    if steps:
      return steps
  return []


def resolve(path: epath.PathLike, step: int | None = None) -> Detection:
  """Detects a checkpoint, at a given step when one is asked for.

  Args:
    path: a root, a step or an item directory (see `detect`).
    step: the step number wanted; None for what `detect` picks (the path's
      own step, or the latest committed one under a root).

  Returns:
    The `Detection` of the step.

  Raises:
    StepNotFoundError: no step `step` under `path` (the message lists those
      present).
    UncommittedStepError: step `step` exists but is unfinished.
    NotACheckpointError, CorruptMetadataError: as `detect`.
  """
  path = as_path(path)
  if step is None:
    return detect(path)
  detection = detect(path)  # Raises the usual errors for non-checkpoints.
  if detection.step == step:
    return detection
  steps = find_steps(path)
  if (path / CHECKPOINT_METADATA).exists() or detection.item is not None:
    raise StepNotFoundError(
        f'{path}: this is step {detection.step}, but `step={step}` was asked'
        ' for. Pass the root directory that holds the steps, or drop `step`.'
    )
  matching = [s for s in steps if s.step == step]
  committed = [s for s in matching if s.committed]
  if committed:
    return detect(committed[-1].path)
  if matching:
    raise errors.UncommittedStepError(
        f'{matching[0].path}: step {step} is unfinished (its writer is still'
        ' running or died). Pick a committed step:'
        f' {describe_steps(steps)}.'
    )
  raise StepNotFoundError(
      f'{path}: expected a step {step}, found none. Steps present:'
      f' {describe_steps(steps)}. Pass one of these as `step`.'
  )


def describe_steps(steps: Sequence[StepInfo]) -> str:
  """'1, 2, 3 (unfinished)': the steps of a root, for messages."""
  if not steps:
    return 'none'
  return ', '.join(f'{s.step}' + ('' if s.committed else ' (unfinished)') for s in steps)


def _leaf_info(item: str, path: Path, disk: Path, meta: Any) -> LeafInfo:
  if isinstance(meta, ocp.metadata.StringMetadata):
    return LeafInfo(item, path, disk, None, None, STRING)
  shape = tuple(getattr(meta, 'shape', None) or ())
  dtype = getattr(meta, 'dtype', None)
  kind = SCALAR if isinstance(meta, ocp.metadata.ScalarMetadata) else ARRAY
  return LeafInfo(item, path, disk, shape, None if dtype is None else np.dtype(dtype), kind)


def item_leaves(detection: Detection, item: str) -> tuple[tuple[LeafInfo, ...], tuple[Path, ...]]:
  """Lists one item's leaves in canonical form, from metadata only.

  Orbax's `metadata()` reads `_METADATA` and opens each array's small zarr
  header (for its dtype); no array data is read.

  Args:
    detection: the step's detection.
    item: the item name.

  Returns:
    (leaves sorted by canonical path, on-disk paths of side leaves).

  Raises:
    CorruptMetadataError: the item's metadata cannot be read.
  """
  item_dir = detection.step_dir / item
  try:
    tree = ocp.PyTreeCheckpointHandler().metadata(item_dir).tree
  except (OSError, ValueError, KeyError, TypeError) as e:
    raise errors.CorruptMetadataError(
        f'{item_dir}: expected readable Orbax PyTree metadata, found an error'
        f' ({type(e).__name__}: {e}). The item is damaged or incomplete;'
        ' try another step.'
    ) from e
  layout = detection.layouts.get(item)
  leaves, side = [], []
  for disk, meta in flat_dict(tree).items():
    canon = disk if layout is None else layout.disk_to_canonical.get(disk, disk)
    if canon is None:
      side.append(disk)
    else:
      leaves.append(_leaf_info(item, canon, disk, meta))
  return tuple(sorted(leaves, key=lambda leaf: leaf.path)), tuple(sorted(side))


def open_checkpoint(
    path: epath.PathLike,
    step: int | None = None,
    items: Iterable[str] | None = None,
) -> CanonicalCheckpoint:
  """Opens a checkpoint's step in canonical form, from metadata only.

  Args:
    path: a root, a step or an item directory (an item directory limits the
      view to that item).
    step: the step wanted (see `resolve`).
    items: limit the view to these items (all PyTree items by default).

  Returns:
    A `CanonicalCheckpoint`.

  Raises:
    TunixCheckpointError subclasses: see `resolve` and `item_leaves`.
  """
  detection = resolve(path, step)
  wanted = set(items) if items is not None else None
  if detection.item is not None:
    wanted = {detection.item} if wanted is None else wanted & {detection.item}
  leaves, side, skipped = {}, {}, {}
  for item in detection.items:
    if wanted is not None and item not in wanted:
      continue
    item_dir = detection.step_dir / item
    if not (item_dir / PYTREE_METADATA).exists():
      if (item_dir / AGGREGATE_FILE).exists():
        skipped[item] = (
            'written by an Orbax release older than _METADATA, so its shapes'
            ' and dtypes are not in metadata; restore it with'
            ' orbax_tunix.TunixPyTreeHandler, then save it with Orbax'
        )
      else:
        skipped[item] = 'not a PyTree item (no _METADATA)'
      continue
    leaves[item], side[item] = item_leaves(detection, item)
  return CanonicalCheckpoint(detection, leaves, side, skipped)


def is_rng_state(path: Path) -> bool:
  """True for nnx RNG state (a path with an `rngs` key), which is no weight."""
  return RNG_KEY in path


def weights(ckpt: CanonicalCheckpoint) -> list[tuple[LeafInfo, Path]]:
  """The model weights of a checkpoint, without RNG state.

  The weights are the `model_params` item (Tunix, or a canonical conversion)
  or, in a MaxText checkpoint, `items` below `params/params`. Leaves that
  are nnx RNG state (see `is_rng_state`) are left out.

  Args:
    ckpt: the checkpoint.

  Returns:
    (leaf, path within the weight tree) pairs, sorted by path.

  Raises:
    UnsupportedLayoutError: neither place holds anything.
  """
  found: list[tuple[LeafInfo, Path]] = []
  if rules.MODEL_ITEM in ckpt.items:
    found = [(leaf, leaf.path) for leaf in ckpt.items[rules.MODEL_ITEM]]
  elif MAXTEXT_ITEM in ckpt.items:
    n = len(MAXTEXT_PARAMS)
    found = [
        (leaf, leaf.path[n:])
        for leaf in ckpt.items[MAXTEXT_ITEM]
        if leaf.path[:n] == MAXTEXT_PARAMS
    ]
  found = [(leaf, path) for leaf, path in found if not is_rng_state(path)]
  if not found:
    raise errors.UnsupportedLayoutError(
        f'{ckpt.step_dir}: expected model weights in item'
        f' {rules.MODEL_ITEM!r} (Tunix or canonical) or in'
        f' {MAXTEXT_ITEM}/{fmt(MAXTEXT_PARAMS)} (MaxText), found items'
        f' {sorted(ckpt.items) or "none"} without them. Pass the step (or'
        ' root) of a model checkpoint, not an optimizer item.'
    )
  return sorted(found, key=lambda pair: pair[1])


def json_scalar(value: Any) -> Any:
  """A numpy scalar as JSON holds it (float, int, bool; else its text)."""
  value = np.asarray(value)[()]
  if isinstance(value, np.floating):
    return float(value)
  if isinstance(value, np.integer | np.bool_):
    return value.item()
  return str(value)


def custom_metadata(step_dir: epath.Path) -> dict[str, Any]:
  """The user's custom metadata recorded in a step's `_CHECKPOINT_METADATA`."""
  meta = read_json(step_dir / CHECKPOINT_METADATA)
  found = meta.get('custom_metadata') if isinstance(meta, dict) else None
  return dict(found) if isinstance(found, dict) else {}


# --- reading ----------------------------------------------------------------


class Progress(Protocol):
  """Where the streaming tools report bytes done; the CLI draws it."""

  def start(self, total_bytes: int, description: str) -> None:
    """Called once, before the first batch."""

  def advance(self, nbytes: int) -> None:
    """Called after each batch with the bytes it covered."""

  def finish(self) -> None:
    """Called once, after the last batch (also on failure)."""


class NullProgress:
  """A `Progress` that shows nothing."""

  def start(self, total_bytes: int, description: str) -> None:
    del total_bytes, description

  def advance(self, nbytes: int) -> None:
    del nbytes

  def finish(self) -> None:
    pass


# Memory the streaming needs whatever the batch size (TensorStore's thread
# pools and caches, allocator slack), measured with
# benchmarks/convert_memory.py; the rest of a budget goes to batches.
FIXED_OVERHEAD = 64 << 20


def batch_bytes(memory_budget: int, copies: int) -> int:
  """Bytes of array data per batch so that the streaming fits `memory_budget`.

  Args:
    memory_budget: bytes the streaming may use above the process's start-up.
    copies: bytes held per byte of a batch while it is read and used.

  Returns:
    (budget - FIXED_OVERHEAD) / copies, and at least budget / (4 * copies)
    so that small budgets still make progress.
  """
  return max(memory_budget // (4 * copies), (memory_budget - FIXED_OVERHEAD) // copies, 1)


def batches(leaves: Sequence[LeafInfo], budget: int) -> Iterator[list[LeafInfo]]:
  """Groups leaves, in order, into batches of at most `budget` bytes.

  A leaf larger than the budget forms a batch of its own: it cannot be split.

  Args:
    leaves: the leaves, in the order they are to be read.
    budget: bytes of array data per batch (at least 1).

  Yields:
    Lists of consecutive leaves.
  """
  batch: list[LeafInfo] = []
  size = 0
  for leaf in leaves:
    if batch and size + leaf.nbytes > budget:
      yield batch
      batch, size = [], 0
    batch.append(leaf)
    size += leaf.nbytes
  if batch:
    yield batch


def cast_dtype(leaf: LeafInfo, dtype: np.dtype | None) -> np.dtype | None:
  """The dtype a leaf is read as: `dtype` for floating leaves, else its own.

  Integer, boolean and PRNG-key leaves (an nnx RNG key is stored as uint32
  key data) keep their dtype: casting them would change what they mean.
  """
  if dtype is None or leaf.dtype is None or not jnp.issubdtype(leaf.dtype, jnp.floating):
    return leaf.dtype
  return np.dtype(dtype)


def _restore_arg(leaf: LeafInfo, dtype: np.dtype | None, sharding: Any) -> tuple[Any, Any]:
  """(target leaf, RestoreArgs) for one leaf; numpy when `sharding` is None."""
  if leaf.kind == STRING:
    return '', ocp.RestoreArgs(restore_type=str)
  if leaf.kind == SCALAR:
    return 0, ocp.RestoreArgs(dtype=dtype)
  if sharding is None:
    return 0, ocp.RestoreArgs(restore_type=np.ndarray, dtype=dtype)
  target = jax.ShapeDtypeStruct(leaf.shape, dtype, sharding=sharding)
  return target, ocp.ArrayRestoreArgs(sharding=sharding, global_shape=leaf.shape, dtype=dtype)


def read(
    step_dir: epath.Path,
    item: str,
    leaves: Sequence[LeafInfo],
    *,
    as_numpy: bool = True,
    dtype: np.dtype | None = None,
    handler: ocp.PyTreeCheckpointHandler | None = None,
) -> list[Any]:
  """Reads some leaves of one item with one Orbax partial restore.

  Only the named arrays are opened. The paths were planned from metadata
  once (`open_checkpoint`), so nothing is re-planned per batch.

  Args:
    step_dir: the step directory.
    item: the item the leaves belong to.
    leaves: the leaves to read (all of `item`).
    as_numpy: read arrays as `np.ndarray`; else as `jax.Array`s on one CPU
      device (what an ordinary save records, and PRNG keys stay typed).
    dtype: cast floating leaves to this dtype while reading (see `cast_dtype`).
    handler: a handler to reuse across batches.

  Returns:
    The values, in the order of `leaves`.
  """
  if not leaves:
    return []
  sharding = None if as_numpy else jax.sharding.SingleDeviceSharding(jax.devices('cpu')[0])
  pairs = [_restore_arg(leaf, cast_dtype(leaf, dtype), sharding) for leaf in leaves]
  handler = handler or ocp.PyTreeCheckpointHandler()
  restored = handler.restore(
      step_dir / item,
      args=ocp.args.PyTreeRestore(
          item=nest((leaf.disk_path, t) for leaf, (t, _) in zip(leaves, pairs, strict=True)),
          restore_args=nest((leaf.disk_path, a) for leaf, (_, a) in zip(leaves, pairs, strict=True)),
          partial_restore=True,
      ),
  )
  by_path = flat_dict(restored)
  return [by_path[leaf.disk_path] for leaf in leaves]

"""Detection: what a path holds, from the small JSON metadata files only.

No array data is read here: a step's `_CHECKPOINT_METADATA` names its items
and their handlers, and each item's `_METADATA` names its leaves. From those,
`detect()` resolves the step to read, classifies the checkpoint (Tunix,
MaxText or plain Orbax) and plans the rewrites (`layout.plan_step`).
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping
from typing import Any

import msgpack
from etils import epath

from orbax_tunix import errors, rules
from orbax_tunix import layout as layout_lib
from orbax_tunix.tree_paths import Path

CHECKPOINT_METADATA = '_CHECKPOINT_METADATA'
PYTREE_METADATA = '_METADATA'
AGGREGATE_FILE = 'checkpoint'  # msgpack tree of Orbax releases before _METADATA
TMP_MARKER = '.orbax-checkpoint-tmp'
# RL trainers nest each model's steps one level deeper.
RL_ROLES = ('actor', 'critic')

_STEP_NAME = re.compile(r'^(?:.*?_)?(\d+)$')


@dataclasses.dataclass(frozen=True)
class StepInfo:
  """One step directory under a root."""

  step: int
  path: epath.Path
  committed: bool


@dataclasses.dataclass(frozen=True)
class Detection:
  """What `detect()` found.

  Attributes:
    path: the path given.
    step_dir: the step directory it resolved to.
    step: that step's number, when its name carries one.
    kind: 'tunix', 'maxtext' or 'orbax' (any other Orbax checkpoint).
    writer: 'v0' or 'v1', the Orbax API the step was written with.
    item_handlers: item name -> handler typestr recorded at save time.
    layouts: Tunix item name -> its planned `ItemLayout` (empty unless Tunix).
    item: the item, when `path` was an item directory.
    notes: things a person should know (e.g. unfinished steps skipped).
  """

  path: epath.Path
  step_dir: epath.Path
  step: int | None
  kind: str
  writer: str
  item_handlers: Mapping[str, str | None]
  layouts: Mapping[str, layout_lib.ItemLayout]
  item: str | None = None
  notes: tuple[str, ...] = ()

  @property
  def is_tunix(self) -> bool:
    return self.kind == 'tunix'

  @property
  def items(self) -> tuple[str, ...]:
    return tuple(sorted(self.item_handlers))

  @property
  def rewrites(self) -> dict[str, tuple[str, ...]]:
    """Item name -> names of the rules that apply to it, in order."""
    return {name: lay.rule_names for name, lay in self.layouts.items()}


def as_path(path: epath.PathLike) -> epath.Path:
  """An `epath.Path`, made absolute when local (TensorStore's OCDBT needs it)."""
  path = epath.Path(path)
  return path if path.is_absolute() else path.resolve()


def read_json(path: epath.Path) -> Any:
  """Reads a JSON metadata file.

  Raises:
    CorruptMetadataError: the file is missing, unreadable or not JSON.
  """
  try:
    text = path.read_text()
  except FileNotFoundError as e:
    raise errors.CorruptMetadataError(
        f'{path}: expected an Orbax metadata file, found nothing. The'
        ' checkpoint is incomplete; restore another step or re-save it.'
    ) from e
  except OSError as e:
    raise errors.CorruptMetadataError(
        f'{path}: cannot read this metadata file ({e}). Check permissions.'
    ) from e
  try:
    return json.loads(text)
  except ValueError as e:
    raise errors.CorruptMetadataError(
        f'{path}: expected JSON, found {len(text)} bytes that do not parse'
        f' ({e}). The file is truncated or damaged; restore another step.'
    ) from e


def _aggregate_paths(aggregate: epath.Path) -> frozenset[Path]:
  """Leaf paths of an old checkpoint's msgpack `checkpoint` file (no _METADATA)."""
  try:
    tree = msgpack.unpackb(aggregate.read_bytes(), raw=False, strict_map_key=False)
  except (ValueError, msgpack.UnpackException) as e:
    raise errors.CorruptMetadataError(
        f'{aggregate}: expected Orbax\'s msgpack tree file, found bytes that do not'
        f' decode ({e}). The file is damaged; restore another step.'
    ) from e
  paths: set[Path] = set()

  def walk(node: Any, prefix: Path) -> None:
    if isinstance(node, dict) and node:
      for key, child in node.items():
        walk(child, prefix + (str(key),))
    else:
      paths.add(prefix)

  walk(tree, ())
  return frozenset(paths)


def has_tree(item_dir: epath.Path) -> bool:
  """Whether a directory holds PyTree metadata (`_METADATA` or the older msgpack)."""
  return (item_dir / PYTREE_METADATA).exists() or (item_dir / AGGREGATE_FILE).exists()


def tree_paths(item_dir: epath.Path) -> frozenset[Path]:
  """The leaf key paths recorded in an item's metadata, without reading arrays.

  Newer Orbax writes them in `_METADATA`; checkpoints older than that have
  only the msgpack `checkpoint` file, read as a fallback.

  Raises:
    CorruptMetadataError: the metadata is missing, damaged or not a PyTree's.
  """
  meta_file = item_dir / PYTREE_METADATA
  if not meta_file.exists() and (item_dir / AGGREGATE_FILE).exists():
    return _aggregate_paths(item_dir / AGGREGATE_FILE)
  meta = read_json(meta_file)
  try:
    entries = meta['tree_metadata']
    return frozenset(
        tuple(str(k['key']) for k in entry['key_metadata'])
        for entry in entries.values()
    )
  except (KeyError, TypeError, AttributeError) as e:
    raise errors.CorruptMetadataError(
        f"{meta_file}: expected Orbax PyTree metadata ('tree_metadata' with"
        f" 'key_metadata' per leaf), found something else (missing {e})."
        ' The file is damaged or was not written by a PyTree handler.'
    ) from e


def _step_number(name: str) -> int | None:
  m = _STEP_NAME.match(name)
  return int(m.group(1)) if m else None


def list_steps(root: epath.Path) -> list[StepInfo]:
  """Step directories directly under `root`, committed or not, by step number."""
  steps = []
  for child in root.iterdir():
    name = child.name
    unfinished = TMP_MARKER in name
    number = _step_number(name.split(TMP_MARKER)[0])
    if number is None or not child.is_dir():
      continue
    committed = not unfinished and (child / CHECKPOINT_METADATA).exists()
    steps.append(StepInfo(number, child, committed))
  return sorted(steps, key=lambda s: (s.step, s.committed))


def resolve_step(path: epath.Path) -> tuple[epath.Path, str | None, tuple[str, ...]]:
  """Finds the step directory a path stands for.

  Args:
    path: a root (latest committed step wins; RL roots holding `actor/` too),
      a step directory or an item directory.

  Returns:
    (step directory, item name or None, notes).

  Raises:
    NotACheckpointError: nothing checkpoint-like is there.
    UncommittedStepError: the path is an unfinished step, or a root whose
      steps are all unfinished.
  """
  if not path.exists():
    raise errors.NotACheckpointError(
        f'{path}: no such file or directory. Expected an Orbax checkpoint'
        ' root, step or item directory; check the path.'
    )
  if not path.is_dir():
    raise errors.NotACheckpointError(
        f'{path}: expected a checkpoint directory, found a file. Pass the'
        ' directory that holds the steps, a step, or an item.'
    )
  if TMP_MARKER in path.name:
    raise errors.UncommittedStepError(
        f'{path}: this step is unfinished (its name contains {TMP_MARKER!r}):'
        ' its writer is still running or died. Restore a committed step.'
    )
  if (path / CHECKPOINT_METADATA).exists():
    return path, None, ()
  if has_tree(path) and (path.parent / CHECKPOINT_METADATA).exists():
    return path.parent, path.name, ()
  steps = list_steps(path)
  committed = [s for s in steps if s.committed]
  notes = tuple(
      f'skipped unfinished step {s.step} ({s.path.name})'
      for s in steps if not s.committed
  )
  if committed:
    return committed[-1].path, None, notes
  if steps:
    raise errors.UncommittedStepError(
        f'{path}: expected a committed step, found only unfinished ones:'
        f' {", ".join(s.path.name for s in steps)}. Wait for the writer to'
        ' finish, or restore from an earlier checkpoint.'
    )
  for role in RL_ROLES:
    if (path / role).is_dir():
      step_dir, item, more = resolve_step(path / role)
      return step_dir, item, (f'RL root: using {role}/',) + more
  raise errors.NotACheckpointError(
      f'{path}: expected an Orbax checkpoint (a root of numbered steps, a step'
      f' holding {CHECKPOINT_METADATA}, or an item holding {PYTREE_METADATA}),'
      ' found none of these. Check the path.'
  )


def require_step_dir(path: epath.Path) -> epath.Path:
  """Checks that `path` is a committed step directory, as Orbax restores take.

  Raises:
    NotACheckpointError: it does not exist, is a file, or is a root/other
      directory (the message names the step to use when there is one).
    UncommittedStepError: it is an unfinished step.
  """
  path = as_path(path)
  step_dir, item, _ = resolve_step(path)
  if step_dir != path or item is not None:
    raise errors.NotACheckpointError(
        f'{path}: expected a step directory (holding {CHECKPOINT_METADATA}),'
        f' found {"an item of" if item else "a checkpoint root containing"} one.'
        f' Pass the step directory instead, e.g. {step_dir}.'
    )
  return step_dir


def recorded_item_handlers(step_dir: epath.Path) -> dict[str, str | None]:
  """Item name -> handler typestr, as `_CHECKPOINT_METADATA` records them.

  Raises:
    CorruptMetadataError: the file is missing, damaged or not a JSON object.
  """
  meta = read_json(step_dir / CHECKPOINT_METADATA)
  if not isinstance(meta, dict):
    raise errors.CorruptMetadataError(
        f'{step_dir / CHECKPOINT_METADATA}: expected a JSON object with'
        f' "item_handlers", found {type(meta).__name__}. The file is damaged;'
        ' restore another step.'
    )
  handlers = meta.get('item_handlers')
  if isinstance(handlers, dict):
    return {str(k): v if isinstance(v, str) else None for k, v in handlers.items()}
  # Older or v1 writers may not list items: every subdirectory is one.
  return {
      child.name: None
      for child in step_dir.iterdir()
      if child.is_dir() and not child.name.startswith(('.', '_'))
  }


def _writer(handlers: Mapping[str, str | None]) -> str:
  if any(t and '.v1.' in t for t in handlers.values()):
    return 'v1'
  return 'v0'


def _classify(paths: Mapping[str, frozenset[Path]]) -> str:
  tunix_items = [paths[i] for i in rules.TUNIX_ITEMS if i in paths]
  if any(rules.NNX_VALUE.find('x', {'x': p}) for p in tunix_items):
    return 'tunix'
  if any(p[:2] == ('params', 'params') for p in paths.get('items', ())):
    return 'maxtext'
  return 'orbax'


def detect(path: epath.PathLike) -> Detection:
  """Says what a checkpoint path holds and which rewrites apply.

  Reads only JSON metadata (`_CHECKPOINT_METADATA`, each item's `_METADATA`).

  Args:
    path: a checkpoint root (the latest committed step is used; an RL root
      with `actor/` too), a step directory or an item directory.

  Returns:
    A `Detection`; `is_tunix` is False for plain Orbax and MaxText checkpoints.

  Raises:
    NotACheckpointError, UncommittedStepError, CorruptMetadataError,
    UnsupportedLayoutError: see their docstrings; each message names the path.
  """
  path = as_path(path)
  step_dir, item, notes = resolve_step(path)
  handlers = recorded_item_handlers(step_dir)
  paths = {name: tree_paths(step_dir / name) for name in handlers if has_tree(step_dir / name)}
  kind = _classify(paths)
  layouts = {}
  if kind == 'tunix':
    layouts = layout_lib.plan_step({i: paths[i] for i in rules.TUNIX_ITEMS if i in paths})
  return Detection(
      path=path,
      step_dir=step_dir,
      step=_step_number(step_dir.name),
      kind=kind,
      writer=_writer(handlers),
      item_handlers=handlers,
      layouts=layouts,
      item=item,
      notes=notes,
  )


def plan_item(item_dir: epath.Path) -> layout_lib.ItemLayout | None:
  """Plans the rewrites of one item directory, or None when it is not Tunix.

  The item's name says which Tunix item it is. For the optimizer the model
  item is consulted too, since the adapter level in mu/nu is recognised by
  comparison with the weights. Only JSON is read.

  Raises:
    CorruptMetadataError, UnsupportedLayoutError.
  """
  item_dir = as_path(item_dir)
  name = item_dir.name
  if name not in rules.TUNIX_ITEMS or not has_tree(item_dir):
    return None
  paths = {name: tree_paths(item_dir)}
  if not rules.NNX_VALUE.find(name, paths):
    return None
  # Only the optimizer's rules consult another item (the weights, to find the
  # adapter level in mu/nu): a params-only restore never parses the optimizer's
  # metadata, often twice the weights' size.
  model_dir = item_dir.parent / rules.MODEL_ITEM
  if name == rules.OPTIMIZER_ITEM and has_tree(model_dir):
    paths[rules.MODEL_ITEM] = tree_paths(model_dir)
  return layout_lib.plan_step(paths)[name]

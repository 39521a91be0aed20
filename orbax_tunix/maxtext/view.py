"""The checkpoint's side: the canonical leaves of one Tunix step, from metadata only.

`read_view` turns what `detect()` found into a `CheckpointView` (canonical
paths, and global shapes for the items asked for); no array is read.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping

from etils import epath

from orbax_tunix import errors, rules
from orbax_tunix.detect import Detection
from orbax_tunix.pytree_handler import TunixPyTreeHandler
from orbax_tunix.tree_paths import Path

Shape = tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class CheckpointView:
  """The canonical leaves of one Tunix step, from metadata only.

  Attributes:
    step_dir: the step directory.
    step: the number in the step directory's name, if any.
    model: canonical weight path -> global shape (None when not looked up).
    optimizer: canonical optimizer path -> global shape (None when not looked
      up), or None when the step has no optimizer item.
    side_paths: on-disk optimizer leaves outside the canonical view (the
      inject_hyperparams shell).
  """

  step_dir: epath.Path
  step: int | None
  model: Mapping[Path, Shape | None]
  optimizer: Mapping[Path, Shape | None] | None
  side_paths: tuple[Path, ...] = ()


def read_view(detection: Detection, *, shapes_of: Collection[str]) -> CheckpointView:
  """Collects the canonical leaves of a Tunix step.

  Args:
    detection: what `detect()` found (must be Tunix).
    shapes_of: items whose shapes to look up (from each array's zarr
      header); the others give paths only, from JSON.

  Returns:
    A `CheckpointView`.

  Raises:
    UnsupportedLayoutError: the step has no `model_params` item.
  """
  layouts = detection.layouts
  if rules.MODEL_ITEM not in layouts:
    raise errors.UnsupportedLayoutError(
        f'{detection.step_dir}: expected a Tunix {rules.MODEL_ITEM!r} item, found'
        f' items {list(detection.items)}. Only steps holding the weights can be'
        ' restored as a MaxText train state.'
    )

  handler = TunixPyTreeHandler()

  def canonical(item: str) -> dict[Path, Shape | None]:
    to_disk = layouts[item].canonical_to_disk
    if item not in shapes_of:
      return {p: None for p in to_disk}
    # The plan from `detect` is reused; only the arrays' small headers are read.
    shapes = handler.disk_shapes(detection.step_dir / item, frozenset(to_disk.values()))
    return {p: shapes.get(d) for p, d in to_disk.items()}

  has_optimizer = rules.OPTIMIZER_ITEM in layouts
  return CheckpointView(
      step_dir=detection.step_dir,
      step=detection.step,
      model=canonical(rules.MODEL_ITEM),
      optimizer=canonical(rules.OPTIMIZER_ITEM) if has_optimizer else None,
      side_paths=layouts[rules.OPTIMIZER_ITEM].side_paths if has_optimizer else (),
  )

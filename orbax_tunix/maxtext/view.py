"""The checkpoint's side: the canonical leaves of one Tunix step, from metadata only.

`read_view` turns what `detect()` found into a `CheckpointView` (canonical
paths, and global shapes for the items asked for); no array is read.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping

from etils import epath

from orbax_tunix import conventions, errors
from orbax_tunix.detection import Detection
from orbax_tunix.keypaths import Path

Shape = tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class CheckpointView:
  """The canonical leaves of one Tunix step, from metadata only.

  Attributes:
    detection: the step as detected (its items, read once, and their maps).
    step_dir: the step directory.
    step: the number in the step directory's name, if any.
    model: canonical weight path -> global shape (None when not looked up).
    optimizer: canonical optimizer path -> global shape (None when not looked
      up), or None when the step has no optimizer item.
    side_paths: on-disk optimizer leaves outside the canonical view (the
      inject_hyperparams shell).
  """

  detection: Detection
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
  maps = detection.maps
  if conventions.MODEL_ITEM not in maps:
    raise errors.UnsupportedLayoutError(
        f'{detection.step_dir}: expected a Tunix {conventions.MODEL_ITEM!r} item, found'
        f' items {list(detection.items)}. Only steps holding the weights can be'
        ' restored as a MaxText train state.'
    )

  def canonical(item: str) -> dict[Path, Shape | None]:
    to_disk = maps[item].canonical_to_disk
    if item not in shapes_of:
      return {p: None for p in to_disk}
    # Only the arrays' small headers (or one listing of the store) are read.
    shapes = detection.item_meta(item).shapes(to_disk.values())
    return {p: shapes.get(d) for p, d in to_disk.items()}

  has_optimizer = conventions.OPTIMIZER_ITEM in maps
  return CheckpointView(
      detection=detection,
      step_dir=detection.step_dir,
      step=detection.step,
      model=canonical(conventions.MODEL_ITEM),
      optimizer=canonical(conventions.OPTIMIZER_ITEM) if has_optimizer else None,
      side_paths=maps[conventions.OPTIMIZER_ITEM].side_paths if has_optimizer else (),
  )

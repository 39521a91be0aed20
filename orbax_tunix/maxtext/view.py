"""The checkpoint's side: the canonical leaves of one Tunix step, from metadata only
(`read_view` of what `detect()` found); no array is read.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping

from etils import epath

from orbax_tunix import conventions, errors
from orbax_tunix.keypaths import Path, fmt
from orbax_tunix.view.detection import Detection

Shape = tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class CheckpointView:
  """The canonical leaves of one Tunix step, from metadata only.

  Paths come from `_METADATA`; shapes are asked for only where they matter:
  `mismatched_shapes` checks what a plan reads, `shapes` fills messages.

  Attributes:
    detection: the step as detected (its items, read once, and their maps).
    step_dir: the step directory.
    step: the number in the step directory's name, if any.
    model: the canonical weight paths (and RNG state).
    optimizer: the canonical optimizer paths, or None when the step has no
      optimizer item.
    side_paths: on-disk optimizer leaves outside the canonical view (the
      inject_hyperparams shell).
  """

  detection: Detection
  step_dir: epath.Path
  step: int | None
  model: frozenset[Path]
  optimizer: frozenset[Path] | None
  side_paths: tuple[Path, ...] = ()

  @property
  def step_leaf(self) -> Path | None:
    """The optimizer's step, `(item, *canonical path)`, where the step holds one."""
    found = (conventions.OPTIMIZER_ITEM, *conventions.OPTIMIZER_STEP)
    return found if self.optimizer is not None and found[1:] in self.optimizer else None

  def stored(self, item: str, path: Path) -> str:
    """A canonical leaf as the checkpoint holds it: 'item/path/on/disk'."""
    return fmt((item, *self.detection.maps[item].canonical_to_disk[path]))

  def shapes(self, item: str, paths: Collection[Path]) -> dict[Path, Shape]:
    """Global shapes of some canonical leaves of `item` (their zarr headers)."""
    to_disk = self.detection.maps[item].canonical_to_disk
    found = self.detection.item_meta(item).shapes([to_disk[p] for p in paths])
    return {p: found[to_disk[p]] for p in paths if to_disk[p] in found}

  def mismatched_shapes(self, item: str, expected: Mapping[Path, Shape]) -> dict[Path, Shape]:
    """The canonical leaves of `item` whose stored shape is not the expected one."""
    if not expected:
      return {}
    to_disk = self.detection.maps[item].canonical_to_disk
    found = self.detection.item_meta(item).mismatched_shapes(
        {to_disk[p]: shape for p, shape in expected.items()}
    )
    return {p: found[to_disk[p]] for p in expected if to_disk[p] in found}


def read_view(detection: Detection) -> CheckpointView:
  """Collects the canonical leaves of a Tunix step (paths only; nothing is read).

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
  optimizer = maps.get(conventions.OPTIMIZER_ITEM)
  return CheckpointView(
      detection=detection,
      step_dir=detection.step_dir,
      step=detection.step,
      model=frozenset(maps[conventions.MODEL_ITEM].canonical_to_disk),
      optimizer=None if optimizer is None else frozenset(optimizer.canonical_to_disk),
      side_paths=optimizer.side_paths if optimizer is not None else (),
  )

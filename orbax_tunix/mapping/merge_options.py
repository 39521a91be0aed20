"""A LoRA merge's options, as `Option`s (one name each: the library's keyword, the command
line's flag, and what every message says), and `MergeOptions`, the one value they make.

Every function that merges takes them as keywords by these names (`MergeKeywords`):
`plan_convert`, `export_to_hf`, `restore_merged_lora`, MaxText's `restore_train_state`; and
`export_peft_adapter` the two of the scaling (`SCALING`). The command line adds their flags
from this catalog (`OPTIONS`).
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Callable, Mapping
from typing import Any, TypedDict

from etils import epath

from orbax_tunix import catalog, errors
from orbax_tunix.options import Option
from orbax_tunix.reading import quantized
from orbax_tunix.store import fileio


def _finite(text: str) -> float:
  """A scaling's number from its text: finite (a NaN or infinite one makes every merged
  weight NaN or infinite)."""
  try:
    value = float(text)
  except ValueError:
    raise ValueError(f'{text!r} is not a number.') from None
  if not math.isfinite(value):
    raise ValueError(f'{text!r}: expected a finite number (a NaN or infinite scale makes every'
                     ' merged weight NaN or infinite).')
  return value


def _tile(text: str) -> int:
  try:
    value = int(text)
  except ValueError:
    raise ValueError(f'{text!r} is not a tile size.') from None
  if value < 1:
    raise ValueError(f'{text!r}: a tile size is at least 1.')
  return value


def _finite_number(name: str) -> Callable[[Any], Any]:
  """A scaling's value as given (None: not given), refused unless a finite number."""

  def check(value: Any) -> Any:
    try:
      finite = value is None or (not isinstance(value, bool | str)
                                 and math.isfinite(float(value)))
    except (TypeError, ValueError):
      finite = False
    if not finite:
      raise errors.LoraError(
          f'`{name}={value!r}`: expected a finite number (the run\'s LoRA alpha, or the scale'
          ' alpha / rank itself); a NaN or infinite scale would make every merged weight NaN'
          ' or infinite. Pass the value the run was trained with.'
      )
    return value
  return check


MERGE_LORA = Option('merge_lora', bool, None, 'merge the LoRA adapters into the weights',
                    default=False)
LORA_ALPHA = Option('lora_alpha', _finite, 'A', "the run's qwix LoRA alpha (scale = alpha /"
                    ' rank); not stored in checkpoints', coerce=_finite_number('lora_alpha'))
LORA_SCALE = Option('lora_scale', _finite, 'S', 'the scale itself',
                    coerce=_finite_number('lora_scale'))
BASE = Option('base', str, 'BASE', 'the base weights for --merge-lora (a Tunix, MaxText or'
              ' canonical checkpoint); default: SRC itself (a full save)')
BASE_QTYPE = Option(
    'base_qtype', str, 'Q', 'an adapters-only QLoRA save: how the run quantized BASE (qwix\'s'
    f' weight_qtype: {", ".join(quantized.QTYPES)}); BASE is re-quantized so before the merge.'
    ' A full save holds its quantized base: not needed', choices=quantized.QTYPES)
BASE_TILE_SIZE = Option('base_tile_size', _tile, 'N',
                        "with --base-qtype: the run's tile_size (default: per channel)")
BASE_CALIBRATION = Option(
    'base_calibration', str, None,
    "with --base-qtype: the run's weight_calibration_method (default absmax)",
    choices=quantized.CALIBRATIONS)

# Every option of a merge, in the order the command line lists them.
OPTIONS: catalog.Catalog[Option] = catalog.Catalog('merge option')
for _option in (MERGE_LORA, LORA_ALPHA, LORA_SCALE, BASE, BASE_QTYPE, BASE_TILE_SIZE,
                BASE_CALIBRATION):
  OPTIONS.register(_option)
# The scaling: one or the other (the scale is alpha / rank).
SCALING = (LORA_ALPHA, LORA_SCALE)
# How an adapters-only QLoRA run quantized `base` (`quantized.Recipe`).
RECIPE = (BASE_QTYPE, BASE_TILE_SIZE, BASE_CALIBRATION)


class MergeSettings(TypedDict, total=False):
  """A merge's options as keywords (`OPTIONS`, less `merge_lora`): None, or left out, is
  not given."""

  lora_alpha: float | None
  lora_scale: float | None
  base: epath.PathLike | None
  base_qtype: str | None
  base_tile_size: int | None
  base_calibration: str | None


class MergeKeywords(MergeSettings, total=False):
  """Every option of `OPTIONS` as keywords, for a function that merges when asked."""

  merge_lora: bool


def renamed(function: str, given: dict[str, Any], old: Mapping[str, Option]) -> dict[str, Any]:
  """`given` with the keywords an earlier release spelled otherwise (`old`: its name -> the
  option) under the option's name, each with a DeprecationWarning.

  Raises:
    TypeError: an old name and its option's both given.
  """
  out = dict(given)
  for name, option in old.items():
    if name not in out:
      continue
    if option.name in out:
      raise TypeError(f'{function}() got `{name}` and `{option.name}`: pass `{option.name}`'
                      f' (`{name}` is its old name).')
    warnings.warn(f'{function}(): `{name}` is deprecated; pass `{option.name}`.',
                  DeprecationWarning, stacklevel=3)
    out[option.name] = out.pop(name)
  return out


def check_keywords(function: str, given: Mapping[str, Any], taken: Mapping[str, Any]) -> None:
  """Refuses a keyword `function` does not take, as Python does.

  Raises:
    TypeError: naming it.
  """
  unknown = sorted(set(given) - set(taken))
  if unknown:
    raise TypeError(f'{function}() got unexpected keyword arguments: {", ".join(unknown)}')


def check_scaling(alpha: Any, scale: Any) -> None:
  """Refuses a LoRA scaling that is not one finite number; reads nothing.

  Raises:
    LoraError: both given, or one that is not a finite number (a NaN or infinite scale
      would write NaN or infinite weights).
  """
  if alpha is not None and scale is not None:
    raise errors.LoraError(
        f'pass {LORA_ALPHA.named()} or {LORA_SCALE.named()}, not both (the scale is'
        ' alpha / rank).')
  for option, value in zip(SCALING, (alpha, scale), strict=True):
    option.coerce(value)


def _recipe(base: Any, qtype: str | None, tile_size: int | None, calibration: str | None
            ) -> quantized.Recipe | None:
  """The quantization recipe of an adapters-only QLoRA save's base, checked (nothing read).

  Raises:
    LoraError: a tile size or calibration without a qtype; a recipe without a base; a
      qtype, tile size or calibration qwix does not take.
  """
  if qtype is None:
    extra = [o for o, v in ((BASE_TILE_SIZE, tile_size), (BASE_CALIBRATION, calibration))
             if v is not None]
    if extra:
      raise errors.LoraError(
          f'{extra[0].named()} given without {BASE_QTYPE.named()}: they describe how a QLoRA'
          f' run quantized its base. Pass {BASE_QTYPE.named()} too (the run\'s weight_qtype:'
          f' one of {", ".join(quantized.QTYPES)}), or drop {extra[0].named()}.')
    return None
  if base is None:
    raise errors.LoraError(
        f'{BASE_QTYPE.named(qtype)} without {BASE.named()}: it says how a QLoRA run quantized'
        f' the float base that {BASE.named()} names, for an adapters-only save. A full save'
        f' holds its quantized base and says how (drop {BASE_QTYPE.named()}); for adapters'
        f' only, pass {BASE.named()} too.')
  try:
    return quantized.Recipe(qtype, tile_size, calibration or 'absmax')
  except ValueError as e:
    raise errors.LoraError(f'{", ".join(o.named() for o in RECIPE)}: {e}') from None


@dataclasses.dataclass(frozen=True)
class MergeOptions:
  """A LoRA merge's options as one value, checked once (`given`), from its callers' keywords
  down to `merge.plan_merge`.

  Attributes:
    alpha: qwix's LoRA alpha of the run (`lora_alpha`; the scale is alpha / rank).
    scale: the scale itself (`lora_scale`), instead of `alpha`.
    base: the base weights' checkpoint (`base`; None: the run's own, a full save).
    base_quantized: how the run quantized `base` before training (an adapters-only QLoRA
      save: `base_qtype`, `base_tile_size`, `base_calibration`): the merge re-quantizes it so.
      None: `base` as stored.
  """

  alpha: float | None = None
  scale: float | None = None
  base: epath.PathLike | None = None
  base_quantized: quantized.Recipe | None = None

  @classmethod
  def given(cls, values: Mapping[str, Any], merging: bool | None = None) -> MergeOptions | None:
    """The options of a merge, or None without one; nothing is read.

    Args:
      values: the options by name (`OPTIONS`: the caller's keywords; None or left out: not
        given).
      merging: whether the caller merges (None: as `merge_lora` says).

    Raises:
      LoraError: options without a merge (the adapters would be copied unmerged); a scaling
        that is not finite (`check_scaling`); a recipe without `base` or without its qtype,
        or one qwix does not take.
    """
    if merging is None:
      merging = bool(values.get(MERGE_LORA.name, False))
    given = [o for o in OPTIONS.values() if o is not MERGE_LORA
             and values.get(o.name) is not None]
    if given and not merging:
      one = len(given) == 1
      raise errors.LoraError(
          f'{" and ".join(o.named() for o in given)}'
          f' {"is an option" if one else "are options"} of a LoRA merge (without one the'
          f' adapters would be copied unmerged): add {MERGE_LORA.named(True)}, or drop'
          f' {"it" if one else "them"}.'
      )
    alpha, scale, base = (values.get(o.name) for o in (*SCALING, BASE))
    check_scaling(alpha, scale)
    recipe = _recipe(base, *(values.get(o.name) for o in RECIPE))
    return cls(alpha, scale, base, recipe) if merging else None

  def asked(self) -> dict[str, Any]:
    """The options given, by their names (`base` a path, as what it is, not as it was
    written); those not given left out."""
    recipe = self.base_quantized
    values = {LORA_ALPHA: self.alpha, LORA_SCALE: self.scale,
              BASE: None if self.base is None else fileio.as_path(self.base)}
    if recipe is not None:
      values |= dict(zip(RECIPE, (recipe.qtype, recipe.tile_size, recipe.calibration),
                         strict=True))
    return {o.name: v for o, v in values.items() if v is not None}


# A merge given no option (a full save of flax adapters needs none).
NONE = MergeOptions()

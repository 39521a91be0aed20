"""A decoder's layers, as data: `LayerForm`, the one model of how they are stored.

MaxText 0.2.5 stores a decoder's layers in one of several forms (printed from
`nnx.state` of tiny models built with MaxText itself; `A` is `param_scan_axis`,
1 by default):

  form                      arrays                                          layer
  unscanned                 decoder/layers_{i}/<w>                          i
  scanned                   decoder/layers/<w>, layers on A                 a
  gemma3 scanned            decoder/layers/layers_{j}/<w>, blocks on A      6a + j
                            decoder/layers_remainder/layers_{j}/<w>         6·blocks + j
  gpt-oss scanned           decoder/layers/layers_{j}/<w>, blocks on A      2a + j
  local/global scanned      decoder/scanned_blocks/local_layers/<w>,        6a + k
                              blocks on A, the 5 local layers on A+1
                            decoder/scanned_blocks/global_layer/<w>, on A   6a + 5
                            decoder/layers_remainder/local_layers/<w>, on A 6·blocks + a
  deepseek scanned          decoder/dense_layers/<w>, on A                  a
                            decoder/moe_layers/<w>, on A (the routing bias  dense + a
                              gate/bias, no nnx.Param: on axis 0)
  deepseek unscanned        decoder/dense_layers_{j}/<w>                    j
                            decoder/moe_layers_{j}/<w>                      dense + j
  deepseek V4 scanned       decoder/layers_{i}/<w> (its hash layers)        i
                            decoder/scanned_blocks/layers_{k}/<w>, on A     hash + 2a + k
  qwen3-next scanned        decoder/layers/local_layers/<w>, blocks on A,   4a + k
                              the 3 linear-attention layers on A+1
                            decoder/layers/global_layer/<w>, on A           4a + 3
                            decoder/layers_remainder/local_layers/<w>, on A 4·blocks + a
  qwen3.5 scanned           decoder/layers/layer_{j}/<w>, blocks on A       4a + j
  gemma2                    as scanned or unscanned, MaxText's layer i      2i + k
                              holding two: <m>_local/... (k = 0) and
                              <m>_global/... (k = 1)

(MaxText's MoE decoders, qwen3's, are in the plain scanned form: a stacked expert
weight holds its experts on axis 0 and its layers on A.)

A `LayerForm` is one of them: per layer (`UNSCANNED`), or blocks of `period` layers
and a remainder, held by its `Stack`s (the arrays under one prefix, holding layers
on `depth` axes from A on, at some positions of each block). Everything about layer
forms is asked of it, by every layout:

  unstack(shapes, axis)    every layer's weights as `decoder/layers_{i}/<w>` (the rest
                           as it is)
  restack(shapes, axis)    per-layer weights into the form's stacks, layers on `axis`
  axes(shapes)             the axes along which the stacked weights may hold their layers
  axis(shapes, ...)        the layer axis: the one given, the one the step records, or
                           the one the shapes (and a target's layer count) tell; one that
                           does not fit is refused, naming the weights
  count(shapes, axis)      how many layers the weights hold

`relay` puts weights from one form (and axis) into another. Planning only: each
result says which source arrays and which transform make each weight. A family's
naming carries its form (`mapping/huggingface.py`); the forms a step may be in are
the families' (`huggingface.layer_forms`), and `form_of` says which holds weights.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
from collections.abc import Iterable, Mapping, Sequence

from orbax_tunix import errors
from orbax_tunix.errors import LayerScanMismatchError
from orbax_tunix.keypaths import Path, fmt
from orbax_tunix.mapping.patterns import Mapped, Pattern
from orbax_tunix.mapping.transforms import (
  IDENTITY,
  Shape,
  Transform,
  TransformError,
  chain,
  move_axis,
  split_axis,
  stack,
  take,
)

# MaxText's `param_scan_axis` default.
DEFAULT_AXIS = 1
SCANNED = 'scanned'
UNSCANNED_NAME = 'unscanned'
# Custom metadata keys of a converted step: the form (MaxText's own key) and the axis.
SCAN_LAYERS_KEY = 'scan_layers'
SCAN_AXIS_KEY = 'param_scan_axis'
# The most axes a stack holds layers on (a scan within a scan: a block's local layers).
MAX_DEPTH = 2
# One layer's weights, in every form taken apart.
LAYER = ('decoder', 'layers_{i}')
# Where a layer is: (its stack's number, the stack's `{j}` or None, its index on the axes).
Place = tuple[int, int | None, tuple[int, ...]]


@functools.cache
def _pattern(keys: tuple[str, ...]) -> Pattern:
  return Pattern.parse((*keys, '...'))


@functools.cache
def _exact(text: str) -> Pattern:
  return Pattern.parse(tuple(text.split('/')))


@dataclasses.dataclass(frozen=True)
class Stack:
  """Layers stacked in arrays under one prefix.

  Attributes:
    prefix: the arrays' path up to the weight's own name (`{j}`: a number in the
      path, e.g. gemma3's position in the block).
    depth: how many axes hold layers, from `param_scan_axis` on: 1 scanned, 2 a
      scan within a scan, 0 none (one layer, numbered in the path only).
    positions: the positions in each block of the layers it holds (its `{j}`, or its
      second layer axis, numbers them from the first). Every layer of a stack holds the
      same weights, of one shape a weight (a block's layers of other weights are another
      stack: a block's global one).
    remainder: it holds the layers after the last whole block instead (numbered by
      its `{j}` or its layer axis).
    per_layer: one array per layer, as MaxText writes the form unscanned (`scan_layers=False`:
      DeepSeek's `dense_layers_{j}`, numbered by its `{j}`; depth 0): weights held only by
      such stacks are an unscanned decoder (`LayerForm.held_by`).
    mixed: its numbered positions hold layers of different kinds, each its own weights
      (Qwen3.5's three linear-attention layers then a full one; DeepSeek V4's blocks), so
      `LayerForm.damage` does not ask every position for the same weights.
  """

  prefix: tuple[str, ...]
  depth: int = 1
  positions: tuple[int, ...] = (0,)
  remainder: bool = False
  per_layer: bool = False
  mixed: bool = False

  def __post_init__(self):
    if not 0 <= self.depth <= MAX_DEPTH:
      raise ValueError(f'{self.prefix}: depth {self.depth}, expected 0 .. {MAX_DEPTH}')

  @property
  def numbered(self) -> bool:
    return any('{j}' in k for k in self.prefix)

  def path(self, j: int | None) -> Path:
    return tuple(k.replace('{j}', str(j)) for k in self.prefix)


@dataclasses.dataclass(frozen=True)
class LayerForm:
  """One way a decoder stores its layers (see the module docstring).

  Attributes:
    name: for people ('scanned', "gemma3's scanned blocks of 6", ...).
    stacks: the arrays holding layers; none: one array per layer (`LAYER`).
    period: the layers of a block (1: each layer a block of its own).
    axis_zero: weights (their path within a layer, `/`-joined patterns) that nnx.scan stacks
      on axis 0 whatever `param_scan_axis`: MaxText's variables that are not an nnx.Param
      (DeepSeek's routing bias, an `MoEBiasVar`: its `_build_linen_params` says so).
    leading: the blocks are a model's first layers, as many as the arrays hold (DeepSeek's
      `first_num_dense_layers`, each layer a block), the remainder the rest: the arrays tell
      where the leading layers end, per-layer weights and a layer count do not (`place`
      cannot say, and `restack` refuses).
    after_layers: the stacks' layers come after the per-layer ones (`decoder/layers_{i}`) the
      weights hold besides (DeepSeek V4's hash layers, kept unscanned before its scanned
      blocks), numbered on from them (`restack` refuses: their count is the model's own).
    sublayers: where one stored layer holds several of the model's (gemma2: MaxText's layer
      i is Hugging Face's local layer 2i and global layer 2i + 1), the suffix each one's
      modules carry, in order (`_local`, `_global`): `unstack` makes stored layer i's module
      `<m><suffix k>` module `<m>` of layer `len(sublayers)·i + k`, `restack` joins them
      back, `count` counts the model's layers. Empty: a stored layer is one layer.
  """

  name: str
  stacks: tuple[Stack, ...] = ()
  period: int = 1
  axis_zero: tuple[str, ...] = ()
  leading: bool = False
  after_layers: bool = False
  sublayers: tuple[str, ...] = ()

  def place(self, i: int, n: int) -> Place:
    """Where layer `i` of `n` is."""
    last = next((k for k, s in enumerate(self.stacks) if s.remainder), None)
    full = n if last is None else n // self.period * self.period
    if i >= full:
      s, at = self.stacks[last], i - full
      return last, at if s.numbered else None, () if s.numbered else (at,)
    block, at = divmod(i, self.period)
    k, s = next((k, s) for k, s in enumerate(self.stacks)
                if not s.remainder and at in s.positions)
    return k, at if s.numbered else None, (block, at - s.positions[0])[:s.depth]

  def layer(self, place: Place, blocks: int) -> int:
    """The number of the layer at `place`, in a decoder of `blocks` whole blocks."""
    k, j, index = place
    s = self.stacks[k]
    at = j if s.numbered else index[-1] if s.remainder or s.depth > 1 else s.positions[0]
    if s.remainder:
      return self.period * blocks + at
    if not index:  # One array per block, numbered by its `{j}` (a `per_layer` stack).
      return self.period * j + s.positions[0]
    return self.period * index[0] + at + (s.positions[0] if s.depth > 1 else 0)

  @property
  def scanned(self) -> bool:
    """Some of its stacks hold layers stacked (`per_layer` ones do not: MaxText's unscanned
    DeepSeek layers are a form of their own, unscanned)."""
    return any(not s.per_layer for s in self.stacks)

  @property
  def stored(self) -> LayerForm:
    """The form as MaxText stores and re-lays its own layers: without `sublayers` (gemma2's
    MaxText layers stacked as they are, each holding two of the model's)."""
    return dataclasses.replace(self, sublayers=()) if self.sublayers else self

  @property
  def kind(self) -> str:
    """SCANNED or UNSCANNED_NAME, as the step's custom metadata and `inspect` say."""
    return SCANNED if self.scanned else UNSCANNED_NAME

  def held_by(self, paths: Iterable[Path]) -> LayerForm:
    """The form these weights are in: itself, or where only its `per_layer` stacks hold them,
    the form of those alone (unscanned: DeepSeek's `dense_layers_{j}`, `moe_layers_{j}`)."""
    held = {hit[0] for p in paths if (hit := self._find(p)) is not None}
    if not held or not all(self.stacks[k].per_layer for k in held):
      return self
    return dataclasses.replace(self, stacks=tuple(s for s in self.stacks if s.per_layer))

  def _axis(self, weight: Path, axis: int) -> int:
    """The first layer axis of a stacked weight (its path within a layer): 0 for the
    `axis_zero` weights, else `axis` (`param_scan_axis`)."""
    return 0 if any(_exact(w).match(weight) is not None for w in self.axis_zero) else axis

  def _find(self, path: Path) -> tuple[int, int | None, Path] | None:
    """(stack, its `{j}`, the weight's own path) of an array in one of the stacks."""
    for k, s in enumerate(self.stacks):
      if (m := _pattern(s.prefix).match(path)) is not None:
        return k, int(m[0]['j']) if 'j' in m[0] else None, tuple(m[1])
    return None

  def holds(self, path: Path) -> bool:
    return self._find(path) is not None

  def layer_axes(self, path: Path, axis: int = DEFAULT_AXIS) -> tuple[int, ...]:
    """The axes of the array at `path` that hold layers, outermost first (none: a weight
    of one layer, or no layer's)."""
    hit = self._find(path)
    if hit is None:
      return ()
    first = self._axis(hit[2], axis)
    return tuple(range(first, first + self.stacks[hit[0]].depth))

  def _stacked(self, shapes: Mapping[Path, Shape | None]
               ) -> list[tuple[int, int | None, Path, Path, Shape]]:
    """(stack, j, weight, path, shape) of each array of `shapes` in a stack (known shapes)."""
    return [(*hit, p, tuple(s)) for p, s in sorted(shapes.items())
            if s is not None and (hit := self._find(p)) is not None]

  def _on_axes(self, shapes, axis: int) -> dict[Path, tuple[int, ...] | None]:
    """Each stacked array (on layer axes) -> its sizes on the layer axes from `axis` on
    (None: it lacks them); an `axis_zero` weight's from axis 0 on."""
    out = {}
    for k, _, w, p, s in self._stacked(shapes):
      depth, at = self.stacks[k].depth, self._axis(w, axis)
      if depth:
        out[p] = s[at:at + depth] if at + depth <= len(s) else None
    return out

  def _per_stack(self, shapes, axis: int) -> dict[Path, list[Path]]:
    """Each stack's prefix -> its arrays (those on layer axes)."""
    out: dict[Path, list[Path]] = {}
    for k, _, _, p, _ in self._stacked(shapes):
      if self.stacks[k].depth:
        out.setdefault(self.stacks[k].prefix, []).append(p)
    return out

  def axes(self, shapes: Mapping[Path, Shape | None]) -> tuple[int, ...]:
    """The axes along which each stack's arrays all hold one number of layers (the
    axes where the layers can be); () when no array holds layers on an axis."""
    per_stack = self._per_stack(shapes, 0)
    if not per_stack:
      return ()
    rank = max(len(s) for s in shapes.values() if s is not None)
    fits = []
    for axis in range(rank):
      sizes = self._on_axes(shapes, axis)
      held = {prefix: {sizes[p] for p in ps} for prefix, ps in per_stack.items()}
      if any(None in h or len(h) != 1 for h in held.values()):
        continue
      # The block stacks hold as many blocks each, a scan within a scan its positions.
      whole = [(s, *held[s.prefix]) for s in self.stacks if s.prefix in held and not s.remainder]
      if len({n[0] for _, n in whole}) <= 1 and all(
          s.depth < 2 or n[1] == len(s.positions) for s, n in whole):
        fits.append(axis)
    return tuple(fits)

  def _slots(self, shapes, axis: int) -> set[Place] | None:
    """Every (stack, j, index) some array holds a layer at (None: a stack's arrays
    disagree along the layer axes)."""
    sizes = self._on_axes(shapes, axis)
    if any(len({sizes[p] for p in ps}) != 1 for ps in self._per_stack(shapes, axis).values()):
      return None
    if None in sizes.values():
      return None
    return {(k, j, index) for k, j, _, p, s in self._stacked(shapes)
            for index in itertools.product(*(range(n) for n in sizes.get(p, ())))}

  def count(self, shapes: Mapping[Path, Shape | None], axis: int = DEFAULT_AXIS) -> int | None:
    """How many layers the weights hold: the stacked ones' (None where a stack's arrays
    disagree along `axis`; with the per-layer ones before them: `after_layers`), else the
    per-layer ones numbered."""
    per = max(1, len(self.sublayers))
    if not self._stacked(shapes):
      return per * len({i for p in shapes if (i := layer_of(p)) is not None})
    slots = self._slots(shapes, axis)
    return None if slots is None else per * len(slots) + self._before(shapes)

  def _before(self, shapes: Mapping[Path, Shape | None]) -> int:
    """How many per-layer layers come before the stacks' (`after_layers`; else none)."""
    if not self.after_layers:
      return 0
    return len({i for p in shapes if not self.holds(p) and (i := layer_of(p)) is not None})

  def damage(self, shapes: Mapping[Path, Shape | None]) -> list[str]:
    """What keeps the stacked weights from being whole blocks of this form (none: nothing):
    a stack of the blocks missing where another is held, a position of a block missing from a
    numbered stack (or one no block has), a gap in a numbered remainder, or a layer of a
    numbered stack lacking a weight the others hold, or holding one of another shape."""
    held: dict[int, dict[int | None, dict[Path, Shape]]] = {}
    for k, j, rest, _, shape in self._stacked(shapes):
      held.setdefault(k, {}).setdefault(j, {})[rest] = shape
    blocks = any(not self.stacks[k].remainder for k in held)
    per_layer = bool(held) and all(self.stacks[k].per_layer for k in held)
    problems = []
    for k, s in enumerate(self.stacks):
      if s.per_layer != per_layer:  # The form's other kind (DeepSeek's unscanned stacks beside
        continue  # its scanned ones): no part of these weights' blocks.
      found = held.get(k, {})
      if s.remainder:  # Any number of layers, or none; numbered from 0.
        want = range(max(found) + 1) if s.numbered and found else ()
      else:
        want = (s.positions if s.numbered else (None,)) if blocks else ()
      problems += [f'{fmt(s.path(j) if s.numbered else s.prefix)}/...: missing' + (
          '' if s.numbered else ', though the block\'s other stacks are held')
          for j in want if j not in found]
      if s.numbered and not s.remainder:
        problems += [f'{fmt(s.path(j))}/...: no position of a block of {self.period}'
                     f' (layers_{s.positions[0]} .. layers_{s.positions[-1]})'
                     for j in sorted(found) if j not in s.positions]
      if s.numbered and not s.mixed:
        problems += _unlike({fmt(s.path(j)): found[j] for j in sorted(found)},
                            'the other positions')
    return problems

  def unstack(self, shapes: Mapping[Path, Shape | None], axis: int = DEFAULT_AXIS, *,
              where: str = '') -> dict[Path, Mapped]:
    """Every weight per layer (`decoder/layers_{i}/<w>`), from the stacks or as stored.

    Args:
      shapes: the weights (canonical paths) -> shapes (None: not known, only for
        weights outside the stacks).
      axis: `param_scan_axis`.
      where: the checkpoint, for messages.

    Returns:
      path -> `Mapped` (one source, `take`s or identity), for every weight.

    Raises:
      UnsupportedLayoutError: a stacked array without the layer axes, or two arrays
        making one layer's weight.
    """
    out: dict[Path, Mapped] = {}
    problems: list[str] = []
    parts = []
    for path, shape in shapes.items():
      hit = self._find(path) if shape is not None else None
      if hit is None:
        _put(out, path, Mapped((path,), IDENTITY, None if shape is None else tuple(shape)),
             problems)
        continue
      k, j, rest = hit
      first = self._axis(rest, axis)
      axes = tuple(range(first, first + self.stacks[k].depth))
      if axes and axes[-1] >= len(shape):
        problems.append(f'{fmt(path)} {tuple(shape)}: expected layers on axes {list(axes)}'
                        f' (param_scan_axis={axis})')
        continue
      parts += [(k, j, rest, path, tuple(shape), axes, index)
                for index in itertools.product(*(range(shape[a]) for a in axes))]
    # Whole blocks: how many a block's stacks hold (none given: the remainder's alone).
    # (A `per_layer` stack's array is one block, numbered by its `{j}`.)
    blocks = max(((index[0] if index else j) + 1 for k, j, *_, index in parts
                  if not self.stacks[k].remainder), default=0)
    before = self._before(shapes)
    for k, j, rest, path, shape, axes, index in parts:
      i = before + self.layer((k, j, index), blocks)
      # Taken innermost first: an outer take would move the inner axis.
      transform = chain(*(take(a, at) for a, at in sorted(zip(axes, index, strict=True),
                                                          reverse=True)))
      kept = tuple(size for d, size in enumerate(shape) if d not in axes)
      _put(out, (*layer_path(i), *rest), Mapped((path,), transform, kept), problems)
    if problems:
      raise errors.UnsupportedLayoutError(
          f'{where}: the decoder\'s stacked layers do not fit MaxText\'s forms:\n'
          f'{errors.list_paths(problems)}\nPass the param_scan_axis the model was built with.'
      )
    return self._split(out, where) if self.sublayers else out

  def _sublayer(self, path: Path) -> tuple[int, int, str] | None:
    """(stored layer, which of its sublayers, the module's own name) of a per-layer weight
    whose module carries one of `sublayers`' suffixes, else None."""
    i = layer_of(path)
    if i is None or len(path) <= len(LAYER) + 1:
      return None
    module = path[len(LAYER)]
    return next(((i, k, module[:-len(s)]) for k, s in enumerate(self.sublayers)
                 if module.endswith(s) and len(module) > len(s)), None)

  def _split(self, out: dict[Path, Mapped], where: str) -> dict[Path, Mapped]:
    """The per-layer weights of stored layers that hold several of the model's layers
    (`sublayers`), each under its own layer.

    Raises:
      UnsupportedLayoutError: a stored layer's weight whose module carries no suffix.
    """
    split: dict[Path, Mapped] = {}
    problems: list[str] = []
    for path, mapped in out.items():
      if layer_of(path) is None:
        split[path] = mapped
      elif (found := self._sublayer(path)) is None:
        problems.append(f'{fmt(path)}: its module carries none of {list(self.sublayers)}')
      else:
        i, k, module = found
        dest = (*layer_path(len(self.sublayers) * i + k), module, *path[len(LAYER) + 1:])
        _put(split, dest, mapped, problems)
    if problems:
      raise errors.UnsupportedLayoutError(
          f'{where}: expected each decoder layer to hold {len(self.sublayers)} layers, every'
          f' module named with one of {list(self.sublayers)} ({self.name}), found:\n'
          f'{errors.list_paths(problems)}\nThese weights are not this family\'s: pick the'
          ' family the model is.')
    return split

  def restack(self, shapes: Mapping[Path, Shape | None], axis: int = DEFAULT_AXIS, *,
              where: str = '') -> dict[Path, Mapped]:
    """Per-layer weights (`decoder/layers_{i}/<w>`) into the form's stacks, the layers
    along `axis` (the rest as it is).

    Raises:
      LayerScanMismatchError: the layers are not one decoder of this form (`layers`).
      UnsupportedLayoutError: `axis` does not fit the weights.
    """
    if self.leading or self.after_layers:
      raise errors.UnsupportedLayoutError(
          f'{where}: per-layer weights (decoder/layers_<i>) do not say how many of their layers'
          f' {self.name} keeps apart (a model\'s own count: DeepSeek\'s first_num_dense_layers,'
          ' V4\'s first_num_hash_layers): they cannot be stacked so. Convert the layers as they'
          ' are stored.')
    if self.sublayers:  # The model's layers joined into the stored ones first.
      n = len(self.sublayers)
      joined = {p if (i := layer_of(p)) is None else
                (*layer_path(i // n), p[len(LAYER)] + self.sublayers[i % n],
                 *p[len(LAYER) + 1:]): p for p in shapes}
      made = dataclasses.replace(self, sublayers=()).restack(
          {j: shapes[p] for j, p in joined.items()}, axis, where=where)
      return {d: Mapped(tuple(joined[s] for s in m.sources), m.transform, m.shape)
              for d, m in made.items()}
    layers = self.layers(shapes, where)
    kept = [(p, (p,), IDENTITY) for p in shapes if not self.stacks or layer_of(p) is None]
    if not self.stacks:
      return _made(kept, shapes)
    groups: dict[tuple[int, Path], dict[tuple[int, ...], Path]] = {}
    for i, weights in layers.items():
      k, j, index = self.place(i, len(layers))
      for w in weights:
        groups.setdefault((k, (*self.stacks[k].path(j), *w)), {})[index] = (*layer_path(i), *w)
    stacked = []
    for (k, dest), parts in sorted(groups.items()):
      order = sorted(parts)
      sizes = tuple(max(index[d] for index in order) + 1 for d in range(self.stacks[k].depth))
      stacked.append((dest, tuple(parts[index] for index in order),
                      _stacking(self._axis(dest[len(self.stacks[k].prefix):], axis), sizes)))
    return _made(kept + stacked, shapes,
                 f'{where}: the layers cannot be stacked as {self.name}, along'
                 f' param_scan_axis={axis}')

  def layers(self, shapes: Mapping[Path, Shape | None], where: str = ''
             ) -> dict[int, dict[Path, Shape]]:
    """The per-layer weights, layer by layer: layers 0 .. n-1, the layers of one stack
    (one `place` stack and `j`) holding the same weights, of one shape a weight.

    Raises:
      LayerScanMismatchError: a layer missing, lacking a weight the others of its stack
        hold, or holding one of another shape (naming them).
    """
    per: dict[int, dict[Path, Shape]] = collections.defaultdict(dict)
    for p, s in shapes.items():
      if s is not None and (i := layer_of(p)) is not None:
        per[i][p[len(LAYER):]] = tuple(s)
    if not per:
      return {}
    n = max(per) + 1
    problems = [f'layers_{i}: missing' for i in range(n) if i not in per]
    groups: dict[object, list[int]] = collections.defaultdict(list)
    for i in sorted(per):  # The layers of one stack alike (`Stack`; of one position: `mixed`).
      at = self.place(i, n) if self.stacks and not problems else None
      groups[None if at is None else at[:2] if self.stacks[at[0]].mixed else at[0]].append(i)
    for members in groups.values():
      problems += _unlike({f'layers_{i}': per[i] for i in members}, 'the other layers')
    if problems:
      alike = ('of each stack of ' + self.name) if len(groups) > 1 else 'each'
      raise LayerScanMismatchError(
          f'{where}: expected the unscanned layers decoder/layers_0 .. layers_{n - 1} to hold'
          f' the same weights {alike}, of one shape a weight, found:\n'
          f'{errors.list_paths(problems)}\nThese weights are not one unscanned MaxText decoder:'
          ' check how the step was written.'
      )
    return dict(sorted(per.items()))

  def axis(self, shapes: Mapping[Path, Shape | None], given: int | None = None, *,
           recorded: int | None = None, count: int | None = None, where: str = '') -> int:
    """The layer axis of stored stacked weights: `given`, else `recorded`, else the one
    their shapes allow (MaxText's default where several do, or the one holding `count`
    layers), checked against the shapes.

    Args:
      shapes: the stored weights -> shapes (those outside the stacks ignored).
      given: the axis the caller names (None: not named).
      recorded: the step's custom metadata `param_scan_axis` (`step_layers.recorded`).
      count: the layer count wanted (a target's), to choose between axes.
      where: the checkpoint, for messages.

    Raises:
      InvalidOptionError: a `given` axis that is not a non-negative int, or one given for
        weights that hold none of the form's stacks.
      LayerScanMismatchError: the stacked weights are not whole blocks of the form
        (`damage`); `recorded` does not fit the shapes and `given` does not name an axis
        that does (the record contradicts the arrays: a `given` axis they fit is taken);
        `given` other than a `recorded` axis that fits; several axes fit and none is
        MaxText's default; the weights do not hold one number of layers along the axis
        (naming each such weight and its shape; another axis is suggested only when every
        weight agrees on it).
    """
    check_axis(given)
    if given is not None and not any(map(self.holds, shapes)):
      raise errors.InvalidOptionError(
          f'{where}: `param_scan_axis` {given}: the weights hold no stacked layers (none'
          f' stacked as {self.name}: they are unscanned, or no MaxText model\'s); leave'
          ' `param_scan_axis` out.')
    if damage := self.damage(shapes):
      raise LayerScanMismatchError(
          f'{where}: expected the scanned layers to be whole blocks of {self.name}'
          f' ({", ".join(fmt(s.prefix) + "/..." for s in self.stacks)}): every stack and'
          ' position of a block held, the layers of a stack holding the same weights, of one'
          f' shape a weight; found:\n{errors.list_paths(damage)}\nThese weights are not one'
          ' scanned MaxText decoder: check how the step was written.'
      )
    axis = recorded if given is None else given
    axes = self.axes(shapes) if self._on_axes(shapes, 0) else None
    if recorded is not None and (against := self._against_record(shapes, given, recorded, axes,
                                                                  where)):
      raise LayerScanMismatchError(against)
    if axes is None:  # Nothing holds layers on an axis to tell it.
      return DEFAULT_AXIS if axis is None else axis
    if axis is None:
      fits = [a for a in axes if count is None or self.count(shapes, a) == count]
      # No axis holds the target's count: refused by the caller, which names both counts.
      fits = fits or [DEFAULT_AXIS if DEFAULT_AXIS in axes else a for a in axes[:1]]
      if len(fits) > 1 and DEFAULT_AXIS not in fits:
        raise LayerScanMismatchError(
            f'{where}: the scanned layers could be stacked along any of axes {fits} (every'
            ' stacked weight has one size along each). Pass `param_scan_axis`.'
        )
      axis = DEFAULT_AXIS if DEFAULT_AXIS in fits else fits[0] if fits else None
    if axis is not None and axis in axes:
      return axis
    raise LayerScanMismatchError(self._misfit(shapes, axis, axes, where))

  def _against_record(self, shapes, given: int | None, recorded: int,
                      axes: Sequence[int] | None, where: str) -> str | None:
    """Why the recorded axis and the given one (if any) cannot both stand, or None: the
    record is taken where the arrays fit it (or cannot tell), a given axis where the arrays
    fit it and not the record."""
    record = f'the step records its layers stacked along axis {recorded} (custom metadata' \
             f' {SCAN_AXIS_KEY!r})'
    if axes == ():  # The arrays agree on no axis: `_misfit` says how they differ.
      return None
    if given in (None, recorded) and (axes is None or recorded in axes):
      return None
    if axes is None or recorded in axes:  # The record stands: the arrays fit it, or say nothing.
      fit = '' if axes is None else ', and its arrays fit that' + (
          f' (and axis {given} too: the record decides)' if given in axes else
          f', not axis {given}')
      return (f'{where}: `param_scan_axis` {given}, but {record}{fit}. Pass'
              f' `param_scan_axis={recorded}`, or leave it out.')
    if given in axes:
      return None  # The arrays fit the axis given, not the record: the user is right.
    best = DEFAULT_AXIS if DEFAULT_AXIS in axes else axes[0]
    held = self._on_axes(shapes, axes[0])[min(self._on_axes(shapes, 0))]
    return (
        f'{where}: {record}, but its arrays hold them along axis'
        f' {" or ".join(map(str, axes))} (every stacked weight has {_sizes(held)} there), not'
        f' along {recorded}' + ('' if given in (None, recorded) else f' nor along the given'
                                f' {given}')
        + f': the record contradicts the arrays. Pass `param_scan_axis={best}` to read the'
        ' layers along the axis they fit.'
    )

  def _misfit(self, shapes, axis: int | None, axes: Sequence[int], where: str) -> str:
    """Why the stacked weights do not hold their layers along `axis`."""
    on_axes = self._on_axes(shapes, 0)
    stacked = {p: s for _, _, _, p, s in self._stacked(shapes) if p in on_axes}
    if axis is not None and axes:
      sizes = ', '.join(f'{fmt(p)} {s}' for p, s in sorted(stacked.items())[:6])
      held = self._on_axes(shapes, axes[0])[min(stacked)]
      return (
          f'{where}: the scanned layers are stacked along axis {" or ".join(map(str, axes))}'
          f' (every stacked weight has {_sizes(held)} there), not along'
          f' param_scan_axis={axis}, where the weights differ: {sizes}'
          f'{", ..." if len(stacked) > 6 else ""}\nPass `param_scan_axis={axes[0]}`, or leave'
          ' it out.'
      )
    axis = DEFAULT_AXIS if axis is None else axis
    along = self._on_axes(shapes, axis)
    odd = []
    for paths in self._per_stack(shapes, axis).values():
      common = collections.Counter(along[p] for p in paths if along[p]).most_common(1)
      odd += [f'{fmt(p)} {stacked[p]}: ' + (f'no axis {axis}' if along[p] is None
                                            else f'{_sizes(along[p])} along it')
              for p in paths if not common or along[p] != common[0][0]]
    return (
        f'{where}: expected every scanned weight of a stack ({self._prefixes()}) to hold the'
        f' same number of layers along param_scan_axis={axis}; {len(odd)} of {len(stacked)}'
        f' do not:\n{errors.list_paths(odd)}\nThese weights are not one scanned MaxText'
        ' decoder: check how the step was written.'
    )

  def _prefixes(self) -> str:
    return ', '.join(f'{fmt(s.prefix)}/...' for s in self.stacks if s.depth)


def _unlike(members: Mapping[str, Mapping[Path, Shape]], others: str) -> list[str]:
  """How layers that should hold the same weights, of one shape a weight, differ: each lacking
  a weight another holds, each holding one of another shape than most (`others` hold)."""
  names = set().union(*members.values())
  problems = [f'{m}: lacks {", ".join(fmt(w) for w in sorted(names - set(held)))}'
              for m, held in members.items() if set(held) != names]
  for w in sorted(names):
    shapes = {m: held[w] for m, held in members.items() if w in held}
    common = collections.Counter(shapes.values()).most_common(1)[0][0]
    problems += [f'{m}/{fmt(w)}: {s}, {others} {common}' for m, s in shapes.items() if s != common]
  return problems


def _sizes(held: tuple[int, ...]) -> str:
  return str(held[0]) if len(held) == 1 else str(held)


def _stacking(axis: int, sizes: tuple[int, ...]) -> Transform:
  """Layers into a stack holding them on `len(sizes)` axes from `axis` on (in C order)."""
  if not sizes:
    return IDENTITY
  return stack(axis) if len(sizes) == 1 else chain(stack(axis), split_axis(axis, sizes))


def _made(made: Sequence[tuple[Path, tuple[Path, ...], Transform]],
          shapes: Mapping[Path, Shape | None], why: str = '') -> dict[Path, Mapped]:
  """Each (destination, its sources, the transform joining them) as a `Mapped`, its shape
  checked (None where a source's is not known).

  Raises:
    UnsupportedLayoutError: `why`, then each destination whose sources the transform
      does not take.
  """
  out, problems = {}, []
  for dest, sources, transform in made:
    known = [shapes[p] for p in sources]
    try:
      out[dest] = Mapped(sources, transform,
                         None if any(s is None for s in known) else transform.check(known))
    except TransformError as e:
      problems.append(f'{fmt(dest)}: {e}')
  if problems:
    raise errors.UnsupportedLayoutError(f'{why}:\n{errors.list_paths(problems)}')
  return out


def _put(out: dict[Path, Mapped], dest: Path, mapped: Mapped, problems: list[str]) -> None:
  if dest in out:
    problems.append(f'{fmt(dest)}: made from both {fmt(out[dest].sources[0])} and'
                    f' {fmt(mapped.sources[0])}')
  else:
    out[dest] = mapped


def layer_path(i: int) -> Path:
  return tuple(k.replace('{i}', str(i)) for k in LAYER)


def layer_of(path: Path) -> int | None:
  """The layer number of a per-layer weight (`decoder/layers_{i}/...`), else None."""
  m = _pattern(LAYER).match(path)
  return None if m is None else int(m[0]['i'])


UNSCANNED = LayerForm(UNSCANNED_NAME)
SCANNED_FORM = LayerForm(SCANNED, (Stack(('decoder', 'layers')),))


def blocks(period: int) -> LayerForm:
  """Gemma3's scanned form: blocks of `period` layers `layers_{j}`, then a remainder."""
  return LayerForm(f"gemma3's scanned blocks of {period}", (
      Stack(('decoder', 'layers', 'layers_{j}'), positions=tuple(range(period))),
      Stack(('decoder', 'layers_remainder', 'layers_{j}'), 0, remainder=True)), period)


def local_global(period: int, model: str) -> LayerForm:
  """`model`'s scanned form of local and global layers: per block, `period - 1` local layers
  (an inner scan), a global one; then a remainder of local layers."""
  return LayerForm(f"{model}'s scanned blocks of {period}", (
      Stack(('decoder', 'scanned_blocks', 'local_layers'), 2, tuple(range(period - 1))),
      Stack(('decoder', 'scanned_blocks', 'global_layer'), positions=(period - 1,)),
      Stack(('decoder', 'layers_remainder', 'local_layers'), remainder=True)), period)


def cycles(period: int, model: str) -> LayerForm:
  """MaxText's scanned blocks of `inhomogeneous_layer_cycle_interval` layers without a
  remainder (`_init_scanned_generic`: gpt-oss's sliding and full attention layers in blocks of
  2): `decoder/layers/layers_{j}/<w>`, blocks on A, layer `period·a + j`."""
  return LayerForm(f"{model}'s scanned blocks of {period}", (
      Stack(('decoder', 'layers', 'layers_{j}'), positions=tuple(range(period))),), period)


def _numbers_fit(form: LayerForm, paths: Sequence[Path]) -> bool:
  """Whether the block positions the paths number (`layers_{j}` of a block's stack) are the
  form's own: gemma3's blocks of 6 and gpt-oss's of 2 hold the same paths, told apart so."""
  held = {form._find(p) for p in paths}
  seen = {(hit[0], hit[1]) for hit in held if hit is not None and hit[1] is not None
          and not form.stacks[hit[0]].remainder}
  want = {(k, j) for k, s in enumerate(form.stacks) if s.numbered and not s.remainder
          for j in s.positions}
  return bool(seen) and seen == want


def leading(name: str, first: str, rest: str, axis_zero: tuple[str, ...] = ()) -> LayerForm:
  """A decoder whose first layers (as many as the arrays hold) are of one kind and the rest of
  another (DeepSeek's dense, then MoE, layers): scanned, `decoder/<first>/<w>` and
  `decoder/<rest>/<w>` (layers on `param_scan_axis`; `axis_zero` weights on axis 0);
  unscanned, `decoder/<first>_{j}/<w>` (layer j) and `decoder/<rest>_{j}/<w>` (layer
  leading + j), one array per layer."""
  return LayerForm(name, (
      Stack(('decoder', first)),
      Stack(('decoder', rest), remainder=True),
      Stack(('decoder', f'{first}_{{j}}'), 0, per_layer=True),
      Stack(('decoder', f'{rest}_{{j}}'), 0, remainder=True, per_layer=True),
  ), axis_zero=axis_zero, leading=True)


def after_per_layer(name: str, prefix: tuple[str, ...], period: int,
                    axis_zero: tuple[str, ...] = ()) -> LayerForm:
  """A decoder whose first layers are kept one array per layer (`decoder/layers_{i}`) and the
  rest stacked in blocks of `period`, `<prefix>/layers_{j}/<w>` (position j of each block,
  blocks on `param_scan_axis`), numbered on from them (DeepSeek V4's scanned form)."""
  return LayerForm(name, (Stack((*prefix, 'layers_{j}'), positions=tuple(range(period)),
                               mixed=True),), period, axis_zero=axis_zero, after_layers=True)
def paired(*suffixes: str) -> LayerForm:
  """Gemma2's form: MaxText's plain scanned form (or one array per layer), each MaxText layer
  holding `len(suffixes)` of the model's, its modules named with the suffixes in order
  (`sublayers`)."""
  return dataclasses.replace(
      SCANNED_FORM, name=f"gemma2's {'/'.join(s.strip('_') for s in suffixes)} layer pairs",
      sublayers=suffixes)


def form_of(paths: Iterable[Path], forms: Sequence[LayerForm]) -> LayerForm | None:
  """The form of a decoder's layers among `forms`: the stacked one that holds the most of
  the paths (among those, one whose numbered block positions are all the paths number: see
  `_numbers_fit`; then the one whose stacks name them most closely, qwen3.5's
  `decoder/layers/layer_{j}` rather than the plain `decoder/layers`; then the first;
  `LayerForm.held_by` them), else UNSCANNED when they hold per-layer weights, else None (no
  decoder layers)."""
  paths = list(paths)
  held = [(n := sum(map(f.holds, paths)), n > 0 and _numbers_fit(f, paths),
           _closeness(f, paths), -k) for k, f in enumerate(forms)]
  best = max(held, default=(0, False, 0, 0))
  if best[0]:
    return forms[-best[3]].held_by(paths)
  return UNSCANNED if any(layer_of(p) is not None for p in paths) else None


def _closeness(form: LayerForm, paths: Sequence[Path]) -> int:
  """How closely a form's stacks name the paths it holds: their prefixes' keys, summed."""
  return sum(len(form.stacks[hit[0]].prefix) for p in paths if (hit := form._find(p)))


def relay(shapes: Mapping[Path, Shape | None], have: LayerForm, want: LayerForm, axis: int,
          to_axis: int | None = None, *, where: str = '') -> dict[Path, Mapped]:
  """The weights in form `want` (its layers on `to_axis`, default `axis`), from form `have`
  (its layers on `axis`), each with its sources and transform (the rest as it is).

  Raises:
    UnsupportedLayoutError: two stacked forms that differ (no weight is made from layers
      that are themselves taken apart), a `leading` form and another, or weights that do
      not fit the axis.
    LayerScanMismatchError: per-layer weights that are not one decoder (`LayerForm.layers`).
  """
  to_axis = axis if to_axis is None else to_axis
  own = [f for f in (have, want) if f.leading or f.after_layers]
  if have != want and own:
    raise errors.UnsupportedLayoutError(
        f'{where}: the layers are stored as {have.name}; expected {want.name}: re-laying'
        f' {own[0].name} into another form is not supported (how many layers it keeps apart'
        ' is the model\'s own, not told by the other form). Convert the layers as they are'
        ' stored.')
  if have != want:
    if not want.scanned:
      return have.unstack(shapes, axis, where=where)
    if not have.scanned:
      return want.restack(shapes, to_axis, where=where)
    raise errors.UnsupportedLayoutError(
        f'{where}: the layers are stacked as {have.name}; expected them per layer or as'
        f' {want.name}, to be stacked so.')
  def moved(p: Path, s: Shape | None) -> Transform:
    hit = have._find(p) if s is not None and axis != to_axis else None
    if hit is None or have._axis(hit[2], axis) != axis:  # An `axis_zero` weight stays.
      return IDENTITY
    return _move(axis, to_axis, have.stacks[hit[0]].depth)

  return _made([(p, (p,), moved(p, s)) for p, s in shapes.items()], shapes,
               f'{where}: the layers cannot be moved from param_scan_axis={axis} to {to_axis}')


def _move(axis: int, to: int, depth: int) -> Transform:
  """The `depth` layer axes from `axis` on moved to `to` on (in their order)."""
  pairs = [(axis + d, to + d) for d in range(depth)]
  return chain(*(move_axis(a, b) for a, b in (pairs if to < axis else reversed(pairs))))


def check_axis(axis: int | None) -> None:
  """Refuses a `param_scan_axis` that is not a non-negative int (None: not given).

  MaxText counts it from the front; from the back it would name another axis
  in weights of different ranks (a kernel's and a norm's scale).

  Raises:
    InvalidOptionError: naming the value.
  """
  if axis is not None and (isinstance(axis, bool) or not isinstance(axis, int) or axis < 0):
    raise errors.InvalidOptionError(
        f'`param_scan_axis` {axis!r}: expected a non-negative axis, counted from the front'
        f' as MaxText counts it ({DEFAULT_AXIS} by default: query/kernel is (emb, layers,'
        ' heads, head_dim)).'
    )


def linear_full(period: int) -> LayerForm:
  """Qwen3-Next's scanned form (`Qwen3NextScannableBlock`): per block of `period` layers
  under `decoder/layers`, `period - 1` linear-attention layers (an inner scan), then a
  full-attention one; the layers past the last whole block are linear ones, a remainder."""
  return LayerForm(f"Qwen3-Next's scanned cycles of {period}", (
      Stack(('decoder', 'layers', 'local_layers'), 2, tuple(range(period - 1))),
      Stack(('decoder', 'layers', 'global_layer'), positions=(period - 1,)),
      Stack(('decoder', 'layers_remainder', 'local_layers'), remainder=True)), period)


def layer_cycles(period: int) -> LayerForm:
  """Qwen3.5's scanned form (`Qwen3_5ScannableBlock`): blocks of `period` layers, the j-th
  of each block under `decoder/layers/layer_{j}`, blocks on the layer axis. MaxText 0.2.5
  builds no remainder: a layer count that is not a multiple of `period` loses its last
  layers (`int(layers / period)` blocks)."""
  return LayerForm(f"Qwen3.5's scanned cycles of {period}", (
      Stack(('decoder', 'layers', 'layer_{j}'), positions=tuple(range(period)), mixed=True),),
      period)

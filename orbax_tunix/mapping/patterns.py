"""Layout rules: canonical path patterns onto destination paths, each with a transform.

A `LayoutRule` is data: a source pattern, a destination pattern and a
`Transform` (see `transforms.py`). A pattern is a tuple of keys; a key may
hold placeholders (`'layers_{i}'`, `'model.layers.{i}.mlp.up_proj.weight'`):
`{i}` stands for a number, `{p:q|k|v}` for one of the words given (the
destination names it `{p}`); a key `'...'` stands for any number of keys (the
same ones on both sides).
`map_paths` applies a layout's rules to a set of leaves (paths and shapes) and
says, for every destination, which sources make it and how, and which sources
no rule takes. Nothing here reads a checkpoint.

Three kinds of rule, told apart by their placeholders:
  one to one   both sides bind the same placeholders;
  gather       a placeholder only the source has: every source that differs
               only in it makes one destination, in its numeric order (or the
               order of the words a `{p:a|b}` lists) (`transform` takes them all,
               e.g. `stack`);
  fan out      a placeholder only the destination has: it ranges over one axis
               of the source (`fan_out=('i', axis)`), and `transform_for(i)`
               makes each destination (e.g. `take(axis, i)`).
"""

from __future__ import annotations

import dataclasses
import itertools
import re
from collections.abc import Callable, Mapping, Sequence

from orbax_tunix import errors
from orbax_tunix.keypaths import Path, fmt
from orbax_tunix.mapping.transforms import IDENTITY, Shape, Transform, TransformError

REST = '...'
# `{i}`: a number (layers, experts); `{name:a|b|c}`: one of the words given.
_PLACEHOLDER = re.compile(r'\{(\w+)(?::([\w|]+))?\}')
# A number as every writer spells an index (`str(i)`): ASCII digits, no leading zero. A key
# spelled otherwise (`01`, `٣`) matches no rule: written as it is it would name another
# tensor (`model.layers.01`), and read as a number it could collide with `1`.
_NUMBER = '0|[1-9][0-9]*'
Bindings = dict[str, str]


@dataclasses.dataclass(frozen=True)
class Key:
  """One key of a pattern: a literal, or a regular expression with named groups."""

  text: str
  names: tuple[str, ...]
  regex: re.Pattern[str] | None
  # Placeholder -> the words it may stand for (`{p:q|k|v}`); numbers are not listed.
  words: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
  spec: str = ''  # As written (with the words), for documentation.

  @classmethod
  def literal(cls, text: str) -> Key:
    """The key `text` itself, braces and all (a key read from a checkpoint)."""
    return cls(text, (), None, spec=text)

  @classmethod
  def parse(cls, text: str) -> Key:
    found = _PLACEHOLDER.findall(text)
    if not found:
      return cls.literal(text)
    regex, at = [], 0
    for m in _PLACEHOLDER.finditer(text):
      regex.append(re.escape(text[at:m.start()]))
      name, words = m.group(1), m.group(2)
      regex.append(f'(?P<{name}>{_NUMBER})' if words is None else f'(?P<{name}>{words})')
      at = m.end()
    regex.append(re.escape(text[at:]))
    return cls(_PLACEHOLDER.sub(r'{\1}', text), tuple(n for n, _ in found),
               re.compile(''.join(regex)), {n: tuple(w.split('|')) for n, w in found if w},
               spec=text)

  def match(self, key: str, bound: Bindings) -> Bindings | None:
    if self.regex is None:
      return bound if key == self.text else None
    m = self.regex.fullmatch(key)
    if m is None:
      return None
    found = dict(bound)
    for name, value in m.groupdict().items():
      if found.setdefault(name, value) != value:
        return None
    return found

  def fill(self, bound: Mapping[str, str]) -> str:
    return self.text.format(**bound) if self.names else self.text


@dataclasses.dataclass(frozen=True)
class Pattern:
  """A path pattern, e.g. ('decoder', 'layers_{i}', '...')."""

  keys: tuple[Key, ...]
  has_rest: bool

  @classmethod
  def parse(cls, keys: Sequence[str]) -> Pattern:
    if list(keys).count(REST) > 1:
      raise ValueError(f'{keys}: at most one {REST!r} in a pattern')
    return cls(tuple(Key.parse(k) for k in keys), REST in keys)

  @property
  def names(self) -> frozenset[str]:
    return frozenset(n for k in self.keys for n in k.names)

  def match(self, path: Path) -> tuple[Bindings, Path] | None:
    """(placeholder values, the keys `...` stood for), or None."""
    keys = self.keys
    if not self.has_rest:
      bound = self._match_keys(keys, path, {})
      return None if bound is None else (bound, ())
    at = next(i for i, k in enumerate(keys) if k.text == REST)
    head, tail = keys[:at], keys[at + 1:]
    if len(path) < len(head) + len(tail):
      return None
    bound = self._match_keys(head, path[:len(head)], {})
    if bound is None:
      return None
    bound = self._match_keys(tail, path[len(path) - len(tail):], bound)
    if bound is None:
      return None
    return bound, path[len(head):len(path) - len(tail)]

  @staticmethod
  def _match_keys(keys: Sequence[Key], path: Path, bound: Bindings) -> Bindings | None:
    if len(keys) != len(path):
      return None
    for key, value in zip(keys, path, strict=True):
      bound = key.match(value, bound)
      if bound is None:
        return None
    return bound

  def expand(self, numbers: Mapping[str, Sequence[str]]) -> list[Path]:
    """Every path the pattern names, its numbers taking the values given (no `...`)."""
    choices = {**{n: tuple(v) for n, v in numbers.items()},
               **{n: w for k in self.keys for n, w in k.words.items()}}
    names = sorted(self.names)
    return [self.fill(dict(zip(names, values, strict=True)))
            for values in itertools.product(*(choices[n] for n in names))]

  def fill(self, bound: Mapping[str, str], rest: Path = ()) -> Path:
    out: list[str] = []
    for key in self.keys:
      if key.text == REST:
        out.extend(rest)
      else:
        out.append(key.fill(bound))
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class LayoutRule:
  """Canonical leaves matching `source` become the destinations named by `dests`.

  Attributes:
    source: the source pattern (keys; see the module docstring).
    dests: (destination pattern, transform) pairs: usually one; several
      split one source (e.g. a fused projection into its parts).
    fan_out: (placeholder, source axis) for a fan-out rule (one dest pattern,
      its transform from `transform_for`).
    transform_for: a fan-out rule's transform for one value of its placeholder.
  """

  source: Pattern
  dests: tuple[tuple[Pattern, Transform], ...]
  fan_out: tuple[str, int] | None = None
  transform_for: Callable[[int], Transform] | None = None

  @classmethod
  def of(cls, source: Sequence[str], dest: Sequence[str], transform: Transform = IDENTITY,
         **kwargs) -> LayoutRule:
    """A rule with one destination."""
    return cls(Pattern.parse(source), ((Pattern.parse(dest), transform),), **kwargs)

  @classmethod
  def split(cls, source: Sequence[str], *dests: tuple[Sequence[str], Transform]) -> LayoutRule:
    """A rule making several destinations from each source."""
    return cls(Pattern.parse(source), tuple((Pattern.parse(d), t) for d, t in dests))

  def gathered(self, dest: Pattern) -> frozenset[str]:
    return self.source.names - dest.names


@dataclasses.dataclass(frozen=True)
class Mapped:
  """One destination: its source paths (in order) and the transform joining them (its
  shape None when its source's is not known: see `map_paths`)."""

  sources: tuple[Path, ...]
  transform: Transform
  shape: Shape | None


@dataclasses.dataclass(frozen=True)
class PathMap:
  """What `map_paths` found.

  Attributes:
    outputs: destination path -> `Mapped`.
    unmatched: source paths no rule takes.
  """

  outputs: dict[Path, Mapped]
  unmatched: tuple[Path, ...]


def map_paths(
    shapes: Mapping[Path, Shape], rules: Sequence[LayoutRule], *, where: str = ''
) -> PathMap:
  """Applies layout rules to some leaves (paths and shapes); pure, metadata only.

  Each source is taken by the first rule that matches it.

  Args:
    shapes: source path -> shape; None where it is not known (then only a rule
      with the identity transform may take it, and its destination's shape is
      None: a caller checks it against the store later).
    rules: the rules, in order.
    where: what the sources are, for messages (e.g. a step directory).

  Returns:
    A `PathMap`.

  Raises:
    UnsupportedLayoutError: one destination made twice, a gather whose
      sources are not numbered 0..n-1, or shapes a transform does not take;
      every problem is listed.
  """
  # dest path -> (transform or gathered placeholder, [(order, source)])
  made: dict[Path, tuple[Transform, str | None, list[tuple[int, Path]]]] = {}
  unmatched: list[Path] = []
  problems: list[str] = []
  for path in shapes:
    rule, found = next(((r, m) for r in rules if (m := r.source.match(path)) is not None),
                       (None, None))
    if rule is None:
      unmatched.append(path)
      continue
    bound, rest = found
    if rule.fan_out is not None:
      name, axis = rule.fan_out
      shape = shapes[path]
      if not -len(shape) <= axis < len(shape):
        problems.append(f'{fmt(path)} {shape}: no axis {axis} to take {name!r} along')
        continue
      (pattern, _), = rule.dests
      for i in range(shape[axis]):
        dest = pattern.fill({**bound, name: str(i)}, rest)
        _add(made, dest, rule.transform_for(i), None, 0, path, problems)
      continue
    for pattern, transform in rule.dests:
      gathered = sorted(rule.gathered(pattern))
      order = _order(rule.source, gathered[0], bound) if gathered else 0
      dest = pattern.fill(bound, rest)
      _add(made, dest, transform, gathered[0] if gathered else None, order, path, problems)
  outputs = {}
  for dest, (transform, gathered, sources) in made.items():
    sources.sort()
    if gathered and [i for i, _ in sources] != list(range(len(sources))):
      problems.append(
          f'{fmt(dest)}: gathers {[fmt(p) for _, p in sources]}, expected them numbered'
          f' 0..{len(sources) - 1} without gaps'
      )
      continue
    paths = tuple(p for _, p in sources)
    if transform.is_identity and shapes[paths[0]] is None:
      outputs[dest] = Mapped(paths, transform, None)
      continue
    try:
      shape = transform.check([shapes[p] for p in paths])
    except TransformError as e:
      problems.append(f'{fmt(dest)} from {", ".join(fmt(p) for p in paths)}: {e}')
      continue
    outputs[dest] = Mapped(paths, transform, shape)
  if problems:
    raise errors.UnsupportedLayoutError(
        f'{where}: the layout rules do not fit these leaves:\n{errors.list_paths(problems)}'
    )
  return PathMap(outputs, tuple(sorted(unmatched)))


def _order(source: Pattern, name: str, bound: Bindings) -> int:
  """A gathered source's place among the others: its number, or its word's position among
  the words the pattern lists (`{p:query|key|value}`: the query first)."""
  words = next((k.words[name] for k in source.keys if name in k.words), None)
  return int(bound[name]) if words is None else words.index(bound[name])


def _add(made, dest, transform, gathered, order, path, problems) -> None:
  entry = made.get(dest)
  if entry is None:
    made[dest] = (transform, gathered, [(order, path)])
  elif gathered is None or entry[1] != gathered:
    problems.append(f'{fmt(dest)}: made from both {fmt(entry[2][0][1])} and {fmt(path)}')
  else:
    entry[2].append((order, path))


def nested(rules: Sequence[LayoutRule], source: Path, dest: Path) -> tuple[LayoutRule, ...]:
  """The rules applied below a node: each source pattern under the keys `source`, each
  destination under `dest` (keys taken literally), e.g. a model's layer rules for its
  weights inside an optimizer's `mu`."""
  def literal(keys: Path) -> tuple[Key, ...]:
    return tuple(map(Key.literal, keys))

  return tuple(dataclasses.replace(
      rule,
      source=dataclasses.replace(rule.source, keys=literal(source) + rule.source.keys),
      dests=tuple((dataclasses.replace(p, keys=literal(dest) + p.keys), t) for p, t in rule.dests),
  ) for rule in rules)


def under(prefix: Path, mapping: PathMap) -> dict[Path, Mapped]:
  """The outputs of a mapping with a prefix put before each destination."""
  return {prefix + d: m for d, m in mapping.outputs.items()}

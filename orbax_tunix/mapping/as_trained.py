"""Where the trainer computed otherwise than `transformers` computes from config.json.

google-tunix 0.1.7's model classes do not all compute what `transformers` computes from the
family's Hub config (measured with `transformers`: tests/test_hf_clients.py). An export of
such a run serves a model that differs from the one trained and evaluated in Tunix. Each such
fact is data on the family (`Family.as_trained`, for Tunix's own model classes only); `apply`
turns the facts that hold for an export into notes, and, where a config.json value reproduces
the trained model and the caller asks (`write`), into that value in the config it writes.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Collection, Mapping, Sequence

from orbax_tunix.keypaths import Path
from orbax_tunix.mapping.patterns import Pattern

TRAINER = 'google-tunix 0.1.7'
# The library keyword that writes the trained values (the CLI names its flag in messages).
OPTION = 'config_as_trained'


@dataclasses.dataclass(frozen=True)
class AsTrained:
  """One computation in which the trainer differs from `transformers` reading the Hub config.

  Attributes:
    what: what differs (a config field's name, or the computation), for people.
    trained: what the trainer computed.
    served: what `transformers` computes instead (where `field` is None).
    consequence: what the served model then does otherwise.
    field: the config.json field whose value reproduces the trained model (None: none does).
    value: the value the trainer used, for `field`.
    when: weight patterns (`{i}` over the layers); the fact holds for weights having any of
      them (empty: for every model of the family).
    brief: what the trainer does, in a few words after the families' names (e.g. 'rotate
      with base 1000000 whatever the config says'), for the help of `OPTION`, which writes
      `field` (`layouts/huggingface.py`).
  """

  what: str
  trained: str
  consequence: str
  served: str = ''
  field: str | None = None
  value: object = None
  when: tuple[str, ...] = ()
  brief: str = ''

  def holds(self, paths: Collection[Path], layers: Sequence[str]) -> bool:
    if not self.when:
      return True
    have = set(paths)
    return any(p in have for pattern in self.when
               for p in Pattern.parse(pattern.split('/')).expand({'i': list(layers)}))


def _where(config: Mapping[str, object], field: str) -> list[dict]:
  """The objects of `config` that hold `field` as `transformers` reads it: its top level or
  `text_config`, and their `rope_parameters` (transformers 5 keeps the RoPE base there)."""
  levels = [level for level in (config, config.get('text_config')) if isinstance(level, dict)]
  return [d for level in levels for d in (level, level.get('rope_parameters'))
          if isinstance(d, dict) and field in d]


def apply(facts: Sequence[AsTrained], family: str, paths: Collection[Path],
          layers: Sequence[str], config: dict | None, write: bool) -> tuple[dict | None, list[str]]:
  """The config to write (a copy, changed where `write` asks) and one note per fact that holds.

  Args:
    facts: the family's `as_trained`.
    family: its name, for the notes.
    paths, layers: the weights' paths and layer numbers.
    config: the config.json the export writes (None: it writes none).
    write: set each fact's `field` to its `value` (`config_as_trained`).

  Returns:
    (the config, changed or not (None when `config` is None); the notes).
  """
  out = copy.deepcopy(config)  # The caller's config is never changed.
  notes = []
  for fact in facts:
    if not fact.holds(paths, layers):
      continue
    trained = f"{TRAINER}'s {family} {fact.trained}"
    if fact.field is None:
      notes.append(f'{fact.what}: {trained}, transformers {fact.served}: {fact.consequence};'
                   ' no config.json value reproduces the trained model')
      continue
    field, value = fact.field, fact.value
    if out is None:
      notes.append(f'{field}: {trained}: the config.json you add must say {field}={value}'
                   f' to serve the model trained; otherwise {fact.consequence}')
      continue
    holders = _where(out, field)
    have = [d[field] for d in holders]
    if have and all(h == value for h in have):
      continue
    shown = (' or '.join(map(str, dict.fromkeys(have))) if have
             else "nothing (its class's default)")
    if not write:
      notes.append(f'{field}: config.json has {shown}; {trained}: served as is,'
                   f' {fact.consequence}. `{OPTION}` writes {field}={value}')
      continue
    for d in holders or [out]:
      d[field] = value
    notes.append(f'config.json: {field}={value} (the base config has {shown}): {trained}'
                 f' (`{OPTION}`)')
  return out, notes

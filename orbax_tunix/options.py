"""An option the library takes by name, as data: one name everywhere.

The library's keyword is `Option.name`; the command line's flag is derived from it
(`orbax_tunix.cli`: `--` and the name with dashes), and so is every message that names it:
a library message names the keyword in backquotes (`named`), which the command line shows as
its flag. The layouts declare theirs (`layouts.Layout.options`), the LoRA merge its own
(`mapping/merge_options.py`).

`from_environment` reads the package's environment variables of a few choices alike
(`ORBAX_TUNIX_COMPILE_EFFORT`, `ORBAX_TUNIX_WARM_COMPILER`).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence
from typing import Any


def _as_given(value: Any) -> Any:
  return value


@dataclasses.dataclass(frozen=True)
class Option:
  """An option, as data.

  Attributes:
    name: the library's keyword (the command line's flag is `--` and it with dashes).
    parse: the value from its text (a flag's); raises ValueError for text that is none.
      `bool`: a switch (given: True).
    metavar: how its value is written in help text (None: its choices, else its name).
    help: what it does, for people.
    default: its value when not given (what a plan leaves out of what was asked).
    coerce: a value given -> the value used (a size's text to bytes, a path's text to a
      path); raises `InvalidOptionError` (or `LoraError`, a merge's) naming the option.
    folder: it names a folder that is read (the destination must be neither it nor inside
      it).
    choices: the values it takes, where they are a few names (None: any `parse` takes).
  """

  name: str
  parse: Callable[[str], Any] = dataclasses.field(repr=False)
  metavar: str | None
  help: str
  default: Any = None
  coerce: Callable[[Any], Any] = dataclasses.field(default=_as_given, repr=False)
  folder: bool = False
  choices: tuple[str, ...] | None = None

  @property
  def switch(self) -> bool:
    """It is given or not (a flag without a value)."""
    return self.parse is bool

  def named(self, value: Any = None) -> str:
    """The option as a message names it: `name`, or `name=value` (a flag, on the command
    line: `--name`, `--name value`)."""
    return f'`{self.name}`' if value is None else f'`{self.name}={value}`'


def from_environment(variable: str, choices: Sequence[str], auto_means: str) -> str:
  """The value of the environment variable `variable`, one of `choices`, whose first is the
  default (unset or empty), compared without case or surrounding spaces.

  Raises:
    ValueError: another value, naming the variable, the choices and what the default does.
  """
  value = os.environ.get(variable, '').strip().lower() or choices[0]
  if value not in choices:
    raise ValueError(f'{variable}={os.environ[variable]!r}: expected one of {", ".join(choices)}'
                     f' ({choices[0]}: {auto_means}); unset it for {choices[0]}.')
  return value

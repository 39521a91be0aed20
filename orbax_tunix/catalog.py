"""A catalog of named values (output layouts, Hugging Face families, trainers, source kinds,
the LoRA merge's options): one name each, one mechanism for every registry.

Adding a layout or a family is one `register` call next to its value; the CLI's
choices and the error for an unknown name come from here.
"""

from __future__ import annotations

from typing import Generic, Protocol, TypeVar

from orbax_tunix import errors


class _Named(Protocol):
  name: str


T = TypeVar('T', bound=_Named)


class Catalog(Generic[T]):
  """Values by their `name`, in the order registered.

  Args:
    option: the parameter that names one (e.g. 'layout'), for messages.
  """

  def __init__(self, option: str):
    self._option = option
    self._values: dict[str, T] = {}

  def register(self, value: T) -> T:
    """Adds `value` under its name (once); returns it.

    Raises:
      ValueError: another value holds the name already.
    """
    held = self._values.get(value.name)
    if held is not None and held is not value:
      raise ValueError(f'a {self._option} named {value.name!r} is registered already')
    self._values[value.name] = value
    return value

  def names(self) -> tuple[str, ...]:
    return tuple(self._values)

  def values(self) -> tuple[T, ...]:
    """Every value, in the order registered."""
    return tuple(self._values.values())

  def find(self, name: str) -> T | None:
    """The value registered as `name`, or None."""
    return self._values.get(name)

  def get(self, name: str) -> T:
    """The value registered as `name`.

    Raises:
      UnsupportedLayoutError: no such name (the message lists them).
    """
    try:
      return self._values[name]
    except KeyError:
      raise errors.UnsupportedLayoutError(
          f'`{self._option}` {name!r}: expected one of {", ".join(self._values)}.'
      ) from None

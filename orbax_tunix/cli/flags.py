"""The command line's flags: each made from the library's own record of what it sets (an
`orbax_tunix.options.Option`: a layout's, a switch's, the LoRA merge's), and the library's
messages shown with these flags (`as_flags`).

The flag of an option is `--` and its name with dashes (`flag_of`); a switch (`Option.switch`)
takes no value, an option of a few names (`Option.choices`) one of them, another's text is
`Option.parse`d. What the flags say of values they refuse is argparse's usage error.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import numpy as np

from orbax_tunix import layouts, sizes
from orbax_tunix.mapping import merge_options
from orbax_tunix.options import Option


def parsed(parse: Callable[[str], Any]) -> Callable[[str], Any]:
  """An option's parser as argparse's type: its ValueError's message said as is."""

  def parse_flag(text: str) -> Any:
    try:
      return parse(text)
    except ValueError as e:
      raise argparse.ArgumentTypeError(str(e) if str(e).startswith(repr(text)) else
                                       f'{text!r}: {e}') from None
  return parse_flag


# Bytes from a size option (`sizes.parse_size`: '512M', '5GB', '1.5GiB', '1000000'); text
# that is not a size raises argparse.ArgumentTypeError.
parse_size = parsed(sizes.parse_size_text)


def parse_dtype(name: str) -> np.dtype:
  """The floating dtype `--dtype` names (e.g. 'bfloat16').

  Raises:
    argparse.ArgumentTypeError: not a floating dtype.
  """
  try:
    dtype = np.dtype(jnp.dtype(name))
  except TypeError:
    raise argparse.ArgumentTypeError(
        f'{name!r} is not a dtype: use a floating dtype such as bfloat16, float16 or float32.'
    ) from None
  if not jnp.issubdtype(dtype, jnp.floating):
    raise argparse.ArgumentTypeError(
        f'{name!r}: expected a floating dtype (bfloat16, float16, float32); only floating'
        ' leaves are cast, integer and RNG leaves always keep their dtype.'
    )
  return dtype


def flag_of(option: Option) -> str:
  """The flag of an option (`orbax_tunix.options.Option`): `--` and its name with dashes."""
  return _dashed(option.name)


def _dashed(name: str) -> str:
  return '--' + name.replace('_', '-')


# The merge's options (`merge_options.OPTIONS`): every command that merges takes their flags.
MERGE = merge_options.OPTIONS.names()

# The library's parameters, as its messages name them (in backquotes), and the
# flags that set them here: `memory_budget` is --memory-budget, the others as listed.
# The options (the layouts', their switches', the merge's) have their own flags (`flag_of`).
_FLAGS = {
    **{name: _dashed(name) for name in (
        'force', 'params_only', 'layout', 'dtype', 'memory_budget', 'step', 'atol',
        'ignore_dtype', 'model', 'coordinator_address', 'num_processes', 'process_id',
        'initialization_timeout')},
    **{o.name: flag_of(o) for o in merge_options.OPTIONS.values()},
    **{name: flag_of(o) for name, o in layouts.options().items()},
    **{d.switch.option.name: flag_of(d.switch.option) for d in layouts.destinations() if d.switch},
    'dst': 'DST',
    'src': 'SRC',
    'out_dir': 'OUT_DIR',
    'items': '--item',
    'export_peft_adapter': 'export --peft',
}
_PARAMETER = re.compile(r'`(\w+)(=[^`]*)?`')


def flag_named(name: str) -> str:
  """The flag that sets the library parameter `name` (`_FLAGS`, else its own spelling)."""
  return _FLAGS.get(name, _dashed(name))


def as_flags(message: str) -> str:
  """A library message with its parameters named as this command's flags.

  `force=True` becomes --force, `step=3` --step 3, `dst` DST; other
  backquoted names are left as they are.
  """

  def flag(m: re.Match[str]) -> str:
    name, value = m.group(1), m.group(2)
    if name not in _FLAGS:
      return m.group(0)
    if value is None or value == '=True':
      return _FLAGS[name]
    return f'{_FLAGS[name]} {value[1:]}'

  return _PARAMETER.sub(flag, message)


def _number(convert: Callable[[str], Any], what: str, ok: Callable[[Any], bool],
            why: str) -> Callable[[str], Any]:
  """A number flag's argparse type: `convert(text)` where `ok` accepts it, else an error
  saying the text is not `what`, or `why` not."""

  def parse(text: str) -> Any:
    try:
      value = convert(text)
    except ValueError:
      raise argparse.ArgumentTypeError(f'{text!r} is not {what}.') from None
    if not ok(value):
      raise argparse.ArgumentTypeError(f'{text!r}: {why}')
    return value
  return parse


step_number = _number(int, 'a step number', lambda value: value >= 0,
                'step numbers are not negative.')
atol = _number(float, 'a number', lambda value: value >= 0, 'the tolerance must be >= 0.')


def add_option(p: Any, option: Option, said: str = '', help: str | None = None) -> None:
  """One option's flag, made from the option (`orbax_tunix.options.Option`): a switch's
  (`Option.switch`) takes no value; one of a few names (`Option.choices`) is one of them;
  another's text is `Option.parse`d. Its help is `said`, then `help` (else the option's)."""
  text = said + (option.help if help is None else help)
  if option.switch:
    p.add_argument(flag_of(option), action='store_true', help=text)
  elif option.choices is not None:
    p.add_argument(flag_of(option), choices=option.choices, metavar=option.metavar, help=text)
  else:
    p.add_argument(flag_of(option), type=parsed(option.parse), metavar=option.metavar,
                   help=text)


def add_layout_options(p: argparse.ArgumentParser, destination: layouts.Destination) -> None:
  """The flags of the options a destination's layouts take (`layouts.Option`s, their data);
  one some of them take says which."""
  every = layouts.named(destination)
  for option in layouts.options(destination).values():
    takers = [n for n in every if layouts.get(n).takes(option.name)]
    add_option(p, option, '' if takers == list(every) else f'{" and ".join(takers)}: ')


def add_switches(p: argparse.ArgumentParser, command: str) -> None:
  """The flags that choose a command's other destinations (`layouts.Switch`: `export
  --peft`), each with the flags of the options only its layouts take."""
  home = default(command)
  for destination in layouts.destinations(command):
    if destination.switch is None:
      continue
    add_option(p, destination.switch.option)
    for name, option in layouts.options(destination).items():
      if name not in layouts.options(home) and name not in MERGE:
        add_option(p, option, f'{flag_of(destination.switch.option)}: ')


def add_merge_options(p: argparse.ArgumentParser, merge_help: str) -> None:
  """The LoRA merge's flags (`merge_options.OPTIONS`), one set for every command that merges
  (convert, export): `merge_help` says what `--merge-lora` does there; the scaling's two
  (`merge_options.SCALING`) exclude each other."""
  scaling = p.add_mutually_exclusive_group()
  for option in merge_options.OPTIONS.values():
    add_option(scaling if option in merge_options.SCALING else p, option,
                help=merge_help if option is merge_options.MERGE_LORA else None)


def default(command: str) -> layouts.Destination:
  """The destination a command writes unless a switch chooses another."""
  return next(d for d in layouts.destinations(command) if d.switch is None)

"""What every layout is and takes: `Request`, `Layout`, `LaidOut`, and the catalog they register in.

Every output is a layout: an Orbax step (canonical, MaxText) or a Hugging Face
safetensors folder (one layout per family). Its `sink` (a `Destination`) says which kind
of destination it fills; its `options` are data the CLI builds flags from.

Its own module so that the layouts (`canonical`, `maxtext`) import it, and the package
(`layouts/__init__.py`) imports them: no cycle.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
from etils import epath

from orbax_tunix import catalog, errors
from orbax_tunix.mapping import merge as merge_lib
from orbax_tunix.mapping.outputs import Input, ItemOutput, Output, copied
from orbax_tunix.reading import reader


@dataclasses.dataclass(frozen=True)
class Request:
  """What a conversion asks of a layout.

  Attributes:
    source: the source step, opened (canonical leaves from metadata).
    params_only: the model weights only.
    dtype: floating leaves cast to this dtype (None: kept).
    merge: a LoRA merge whose merged weights are written (implies params_only).
    scan_layers: MaxText's layer form to write (None: as stored).
    param_scan_axis: MaxText's layer axis of the scanned side (None: found; see `convert`).
    hf_config: a Hugging Face folder whose config and tokenizer a folder
      layout checks and copies (None: none).
    max_shard_size: bytes per safetensors file of a folder layout (None:
      `transformers`' default).
    base_only: a folder layout writes a LoRA save's base weights alone (the
      adapters left out, not merged).
    adapter_scaling: an adapter layout's LoRA scaling, as a merge's options
      spell it (`merge.Options`: qwix's `alpha`, or alpha / rank itself,
      `scale`; no `base`). None: neither given.
    base_model: an adapter layout's base model (a Hub name or a folder), as its
      config names it.
    config_as_trained: a folder layout writes into config.json the values the
      trainer computed with where they differ from the base config's
      (`mapping/as_trained.py`).
  """

  source: reader.CanonicalCheckpoint
  params_only: bool = False
  dtype: np.dtype | None = None
  merge: merge_lib.MergePlan | None = None
  scan_layers: bool | None = None
  param_scan_axis: int | None = None
  hf_config: epath.Path | None = None
  max_shard_size: int | None = None
  base_only: bool = False
  adapter_scaling: merge_lib.Options | None = None
  base_model: str | None = None
  config_as_trained: bool = False


def weights(request: Request) -> dict[tuple[str, ...], Output]:
  """The model's weights as outputs under their canonical weight paths, no RNG state.

  Copied from the source (cast to `request.dtype`), or merged for a LoRA
  merge (the plain model's paths).
  """
  if request.merge is not None:
    return {o.path: o for o in merge_lib.outputs(request.merge, (), request.dtype)}
  source = request.source
  return {path: copied(Input(source, leaf), path, request.dtype)
          for leaf, path in reader.weights(source)}


@dataclasses.dataclass(frozen=True)
class LaidOut:
  """A layout applied to one source step.

  Attributes:
    items: the destination items, in write order.
    notes: things a person should know (what was left out, filled, ...).
    custom_metadata: entries the new step's custom metadata needs for its
      readers (e.g. MaxText's `scan_layers`).
    files: a folder's other files, by name: a path to copy or a text to write
      (a Hugging Face config.json, tokenizer files).
    summary: what a person is told of the output beyond its items (a
      family's `model` and `architecture`).
  """

  items: tuple[ItemOutput, ...]
  notes: tuple[str, ...] = ()
  custom_metadata: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  files: tuple[tuple[str, epath.Path | str], ...] = ()
  summary: Mapping[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Option:
  """An option a layout takes, as data: a `Request` field, and what the CLI's flag is.

  Attributes:
    name: the `Request` field and library keyword (the flag: `--scan-layers`).
    parse: the flag's text -> the value (raises ValueError for text that is none).
    metavar: how the flag's value is shown.
    help: what it does, for people.
    coerce: a value the library was given -> the `Request`'s (a size's text to
      bytes, a path's text to a path); raises `InvalidOptionError`.
    switch: the flag takes no value (it sets True).
  """

  name: str
  parse: Callable[[str], Any] = dataclasses.field(repr=False)
  metavar: str
  help: str
  coerce: Callable[[Any], Any] = dataclasses.field(default=lambda value: value, repr=False)
  switch: bool = False

  @property
  def unset(self) -> Any:
    """Its value when not asked for (the `Request` field's default)."""
    return {f.name: f.default for f in dataclasses.fields(Request)}[self.name]

  @property
  def flag(self) -> str:
    return '--' + self.name.replace('_', '-')


class Destination(enum.Enum):
  """The kinds of destination a layout fills (`Layout.sink`); `tools/pipeline.py` writes
  each (`pipeline.SINKS`, keyed by them)."""

  STEP = 'step'  # An Orbax step: one PyTree (or JSON) item per `ItemOutput`.
  FOLDER = 'folder'  # A Hugging Face folder: one item's outputs as safetensors tensors.
  ADAPTER = 'adapter'  # A PEFT adapter folder: one item's outputs in adapter_model.safetensors.


def _check_kind(sink: object) -> None:
  """Refuses a sink kind that is not a `Destination` (a bare string would match no layout)."""
  if not isinstance(sink, Destination):
    raise TypeError(f'sink {sink!r}: expected a layouts.Destination'
                    f' ({", ".join(k.name for k in Destination)}), found a {type(sink).__name__}.')


@dataclasses.dataclass(frozen=True)
class Layout:
  """One output layout.

  Attributes:
    name: what `--layout` (a folder layout: `--model`) calls it.
    description: one line for people.
    lay_out: `Request -> LaidOut`, from metadata only.
    options: the options it reads (`Option`s: `Request` fields); the other
      layouts' options must keep their unset value (`check_options`).
    sink: the kind of destination it fills (a `Destination`).
    weights_only: it writes the model's weights alone (a `params_only` request).
    adapters: it takes LoRA adapters as they are (an adapters-only save is a
      valid source); else the pipeline refuses an adapters-only save unmerged.
  """

  name: str
  description: str
  lay_out: Callable[[Request], LaidOut]
  options: tuple[Option, ...] = ()
  sink: Destination = Destination.STEP
  weights_only: bool = False
  adapters: bool = False

  def __post_init__(self):
    _check_kind(self.sink)

  def takes(self, option: str) -> bool:
    return any(o.name == option for o in self.options)


LAYOUTS: catalog.Catalog[Layout] = catalog.Catalog('layout')
register, get, names = LAYOUTS.register, LAYOUTS.get, LAYOUTS.names


def options(sink: Destination | None = None) -> dict[str, Option]:
  """Every option some layout (of `sink`, else any) takes, by name: a command's layout flags.

  Raises:
    TypeError: `sink` is neither None nor a `Destination`.
  """
  if sink is not None:
    _check_kind(sink)
  return {o.name: o for n in names() for o in get(n).options
          if sink is None or get(n).sink == sink}


def named(sink: Destination) -> tuple[str, ...]:
  """The layouts that fill `sink` (a command's choices).

  Raises:
    TypeError: `sink` is not a `Destination`.
  """
  _check_kind(sink)
  return tuple(n for n in names() if get(n).sink == sink)


def check_options(layout: Layout, given: Mapping[str, Any]) -> None:
  """Refuses an option `layout` would ignore; checked before the source is opened.

  Args:
    layout: the layout asked for.
    given: layout options (`options()`) as the caller passed them.

  Raises:
    InvalidOptionError: one set (not its unset value) that `layout` does not
      read; the message names the layouts that do.
  """
  for option, known in options(layout.sink).items():
    value = given.get(option, known.unset)
    if not layout.takes(option) and value != known.unset:
      takers = [n for n in named(layout.sink) if get(n).takes(option)]
      raise errors.InvalidOptionError(
          f'`{option}` {value!r}: the {layout.name} layout does not take it (only'
          f' {", ".join(takers)} does). Leave `{option}` out, or pass `layout`'
          f' {" or ".join(takers)}.'
      )


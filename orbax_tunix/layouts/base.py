"""What every output is: a `Destination` (a kind of destination, and how it is written), a
`Layout` (what one holds), the `Option`s each layout declares, the `Plan` the pipeline makes of
them, and the catalog they register in.

Every output is a layout: an Orbax step (canonical, MaxText), a Hugging Face safetensors
folder (one layout per family) or a PEFT adapter folder. Its `destination` is one value: the
kind of destination (`commit.Kind`: what may be replaced, how it is committed), how its
outputs are sharded into files and written (through the one writer, `writing/writer.py`),
the dtypes it takes, and which command's flag chooses it. Its `options` are data the library
takes by name (`orbax_tunix.options.Option`) and the command line builds its flags from. A new output format is one module
(its destination, if it is a new kind, and its layouts) registered in `layouts/__init__.py`.

Its own module so that the layouts (`canonical`, `maxtext`, ...) import it, and the package
(`layouts/__init__.py`) imports them: no cycle.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
from etils import epath

from orbax_tunix import catalog, errors
from orbax_tunix.mapping import merge as merge_lib
from orbax_tunix.mapping.outputs import Input, ItemOutput, Output, copied
from orbax_tunix.options import Option
from orbax_tunix.reading import memory, reader
from orbax_tunix.writing import commit, writer


@dataclasses.dataclass(frozen=True)
class Request:
  """What a conversion asks of a layout.

  Attributes:
    source: the source step, opened (canonical leaves from metadata).
    params_only: the model weights only.
    dtype: floating leaves cast to this dtype (None: kept).
    merge: a LoRA merge whose merged weights are written (implies params_only).
    options: the layout's options (`Layout.options`) by name, as given (coerced), the
      others at their default.
  """

  source: reader.Source
  params_only: bool = False
  dtype: np.dtype | None = None
  merge: merge_lib.MergePlan | None = None
  options: Mapping[str, Any] = dataclasses.field(default_factory=dict)

  def option(self, option: Option) -> Any:
    """The value of one of the layout's options (its default when not given)."""
    return self.options.get(option.name, option.default)


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
class Plan:
  """Everything a conversion or an export does, decided from metadata before any write
  (`tools/pipeline.py` makes it, its layout's destination writes it).

  Attributes:
    source: the source step, canonical.
    dst: the destination (a step directory, an export folder).
    layout: the layout's name (`names()`).
    params_only: weights only (no optimizer state, no RNG state).
    dtype: floating leaves are cast to this dtype (None: kept).
    memory_budget: bytes of memory the streaming may use.
    force: replace an existing destination of the destination's kind.
    items: the items to write (a folder: one, its tensors).
    notes: things a person should know.
    merge: the LoRA merge whose weights are written (None: leaves are copied).
    custom_metadata: what the layout adds to a step's custom metadata.
    files: a folder's safetensors files and what each holds (a step: none).
    other_files: a folder's other files: (name, a path to copy or a text).
    summary: what the layout tells of its output (a family's model, architecture).
    options: the options the caller gave, by their names (`Option.name`: a layout's, a
      merge's; those not given left out), as given: a job's processes compare them by value
      (`agreement`), so a difference names the option, not only what it makes.
  """

  source: reader.Source
  dst: epath.Path
  layout: str
  params_only: bool
  dtype: np.dtype | None
  memory_budget: int
  force: bool
  items: tuple[ItemOutput, ...]
  notes: tuple[str, ...] = ()
  merge: merge_lib.MergePlan | None = None
  custom_metadata: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  files: tuple[writer.Shard, ...] = ()
  other_files: tuple[tuple[str, epath.Path | str], ...] = ()
  summary: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  options: Mapping[str, Any] = dataclasses.field(default_factory=dict)

  @property
  def outputs(self) -> tuple[Output, ...]:
    """Every output, item after item (a folder's: its tensors in write order)."""
    return tuple(o for item in self.items for o in item.outputs)

  @property
  def bytes_written(self) -> int:
    return sum(o.nbytes for o in self.outputs)

  @property
  def write_threads(self) -> int:
    """Threads that copy and write the files (`memory.write_threads` where the destination
    writes safetensors on the host: `Destination.safetensors`; else none beside the caller's)."""
    return memory.write_threads(self.memory_budget) if self._safetensors else 0

  @property
  def batch_bytes(self) -> int:
    return writer.batch_bytes(self.memory_budget, self._safetensors)

  @property
  def _safetensors(self) -> bool:
    return get(self.layout).destination.safetensors

  @property
  def reads_ahead(self) -> bool:
    return writer.reads_ahead(self.memory_budget)

  @property
  def sources(self) -> list[epath.Path]:
    """The step directories read (the source, and a merge's base)."""
    return [c.step_dir for c in merge_lib.checkpoints_read(self.source, self.merge)]

  @property
  def architecture(self) -> str | None:
    return self.summary.get('architecture')


@dataclasses.dataclass(frozen=True)
class Switch:
  """A command's flag that chooses a destination other than the command's default
  (`export --peft`), and the command's flags that do not go with it.

  Attributes:
    option: the flag (a switch: `Option.switch`).
    refuses: the command's flags (by their options' names) that do not go with it -> why.
    instead: what to do instead of such a flag, besides leaving it out.
    alone: the options of its layouts (by name) -> what the command says when one is given
      without it (else: that it is an option of this switch).
  """

  option: Option
  refuses: Mapping[str, str] = dataclasses.field(default_factory=dict)
  instead: str = ''
  alone: Mapping[str, str] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Destination:
  """A kind of destination, as one value: what it is, and which command writes it; how it is
  planned, shared and written are its methods (a new kind is a subclass: `layouts/step.py`,
  `layouts/folder.py`, `layouts/peft.py`).

  Attributes:
    name: what it is called ('step', 'folder', 'adapter').
    kind: what it is, for the destination checks and the commit (`commit.Kind`).
    unit: what one output is, for messages ('array', 'tensor').
    run: what writing one is called ('conversion', 'export').
    doing: the progress line's verb.
    command: the command that writes it (`orbax-tunix convert`, `export`).
    switch: the command's flag that chooses it (None: the command's default).
    merges: its layouts take a LoRA merge (the command's merge flags make one).
    safetensors: `write` writes safetensors files on the host (`writer.write(on_host=True)`):
      each tensor's bytes as they are (uncompressed), a tensor larger than a batch in
      blocks of its rows; else an Orbax step, each array held whole while written. On the host it
      writes on `Plan.write_threads` threads (their buffers, and the sink's own copies per
      byte, `memory.HOST_WRITE_COPIES`, size its batches).
  """

  name: str
  kind: commit.Kind
  unit: str
  run: str
  doing: str
  command: str = 'convert'
  switch: Switch | None = None
  merges: bool = True
  safetensors: bool = False

  def shard(self, items: Sequence[ItemOutput], given: Mapping[str, Any]
            ) -> tuple[Sequence[ItemOutput], Sequence[writer.Shard]]:
    """The items in write order, and a folder's files (the options given: by name)."""
    del given
    return items, ()

  def share(self, plan: Plan) -> Sequence[Output]:
    """The outputs this process reads (across hosts); all of them here."""
    return plan.outputs

  def write(self, plan: Plan, mine: Sequence[Output], work: epath.Path,
            progress: reader.Progress) -> dict[str, Any]:
    """Writes this process's outputs into the staging directory `work`; returns what to
    record of it (a folder: its files and bytes)."""
    raise NotImplementedError

  def entries(self, plan: Plan) -> Sequence[str]:
    """Every entry `write` makes at the top of the destination (a bucket's claim names
    them: `commit.staged`)."""
    raise NotImplementedError

  def dtype(self, dtype: Any) -> np.dtype | None:
    """The dtype written, from the `dtype` the caller gave (None: as stored).

    Raises:
      InvalidOptionError: one the destination's readers do not take.
    """
    return dtype


def _check_destination(destination: object) -> None:
  """Refuses a destination that is not a `Destination` (a bare string would match no
  layout)."""
  if not isinstance(destination, Destination):
    raise TypeError(f'destination {destination!r}: expected a layouts.Destination, found a'
                    f' {type(destination).__name__}.')


@dataclasses.dataclass(frozen=True)
class Layout:
  """One output layout.

  Attributes:
    name: what `--layout` (a family's layout: `--model`, with its destination's switch)
      calls it.
    description: one line for people.
    lay_out: `Request -> LaidOut`, from metadata only.
    destination: the kind of destination it fills (a `Destination`).
    options: the options it reads (`Option`s); the other layouts' options must keep their
      default (`check_options`).
    weights_only: it writes the model's weights alone (a `params_only` request).
    adapters: it takes LoRA adapters as they are (an adapters-only save is a
      valid source); else the pipeline refuses an adapters-only save unmerged.
    family: the Hugging Face family it writes (`mapping.huggingface`), for a family's
      layouts (found by `find`); None for the others.
  """

  name: str
  description: str
  lay_out: Callable[[Request], LaidOut]
  destination: Destination
  options: tuple[Option, ...] = ()
  weights_only: bool = False
  adapters: bool = False
  family: str | None = None

  def __post_init__(self):
    _check_destination(self.destination)

  def takes(self, option: str) -> bool:
    return any(o.name == option for o in self.options)


LAYOUTS: catalog.Catalog[Layout] = catalog.Catalog('layout')
register, get, names = LAYOUTS.register, LAYOUTS.get, LAYOUTS.names


def destinations(command: str | None = None) -> tuple[Destination, ...]:
  """The destinations the registered layouts fill (those `command` writes, else all), in
  the order their first layouts were registered: a command's default first."""
  found = {id(get(n).destination): get(n).destination for n in names()}
  return tuple(d for d in found.values() if command is None or d.command == command)


def options(destination: Destination | None = None) -> dict[str, Option]:
  """Every option some layout (filling `destination`, else any) takes, by name: a command's
  layout flags.

  Raises:
    TypeError: `destination` is neither None nor a `Destination`.
  """
  if destination is not None:
    _check_destination(destination)
  return {o.name: o for n in names() for o in get(n).options
          if destination is None or get(n).destination is destination}


def named(destination: Destination) -> tuple[str, ...]:
  """The layouts that fill `destination` (a command's choices).

  Raises:
    TypeError: `destination` is not a `Destination`.
  """
  _check_destination(destination)
  return tuple(n for n in names() if get(n).destination is destination)


def find(destination: Destination, family: str) -> Layout:
  """The layout that writes a Hugging Face family (by name) into `destination`.

  Raises:
    UnsupportedLayoutError: no such layout (the message names the families it has).
  """
  found = [get(n) for n in named(destination) if get(n).family == family]
  if not found:
    have = [get(n).family for n in named(destination) if get(n).family is not None]
    raise errors.UnsupportedLayoutError(
        f'`model` {family!r}: expected a family the {destination.name} layouts write'
        f' ({", ".join(have)}).')
  return found[0]


def check_options(layout: Layout, given: Mapping[str, Any]) -> None:
  """Refuses an option `layout` would ignore; checked before the source is opened.

  Args:
    layout: the layout asked for.
    given: layout options (`options()`) as the caller passed them.

  Raises:
    InvalidOptionError: one set (not its default) that `layout` does not read; the message
      names the layouts that do.
  """
  for option, known in options(layout.destination).items():
    value = given.get(option, known.default)
    if not layout.takes(option) and value != known.default:
      takers = [n for n in named(layout.destination) if get(n).takes(option)]
      raise errors.InvalidOptionError(
          f'`{option}` {value!r}: the {layout.name} layout does not take it (only'
          f' {", ".join(takers)} does). Leave `{option}` out, or pass `layout`'
          f' {" or ".join(takers)}.'
      )

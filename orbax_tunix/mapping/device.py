"""Outputs made on the devices, into their targets' shardings and dtypes: `OnDevices`, the
placement the one executor (`executor.run`) runs a restore with.

A MaxText restore (`maxtext.execute_plan`: reads, re-laid layers, filled
counts) and a LoRA merge (`merge.read_merged`) both come here as
`outputs.Output`s, the vocabulary the writer runs on the host:

  one whole source, as stored   read straight into its target (the caller's
                                restore args kept); a second target of the
                                same source is cast and resharded from it
  no source (a constant)        made on the devices
  a transform of sources        its sources read in the sharding that lines
                                up with the target's (`Transform.source_specs`),
                                then one compiled function per group of
                                outputs sharing their sources

Each source is read once. Groups are read together (one restore per item) up
to `memory.DEVICE_GROUP_BYTES` of sources held beside what they make, and released
before the next batch: many small merges are one read, a large stacked weight is
read alone. A source read exactly as its one output (a weight a merge adds
to) is donated: the output reuses its buffer.

Every group's program is known, by shapes, dtypes and shardings, before any
byte is read: `Compiler` compiles them on threads while the sources are read,
so that a first call does not compile after its reads (BENCHMARKS.md, issue 48: XLA
compiles partly outside the GIL; on a TPU the first compile in a process takes
longer than the merges), or loads them where `executables` kept them.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import contextvars
import dataclasses
import math
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from orbax_tunix import errors
from orbax_tunix.keypaths import Path, fmt
from orbax_tunix.mapping import dequantize, executables, executor, transforms
from orbax_tunix.mapping.outputs import Input, Output
from orbax_tunix.reading import memory, quantized
from orbax_tunix.reading.planned_item import PlannedItem, Reads
from orbax_tunix.reading.read_requests import ReadRequest, into, is_key, sharding_of


def require_arrays(targets: Mapping[Path, Any], subject: str, build: str) -> None:
  """Refuses target leaves that are not arrays (a float, an int, None), before any read.

  Args:
    targets: path -> a caller's target leaf (an abstract or concrete array, or a `Target`).
    subject: what holds them, for the message (e.g. 'The abstract state').
    build: how to build a target of arrays.

  Raises:
    TargetMismatchError: naming each such leaf and what it is.
  """
  bad = [f'{fmt(p)}: {type(t).__name__}' for p, t in targets.items()
         if not isinstance(t, Target) and not (hasattr(t, 'shape') and hasattr(t, 'dtype'))]
  if bad:
    raise errors.TargetMismatchError(
        f'{subject} has {len(bad)} leaves that are not arrays (expected'
        f' jax.ShapeDtypeStruct or jax.Array):\n{errors.list_paths(bad)}\n{build}')


@dataclasses.dataclass(frozen=True)
class Target:
  """Where an output goes.

  Attributes:
    abstract: its shape, dtype and sharding.
    args: the restore args a direct read uses.
  """

  abstract: jax.ShapeDtypeStruct
  args: ocp.ArrayRestoreArgs

  @classmethod
  def of(cls, leaf: Any, arg: Any = None) -> Target:
    """A caller's target leaf and its optional restore args.

    Caller-given `ArrayRestoreArgs` are kept (their class too, e.g. MaxText's
    single-replica ones); what they leave open is taken from the leaf, so
    every result has the target's dtype (MaxText passes shardings only). A
    leaf without a sharding is put on the first local device.
    """
    shape = tuple(leaf.shape)
    if isinstance(arg, ocp.ArrayRestoreArgs):
      sharding = arg.sharding if isinstance(arg.sharding, jax.sharding.Sharding) else None
      if sharding is None and arg.mesh is not None and arg.mesh_axes is not None:
        sharding = jax.sharding.NamedSharding(arg.mesh, arg.mesh_axes)
      changes: dict[str, Any] = {}
      if arg.dtype is None:
        changes['dtype'] = leaf.dtype
      if sharding is None:
        sharding = sharding_of(leaf)
        if arg.sharding is None and arg.mesh is None:
          changes['sharding'] = sharding
      arg = dataclasses.replace(arg, **changes) if changes else arg
      return cls(jax.ShapeDtypeStruct(shape, arg.dtype, sharding=sharding), arg)
    dtype = getattr(arg, 'dtype', None) or leaf.dtype
    sharding = sharding_of(leaf)
    return cls(jax.ShapeDtypeStruct(shape, dtype, sharding=sharding),
               ocp.ArrayRestoreArgs(sharding=sharding, dtype=dtype, global_shape=shape))

  def read_form(self) -> ReadRequest:
    """What to ask the item handler for: a typed PRNG key is read as its key data.

    The checkpoint records key data (e.g. uint32 (2,) for a threefry key of
    shape ()); it is wrapped back into a key after reading (`as_target`).
    """
    target, arg = self.abstract, self.args
    if not is_key(target.dtype):
      return target, arg
    data = jax.eval_shape(jax.random.key_data, target)
    sharding = target.sharding
    if isinstance(sharding, jax.sharding.NamedSharding):
      trailing = (None,) * (len(data.shape) - len(target.shape))
      sharding = jax.sharding.NamedSharding(
          sharding.mesh, jax.sharding.PartitionSpec(*sharding.spec, *trailing))
    arg = dataclasses.replace(arg, dtype=data.dtype, global_shape=data.shape, shape=data.shape,
                              sharding=sharding, mesh=None, mesh_axes=None)
    return jax.ShapeDtypeStruct(data.shape, data.dtype, sharding=sharding), arg

  def as_target(self, value: jax.Array) -> jax.Array:
    """A value read for this target in its form: PRNG keys as typed keys or key data."""
    want_key, have_key = is_key(self.abstract.dtype), is_key(value.dtype)
    if want_key == have_key:
      return value
    value = jax.random.wrap_key_data(value) if want_key else jax.random.key_data(value)
    return jax.device_put(value, self.abstract.sharding)

  def converted(self, value: jax.Array) -> jax.Array:
    """A value read for another target, cast and resharded on the devices into this one."""
    value = self.as_target(value)
    if is_key(self.abstract.dtype):
      return jax.device_put(value, self.abstract.sharding)
    dtype, sharding = self.abstract.dtype, self.abstract.sharding
    return jax.jit(lambda x: x.astype(dtype), out_shardings=sharding)(value)

  def constant(self, value: Any) -> jax.Array:
    """`value` everywhere in this target's shape, dtype and sharding."""
    host = np.full(self.abstract.shape, value, dtype=self.abstract.dtype)
    return jax.make_array_from_callback(host.shape, self.abstract.sharding, lambda idx: host[idx])


@dataclasses.dataclass(frozen=True)
class _Group:
  """Outputs made from the same sources, how each source is read and where it is put."""

  outputs: tuple[Output, ...]
  requests: tuple[ReadRequest, ...]
  placed: tuple[jax.sharding.Sharding, ...]
  donate: tuple[int, ...]

  @property
  def inputs(self) -> tuple[Input, ...]:
    return self.outputs[0].inputs

  @property
  def reads(self) -> tuple[tuple[Input, ReadRequest], ...]:
    return tuple(zip(self.inputs, self.requests, strict=True))

  @property
  def abstract_sources(self) -> tuple[jax.ShapeDtypeStruct, ...]:
    """What its program is called with, as shapes: an array read onto the devices (in its
    sharding), or a numpy array read to the host (no sharding: the program places it)."""
    return tuple(target if isinstance(target, jax.ShapeDtypeStruct) else
                 jax.ShapeDtypeStruct(tuple(i.leaf.shape), arg.dtype or i.leaf.dtype)
                 for i, (target, arg) in self.reads)

  @property
  def held_bytes(self) -> int:
    """Bytes of its sources that are not its outputs' buffers."""
    return sum(math.prod(i.leaf.shape) * np.dtype(getattr(r[1], 'dtype', None) or r[0].dtype
                                                  ).itemsize
               for k, (i, r) in enumerate(self.reads) if k not in self.donate)


def _group(outputs: Sequence[Output], targets: Mapping[Path, Target], uses: Mapping) -> _Group:
  first = outputs[0]
  dest = targets[first.path].abstract
  n = len(first.inputs)
  if any(i.partial for i in first.inputs):
    raise ValueError(f'{fmt(first.path)}: the device executor reads whole sources')
  shardings = transforms.source_shardings(first.transform, dest.sharding, len(dest.shape), n)
  dtypes = first.read_dtypes or (dest.dtype,) * n
  # A source to the host (None) is put whole on every device by the compiled function.
  requests = tuple(into(i.leaf.shape, d, s)
                   for i, d, s in zip(first.inputs, dtypes, shardings, strict=True))
  placed = tuple(transforms.everywhere(dest.sharding) if s is None else s for s in shardings)
  # A source read as its group's one output is, used nowhere else, gives it its buffer.
  donate = () if len(outputs) > 1 else tuple(
      k for k, (i, s, d) in enumerate(zip(first.inputs, shardings, dtypes, strict=True))
      if uses[i.key] == 1 and s is not None and (tuple(i.leaf.shape), np.dtype(d), s)
      == (tuple(dest.shape), np.dtype(dest.dtype), dest.sharding))
  return _Group(tuple(outputs), requests, placed, donate[:1])


@dataclasses.dataclass(frozen=True)
class _Direct:
  """Outputs that are one whole source as stored: read straight into the first target,
  the others cast and resharded from it. Holds nothing beside its outputs."""

  outputs: tuple[Output, ...]
  request: ReadRequest
  held_bytes = 0

  @property
  def reads(self) -> tuple[tuple[Input, ReadRequest], ...]:
    return ((_source(self), self.request),)


@dataclasses.dataclass(frozen=True)
class _Constant:
  """Outputs made from no source (a filled count)."""

  outputs: tuple[Output, ...]
  held_bytes = 0
  reads = ()


_Unit = _Direct | _Constant | _Group


def _source(unit: _Unit) -> Input:
  return unit.outputs[0].inputs[0]


def _got(reads: Reads, source: Input) -> Any:
  return reads.got(source.ckpt.detection, source.leaf.item, source.leaf.path)


class Compiler:
  """Programs compiled on threads, ahead of their first call: `submit` each, then call what
  `ready` gives (kept across processes where `executables` keeps them; else the program,
  whose own call runs what was compiled, from jit's cache).

  A compile that fails is left to the program's own call to raise (it compiles again).
  """

  def __init__(self):
    # Half the host's threads (the rest read), at most 8: XLA compiles outside the GIL, and
    # a TPU's compiles of one merge's programs (a second each, BENCHMARKS.md §28) overlap.
    threads = min(8, max(1, memory.host_threads() // 2))
    self._pool = concurrent.futures.ThreadPoolExecutor(threads,
                                                       thread_name_prefix='orbax_tunix-compile')
    self._compiling: dict[Hashable, concurrent.futures.Future] = {}

  def submit(self, program: transforms.Program, abstract: Sequence[jax.ShapeDtypeStruct]) -> None:
    """Compiles `program` for arguments like `abstract` (once)."""
    key = (program, tuple((s.shape, s.dtype, s.sharding) for s in abstract))
    if key not in self._compiling:
      # The caller's context (e.g. Orbax's served metadata) is the thread's.
      run = contextvars.copy_context().run
      self._compiling[key] = self._pool.submit(run, executables.compiled, program, abstract,
                                               executables.entry(program, abstract))

  def ready(self, program: transforms.Program,
            abstract: Sequence[jax.ShapeDtypeStruct]) -> Callable:
    """What to call `program` as for arguments like `abstract`, once its compile (if
    submitted) is done."""
    key = (program, tuple((s.shape, s.dtype, s.sharding) for s in abstract))
    found = self._compiling.get(key)
    if found is None or found.exception() is not None:
      return program
    return found.result()

  def close(self) -> None:
    """Stops compiling what has not started; waits for what has."""
    self._pool.shutdown(wait=True, cancel_futures=True)


@contextlib.contextmanager
def compiling() -> Iterator[Compiler]:
  """A `Compiler` for one restore, closed after it."""
  compiler = Compiler()
  try:
    yield compiler
  finally:
    compiler.close()


@dataclasses.dataclass(frozen=True)
class OnDevices:
  """The placement of outputs made on the devices, into their targets (`executor.Placement`;
  its units are the module's three kinds).

  Attributes:
    targets: output path -> its `Target`.
    compiler: where the groups' programs are compiled ahead while the sources are read
      (`units` submits them); None: each at its first call.
  """

  targets: Mapping[Path, Target]
  compiler: Compiler | None = None

  def units(self, outputs: Sequence[Output]) -> list[_Unit]:
    direct: dict[tuple, list[Output]] = {}
    made: dict[tuple, list[Output]] = {}
    for o in outputs:
      if o.transform.is_identity and len(o.inputs) == 1 and not o.inputs[0].partial:
        direct.setdefault(o.inputs[0].key, []).append(o)
      else:
        made.setdefault(tuple(i.key for i in o.inputs), []).append(o)
    uses = collections.Counter(i.key for o in outputs for i in o.inputs)
    reads = sorted((_Direct(tuple(g), self.targets[g[0].path].read_form()) for g in
                    direct.values()), key=lambda u: (_source(u).leaf.item, _source(u).leaf.path))
    constants = [_Constant(tuple(g)) for g in made.values() if not g[0].inputs]
    groups = [_group(g, self.targets, uses) for g in made.values() if g[0].inputs]
    if self.compiler is not None:
      for unit in groups:  # In the order they are made.
        self.compiler.submit(self._program(unit), unit.abstract_sources)
    # In this order, so that the first batch reads every direct source with the first groups.
    return [*reads, *constants, *groups]

  def _program(self, unit: _Group) -> Any:
    """A group's outputs as one jitted function of its sources (`transforms.on_devices`)."""
    return transforms.on_devices(
        [o.transform for o in unit.outputs],
        [self.targets[o.path].abstract.sharding for o in unit.outputs],
        [self.targets[o.path].abstract.dtype for o in unit.outputs], unit.donate, unit.placed)

  def held_bytes(self, unit: _Unit) -> int:
    return unit.held_bytes

  def read_bytes(self, batch: Sequence[_Unit]) -> int:
    return sum(source.nbytes for unit in batch for source, _ in unit.reads)

  def read(self, batch: Sequence[_Unit]) -> Reads:
    reads = Reads()
    for unit in batch:
      for source, request in unit.reads:
        reads.want(source.ckpt.detection, source.leaf.item, source.leaf.path, request)
    reads.read()
    return reads

  def make(self, unit: _Unit, reads: Reads) -> Iterable[tuple[Output, jax.Array]]:
    if isinstance(unit, _Constant):
      return [(o, self.targets[o.path].constant(np.asarray(o.transform.apply([])).item()))
              for o in unit.outputs]
    if isinstance(unit, _Direct):
      value = _got(reads, _source(unit))
      first, *others = unit.outputs
      return [(first, self.targets[first.path].as_target(value)),
              *((o, self.targets[o.path].converted(value)) for o in others)]
    make = self._program(unit)
    if self.compiler is not None:
      make = self.compiler.ready(make, unit.abstract_sources)
    made = make(*(_got(reads, s) for s in unit.inputs))
    return list(zip(unit.outputs, jax.block_until_ready(made), strict=True))


def _made(transform: transforms.Transform, request: ReadRequest, parts: Sequence[Any],
          compiler: Compiler) -> tuple[list[ReadRequest], Any]:
  """How to read a weight's parts for `request` (to the host, as saved, or into the
  sharding that lines up with the request's), and what makes it from them: a function of
  the parts' values, compiled ahead on the devices."""
  target, arg = request
  if isinstance(arg, ocp.ArrayRestoreArgs) or isinstance(
      getattr(target, 'sharding', None), jax.sharding.Sharding):
    dest = Target.of(target, arg).abstract
    shardings = transforms.source_shardings(transform, dest.sharding, len(dest.shape),
                                            len(parts))
    requests = [into(shape, dtype, sharding) for (shape, dtype), sharding
                in zip(parts, shardings, strict=True)]
    program = transforms.on_devices([transform], [dest.sharding], [dest.dtype], (), shardings)
    abstract = [r[0] for r in requests]
    compiler.submit(program, abstract)

    def compiled(*xs: Any) -> Any:
      return compiler.ready(program, abstract)(*xs)[0]
    return requests, compiled
  dtype = arg.dtype or getattr(target, 'dtype', None)
  if arg.restore_type is np.ndarray:  # To the host.
    requests = [into(shape, stored, None) for shape, stored in parts]
  else:  # As saved (no sharding asked for): made where qvalue was put.
    requests = [(0, ocp.RestoreArgs())] * len(parts)

  def make(*xs: Any) -> Any:
    if isinstance(xs[0], np.ndarray):
      value = transform.apply(xs)
      return value if dtype is None else value.astype(dtype)
    return transforms.on_devices([transform], [xs[0].sharding],
                                 [dtype or parts[1][1]])(*xs)[0]
  return requests, make


def plan_read(planned: PlannedItem, wanted: Mapping[Path, ReadRequest],
              via: Any = None) -> Callable[[], dict[Path, Any]]:
  """`PlannedItem.read` (one Orbax restore) where weights saved quantized are among the
  canonical leaves asked for (`PlannedItem.restore`'s `plan`): each read as its parts and
  made by `dequantize.transform` into its request's dtype, on the devices in its sharding
  (compiled while the parts are read; the parts dropped once it is made), to the host with
  numpy, or as saved. The parts are read `memory.DEVICE_GROUP_BYTES` at a time, one Orbax
  restore a group, each group made before the next is read (on the devices: while it is
  read). The parts are checked now, from their headers (`quantized.parts_of`); the read is
  the function returned.

  Raises:
    CorruptMetadataError: a weight's parts are not one quantized weight's (now); stored
      data is missing or damaged (on the read).
  """
  made = quantized.parts_of(planned.meta, planned.cmap, wanted)
  if not made:
    return lambda: planned.read(wanted, via)
  path_of = {d: p for p, d in planned.cmap.parts.items()}

  def read() -> dict[Path, Any]:
    out: dict[Path, Any] = {}
    with compiling() as compiler:
      makers, part_requests = {}, {}
      for c, (_, scheme) in made.items():  # Every program submitted before the first read.
        part_requests[c], makers[c] = _made(dequantize.transform(scheme), wanted[c],
                                            scheme.parts, compiler)
      # The parts read a group at a time, the other leaves with the first: a group is made
      # on the devices, asynchronously, while the next one is read.
      others = {c: r for c, r in wanted.items() if c not in made}
      for group in memory.batches(list(made), memory.DEVICE_GROUP_BYTES,
                                  size=lambda c: made[c][1].stored_bytes):
        requests, others = others, {}
        for c in group:
          requests.update(zip((path_of[d] for d in made[c][0]), part_requests[c], strict=True))
        got = planned.read(requests, via)
        for c in group:  # Each weight's parts taken out as it is made.
          out[c] = makers[c](*(got.pop(path_of[d]) for d in made[c][0]))
        out.update(got)  # What is left: the other leaves (the first group's).
    return {c: out[c] for c in wanted}
  return read


def execute(
    outputs: Sequence[Output], targets: Mapping[Path, Target], *,
    group_bytes: int | None = None,
) -> dict[Path, jax.Array]:
  """Makes each output on the devices, in its target's sharding and dtype (`OnDevices`).

  Args:
    outputs: what to make (whole sources; `Output.path` names the target).
    targets: output path -> its `Target`.
    group_bytes: sources held at once beside the outputs they make (None:
      `memory.DEVICE_GROUP_BYTES`; see the module).

  Returns:
    output path -> `jax.Array`.

  Raises:
    CorruptMetadataError: stored data is missing or damaged.
  """
  budget = memory.DEVICE_GROUP_BYTES if group_bytes is None else group_bytes
  with compiling() as compiler:
    return executor.run(outputs, OnDevices(targets, compiler), executor.Collect(),
                        budget)['values']

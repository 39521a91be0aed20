"""Property tests: the canonical rewrite and its inverse round-trip on generated trees; a
region read equals the takes it replaces."""

import hypothesis.strategies as st
import numpy as np
from hypothesis import given, settings

from orbax_tunix.keypaths import nest
from orbax_tunix.mapping import transforms
from orbax_tunix.view import canonical_map

# Module names a model may use, `base` among them (a model's own module).
NAMES = st.sampled_from(['base', 'layers', 'attn', 'mlp', 'w', 'kernel', 'bias', 'q', '0', '1', 'head', 'mu'])


def _tree(depth):
  if depth == 0:
    return st.just(None)
  return st.dictionaries(NAMES, st.one_of(st.just(None), _tree(depth - 1)), min_size=1, max_size=3)


def _paths(tree, prefix=()):
  for key, child in tree.items():
    if child is None:
      yield prefix + (key,)
    else:
      yield from _paths(child, prefix + (key,))


@st.composite
def weight_paths(draw):
  tree = draw(_tree(4))
  # A model whose only top-level module is called `base` is indistinguishable
  # from the adapter level (documented); the generator leaves that case out.
  if set(tree) == {'base'}:
    tree['head'] = None
  return sorted(set(_paths(tree)))


@st.composite
def checkpoint(draw):
  weights = draw(weight_paths())
  value = draw(st.booleans())
  adapter = draw(st.booleans())
  shell_at = draw(st.sampled_from([None, 'top', 'chain', 'accum']))
  chain_pos = draw(st.sampled_from(['0', '1', '3']))
  mirror = [('base',) + w if adapter else w for w in weights]
  inner = [('0', 'count')] + [('0', f) + w for f in ('mu', 'nu') for w in mirror]
  if shell_at is None:
    opt = [('opt_state',) + p for p in inner]
  else:
    shell = [('count',), ('hyperparams', 'learning_rate'), ('hyperparams', 'b1')]
    shell += [('inner_state',) + p for p in inner]
    where = {'top': ('opt_state',), 'chain': ('opt_state', chain_pos),
             'accum': ('opt_state', 'inner_opt_state')}[shell_at]
    opt = [where + p for p in shell]
    if shell_at == 'accum':
      opt += [('opt_state', 'mini_step'), ('opt_state', 'gradient_step')]
      opt += [('opt_state', 'acc_grads') + w for w in mirror]
  opt.append(('step',))
  model = mirror
  if value:
    model = [p + ('value',) for p in model]
    opt = [p + ('value',) for p in opt]
  return weights, value, adapter, shell_at, frozenset(model), frozenset(opt)


@settings(max_examples=150, deadline=None)
@given(checkpoint())
def test_round_trip_and_canonical_form(ckpt):
  weights, value, adapter, shell_at, model, opt = ckpt
  layouts = canonical_map.plan_step({'model_params': model, 'optimizer_state': opt})
  m, o = layouts['model_params'], layouts['optimizer_state']
  if not value:
    # No nnx value level: not Tunix's, so read exactly as it is (a plain optax
    # state keeps its inject shell, a model its `base`).
    assert not m.rewrites and not o.rewrites
    assert set(m.canonical_to_disk) == model and set(o.canonical_to_disk) == opt
    return
  for lay in (m, o):
    for disk, canon in lay.disk_to_canonical.items():
      if canon is not None:
        assert lay.to_disk_path(canon) == disk
  # The model's canonical paths are exactly its weights: a `base` of its own
  # survives; the adapter level and the value level do not.
  assert set(m.canonical_to_disk) == set(weights)
  canon_opt = set(o.canonical_to_disk)
  assert ('step',) in canon_opt
  assert not any(p[-1] == 'value' for p in canon_opt)
  mu_prefix = {None: ('opt_state', '0'), 'top': ('opt_state', '0'),
               'chain': ('opt_state', None, '0'), 'accum': ('opt_state', 'inner_opt_state', '0')}[shell_at]
  mus = {p[len(mu_prefix) + 1:] for p in canon_opt
         if len(p) > len(mu_prefix) and p[len(mu_prefix)] == 'mu'
         and all(a is None or a == b for a, b in zip(mu_prefix, p, strict=False))}
  assert mus == set(weights)
  # The shell's hyperparameters are the only leaves left out.
  side = {p[:-1] for p in o.side_paths}
  assert all('hyperparams' in p or p[-1] == 'count' for p in side)
  assert len(side) == (0 if shell_at is None else 3)


@settings(max_examples=60, deadline=None)
@given(checkpoint())
def test_tree_round_trip(ckpt):
  *_, model, opt = ckpt
  layouts = canonical_map.plan_step({'model_params': model, 'optimizer_state': opt})
  for paths, lay in ((model, layouts['model_params']), (opt, layouts['optimizer_state'])):
    disk_tree = nest((p, i) for i, p in enumerate(sorted(paths)))
    canon = canonical_map.to_canonical_tree(disk_tree, lay)
    back = canonical_map.to_disk_tree(canon, lay)
    kept = {p: i for i, p in enumerate(sorted(paths)) if lay.to_canonical_path(p) is not None}
    assert back == nest(kept.items())


@st.composite
def takes_on_a_shape(draw):
  """A shape, and `take`s one after another that fit it (axes counted either way)."""
  shape = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=4)))
  takes, ndim = [], len(shape)
  left = list(shape)
  for _ in range(draw(st.integers(0, ndim))):
    axis = draw(st.integers(-len(left), len(left) - 1))
    takes.append((axis, draw(st.integers(0, left[axis] - 1))))
    left.pop(axis)
  return shape, takes


@given(takes_on_a_shape())
@settings(max_examples=200, deadline=None)
def test_reading_a_region_equals_taking_its_slices(case):
  """What a reader reads (`x[region]`) is what the takes make of the whole array
  (`np.take` one after another), and the shape the transforms expect."""
  shape, takes = case
  x = np.arange(int(np.prod(shape))).reshape(shape)
  want = x
  for axis, i in takes:
    want = np.take(want, i, axis=axis)
  index, left = transforms.region(shape, takes)
  np.testing.assert_array_equal(x[index], want)
  assert left == want.shape
  chained = transforms.chain(*(transforms.take(a, i) for a, i in takes))
  peeled, rest = transforms.leading_takes(transforms.chain(chained, transforms.transpose()))
  assert list(peeled) == takes and rest.name == 'transpose'


# Element widths the safetensors sink copies as unsigned integers (1, 2, 4, 8 bytes) and one
# it copies as is (complex128: 16 bytes).
_DTYPES = ('float32', 'bfloat16', 'int8', 'float64', 'bool', 'complex128')


@st.composite
def strided_views(draw):
  """An array and a strided view of it: transposed, stepped, permuted, or as is."""
  ndim = draw(st.integers(1, 3))
  shape = tuple(draw(st.lists(st.integers(1, 300 if ndim <= 2 else 9), min_size=ndim,
                              max_size=ndim)))
  dtype = np.dtype(draw(st.sampled_from(_DTYPES)))
  x = np.arange(int(np.prod(shape))).reshape(shape).astype(dtype)
  view = draw(st.sampled_from(['T', 'step', 'perm', 'as is']))
  if view == 'T':
    return x.T
  if view == 'step':
    return x[(slice(None, None, draw(st.integers(1, 3))),) * ndim]
  if view == 'perm':
    return x.transpose(draw(st.permutations(range(ndim))))
  return x


@given(strided_views(), st.sampled_from([1, 100, 4096, 1 << 22]))
@settings(max_examples=100, deadline=None)
def test_row_pieces_copied_are_the_arrays_bytes_in_order(view, piece_bytes):
  """What the safetensors sink writes of a view (its pieces of rows, each copied into C order,
  at the bytes where their first row starts) is numpy's own C-order copy of it, whatever the
  strides, dtype and piece size."""
  from orbax_tunix.writing import writer  # noqa: PLC0415

  want = np.ascontiguousarray(view).reshape(-1).view(np.uint8)
  got = np.zeros_like(want)
  row = view[0].nbytes if view.ndim else view.nbytes
  for first, piece in writer.row_pieces(view, piece_bytes):
    out = np.empty(piece.shape, view.dtype)
    writer.copy_rows(piece, out)
    got[first * row:first * row + out.nbytes] = out.reshape(-1).view(np.uint8)
  np.testing.assert_array_equal(got, want)


class _Count:
  def __init__(self):
    self.advanced = []

  def advance(self, n):
    self.advanced.append(n)


@given(st.lists(st.integers(0, 9), max_size=6), st.booleans())
@settings(max_examples=60, deadline=None)
def test_stream_ahead_hands_over_what_it_reads_in_order(sizes, ahead):
  """Reading ahead hands over the same batches, values and progress as reading in turn, and
  reads a batch only once the one before it was handed over (two in flight at most)."""
  import contextvars  # noqa: PLC0415
  import threading  # noqa: PLC0415

  from orbax_tunix.reading import reader  # noqa: PLC0415

  seen = contextvars.ContextVar('seen', default=None)
  seen.set('caller')
  handed, reads, lock = [], [], threading.Lock()

  def read(batch):
    with lock:
      reads.append((batch[0], len(handed)))
    return (batch[0] * 10, seen.get())  # The read sees the caller's context.

  progress = _Count()
  batches = [[i] * (s + 1) for i, s in enumerate(sizes)]
  for batch, value in reader.stream(batches, read, progress, len, ahead=ahead):
    assert value == (batch[0] * 10, 'caller')
    handed.append(batch[0])
  assert handed == list(range(len(sizes)))
  assert progress.advanced == [s + 1 for s in sizes]
  assert all(handed_before >= i - 1 for i, handed_before in reads)


def test_stream_ahead_stops_reading_when_the_caller_fails():
  """An error in the caller's loop ends the stream: the read under way is cancelled or let
  finish, and no batch after it is read."""
  import pytest  # noqa: PLC0415

  from orbax_tunix.reading import reader  # noqa: PLC0415

  reads = []
  with pytest.raises(RuntimeError, match='caller'):
    for batch, _ in reader.stream([[0], [1], [2], [3]], lambda b: reads.append(b[0]),
                                  _Count(), len, ahead=True):
      if batch[0] == 1:
        raise RuntimeError('caller')
  assert reads in ([0, 1], [0, 1, 2])


@given(st.lists(st.integers(1, 9), min_size=1, max_size=6), st.integers(2, 12))
@settings(max_examples=60, deadline=None)
def test_stream_reads_ahead_only_batches_that_fit_beside_the_one_held(sizes, limit):
  """A batch is read while the one before is still held only where the two hold at most
  `limit` bytes together; otherwise once the caller has released it (a stack larger than a
  batch is not read beside another)."""
  import threading  # noqa: PLC0415

  from orbax_tunix.reading import reader  # noqa: PLC0415

  released, reads, lock = [0], {}, threading.Lock()

  def read(batch):
    with lock:
      reads[batch[0]] = released[0]  # Batches the caller was done with when this read began.
    return batch[0]

  batches = [[i] * s for i, s in enumerate(sizes)]
  handed = []
  for _, value in reader.stream(batches, read, _Count(), len, ahead=True, size=len,
                                    limit=limit):
    handed.append(value)
    released[0] += 1
  assert handed == list(range(len(sizes)))
  for i in range(1, len(sizes)):
    if sizes[i - 1] + sizes[i] > limit:
      assert reads[i] >= i, (sizes, limit, reads)


def test_nothing_made_outlives_its_batch():
  """The executor hands a batch's outputs to the sink and keeps none: an output that is a
  view of what was read (a layer of a stack read whole) would keep the stack alive beside
  the next batch's read."""
  import dataclasses  # noqa: PLC0415
  import weakref  # noqa: PLC0415

  from orbax_tunix.mapping import executor  # noqa: PLC0415
  from orbax_tunix.mapping.outputs import Output  # noqa: PLC0415

  alive = []

  @dataclasses.dataclass
  class Views:
    def units(self, outputs):
      return [[o] for o in outputs]

    def held_bytes(self, unit):
      return 10

    def read_bytes(self, batch):
      return 10

    def read(self, batch):
      alive.extend(r() is not None for r in refs)  # What earlier batches read, still held?
      stack = np.ones(10)
      refs.append(weakref.ref(stack))
      return stack

    def make(self, unit, stack):
      yield unit[0], stack[:1]  # A view: it holds the whole stack.

  class Drop:
    def write(self, batch):
      pass

    def close(self):
      return {}

  refs = []
  outputs = [Output((name,), (), shape=(1,), dtype=np.dtype(np.float64)) for name in 'abc']
  executor.run(outputs, Views(), Drop(), budget=10)
  assert len(refs) == 3 and not any(alive), alive


def test_a_take_of_a_host_array_is_a_view():
  """`take` on numpy selects without copying (`np.take` copies): a layer of a stack read
  whole, then an expert of it, costs no copy of the layer."""
  x = np.arange(4 * 3 * 5, dtype=np.float32).reshape(4, 3, 5)
  for axis in range(3):
    for index in range(x.shape[axis]):
      got = transforms.take(axis, index).apply([x])
      np.testing.assert_array_equal(got, np.take(x, index, axis=axis))
      assert np.shares_memory(got, x)
  got = transforms.chain(transforms.take(1, 2), transforms.take(0, 3)).apply([x])
  np.testing.assert_array_equal(got, x[3, 2])
  assert np.shares_memory(got, x)


def test_transforms_that_compute_differently_are_compiled_apart():
  """The device executor's compile cache is keyed by what a transform computes: two divides
  of one name but another axis (or function) are two programs, with their own results."""
  import math  # noqa: PLC0415

  import jax  # noqa: PLC0415

  x = np.arange(2 * 4 * 9, dtype=np.float32).reshape(2, 4, 9) + 1
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  for axis in (1, 2):
    t = transforms.divide('sqrt(n)', math.sqrt, axis=axis)
    got = transforms.on_devices([t], [device], [np.float32])(x)[0]
    np.testing.assert_allclose(np.asarray(got), x / np.sqrt(x.shape[axis]), rtol=1e-6)
  same = [transforms.chain(transforms.divide('s', math.sqrt, axis=1), transforms.transpose())
          for _ in range(2)]
  assert same[0].computes == same[1].computes
  assert (transforms.divide('s', math.sqrt, axis=1).computes
          != transforms.divide('s', math.log, axis=1).computes)

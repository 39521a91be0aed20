"""A QLoRA restore, dequantizing (and merging) during the read, against the plain read of the
same checkpoint's raw leaves.

Writes a Tunix-layout full save of a QLoRA run (issue 45): Qwen3-shaped decoder layers
(attention `q_proj`, `k_proj`, `v_proj` (D, N, H) and `o_proj` (N, H, D) einsum kernels, MLP
`gate_proj`, `up_proj` (D, F) and `down_proj` (F, D) kernels, four norms), an embedding and an
LM head; every projection quantized by the real qwix (`qwix.quantize(w, --qtype,
channelwise_axes=<its output axes>, tiled_axes={<its last contracting axis>: --tile-size},
calibration_method=--calibration)`, as qwix's `LoraProvider(weight_qtype=...)` quantizes a
frozen base) from incompressible random weights of `--dtype`, stored as qwix keeps them
(`<w>/array/{qvalue,scale[,zero_point]}`) with `<w>_lora_a`, `<w>_lora_b` beside each, every
leaf under nnx's `value` level, saved by Orbax as Tunix's `CheckpointManager` saves
(`ocp.Checkpointer(ocp.CompositeCheckpointHandler())`, item `model_params`). Then, each in a
fresh process, restores it into targets sharded over a (data, model) mesh of the first
`--devices N` of JAX's devices (8 simulated CPU devices by default; `harness.py`), once (the
first call) and `--warm K` more times in the same process:

  raw      plain Orbax (`PyTreeCheckpointHandler` under a `CompositeCheckpointHandler`) reads
           the raw leaves as stored (qvalue, scale, zero point, adapters, the rest): qvalue in
           the weight's target sharding, scale and zero point in the one that lines up with it
           (partitioned on the axes where they have the weight's size): the floor, the same
           bytes read
  qwix     raw, then qwix's own `dequantize` of each weight, compiled into the target's
           sharding and dtype: what a user of plain Orbax writes by hand (a reference)
  dequant  `ocp.Checkpointer(orbax_tunix.TunixAwareHandler())` restores the canonical target:
           every weight dequantized, adapters and the rest as stored
  merge    `orbax_tunix.restore_merged_lora(run, plain_target, lora_alpha=--alpha)`: the plain
           model's weights, W_deq + alpha/rank * a.b where adapted

and, only where `--contenders` names them, the arithmetic alone (what no read can hide on a host
whose cores the read keeps busy): each reads raw's arrays at its first call and keeps them, so
that its warm calls time only its programs:

  dequant-math  qwix's `dequantize` of each weight (qwix's warm calls without the read)
  merge-math    each weight's merge as one program: qwix's `dequantize`, then
                W + alpha/rank * a.b in float32, in the model's dtype

Before the rounds, one more fresh process checks the contenders once: dequant's weights equal
`qwix.dequantize` of raw's parts (bit for bit, cast to the target's dtype), its adapters and
other leaves raw's; merge's weights equal numpy's W_deq + s * tensordot(a, b) on the first and
last layers' projections. Repetitions rotate the order; the page cache is left warm (every
contender reads the same quantized bytes; merge and dequant also read the adapters, as raw
does). Reported, first and warm calls apart: wall time (median and spread), peak RSS above the
process's RSS just before the call (VmHWM after resetting it) against the bound a dequantizing
read must keep, the devices' peak memory where the backend reports it, and each contender's
time over raw's.

  python benchmarks/qlora.py [--layers 16 --dim 1024 --dtype float32 --qtype int8
      --tile-size T --calibration absmax --reps 5] [--devices N] [--warm K] [--quick]
      [--compile-cache off|cold|warm]

`--compile-cache` runs every child without JAX's persistent compilation cache, with a fresh
empty one each (cold), or with one earlier children filled (warm: `harness.CompileCache`).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import pathlib
import tempfile
import time
from collections.abc import Callable
from typing import Any

import harness  # sibling module; the script's directory is on sys.path
import synthetic  # sibling module

MIB = 2**20
CONTENDERS = ('raw', 'qwix', 'dequant', 'merge')
ARITHMETIC = ('dequant-math', 'merge-math')  # Run only where `--contenders` names them.
NAMES = {
    'raw': 'plain Orbax: the raw leaves (floor)',
    'qwix': 'raw, then qwix.dequantize on the devices',
    'dequant': 'TunixAwareHandler: the canonical float target',
    'merge': 'restore_merged_lora: the plain model',
    'dequant-math': "qwix.dequantize alone (warm calls), of raw's arrays read once",
    'merge-math': "dequantize + W + s a.b alone (warm calls), of raw's arrays read once",
}
# Orbax cannot save qwix's nf4 (uint4: "Unsupported data type"), so a full save has none.
QTYPES = ('int8', 'int4', 'float8_e4m3fn')
PARTS = ('qvalue', 'scale', 'zero_point')


@dataclasses.dataclass(frozen=True)
class Model:
  """The synthetic QLoRA run's shapes and recipe."""

  layers: int
  dim: int
  heads: int
  kv_heads: int
  head_dim: int
  ffn: int
  vocab: int
  rank: int
  dtype: str
  qtype: str
  tile_size: int | None
  calibration: str

  def projections(self) -> dict[str, tuple[tuple[int, ...], tuple[int, ...], tuple[Any, ...]]]:
    """Within a layer: weight path -> (shape, contracting axes, target partition spec)."""
    d, n, k, h, f = self.dim, self.heads, self.kv_heads, self.head_dim, self.ffn
    return {
        'attn/q_proj/w': ((d, n, h), (0,), ('data', 'model', None)),
        'attn/k_proj/w': ((d, k, h), (0,), ('data', 'model', None)),
        'attn/v_proj/w': ((d, k, h), (0,), ('data', 'model', None)),
        'attn/o_proj/w': ((n, h, d), (0, 1), ('model', None, 'data')),
        'mlp/gate_proj/kernel': ((d, f), (0,), ('data', 'model')),
        'mlp/up_proj/kernel': ((d, f), (0,), ('data', 'model')),
        'mlp/down_proj/kernel': ((f, d), (0,), ('model', 'data')),
    }

  def others(self) -> dict[str, tuple[tuple[int, ...], tuple[Any, ...]]]:
    """The leaves that are not quantized: path -> (shape, partition spec)."""
    out = {'embedder/input_embedding': ((self.vocab, self.dim), ('model', 'data')),
           'final_norm/w': ((self.dim,), ()),
           'lm_head/w': ((self.dim, self.vocab), ('data', 'model'))}
    for i in range(self.layers):
      for name, size in (('input_layernorm/w', self.dim), ('post_attention_layernorm/w', self.dim),
                         ('attn/q_norm/w', self.head_dim), ('attn/k_norm/w', self.head_dim)):
        out[f'layers/{i}/{name}'] = ((size,), ())
    return out

  def weights(self) -> dict[str, tuple[tuple[int, ...], tuple[int, ...], tuple[Any, ...]]]:
    return {f'layers/{i}/{p}': v for i in range(self.layers)
            for p, v in self.projections().items()}

  def tiled(self, shape: tuple[int, ...], contracting: tuple[int, ...]) -> dict[int, int]:
    return {contracting[-1]: self.tile_size} if self.tile_size else {}

  def scale_shape(self, shape: tuple[int, ...], contracting: tuple[int, ...]) -> tuple[int, ...]:
    tiled = self.tiled(shape, contracting)
    return tuple(n // tiled[a] if a in tiled else 1 if a in contracting else n
                 for a, n in enumerate(shape))

  @staticmethod
  def adapter_shapes(shape, contracting, rank) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """qwix's `lora_a` (the contracting axes, rank) and `lora_b` (rank, the output axes)."""
    kept = tuple(n for a, n in enumerate(shape) if a not in contracting)
    return tuple(shape[a] for a in contracting) + (rank,), (rank, *kept)

  def float_bytes(self) -> int:
    """The dequantized projections in `dtype`."""
    size = 2 if self.dtype == 'bfloat16' else 4
    return sum(math.prod(s) for s, _, _ in self.weights().values()) * size

  def largest_f32(self) -> int:
    return max(math.prod(s) for s, _, _ in self.projections().values()) * 4

  def key(self) -> str:
    tile = f't{self.tile_size}' if self.tile_size else 'pc'
    return (f'{self.layers}x{self.dim}-h{self.heads}k{self.kv_heads}d{self.head_dim}'
            f'-f{self.ffn}-v{self.vocab}-r{self.rank}-{self.dtype}-{self.qtype}-{tile}'
            f'-{self.calibration}')


def model_of(args) -> Model:
  return Model(args.layers, args.dim, args.heads, args.kv_heads, args.head_dim,
               args.ffn or 3 * args.dim, args.vocab, args.rank, args.dtype, args.qtype,
               args.tile_size, args.calibration)


def nest(flat: dict[str, Any]) -> dict[str, Any]:
  """Nested dicts from '/'-joined paths."""
  return synthetic.nest((tuple(path.split('/')), value) for path, value in flat.items())


def write(step: pathlib.Path, model: Model) -> dict[str, int]:
  """The QLoRA full save, quantized by qwix; returns its bytes by kind."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  import qwix  # pylint: disable=g-import-not-at-top

  rng = np.random.default_rng(0)
  dtype = jnp.dtype(model.dtype)

  def noise(shape, scale=1.0):
    return jnp.asarray(rng.standard_normal(shape, dtype=np.float32) * scale).astype(dtype)

  flat: dict[str, Any] = {}
  sizes = {'parts': 0, 'adapters': 0, 'others': 0}
  for path, (shape, contracting, _) in model.weights().items():
    w = noise(shape, 0.02)
    channelwise = tuple(a for a in range(len(shape)) if a not in contracting)
    q = qwix.quantize(w, model.qtype, channelwise_axes=channelwise,
                      tiled_axes=model.tiled(shape, contracting) or None,
                      calibration_method=model.calibration)
    parts = {'qvalue': q.qvalue, 'scale': q.scale, 'zero_point': q.zero_point}
    for name, value in parts.items():
      if value is not None:
        flat[f'{path}/array/{name}/value'] = value
        sizes['parts'] += value.size * max(1, value.dtype.itemsize)
    a_shape, b_shape = model.adapter_shapes(shape, contracting, model.rank)
    flat[f'{path}_lora_a/value'] = noise(a_shape, 0.05)
    flat[f'{path}_lora_b/value'] = noise(b_shape, 0.05)
    sizes['adapters'] += (math.prod(a_shape) + math.prod(b_shape)) * dtype.itemsize
  for path, (shape, _) in model.others().items():
    flat[f'{path}/value'] = noise(shape, 0.02 if len(shape) > 1 else 1.0)
    sizes['others'] += math.prod(shape) * dtype.itemsize
  with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckptr:
    ckptr.save(step, args=ocp.args.Composite(model_params=ocp.args.PyTreeSave(nest(flat))))
  return sizes


# --- the children ----------------------------------------------------------------------


class Targets:
  """The three targets the contenders restore into, over one mesh."""

  def __init__(self, model: Model, mesh):
    import jax  # pylint: disable=g-import-not-at-top
    import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
    import ml_dtypes  # pylint: disable=g-import-not-at-top

    self.model = model
    dtype = jnp.dtype(model.dtype)
    qdtype = jnp.dtype(getattr(ml_dtypes, model.qtype, None) or model.qtype)
    everywhere = harness.sharding(mesh, (), ())

    def leaf(shape, d, spec):
      return jax.ShapeDtypeStruct(shape, d, sharding=harness.sharding(mesh, shape, spec))

    canonical, plain, raw = {}, {}, {}
    self.shardings = {}
    for path, (shape, contracting, spec) in model.weights().items():
      weight = leaf(shape, dtype, spec)
      canonical[path] = plain[path] = weight
      self.shardings[path] = weight.sharding
      scale_shape = model.scale_shape(shape, contracting)
      # Partitioned as the weight where the scale has the weight's size; whole elsewhere.
      lined = tuple(p if s == n else None for p, s, n in zip(spec + (None,) * len(shape), scale_shape,
                                                             shape, strict=False))
      raw[f'{path}/array/qvalue/value'] = leaf(shape, qdtype, spec)
      raw[f'{path}/array/scale/value'] = leaf(scale_shape, dtype, lined)
      if model.calibration == 'minmax':
        raw[f'{path}/array/zero_point/value'] = leaf(scale_shape, qdtype, lined)
      a_shape, b_shape = model.adapter_shapes(shape, contracting, model.rank)
      for name, s in (('lora_a', a_shape), ('lora_b', b_shape)):
        adapter = jax.ShapeDtypeStruct(s, dtype, sharding=everywhere)
        canonical[f'{path}_{name}'] = raw[f'{path}_{name}/value'] = adapter
    for path, (shape, spec) in model.others().items():
      other = leaf(shape, dtype, spec)
      canonical[path] = plain[path] = raw[f'{path}/value'] = other
    self.canonical, self.plain, self.raw = nest(canonical), nest(plain), nest(raw)


_COMPILED: dict[Any, Any] = {}


def _made_qwix(n: int, merge_scale: float | None, dtype: Any, sharding: Any, *xs: Any) -> Any:
  """One weight from its `n` parts (qvalue, scale[, zero point]) by qwix's `dequantize`; with
  `merge_scale`, merged with the adapters after them: W + merge_scale * a.b in float32, in
  `dtype`, each device computing its own block (a laid out as W's leading, contracting axes, b
  as the rest: the product then moves no data between devices)."""
  import jax  # pylint: disable=g-import-not-at-top
  import qwix  # pylint: disable=g-import-not-at-top

  jnp = jax.numpy
  qvalue, scale, *zero_point = xs[:n]
  w = qwix.dequantize(qwix.QArray(qvalue, scale, *(zero_point or [None]), qvalue.dtype))
  w = w.astype(dtype)
  if merge_scale is None:
    return w
  a, b = (x.astype(jnp.float32) for x in xs[n:])
  k = a.ndim - 1  # The contracting axes lead W's.
  spec = (*sharding.spec, *(None,) * (w.ndim - len(sharding.spec)))
  # jax.make_mesh's axes are explicit (resharded); a Mesh's are auto (constrained).
  explicit = all(t == jax.sharding.AxisType.Explicit for t in sharding.mesh.axis_types)
  lay = jax.sharding.reshard if explicit else jax.lax.with_sharding_constraint
  a = lay(a, jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*spec[:k], None)))
  b = lay(b, jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(None, *spec[k:])))
  axes = 'abcdefgh'[:w.ndim]
  delta = jnp.einsum(f'{axes[:k]}r,r{axes[k:]}->{axes}', a, b)
  return (w.astype(jnp.float32) + jnp.float32(merge_scale) * delta).astype(dtype)


def _qwix_weights(model: Model, targets: Targets, tree, merge_scale: float | None = None
                  ) -> dict[str, Any]:
  """qwix's `dequantize` of each weight of a raw read, compiled into its target's sharding;
  with `merge_scale`, each weight merged in the same program (`_made_qwix`), in the model's
  dtype."""
  import jax  # pylint: disable=g-import-not-at-top

  dtype = jax.numpy.dtype(model.dtype)
  compiled = _COMPILED  # Kept across calls, as a user's jitted function is.
  out = {}
  for path in model.weights():
    *parents, name = path.split('/')
    parent = tree
    for p in parents:
      parent = parent[p]
    parts = [parent[name]['array'][k]['value'] for k in PARTS if k in parent[name]['array']]
    adapters = [] if merge_scale is None else [parent[f'{name}_lora_{n}']['value'] for n in 'ab']
    sharding = targets.shardings[path]
    key = (sharding, len(parts), merge_scale)
    if key not in compiled:
      made = functools.partial(_made_qwix, len(parts), merge_scale, dtype, sharding)
      compiled[key] = jax.jit(made, out_shardings=sharding)
    out[path] = compiled[key](*parts, *adapters)
  return out


def calls_of(args, model: Model, targets: Targets):
  """name -> the call a contender times (blocks until every array is ready)."""
  import jax  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

  import orbax_tunix  # pylint: disable=g-import-not-at-top

  run = pathlib.Path(args.workdir) / model.key()
  step = run / '1'

  def raw():
    # Plain Orbax needs restore_args to read into shardings; deriving them is part of
    # what its user does, so it is timed (as in restore_cost.py's contender a).
    item = ocp.args.PyTreeRestore(
        item=targets.raw, restore_args=ocp.checkpoint_utils.construct_restore_args(targets.raw))
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler(
        model_params=ocp.PyTreeCheckpointHandler())) as ckptr:
      return ckptr.restore(step, args=ocp.args.Composite(model_params=item))['model_params']

  def qwix_dequantized():
    tree = raw()
    return tree, _qwix_weights(model, targets, tree)

  def dequant():
    with ocp.Checkpointer(orbax_tunix.TunixAwareHandler(
        model_params=ocp.PyTreeCheckpointHandler())) as ckptr:
      return ckptr.restore(step, args=ocp.args.Composite(
          model_params=ocp.args.PyTreeRestore(item=targets.canonical)))['model_params']

  def merge():
    return orbax_tunix.restore_merged_lora(run, targets.plain, lora_alpha=args.alpha)

  held = {}

  def read_once():
    # Read by the first call and kept: the warm calls time the arithmetic alone.
    if 'tree' not in held:
      held['tree'] = raw()
    return held['tree']

  calls = {'raw': raw, 'qwix': qwix_dequantized, 'dequant': dequant, 'merge': merge,
           'dequant-math': lambda: _qwix_weights(model, targets, read_once()),
           'merge-math': lambda: _qwix_weights(model, targets, read_once(),
                                                  args.alpha / model.rank)}
  return {k: (lambda f=f: jax.block_until_ready(f())) for k, f in calls.items()}


def check(args, model: Model, targets: Targets, calls) -> dict[str, Any]:
  """dequant against qwix's dequantize of raw's parts; merge against numpy's formula."""
  import jax  # pylint: disable=g-import-not-at-top
  import ml_dtypes  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import qwix  # pylint: disable=g-import-not-at-top

  def at(tree, path):
    for p in path.split('/'):
      tree = tree[p]
    return tree

  raw = calls['raw']()
  dequant = calls['dequant']()
  dtype = np.dtype(model.dtype)
  checked = {'dequant_weights': 0, 'dequant_others': 0, 'merge_weights': 0}
  wanted = {}
  for path in model.weights():
    node = at(raw, path)['array']
    parts = {k: np.asarray(node[k]['value']) for k in PARTS if k in node}
    want = qwix.dequantize(qwix.QArray(
        jax.numpy.asarray(parts['qvalue']), jax.numpy.asarray(parts['scale']),
        None if 'zero_point' not in parts else jax.numpy.asarray(parts['zero_point']),
        parts['qvalue'].dtype))
    want = np.asarray(want).astype(dtype)
    got = at(dequant, path)
    assert got.dtype == dtype and got.sharding == targets.shardings[path], (path, got.sharding)
    np.testing.assert_array_equal(np.asarray(got), want, err_msg=path)
    checked['dequant_weights'] += 1
    for name in ('lora_a', 'lora_b'):
      np.testing.assert_array_equal(np.asarray(at(dequant, f'{path}_{name}')),
                                    np.asarray(at(raw, f'{path}_{name}/value')))
    if path.startswith(('layers/0/', f'layers/{model.layers - 1}/')):
      wanted[path] = want
  for path in model.others():
    np.testing.assert_array_equal(np.asarray(at(dequant, path)), np.asarray(at(raw, f'{path}/value')))
    checked['dequant_others'] += 1
  del dequant
  merged = calls['merge']()
  # The arithmetic contender computes what it times: the same merge, by qwix and jax.numpy.
  merged_math = calls['merge-math']()
  s = np.float32(args.alpha / model.rank)
  for path, w in wanted.items():
    a = np.asarray(at(raw, f'{path}_lora_a/value')).astype(np.float32)
    b = np.asarray(at(raw, f'{path}_lora_b/value')).astype(np.float32)
    want = w.astype(np.float32) + s * np.tensordot(a, b, axes=1)
    # float32: summation order only; bfloat16: the result rounded once to 8 bits.
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == np.float32 else dict(
        rtol=float(ml_dtypes.finfo(dtype).eps), atol=1e-3)
    for got in (at(merged, path), merged_math[path]):
      assert got.dtype == dtype and got.sharding == targets.shardings[path], path
      np.testing.assert_allclose(np.asarray(got).astype(np.float32),
                                 want.astype(dtype).astype(np.float32), err_msg=path, **tol)
    checked['merge_weights'] += 1
  for path in model.others():
    np.testing.assert_array_equal(np.asarray(at(merged, path)), np.asarray(at(raw, f'{path}/value')))
  adapters = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(merged)[0]
              if 'lora' in jax.tree_util.keystr(p)]
  assert not adapters, f'adapters in the plain model: {adapters[:3]}'
  return checked


def child(args) -> None:
  """The measured restores, in this fresh process; prints a JSON line."""
  devices = harness.use_devices(args.devices, cpu_default=8)
  import jax  # pylint: disable=g-import-not-at-top

  mesh = harness.make_mesh(devices)
  model = model_of(args)
  targets = Targets(model, mesh)
  calls = calls_of(args, model, targets)
  if args.child == 'check':
    checked = check(args, model, targets, calls)
    harness.emit({'contender': 'check', 'checked': checked,
                  'devices': harness.describe(devices, mesh)})
    return
  waited = _compile_waits()
  measured = harness.calls(calls[args.child], args.warm, devices,
                           describe_out=lambda out: {'leaves': len(jax.tree.leaves(out)),
                                                     'compile_wait_s': waited()})
  harness.emit(harness.child_result(args.child, measured, devices, mesh))


def _compile_waits() -> Callable[[], float]:
  """Times what callers wait in `device.Compiler.ready` (a program asked for before it is
  compiled: the read outran the compile thread); returns a function giving the seconds
  waited since it last gave them (each call's, read after it)."""
  from orbax_tunix.mapping import device  # pylint: disable=g-import-not-at-top

  total, ready = [0.0], device.Compiler.ready

  def timed(self, *args: Any, **kwargs: Any) -> Any:
    start = time.perf_counter()
    try:
      return ready(self, *args, **kwargs)
    finally:
      total[0] += time.perf_counter() - start

  device.Compiler.ready = timed

  def taken() -> float:
    seconds, total[0] = total[0], 0.0
    return round(seconds, 4)
  return taken


# --- the parent ------------------------------------------------------------------------


def add_model_flags(parser) -> None:
  parser.add_argument('--layers', type=int, default=16)
  parser.add_argument('--dim', type=int, default=1024)
  parser.add_argument('--heads', type=int, default=16)
  parser.add_argument('--kv-heads', type=int, default=8)
  parser.add_argument('--head-dim', type=int, default=128)
  parser.add_argument('--ffn', type=int, default=None, help='MLP width (default 3 x dim)')
  parser.add_argument('--vocab', type=int, default=8192)
  parser.add_argument('--rank', type=int, default=16)
  parser.add_argument('--alpha', type=float, default=32.0)
  parser.add_argument('--dtype', choices=('float32', 'bfloat16'), default='float32',
                      help="the model's dtype: the weights qwix quantizes, scales, adapters,"
                      ' targets')
  parser.add_argument('--qtype', choices=QTYPES, default='int8',
                      help='qwix weight_qtype (nf4: Orbax cannot save it, see TUNIX_FORMAT.md)')
  parser.add_argument('--tile-size', type=int, default=None,
                      help='qwix tile_size on the last contracting axis (default per channel)')
  parser.add_argument('--calibration', choices=('absmax', 'minmax'), default='absmax')


QUICK = dict(layers=2, dim=256, heads=4, kv_heads=2, head_dim=64, vocab=1024, rank=8, reps=2)


def shown(args) -> str:
  """The flags that make this run, as a command line."""
  flags = ['layers', 'dim', 'heads', 'kv_heads', 'head_dim', 'ffn', 'vocab', 'rank', 'alpha',
           'dtype', 'qtype', 'tile_size', 'calibration', 'reps', 'warm', 'devices',
           'compile_cache']
  out = []
  for k in flags:
    v = getattr(args, k)
    if v is not None:
      out.append(f'--{k.replace("_", "-")} {v:g}' if isinstance(v, float) else
                 f'--{k.replace("_", "-")} {v}')
  if args.contenders != ','.join(CONTENDERS):
    out.append(f'--contenders {args.contenders}')
  return ' '.join(out)


def report(args, model: Model, sizes: dict[str, int], results, checked) -> None:
  names = list(results)
  print(f'\nCommand: `python benchmarks/qlora.py {shown(args)}`')
  per = model.projections()
  print(f'{len(model.weights())} projections ({len(per)} per layer, Qwen3-shaped: q/k/v/o'
        f' {per["attn/q_proj/w"][0]}/{per["attn/k_proj/w"][0]}/{per["attn/o_proj/w"][0]},'
        f' MLP {per["mlp/gate_proj/kernel"][0]}) quantized by qwix {model.qtype},'
        f' {f"tiles of {model.tile_size}" if model.tile_size else "per channel"},'
        f' {model.calibration}, from {model.dtype} weights; adapters rank {model.rank}.'
        f'\nOn disk: parts {sizes["parts"] / MIB:.0f} MiB, adapters {sizes["adapters"] / MIB:.0f}'
        f' MiB, other leaves {sizes["others"] / MIB:.0f} MiB; dequantized projections'
        f' {model.float_bytes() / MIB:.0f} MiB of {model.dtype}.'
        f'\nDevices: {harness.describe_line(harness.first_device_info(results))};'
        f' {harness.CompileCache(args.compile_cache, pathlib.Path()).describe()}.'
        f' Checked once: {checked}')
  print('\n' + harness.first_and_warm(results, NAMES, base='raw' if 'raw' in names else None))
  if 'raw' not in names:
    return
  raw = harness.ok(results['raw'])
  # Paired per round: each contender's first call over raw's of the same round.
  print('\nPer round, over raw (first calls; warm calls: their median in the process):\n')
  rows = []
  for c in names:
    if c == 'raw':
      continue
    firsts, warms = [], []
    for r in harness.ok(results[c]):
      b = next((x for x in raw if x['round'] == r['round']), None)
      if b is None:
        continue
      firsts.append(r['wall_s'] / b['wall_s'])
      if r.get('warm') and b.get('warm'):
        warms.append(harness.med([w['wall_s'] for w in r['warm']])
                     / harness.med([w['wall_s'] for w in b['warm']]))
    rows.append([c, f'{harness.med(firsts):.2f} ({min(firsts):.2f}-{max(firsts):.2f})',
                 f'{harness.med(warms):.2f} ({min(warms):.2f}-{max(warms):.2f})' if warms else '-',
                 'met' if harness.med(firsts) <= 1.3 else 'missed',
                 'met' if warms and harness.med(warms) <= 1.3 else ('-' if not warms else 'missed')])
  print(harness.table(['', 'first / raw, median (min-max)', 'warm / raw, median (min-max)',
                       'first <= 1.3', 'warm <= 1.3'], rows))
  peak_raw = harness.med_of(raw, 'peak_rss_bytes')
  if peak_raw is None:
    return
  bound = peak_raw + model.float_bytes() + model.largest_f32()
  print(f'\nPeak RSS bound for a read into the float target: raw\'s peak {peak_raw / MIB:.0f} MiB'
        f' + the dequantized projections the target holds {model.float_bytes() / MIB:.0f} MiB'
        f' + one projection\'s float32 temporaries {model.largest_f32() / MIB:.0f} MiB'
        f' = {bound / MIB:.0f} MiB (on the CPU backend the devices\' memory is the host\'s).\n')
  rows = []
  for c in names:
    rs = harness.ok(results[c])
    first = harness.med_of(rs, 'peak_rss_bytes')
    warm = harness.med_of([w for r in rs for w in r.get('warm', ())], 'peak_rss_bytes')
    most = max(r['peak_rss_bytes'] for r in rs)
    rows.append([c, harness.mib(first), harness.mib(most),
                 harness.mib(warm) if warm is not None else '-',
                 'met' if first <= bound else 'over',
                 '-' if warm is None else 'met' if warm <= bound else 'over'])
  print(harness.table(['', 'peak RSS MiB, first (median)', 'first (max)', 'warm (median)',
                       f'first <= {bound / MIB:.0f} MiB', f'warm <= {bound / MIB:.0f} MiB'], rows))
  print('\n(A first call\'s peak includes XLA\'s compiler for its new shapes: tens of MiB.)')


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  add_model_flags(parser)
  parser.add_argument('--reps', type=int, default=5)
  parser.add_argument('--quick', action='store_true',
                      help='a small smoke run: ' + ' '.join(f'--{k} {v}' for k, v in QUICK.items()))
  parser.add_argument('--contenders', default=','.join(CONTENDERS),
                      help=f'comma-separated, of {",".join(CONTENDERS + ARITHMETIC)}')
  parser.add_argument('--no-check', action='store_true', help='skip the correctness check')
  parser.add_argument('--json', help='write every figure, per repetition, here')
  parser.add_argument('--workdir', help='where the checkpoints are kept (reused across runs)')
  parser.add_argument('--child', choices=(*CONTENDERS, *ARITHMETIC, 'check'),
                      help=argparse.SUPPRESS)
  harness.add_flags(parser, cpu_default=8, warm=True, compile_cache=True)
  args = parser.parse_args(argv)
  if args.quick:
    for k, v in QUICK.items():
      if getattr(args, k) == parser.get_default(k):
        setattr(args, k, v)
  if args.child:
    return child(args)
  contenders = tuple(c.strip() for c in args.contenders.split(',') if c.strip())
  unknown = set(contenders) - set(CONTENDERS + ARITHMETIC)
  if unknown:
    raise SystemExit(f'--contenders: unknown {sorted(unknown)}; pick from'
                     f' {CONTENDERS + ARITHMETIC}')
  model = model_of(args)
  for path, (shape, contracting, _) in model.weights().items():
    axis = contracting[-1]
    if model.tile_size and shape[axis] % model.tile_size:
      raise SystemExit(f'--tile-size {model.tile_size} does not divide axis {axis} of'
                       f' {path} {shape}')
  harness.keep_off_devices()  # The writer's JAX: the accelerator stays free for the children.
  workdir = pathlib.Path(args.workdir or tempfile.mkdtemp(prefix='qlora-bench-'))
  run = workdir / model.key()
  sizes_file = run / 'sizes.json'
  if not sizes_file.exists():
    print(f'writing {run} ...', flush=True)
    sizes = write(run / '1', model)
    sizes_file.write_text(json.dumps(sizes))
  sizes = json.loads(sizes_file.read_text())
  flags = ['--workdir', str(workdir)] + shown(args).split()
  checked = 'skipped (--no-check)'
  if not args.no_check:
    res = harness.run_child([__file__, '--child', 'check', *flags])
    if 'error' in res:
      raise SystemExit(f'the correctness check failed: {res["error"]}')
    checked = ', '.join(f'{v} {k.replace("_", " ")}' for k, v in res['checked'].items()) + ' equal'
    print(f'check: {checked}', flush=True)
  cache = harness.CompileCache(args.compile_cache, workdir / 'jax-cache')
  cache.prime([__file__, '--child', name, *flags] for name in contenders)
  results = harness.rounds(contenders, args.reps,
                           lambda name, _: cache.run([__file__, '--child', name, *flags]))
  harness.exit_if_failed(results)
  if args.json:
    pathlib.Path(args.json).write_text(json.dumps(
        {'host': harness.host(), 'model': dataclasses.asdict(model), 'sizes': sizes,
         'results': results}, indent=1))
  report(args, model, sizes, results, checked)


if __name__ == '__main__':
  main()

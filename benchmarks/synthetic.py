"""A synthetic transformer checkpoint, written twice: Tunix layout and canonical.

The model is a decoder of `layers` blocks (attention q/k/v/o, gated MLP, two
norms), an embedding, a final norm and an LM head. Its state is written with
Orbax directly, the way Tunix's checkpoint manager lays it out:

  model_params/base/<weights>/value                 (MaxText adapter + nnx)
  optimizer_state/opt_state/{count,hyperparams/*,hyperparams_states/*}/value
  optimizer_state/opt_state/inner_state/0/{count,mu/base/*,nu/base/*}/value
  optimizer_state/step/value                        (uint32)

and a second time as the same tensors in canonical form (no `value`, `base` or
inject shell) with the same item names: the ordinary Orbax checkpoint a plain
restore reads. Nothing here uses orbax_tunix, so the Tunix layout is built
independently of the rules under test.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import shutil
from collections.abc import Iterator
from typing import Any

import harness  # sibling module; the script's directory is on sys.path
import numpy as np

Path = tuple[str, ...]

STEP = 1000
MODEL_ITEM = 'model_params'
OPT_ITEM = 'optimizer_state'
SPEC_FILE = 'spec.json'
LAYOUTS = ('tunix', 'canonical')
# Leaves of the inject shell and the step, outside the weight mirrors.
SIDE_LEAVES = 9  # count, 6 hyperparams, hyperparams_states count, step
HYPERPARAMS = ('learning_rate', 'b1', 'b2', 'eps', 'eps_root', 'weight_decay')
# The writer's devices: 8 simulated CPU devices, a (4, 2) mesh, whatever the reader's are.
WRITER_DEVICES = 8
# Column- and row-parallel layouts over the (data, model) mesh.
COL = ('data', 'model')
ROW = ('model', 'data')


@dataclasses.dataclass(frozen=True)
class Shape:
  """The synthetic model's dimensions.

  Attributes:
    layers: decoder blocks.
    d_model: hidden size (a multiple of 16, so every mesh split is even).
    param_dtype: dtype of the weights; `mu` and `nu` are always float32.
  """

  layers: int
  d_model: int
  param_dtype: str = 'bfloat16'

  @property
  def d_ff(self) -> int:
    return 4 * self.d_model

  @property
  def vocab(self) -> int:
    return 8 * self.d_model

  def weights(self) -> Iterator[tuple[Path, tuple[int, ...], tuple[str | None, ...]]]:
    """Canonical weight paths with their global shape and partition spec."""
    d, f, v = self.d_model, self.d_ff, self.vocab
    yield ('embedder', 'embedding'), (v, d), ROW
    for i in range(self.layers):
      layer = ('layers', str(i))
      for name in ('q_proj', 'k_proj', 'v_proj'):
        yield layer + ('attn', name, 'kernel'), (d, d), COL
      yield layer + ('attn', 'o_proj', 'kernel'), (d, d), ROW
      for name in ('gate_proj', 'up_proj'):
        yield layer + ('mlp', name, 'kernel'), (d, f), COL
      yield layer + ('mlp', 'down_proj', 'kernel'), (f, d), ROW
      for name in ('pre_attn_norm', 'pre_mlp_norm'):
        yield layer + (name, 'scale'), (d,), ()
    yield ('final_norm', 'scale'), (d,), ()
    yield ('lm_head', 'kernel'), (d, v), COL

  @property
  def weight_leaves(self) -> int:
    return 9 * self.layers + 3

  @property
  def disk_leaves(self) -> int:
    """Leaves written in the Tunix checkpoint (weights, mu, nu, side leaves)."""
    return 3 * self.weight_leaves + SIDE_LEAVES

  @property
  def weight_elements(self) -> int:
    return sum(math.prod(s) for _, s, _ in self.weights())

  @property
  def params_bytes(self) -> int:
    return self.weight_elements * np.dtype(_np_dtype(self.param_dtype)).itemsize

  @property
  def total_bytes(self) -> int:
    """Bytes of the canonical state: params, mu and nu (scalars ignored)."""
    return self.params_bytes + 2 * 4 * self.weight_elements

  def to_json(self) -> dict[str, Any]:
    return dataclasses.asdict(self)


def shape_for(size_mb: float, leaves: int, param_dtype: str = 'bfloat16') -> Shape:
  """The model with about `leaves` leaves on disk and `size_mb` MiB in all."""
  layers = max(1, round((leaves - SIDE_LEAVES - 9) / 27))
  budget = size_mb * 2**20
  best = None
  for d in range(16, 16 * 4096, 16):
    shape = Shape(layers, d, param_dtype)
    miss = abs(shape.total_bytes - budget)
    if best is not None and miss > best[0]:
      break
    best = (miss, shape)
  return best[1]


def _np_dtype(name: str) -> Any:
  import ml_dtypes  # pylint: disable=g-import-not-at-top  (a jax dependency)

  return ml_dtypes.bfloat16 if name == 'bfloat16' else np.dtype(name)


def nest(pairs: Iterator[tuple[Path, Any]]) -> dict[str, Any]:
  """Nested dicts from (path, value) pairs."""
  root: dict[str, Any] = {}
  for path, value in pairs:
    node = root
    for key in path[:-1]:
      node = node.setdefault(key, {})
    node[path[-1]] = value
  return root


def canonical_structure(shape: Shape, leaf_fn) -> dict[str, Any]:
  """The canonical state as {item: tree}, each leaf `leaf_fn(path, shape, dtype, spec)`.

  The canonical optimizer state is what orbax_tunix shows for
  `inject_hyperparams(adamw)`: the inner adam state at `opt_state/0` and the
  step, without the hyperparameters.
  """
  param_dtype = _np_dtype(shape.param_dtype)
  params = [(p, leaf_fn((MODEL_ITEM,) + p, s, param_dtype, spec)) for p, s, spec in shape.weights()]
  opt = [(('opt_state', '0', 'count'), leaf_fn(None, (), np.int32, ()))]
  for moment in ('mu', 'nu'):
    opt += [
        (('opt_state', '0', moment) + p, leaf_fn((OPT_ITEM, moment) + p, s, np.float32, spec))
        for p, s, spec in shape.weights()
    ]
  opt.append((('step',), leaf_fn(None, (), np.uint32, ())))
  return {MODEL_ITEM: nest(iter(params)), OPT_ITEM: nest(iter(opt))}


def tunix_layout(canonical: dict[str, Any], scalar) -> dict[str, Any]:
  """The Tunix on-disk trees holding the leaves of `canonical`.

  Args:
    canonical: {item: tree} as built by `canonical_structure`.
    scalar: `scalar(value, dtype)` makes a side leaf (hyperparameters).
  """

  def value_level(tree: Any) -> Any:
    if isinstance(tree, dict):
      return {k: value_level(v) for k, v in tree.items()}
    return {'value': tree}

  adam = canonical[OPT_ITEM]['opt_state']['0']
  model = {'base': value_level(canonical[MODEL_ITEM])}
  hyper = {name: {'value': scalar(1e-3, np.float32)} for name in HYPERPARAMS}
  opt = {
      'opt_state': {
          'count': {'value': scalar(7, np.int32)},
          'hyperparams': hyper,
          'hyperparams_states': {'learning_rate': {'count': {'value': scalar(7, np.int32)}}},
          'inner_state': {
              '0': {
                  'count': {'value': adam['count']},
                  'mu': {'base': value_level(adam['mu'])},
                  'nu': {'base': value_level(adam['nu'])},
              }
          },
      },
      'step': {'value': canonical[OPT_ITEM]['step']},
  }
  return {MODEL_ITEM: model, OPT_ITEM: opt}


def target(shape: Shape, mesh) -> dict[str, Any]:
  """The canonical restore target: ShapeDtypeStructs sharded over `mesh` (any (data, model)
  mesh: a mesh axis is left off a dimension it does not divide)."""
  import jax  # pylint: disable=g-import-not-at-top

  def leaf(_, s, dtype, spec):
    return jax.ShapeDtypeStruct(s, dtype, sharding=harness.sharding(mesh, s, spec))

  return canonical_structure(shape, leaf)


def write(
    workdir: pathlib.Path,
    shape: Shape,
    layouts: tuple[str, ...] = LAYOUTS,
    seed: int = 0,
) -> dict[str, pathlib.Path]:
  """Writes the checkpoints under `workdir/<layout>/<STEP>`, reusing any already there.

  The values depend only on `shape` and `seed`, so a layout written later holds
  the same tensors as one written before.

  Args:
    workdir: where to write; wiped when it holds another shape.
    shape: the model.
    layouts: which of 'tunix' and 'canonical' to write.
    seed: for the random values.

  Returns:
    {layout: step dir} for `layouts`.
  """
  import jax  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

  dirs = {k: step_dir(workdir, k) for k in layouts}
  spec_file = workdir / SPEC_FILE
  same = spec_file.exists() and json.loads(spec_file.read_text()) == shape.to_json()
  if not same:
    shutil.rmtree(workdir, ignore_errors=True)
  todo = [k for k, d in dirs.items() if not (d / '_CHECKPOINT_METADATA').exists()]
  if not todo:
    return dirs
  workdir.mkdir(parents=True, exist_ok=True)
  for k in todo:
    shutil.rmtree(workdir / k, ignore_errors=True)  # a run that died half way
  mesh = harness.make_mesh(jax.devices())
  rng = np.random.default_rng(seed)
  P = jax.sharding.PartitionSpec

  def leaf(path, s, dtype, spec):
    sharding = harness.sharding(mesh, s, spec)
    if path is None:
      host = np.asarray(7, dtype)
    else:
      # Random values: no chunk equals the fill value, so Orbax skips none.
      host = rng.random(s, dtype=np.float32).astype(dtype)
    return jax.device_put(host, sharding)

  trees = {'canonical': canonical_structure(shape, leaf)}
  replicated = jax.sharding.NamedSharding(mesh, P())
  trees['tunix'] = tunix_layout(
      trees['canonical'], lambda v, dt: jax.device_put(np.asarray(v, dt), replicated)
  )
  for name in todo:
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckptr:
      ckptr.save(
          dirs[name],
          args=ocp.args.Composite(
              **{k: ocp.args.PyTreeSave(v) for k, v in trees[name].items()}
          ),
      )
  spec_file.write_text(json.dumps(shape.to_json()))
  return dirs


def step_dir(workdir: pathlib.Path, layout: str) -> pathlib.Path:
  return workdir / layout / str(STEP)


def read_shape(workdir: pathlib.Path) -> Shape:
  return Shape(**json.loads((workdir / SPEC_FILE).read_text()))


def files(step_dir: pathlib.Path) -> list[pathlib.Path]:
  return [p for p in step_dir.rglob('*') if p.is_file()]


def disk_bytes(step_dir: pathlib.Path, item: str | None = None) -> int:
  root = step_dir / item if item else step_dir
  return sum(p.stat().st_size for p in files(root))


def main(argv: list[str]) -> None:
  """`python synthetic.py WORKDIR LAYERS D_MODEL DTYPE LAYOUT...`: writes in a process of its own."""
  import argparse  # pylint: disable=g-import-not-at-top
  import os  # pylint: disable=g-import-not-at-top

  parser = argparse.ArgumentParser(
      prog='synthetic.py',
      description='Writes the synthetic decoder checkpoints restore_cost.py measures, with'
      ' Orbax alone (no orbax_tunix code), on 8 simulated CPU devices (whatever'
      ' JAX_PLATFORMS says: the writer\'s topology is the same for every reader).',
  )
  parser.add_argument('workdir', type=pathlib.Path, help='where the checkpoints go')
  parser.add_argument('layers', type=int, help='decoder layers (27 leaves each)')
  parser.add_argument('d_model', type=int, help='model width')
  parser.add_argument('dtype', help='the weights\' dtype, e.g. bfloat16')
  parser.add_argument('layouts', nargs='+', choices=LAYOUTS, help='layouts to write')
  args = parser.parse_args(argv)
  # Before jax is imported: the CPU alone (an accelerator stays free for the readers).
  os.environ['JAX_PLATFORMS'] = 'cpu'
  os.environ['JAX_NUM_CPU_DEVICES'] = str(WRITER_DEVICES)
  write(args.workdir, Shape(args.layers, args.d_model, args.dtype), tuple(args.layouts))


if __name__ == '__main__':
  import sys  # pylint: disable=g-import-not-at-top

  main(sys.argv[1:])

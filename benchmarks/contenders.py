"""One repetition of one contender, in a fresh process; prints one JSON line.

Run by `restore_cost.py`, never by hand (but `--help` says how). A fresh
process per repetition gives every contender the same start: no warm
tensorstore context or jit cache from a previous contender, and a peak RSS of
its own. What is measured is the call a user makes, from the moment the target
exists until every array is ready, first in this fresh process and then
`--warm K` more times in it (the page cache made as it was before each):

  a   plain Orbax: the canonical copy into the target (the floor).
  b   orbax_tunix: the Tunix checkpoint into the same target, full state.
  c   orbax_tunix: params only (the `model_params` item).
  d   naive: plain Orbax restores the raw Tunix tree (as saved where the
      writer's devices exist; else to host arrays, as its user must on another
      topology), Python rewrites it to canonical, `jax.device_put` moves it
      into the target's shardings.
  e   `orbax-tunix convert` of the Tunix step to a canonical copy.
  f   orbax_tunix: one named weight of the Tunix checkpoint.
  g   plain Orbax: the same weight from the canonical copy (partial restore).
  h   plain Orbax: the same weight from the Tunix checkpoint, by its on-disk
      path (partial restore): Orbax's own cost on the deeper Tunix tree.
  plan      times the planning steps of b one by one (no array is read).
  verify    b, c and d against a, leaf by leaf (not timed).

The target is sharded over a (data, model) mesh of the first `--devices N` of
JAX's devices (8 simulated CPU devices by default; `harness.py`).
"""

from __future__ import annotations

import argparse
import gc
import os
import pathlib
import shutil
import sys
import tempfile
import time
from typing import Any

import harness  # sibling modules; the script's directory is on sys.path
import jax
import numpy as np
import orbax.checkpoint as ocp
import synthetic
from orbax.checkpoint._src.handlers import base_pytree_checkpoint_handler as base_lib

import orbax_tunix
from orbax_tunix.handlers import pytree_handler
from orbax_tunix.keypaths import flatten, nest
from orbax_tunix.reading import planned_item, read_requests
from orbax_tunix.store import fileio, step_store
from orbax_tunix.view import canonical_map

CONTENDERS = ('a', 'b', 'c', 'd', 'e', 'f', 'g', 'h')


# --- where the time goes ----------------------------------------------------


class Timeline:
  """Times where the array reads start, by wrapping the handlers' methods.

  Per item restore it records: entry into the outermost item handler
  (`TunixPyTreeHandler.restore` or, for plain Orbax, `PyTreeCheckpointHandler
  .restore`), entry into Orbax's own `PyTreeCheckpointHandler.restore` (for
  orbax_tunix: the end of its planning), entry into Orbax's deserialisation
  (`_maybe_deserialize`: the first array read) and the handler's return.
  """

  def __init__(self):
    self.items: list[dict[str, float]] = []
    self._depth = 0

  def _wrap(self, cls: type, name: str, mark: str) -> None:
    """Wraps `cls.name`; the outermost call opens an item, inner ones mark it."""
    original = getattr(cls, name)
    timeline = self

    def wrapper(*args, **kwargs):
      now = time.perf_counter()
      if timeline._depth == 0:
        timeline.items.append({'entry': now})
      elif mark not in timeline.items[-1]:
        timeline.items[-1][mark] = now
      timeline._depth += 1
      try:
        return original(*args, **kwargs)
      finally:
        timeline._depth -= 1
        if timeline._depth == 0:
          timeline.items[-1]['exit'] = time.perf_counter()

    setattr(cls, name, wrapper)

  def _mark_async(self, cls: type, name: str, mark: str) -> None:
    """Wraps the coroutine function `cls.name` to mark its first call."""
    original = getattr(cls, name)
    timeline = self

    async def wrapper(*args, **kwargs):
      if timeline.items and mark not in timeline.items[-1]:
        timeline.items[-1][mark] = time.perf_counter()
      return await original(*args, **kwargs)

    setattr(cls, name, wrapper)

  def install(self) -> Timeline:
    self._wrap(pytree_handler.TunixPyTreeHandler, 'restore', 'entry')
    self._wrap(ocp.PyTreeCheckpointHandler, 'restore', 'orbax')
    self._mark_async(base_lib.BasePyTreeCheckpointHandler, '_maybe_deserialize', 'read')
    return self

  def summary(self, start: float, end: float) -> dict[str, float]:
    """Seconds: our planning and all pre-read work (summed over items), and the
    time outside the item handlers (the composite's own work, before and after)."""
    plan = pre_read = inside = 0.0
    for it in self.items:
      plan += it.get('orbax', it['entry']) - it['entry']
      pre_read += it.get('read', it['entry']) - it['entry']
      inside += it.get('exit', it['entry']) - it['entry']
    return {
        'plan_s': plan,
        'pre_read_s': pre_read,
        'outside_items_s': (end - start) - inside if self.items else 0.0,
        'items': len(self.items),
    }


# --- the contenders --------------------------------------------------------

# Options given to every contender's PyTree handlers alike (see
# `restore_cost.py --restore-concurrent-gb`): Orbax's in-flight read budget.
HANDLER_OPTIONS: dict[str, Any] = {}
if os.environ.get('BENCH_RESTORE_CONCURRENT_GB'):
  HANDLER_OPTIONS['restore_concurrent_gb'] = float(os.environ['BENCH_RESTORE_CONCURRENT_GB'])


def tunix_handler(items=(synthetic.MODEL_ITEM, synthetic.OPT_ITEM)) -> orbax_tunix.TunixAwareHandler:
  # The same item handlers, with the same options, as a's: ours reads through them.
  return orbax_tunix.TunixAwareHandler(
      **{item: ocp.PyTreeCheckpointHandler(**HANDLER_OPTIONS) for item in items}
  )



def run_a(dirs, tgt):
  # Plain Orbax needs restore_args to read into shardings; deriving them is
  # part of what its user does, so it is timed.
  items = {
      k: ocp.args.PyTreeRestore(item=v, restore_args=ocp.checkpoint_utils.construct_restore_args(v))
      for k, v in tgt.items()
  }
  handlers = {k: ocp.PyTreeCheckpointHandler(**HANDLER_OPTIONS) for k in tgt}
  with ocp.Checkpointer(ocp.CompositeCheckpointHandler(**handlers)) as ckptr:
    return dict(ckptr.restore(dirs['canonical'], args=ocp.args.Composite(**items)).items())


def run_b(dirs, tgt):
  items = {k: ocp.args.PyTreeRestore(item=v) for k, v in tgt.items()}
  with ocp.Checkpointer(tunix_handler()) as ckptr:
    return dict(ckptr.restore(dirs['tunix'], args=ocp.args.Composite(**items)).items())


def run_c(dirs, tgt):
  item = ocp.args.PyTreeRestore(item=tgt[synthetic.MODEL_ITEM])
  with ocp.Checkpointer(tunix_handler()) as ckptr:
    return dict(ckptr.restore(dirs['tunix'], args=ocp.args.Composite(model_params=item)).items())


def naive_canonical(tree: Any) -> Any:
  """What a user writes by hand: drop `value`, `base` and the inject shell."""
  if not isinstance(tree, dict):
    return tree
  if set(tree) == {'value'}:
    return tree['value']
  if set(tree) == {'base'}:
    return naive_canonical(tree['base'])
  if 'inner_state' in tree and 'hyperparams' in tree:
    return naive_canonical(tree['inner_state'])
  return {k: naive_canonical(v) for k, v in tree.items()}


def writer_devices_here() -> bool:
  """Whether the devices the checkpoints were written on exist in this process.

  `synthetic.write` writes on `synthetic.WRITER_DEVICES` CPU devices; Orbax can
  rebuild the saved shardings only where JAX has those devices.
  """
  devices = jax.devices()
  return devices[0].platform == 'cpu' and len(devices) >= synthetic.WRITER_DEVICES


def run_d(dirs, tgt):
  handlers = {k: ocp.PyTreeCheckpointHandler(**HANDLER_OPTIONS) for k in tgt}
  args = ()  # no target: the tree as saved, in the writer's shardings
  if not writer_devices_here():
    # Elsewhere Orbax cannot rebuild the writer's shardings ("sharding passed to
    # deserialization should be specified"): the user asks for host arrays, leaf by leaf
    # from the saved tree's metadata, and moves them to the devices afterwards.
    args = (ocp.args.Composite(**{
        k: ocp.args.PyTreeRestore(restore_args=jax.tree.map(
            lambda _: ocp.RestoreArgs(restore_type=np.ndarray),
            ocp.PyTreeCheckpointHandler().metadata(dirs['tunix'] / k).tree))
        for k in tgt}),)
  with ocp.Checkpointer(ocp.CompositeCheckpointHandler(**handlers)) as ckptr:
    raw = dict(ckptr.restore(dirs['tunix'], *args).items())
  canonical = {k: naive_canonical(raw[k]) for k in tgt}
  shardings = jax.tree.map(lambda t: t.sharding, tgt)
  return jax.device_put(canonical, shardings)


def run_e(dirs, tgt):
  del tgt
  from orbax_tunix import cli

  out = pathlib.Path(tempfile.mkdtemp(dir=dirs['tunix'].parent.parent, prefix='convert-'))
  dst = out / str(synthetic.STEP)
  try:
    code = cli.main(['convert', str(dirs['tunix']), str(dst)])
    if code not in (None, 0):
      raise RuntimeError(f'orbax-tunix convert exited with {code}')
  finally:
    shutil.rmtree(out, ignore_errors=True)
  return None


def one_leaf(tgt):
  """The first weight of the target alone (an embedding-sized array)."""
  path, leaf = flatten(tgt[synthetic.MODEL_ITEM])[0][0]
  return nest([(path, leaf)])


def run_f(dirs, tgt):
  item = ocp.args.PyTreeRestore(item=one_leaf(tgt))
  with ocp.Checkpointer(tunix_handler((synthetic.MODEL_ITEM,))) as ckptr:
    return dict(ckptr.restore(dirs['tunix'], args=ocp.args.Composite(model_params=item)).items())


def _plain_partial(step_dir, want):
  """Plain Orbax's partial restore of `want` (an on-disk tree) from a step's model item."""
  item = ocp.args.PyTreeRestore(
      item=want, restore_args=ocp.checkpoint_utils.construct_restore_args(want),
      partial_restore=True)
  handler = ocp.CompositeCheckpointHandler(
      model_params=ocp.PyTreeCheckpointHandler(**HANDLER_OPTIONS))
  with ocp.Checkpointer(handler) as ckptr:
    return dict(ckptr.restore(step_dir, args=ocp.args.Composite(model_params=item)).items())


def run_g(dirs, tgt):
  return _plain_partial(dirs['canonical'], one_leaf(tgt))


def run_h(dirs, tgt):
  # The on-disk path written out by hand from synthetic.tunix_layout: the
  # model item's `base` level above, nnx's `value` below.
  path, leaf = flatten(tgt[synthetic.MODEL_ITEM])[0][0]
  return _plain_partial(dirs['tunix'], nest([(('base',) + path + ('value',), leaf)]))


RUNNERS = {'a': run_a, 'b': run_b, 'c': run_c, 'd': run_d, 'e': run_e, 'f': run_f, 'g': run_g,
           'h': run_h}


def target_bytes(tree: Any) -> tuple[int, int]:
  """(global bytes, bytes held over all devices) of a target's leaves."""
  total = held = 0
  for leaf in jax.tree.leaves(tree):
    n = int(np.prod(leaf.shape)) * np.dtype(leaf.dtype).itemsize
    total += n
    shard = leaf.sharding.shard_shape(leaf.shape)
    held += int(np.prod(shard)) * np.dtype(leaf.dtype).itemsize * len(leaf.sharding.device_set)
  return total, held


def measure(name: str, dirs: dict[str, pathlib.Path], shape: synthetic.Shape,
            devices: list[Any], warm: int, cache: harness.CachePolicy) -> dict[str, Any]:
  """The contender's first call in this process, then `warm` more (`harness.calls`)."""
  mesh = harness.make_mesh(devices)
  tgt = synthetic.target(shape, mesh)
  if name == 'c':
    tgt = {synthetic.MODEL_ITEM: tgt[synthetic.MODEL_ITEM]}
  elif name in 'fgh':
    tgt = {synthetic.MODEL_ITEM: one_leaf(tgt)} | {'_full': tgt}
  nbytes, held = target_bytes({k: v for k, v in tgt.items() if k != '_full'})
  arg = tgt.pop('_full', tgt)
  timeline = Timeline().install()
  span: dict[str, float] = {}

  def call():
    timeline.items.clear()
    span['start'] = time.perf_counter()
    out = RUNNERS[name](dirs, arg)
    jax.block_until_ready(out)
    span['end'] = time.perf_counter()
    return out

  def describe_out(out):
    return {'leaves': len(jax.tree.leaves(out)) if out is not None else 0,
            **timeline.summary(span['start'], span['end'])}

  measured = harness.calls(call, warm, devices, lambda: cache.prepare(list(dirs.values())),
                           describe_out)
  return harness.child_result(name, measured, devices, mesh, target_bytes=nbytes,
                              target_held_bytes=held)


def _to_disk(cmap, pairs):
  return [cmap.canonical_to_disk.get(c) for c, _ in pairs]


def _requests(pairs):
  return {c: (leaf, read_requests.restore_arg_for(leaf)) for c, leaf in pairs}


def _orbax_parse(directory):
  """What Orbax's restore parses of `_METADATA` before it reads (its tree metadata)."""
  from orbax.checkpoint._src import asyncio_utils  # pylint: disable=g-import-not-at-top

  handler = ocp.PyTreeCheckpointHandler()
  internal = asyncio_utils.run_sync(handler._handler_impl._read_metadata_file(directory))  # pylint: disable=protected-access
  return internal.as_nested_tree()


def plan_steps(dirs: dict[str, pathlib.Path], shape: synthetic.Shape, devices: list[Any],
               with_orbax: bool = False) -> dict[str, Any]:
  """Times b's planning steps separately, as TunixAwareHandler.restore runs them.

  With `with_orbax`, also times Orbax's own parse of the same `_METADATA`
  files (what its restore does again), outside the total.
  """
  tgt = synthetic.target(shape, harness.make_mesh(devices))
  times: dict[str, float] = {}

  def timed(key, fn, *args, **kwargs):
    t = time.perf_counter()
    with fileio.no_gc():  # As the handler plans (open_item pauses it itself).
      out = fn(*args, **kwargs)
    times[key] = times.get(key, 0.0) + time.perf_counter() - t
    return out

  step = timed('open_step', step_store.open_step, dirs['tunix'])
  metas = {item: timed('open_items', step.item, item) for item in tgt}
  maps = timed('plan', canonical_map.plan_step, {k: m.paths for k, m in metas.items()})
  for item, tree in tgt.items():
    meta, cmap = metas[item], maps[item]
    pairs, _ = timed('flatten', flatten, tree)
    disk = timed('to_disk', _to_disk, cmap, pairs)
    timed('validate', planned_item.validate_target, meta, [c for c, _ in pairs],
          disk, [leaf for _, leaf in pairs])
    wanted = timed('restore_args', _requests, pairs)
    by_disk = {cmap.canonical_to_disk[c]: r for c, r in wanted.items()}
    timed('skeleton', planned_item._skeleton, meta, by_disk)  # pylint: disable=protected-access
    if with_orbax:
      timed('orbax_metadata', _orbax_parse, meta.directory)
  times['total'] = sum(v for k, v in times.items() if k != 'orbax_metadata')
  return {'contender': 'plan', 'steps_s': times, 'leaves': shape.disk_leaves}


def verify(dirs: dict[str, pathlib.Path], shape: synthetic.Shape,
           devices: list[Any]) -> dict[str, Any]:
  """b, c and d must return exactly a's arrays, in the target's shardings."""
  mesh = harness.make_mesh(devices)
  tgt = synthetic.target(shape, mesh)
  ref = flatten(run_a(dirs, tgt))[0]
  report = {'contender': 'verify', 'leaves': len(ref), 'devices': harness.describe(devices, mesh)}
  for name in ('b', 'c', 'd'):
    got = dict(flatten(RUNNERS[name](dirs, tgt if name != 'c' else {
        synthetic.MODEL_ITEM: tgt[synthetic.MODEL_ITEM]}))[0])
    want = [(p, v) for p, v in ref if name != 'c' or p[0] == synthetic.MODEL_ITEM]
    bad = [
        '/'.join(p) for p, v in want
        if p not in got
        or got[p].sharding != v.sharding
        or got[p].dtype != v.dtype
        or not np.array_equal(np.asarray(got[p]), np.asarray(v))
    ]
    report[name] = 'ok' if not bad and len(got) == len(want) else f'MISMATCH {bad[:5]}'
    del got
    gc.collect()
  return report


def main(argv: list[str]) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('contender', choices=CONTENDERS + ('plan', 'verify'))
  parser.add_argument('workdir', type=pathlib.Path, help='as written by synthetic.write')
  parser.add_argument('--with-orbax', action='store_true',
                      help='plan: also time Orbax metadata() for the same leaves')
  parser.add_argument('--cache', choices=('cold', 'warm', 'as-is'), default='as-is',
                      help='the page cache before each warm call, as the parent made it'
                      ' before the first')
  parser.add_argument('--drop-caches', action='store_true',
                      help='cold through /proc/sys/vm/drop_caches (root) rather than fadvise')
  harness.add_flags(parser, cpu_default=8, warm=True)
  args = parser.parse_args(argv)
  devices = harness.use_devices(args.devices, cpu_default=8)
  shape = synthetic.read_shape(args.workdir)
  dirs = {k: synthetic.step_dir(args.workdir, k) for k in synthetic.LAYOUTS}
  if args.contender == 'plan':
    result = plan_steps(dirs, shape, devices, args.with_orbax)
  elif args.contender == 'verify':
    result = verify(dirs, shape, devices)
  else:
    cache = harness.CachePolicy(args.cache, args.drop_caches)
    result = measure(args.contender, dirs, shape, devices, args.warm, cache)
  harness.emit(result)


if __name__ == '__main__':
  main(sys.argv[1:])

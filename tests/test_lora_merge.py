"""LoRA merged into the weights during the restore: proven by forward passes.

Models with adapters are built with the real qwix (as Tunix applies it) and
flax's nnx.LoRA, trained a few steps, and saved as Tunix saves them (the full
model, or the adapters only beside a base checkpoint). The expected values
are the LoRA models' own outputs: the plain model (no LoRA code) with the
merged weights must compute the same logits.
"""

from __future__ import annotations

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import orbax_tunix as ot
from orbax_tunix import maxtext
from orbax_tunix.keypaths import flatten, fmt, nest
from orbax_tunix.mapping import lora, merge
from orbax_tunix.reading.planned_item import PlannedItem
from tests import builders
from tests import lora_models as lm
from tests import tunix_models as tm
from tests.test_cli import run
from tests.test_scan_layers import compiled_on_threads

# float32: the merged path computes x·(W + s·a·b) where the LoRA model
# computes x·W + s·(x·a)·b, the same math in another order.
F32_ATOL = 1e-5
# bfloat16 weights (8 bits of mantissa) through the network: 0.004-0.011 seen.
BF16_ATOL = 0.03


def _save_model_params(step_dir: pathlib.Path, state) -> None:
  with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckptr:
    ckptr.save(step_dir, args=ocp.args.Composite(model_params=ocp.args.PyTreeSave(state)))


@pytest.fixture(scope='module')
def runs(tmp_path_factory):
  """Two LoRA runs, each saved in full and adapters-only, with their base."""
  root = tmp_path_factory.mktemp('lora')
  out = {}
  for name, make_base, with_lora in (
      ('qwix', lambda: lm.QwixLM(rngs=nnx.Rngs(0)), lm.with_qwix_lora),
      ('flax', lambda: lm.FlaxLM(rngs=nnx.Rngs(0)), lambda m: m),
  ):
    base = make_base()
    model = lm.train(with_lora(nnx.clone(base)))
    builders.save_tunix(root / name / 'full', 1, model)
    _save_model_params(root / name / 'only' / '1', nnx.state(model, nnx.LoRAParam))
    if name == 'qwix':
      builders.save_tunix(root / name / 'base', 1, base)  # a Tunix save of the base
    else:  # a plain Orbax checkpoint of canonical weights
      _save_model_params(root / name / 'base' / '1', lm.flax_plain_weights(base))
    out[name] = {'model': model, 'root': root / name,
                 'logits': np.asarray(model(jnp.asarray(lm.TOKENS)))}
  return out


def plain_model(name: str) -> nnx.Module:
  return lm.QwixLM(rngs=nnx.Rngs(9)) if name == 'qwix' else lm.FlaxPlainLM(rngs=nnx.Rngs(9))


def abstract_weights(name: str, mesh, dtype=jnp.float32):
  """The plain model's weights as a sharded target (split where the mesh divides)."""
  state = nnx.to_pure_dict(nnx.state(nnx.eval_shape(lambda: plain_model(name))))

  def sds(x):
    spec = [None] * len(x.shape)
    if x.shape and x.shape[0] % 4 == 0:
      spec[0] = 'data'
    if len(x.shape) > 1 and x.shape[-1] % 2 == 0:
      spec[-1] = 'model'
    return jax.ShapeDtypeStruct(x.shape, dtype, sharding=NamedSharding(mesh, P(*spec)))

  return jax.tree.map(sds, state)


def forward(name: str, weights) -> np.ndarray:
  """The plain model's logits with these weights (computed in float32)."""
  model = plain_model(name)
  state = nnx.state(model)
  # Host copies: the forward pass runs unsharded, on one device.
  nnx.replace_by_pure_dict(state, jax.tree.map(lambda w: np.asarray(w, np.float32), weights))
  nnx.update(model, state)
  return np.asarray(model(jnp.asarray(lm.TOKENS)))


def assert_target_kept(result, target):
  for (path, got), (_, want) in zip(flatten(result)[0], flatten(target)[0], strict=True):
    assert got.shape == want.shape and got.dtype == want.dtype, fmt(path)
    assert got.sharding == want.sharding, fmt(path)


@pytest.mark.parametrize('name', ['qwix', 'flax'])
@pytest.mark.parametrize('saved', ['full', 'only'])
@pytest.mark.parametrize('dtype', [jnp.float32, jnp.bfloat16])
def test_merged_weights_compute_what_the_lora_model_computes(runs, mesh, name, saved, dtype):
  run_ = runs[name]
  target = abstract_weights(name, mesh, dtype)
  base = None if saved == 'full' else run_['root'] / 'base'
  alpha = lm.ALPHA if name == 'qwix' else None  # flax's LoRA has no alpha
  merged = ot.restore_merged_lora(run_['root'] / saved, target, lora_alpha=alpha, base=base)
  assert_target_kept(merged, target)
  atol = F32_ATOL if dtype == jnp.float32 else BF16_ATOL
  np.testing.assert_allclose(forward(name, merged), run_['logits'], atol=atol, rtol=0)
  # Without the adapters (the base alone) the logits are measurably different.
  unmerged = builders.raw_leaves(run_['root'] / 'base' / '1' / 'model_params')
  base_weights = nest((tuple(p.removesuffix('/value').split('/')), v) for p, v in unmerged.items())
  assert np.abs(forward(name, base_weights) - run_["logits"]).max() > 5 * atol


def test_each_weight_is_the_formula(runs, mesh):
  """W + alpha/rank * a·b per weight, in numpy, from plain Orbax reads."""
  root = runs['qwix']['root']
  raw = builders.raw_leaves(root / 'full' / '1' / 'model_params')
  merged = dict(flatten(ot.restore_merged_lora(root / 'full', abstract_weights('qwix', mesh),
                                               lora_alpha=lm.ALPHA))[0])
  scale = lm.ALPHA / lm.RANK
  q = 'layers/1/q_proj/w'
  want = raw[f'{q}/value'] + scale * np.tensordot(raw[f'{q}_lora_a/value'], raw[f'{q}_lora_b/value'], 1)
  np.testing.assert_allclose(np.asarray(merged[('layers', '1', 'q_proj', 'w')]), want, atol=1e-6)
  v = 'layers/0/v_proj/w'  # (N, D, H): a holds D, b holds (N, H).
  delta = np.tensordot(raw[f'{v}_lora_a/value'], raw[f'{v}_lora_b/value'], 1).transpose(1, 0, 2)
  np.testing.assert_allclose(np.asarray(merged[('layers', '0', 'v_proj', 'w')]),
                             raw[f'{v}/value'] + scale * delta, atol=1e-6)
  np.testing.assert_array_equal(np.asarray(merged[('layers', '0', 'up', 'bias')]),
                                raw['layers/0/up/bias/value'])


def test_the_merges_compile_while_the_weights_are_read(runs, mesh, monkeypatch):
  """The merges' programs (one per kind of adapted weight) are known from the plan: they
  compile on the executor's compile thread during the read, none on the caller's after it
  (on an accelerator a compile costs more than the merges)."""
  root = runs['qwix']['root']
  target = abstract_weights('qwix', mesh)
  merged, threads = compiled_on_threads(
      monkeypatch, lambda: ot.restore_merged_lora(root / 'full', target, lora_alpha=lm.ALPHA))
  merges = merge.plan_merge(root / 'full', merge.MergeOptions(lm.ALPHA)).merges
  leaves = dict(flatten(target)[0])
  kinds = {(m.contraction, m.scale, leaves[p].sharding) for p, m in merges.items()}
  # One program per kind of weight (shape, dtype, sharding, recipe), not one per weight.
  assert len(merges) > len(kinds) > 1 and len(threads) == len(kinds), (threads, kinds)
  assert all(t.startswith('orbax_tunix-compile') for t in threads), threads
  np.testing.assert_allclose(forward('qwix', merged), runs['qwix']['logits'], atol=F32_ATOL, rtol=0)


def test_scale_instead_of_alpha_and_partial_target(runs, mesh, monkeypatch):
  root = runs['qwix']['root']
  full = abstract_weights('qwix', mesh)
  target = {'layers': {'0': {'q_proj': {'w': full['layers'][0]['q_proj']['w']}}}}
  read, calls = [], []
  original = PlannedItem.read

  def spy(self, wanted, *args, **kwargs):
    read.extend(fmt(p) for p in wanted)
    calls.append({fmt(p): type(r[0]) for p, r in wanted.items()})
    return original(self, wanted, *args, **kwargs)

  monkeypatch.setattr(PlannedItem, 'read', spy)
  by_scale = ot.restore_merged_lora(root / 'full', target, lora_scale=lm.ALPHA / lm.RANK)
  assert sorted(read) == ['layers/0/q_proj/w', 'layers/0/q_proj/w_lora_a', 'layers/0/q_proj/w_lora_b']
  # One restore: the weight into its target, the adapters to the host (the merge puts them).
  assert calls == [{'layers/0/q_proj/w': jax.ShapeDtypeStruct, 'layers/0/q_proj/w_lora_a': int,
                    'layers/0/q_proj/w_lora_b': int}]
  by_alpha = ot.restore_merged_lora(root / 'full', target, lora_alpha=lm.ALPHA)
  np.testing.assert_array_equal(np.asarray(by_scale['layers']['0']['q_proj']['w']),
                                np.asarray(by_alpha['layers']['0']['q_proj']['w']))


def test_flax_wrapped_layer_is_lifted_to_the_plain_models_place(runs):
  plan = merge.plan_merge(runs['flax']['root'] / 'full')
  assert {fmt(p): m.adapter.saved_base for p, m in plan.merges.items()} == {
      'fc1/kernel': ('fc1', 'kernel'),  # nnx.LoRALinear: its own kernel
      'fc2/kernel': ('fc2', 'base_module', 'kernel'),  # nnx.LoRA(base_module=...)
  }
  assert ('fc2', 'bias') in plan.weights and all(m.scale == 1.0 for m in plan.merges.values())
  # What the error messages point users at: the plain model's weights, from nnx itself.
  plain = nnx.to_pure_dict(nnx.state(nnx.eval_shape(lambda: plain_model('flax'))))
  assert {p: s for p, (s, _) in plan.shapes().items()} == {
      p: tuple(x.shape) for p, x in flatten(plain)[0]}


def test_maxtext_params_only_with_lora(runs, mesh):
  root = runs['qwix']['root']
  weights = abstract_weights('qwix', mesh, jnp.bfloat16)
  abstract = {'params': {'params': weights}, 'step': jax.ShapeDtypeStruct((), jnp.int32)}
  restored = maxtext.restore_train_state(root / 'only', abstract, params_only=True,
                                         merge_lora=True, lora_alpha=lm.ALPHA,
                                         base=root / 'base')
  assert restored['step'] is abstract['step']
  assert_target_kept(restored['params']['params'], weights)
  np.testing.assert_allclose(forward('qwix', restored['params']['params']),
                             runs['qwix']['logits'], atol=BF16_ATOL, rtol=0)
  with pytest.raises(ot.LoraError, match='params_only=True'):
    maxtext.restore_train_state(root / 'full', abstract, merge_lora=True, lora_alpha=lm.ALPHA)
  with pytest.raises(ot.LoraOnlyCheckpointError, match='merge_lora=True'):
    maxtext.restore_train_state(root / 'only', abstract, params_only=True)


# --- errors, all before any array is read --------------------------------------------


def forbid_reads(monkeypatch):
  """From here on, reading any array fails the test (errors must come first)."""

  def fail(*args, **kwargs):
    raise AssertionError('an array was read before the error')

  monkeypatch.setattr(ocp.PyTreeCheckpointHandler, 'restore', fail)


def test_errors_before_any_read(runs, mesh, tmp_path, monkeypatch):
  root = runs['qwix']['root']
  target = abstract_weights('qwix', mesh)
  raw = builders.raw_leaves(root / 'base' / '1' / 'model_params')
  # A base without some of the weights the adapters need; one of other shapes
  # (not the model these adapters were trained on); adapters whose ranks disagree.
  partial = nest((tuple(p.split('/')), v) for p, v in raw.items() if 'layers/1/' not in p)
  _save_model_params(tmp_path / 'partial' / '1', partial)
  other = nest((tuple(p.split('/')), np.zeros((2 * v.shape[0], *v.shape[1:]), v.dtype))
               for p, v in raw.items())
  _save_model_params(tmp_path / 'other' / '1', other)
  bad = {'fc': {'kernel': {'value': np.zeros((4, 6), np.float32)},
                'kernel_lora_a': {'value': np.zeros((4, 2), np.float32)},
                'kernel_lora_b': {'value': np.zeros((3, 6), np.float32)}}}
  _save_model_params(tmp_path / 'ranks' / '1', bad)
  forbid_reads(monkeypatch)

  with pytest.raises(ot.LoraError, match='alpha'):
    ot.restore_merged_lora(root / 'full', target)
  # A scale that is not a finite number: refused before anything is opened (no path needed).
  for given in ({'alpha': float('nan')}, {'alpha': float('inf')}, {'scale': -float('inf')},
                {'alpha': 'four'}, {'alpha': 4.0, 'scale': 2.0}):
    with pytest.raises(ot.LoraError, match='finite number|not both'):
      ot.restore_merged_lora(tmp_path / 'nothing here', target,
                             **{f'lora_{k}': v for k, v in given.items()})
    with pytest.raises(ot.LoraError, match='finite number|not both'):
      merge.plan_merge(tmp_path / 'nothing here', merge.MergeOptions(**given))
  with pytest.raises(ot.LoraError, match='finite number'):
    maxtext.restore_train_state(tmp_path / 'nothing here', {}, params_only=True, merge_lora=True,
                                lora_alpha=float('nan'))
  with pytest.raises(ot.LoraError, match='add `merge_lora=True`'):
    maxtext.restore_train_state(tmp_path / 'nothing here', {}, lora_alpha=4.0)
  with pytest.raises(ot.LoraError, match='base weight of every adapter') as e:
    ot.restore_merged_lora(root / 'only', target, lora_alpha=lm.ALPHA)
  assert 'layers/1/v_proj/w (adapted by layers/1/v_proj/w_lora_a)' in str(e.value)
  with pytest.raises(ot.LoraError, match='5 missing') as e:
    ot.restore_merged_lora(root / 'only', target, lora_alpha=lm.ALPHA, base=tmp_path / 'partial')
  assert 'layers/1/up/kernel' in str(e.value) and 'layers/0/' not in str(e.value)
  with pytest.raises(ot.LoraError, match='do not reproduce') as e:
    ot.restore_merged_lora(root / 'only', target, lora_alpha=lm.ALPHA, base=tmp_path / 'other')
  assert 'layers/0/up/kernel (16, 16)' in str(e.value)
  with pytest.raises(ot.LoraError, match='ranks disagree'):
    merge.plan_merge(tmp_path / 'ranks', merge.MergeOptions(alpha=1.0))
  # A target that is not the plain model: an adapter leaf in it.
  with pytest.raises(ot.TargetMismatchError, match='an adapter'):
    ot.restore_merged_lora(root / 'full', {'layers': {'0': {'up': {'kernel_lora_a': target[
        'layers'][0]['up']['kernel']}}}}, lora_alpha=lm.ALPHA)
  with pytest.raises(ot.LoraError, match='expected LoRA adapters'):
    ot.restore_merged_lora(root / 'base', target, lora_alpha=lm.ALPHA)


@pytest.mark.parametrize('weight, a, b, expected', [
    ((8, 2, 4), (8, 2), (2, 2, 4), (False, (0, 1, 2))),  # q_proj: a first
    ((2, 4, 8), (2, 4, 2), (2, 8), (False, (0, 1, 2))),  # o_proj
    ((2, 8, 4), (8, 2), (2, 2, 4), (False, (1, 0, 2))),  # interleaved
    ((3, 4, 5, 2), (12, 2), (2, 10), (True, (0, 1))),  # flattened dot_general
    ((8, 8), (4, 2), (2, 8), None),  # does not reproduce
    ((8, 8), (8, 2), (3, 8), None),  # ranks disagree
])
def test_contraction_from_shapes(weight, a, b, expected):
  got = lora.contraction(weight, a, b)
  assert (None if got is None else (got.reshape, got.permutation)) == expected


# --- the command line ---------------------------------------------------------------


def test_cli_convert_merge_lora_writes_a_plain_checkpoint(runs, tmp_path, capsys):
  root = runs['qwix']['root']
  # Adapters alone are no model: MaxText's layout refuses them unmerged (a canonical step,
  # which claims no model, keeps them as they are: tests/test_cli.py).
  status, _, err = run(capsys, 'convert', root / 'only', tmp_path / 'x' / '1', '--layout',
                       'maxtext', '--params-only')
  assert status == 2 and '--merge-lora' in err and '--base' in err
  status, _, err = run(capsys, 'convert', root / 'full', tmp_path / 'y' / '1', '--merge-lora')
  assert status == 2 and '--lora-alpha' in err
  dst = tmp_path / 'merged' / '1'
  status, _, err = run(capsys, 'convert', root / 'only', dst, '--merge-lora', '--lora-alpha',
                       str(lm.ALPHA), '--base', root / 'base', '--layout', 'maxtext')
  assert status == 0, err
  # Plain Orbax, no LoRA code and no orbax_tunix: MaxText's load_parameters_path.
  params = ocp.PyTreeCheckpointHandler().restore(dst / 'items')['params']['params']
  np.testing.assert_allclose(forward('qwix', params), runs['qwix']['logits'], atol=F32_ATOL, rtol=0)
  record = json.loads((dst / '_CHECKPOINT_METADATA').read_text())['custom_metadata']['orbax_tunix']
  assert record['lora_merge']['adapted']['layers/0/q_proj/w'] == {
      'style': 'qwix', 'rank': lm.RANK, 'scale': lm.ALPHA / lm.RANK}


def test_cli_inspect_shows_adapters_per_weight(runs, capsys):
  status, out, _ = run(capsys, 'inspect', runs['flax']['root'] / 'full', '--json')
  report = json.loads(out)['lora']
  assert dict(zip(report['targets'], report['target_ranks'], strict=True)) == {
      'fc1/kernel': lm.RANK, 'fc2/kernel': lm.RANK}
  assert report['style'] == 'flax' and report['base_weights'] is True
  status, out, _ = run(capsys, 'inspect', runs['qwix']['root'] / 'only', '--full')
  assert 'layers/1/v_proj/w  rank 2' in out and 'not saved (adapters only)' in out


# --- the committed checkpoints written by google-tunix ------------------------------

# scripts/make_tunix_fixtures.py: qwix.LoraProvider(..., rank=2, alpha=4.0).
FIXTURE_ALPHA = 4.0
FIXTURE_BF16_ATOL = 0.02
FIXTURE_CASES = {
    # case: (LoRA checkpoint, base checkpoint, plain model, reference logits)
    'qwix full save': ('lora_qwix_full', None, tm.TinyLM, 'lora_qwix_full'),
    'qwix adapters only': ('lora_qwix', 'lora_base', tm.TinyLM, 'lora_qwix_full'),
    'flax nnx.LoRA': ('lora_flax', None, tm.FlaxPlainLM, 'lora_flax'),
}


def test_fixture_runs_are_the_same_run(tunix_data):
  """lora_qwix (adapters only) and lora_qwix_full are one run saved two ways,
  started from lora_base: so one reference serves both."""
  only = builders.raw_leaves(tunix_data / 'lora_qwix' / '1' / 'model_params')
  full = builders.raw_leaves(tunix_data / 'lora_qwix_full' / '1' / 'model_params')
  base = builders.raw_leaves(tunix_data / 'lora_base' / '1' / 'model_params')
  assert set(only) | set(base) == set(full) and not set(only) & set(base)
  for path, value in [*only.items(), *base.items()]:
    np.testing.assert_array_equal(full[path], value, err_msg=path)


@pytest.mark.parametrize('dtype', [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize('case', sorted(FIXTURE_CASES))
def test_fixture_merge_computes_the_lora_models_logits(tunix_data, mesh, case, dtype):
  name, base, model_cls, reference = FIXTURE_CASES[case]
  ref = json.loads((tunix_data / 'lora_reference.json').read_text())[reference]
  state = nnx.to_pure_dict(nnx.state(nnx.eval_shape(lambda: model_cls(rngs=nnx.Rngs(0)))))
  replicated = NamedSharding(mesh, P())
  split = NamedSharding(mesh, P(None, 'model'))
  target = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, dtype, sharding=split if x.ndim == 2 else replicated),
      state)
  merged = ot.restore_merged_lora(tunix_data / name, target,
                                  lora_alpha=None if name == 'lora_flax' else FIXTURE_ALPHA,
                                  base=None if base is None else tunix_data / base)
  assert_target_kept(merged, target)
  # bfloat16: 0.008-0.012 seen; the adapters move these logits by 0.065-0.10.
  atol = F32_ATOL if dtype == jnp.float32 else FIXTURE_BF16_ATOL
  np.testing.assert_allclose(plain_logits(model_cls, merged, ref['tokens']),
                             np.asarray(ref['logits'], np.float32), atol=atol, rtol=0)
  # The base weights alone (read by plain Orbax) miss the reference by more.
  raw = builders.raw_leaves(tunix_data / (base or name) / '1' / 'model_params')
  unmerged = nest((tuple(p.removesuffix('/value').replace('base_module/', '').split('/')), v)
                  for p, v in raw.items() if not lora.is_adapter(tuple(p.split('/'))))
  miss = np.abs(plain_logits(model_cls, unmerged, ref['tokens']) - np.asarray(ref['logits'])).max()
  assert miss > 3 * atol, miss


def plain_logits(model_cls, weights, tokens) -> np.ndarray:
  """The plain (no LoRA) model's logits with `weights` (a pure dict) on `tokens`."""
  model = model_cls(rngs=nnx.Rngs(1))
  graph = nnx.state(model)
  nnx.replace_by_pure_dict(graph, jax.tree.map(lambda w: np.asarray(w, np.float32), weights))
  nnx.update(model, graph)
  return np.asarray(model(jnp.asarray(tokens)))


def test_errors_name_paths_as_each_checkpoint_holds_them(runs, tmp_path, monkeypatch):
  """A merge of nnx.LoRA(base_module=...) adapters onto a base of other shapes that
  holds the layer as `base_module/kernel`: the message names that path (as the base
  stores it), not the lifted plain-model path alone."""
  raw = builders.raw_leaves(runs['flax']['root'] / 'full' / '1' / 'model_params')
  wider = nest((tuple(p.split('/')), np.zeros((2 * v.shape[0], *v.shape[1:]), v.dtype))
               for p, v in raw.items())
  _save_model_params(tmp_path / 'wider' / '1', wider)
  forbid_reads(monkeypatch)
  with pytest.raises(ot.LoraError, match='do not reproduce') as e:
    merge.plan_merge(runs['flax']['root'] / 'only', merge.MergeOptions(base=tmp_path / 'wider'))
  msg = str(e.value)
  assert 'fc2/kernel (32, 8): the base holds model_params/fc2/base_module/kernel/value' in msg, msg
  assert 'model_params/fc2/lora_a/value' in msg


# --- issue 36: inputs that gave wrong weights or raw errors ---------------------------------


def test_a_scale_float32_cannot_hold_is_refused(runs, mesh, tmp_path, capsys, monkeypatch):
  """alpha 1e39 is a finite Python float, but alpha / rank is inf in float32 (the merge's
  arithmetic): every merged weight would be inf or NaN. Refused before any read, naming the
  option; so is a nonzero scale float32 rounds to 0 (the adapters silently dropped)."""
  root = runs['qwix']['root']
  target = abstract_weights('qwix', mesh)
  dst = tmp_path / 'merged' / '1'
  status, _, err = run(capsys, 'convert', root / 'full', dst, '--merge-lora', '--lora-alpha',
                       '1e39')
  assert status == 2 and '--lora-alpha 1e+39' in err and 'float32' in err, err
  assert not dst.exists()
  forbid_reads(monkeypatch)
  for given, name in (({'lora_alpha': 1e39}, 'lora_alpha'), ({'lora_scale': -4e38}, 'lora_scale'),
                      ({'lora_alpha': 1e-46}, 'lora_alpha')):
    with pytest.raises(ot.LoraError, match=f'`{name}=.*float32') as e:
      ot.restore_merged_lora(root / 'full', target, **given)
    assert 'layers/0/q_proj/w_lora_a' in str(e.value) or 'lora_a' in str(e.value)


def test_a_merge_that_overflows_float32_is_refused(tmp_path, capsys):
  """A finite scale whose product with a·b leaves float32's range: the merged weights would
  be inf. W, a, b are finite, so it is the merge's own arithmetic: refused naming the leaf and
  --lora-alpha/--lora-scale, nothing committed (as --dtype refuses a cast that overflows)."""
  src = tmp_path / 'run' / '1'
  _save_model_params(src, {'fc': {'kernel': np.ones((4, 6), np.float32),
                                  'kernel_lora_a': np.full((4, 2), 10.0, np.float32),
                                  'kernel_lora_b': np.full((2, 6), 10.0, np.float32)}})
  # a⊗b is 200 everywhere: 1e36 keeps the merge finite (2e38), 1e37 does not (2e39).
  ok = tmp_path / 'ok' / '1'
  status, _, err = run(capsys, 'convert', src, ok, '--merge-lora', '--lora-scale', '1e36')
  assert status == 0, err
  got = ocp.PyTreeCheckpointHandler().restore(ok / 'model_params')['fc']['kernel']
  np.testing.assert_allclose(np.asarray(got), np.float32(1 + 1e36 * 200), rtol=1e-6)
  dst = tmp_path / 'merged' / '1'
  status, _, err = run(capsys, 'convert', src, dst, '--merge-lora', '--lora-scale', '1e37')
  assert status == 2, err
  assert 'model_params/fc/kernel' in err and '24 of 24 values' in err, err
  assert '--lora-alpha' in err and '--lora-scale' in err and 'float32' in err, err
  assert not dst.exists() and (not dst.parent.exists() or not list(dst.parent.iterdir()))


def test_flax_adapters_take_no_alpha(runs, mesh, tmp_path, capsys, monkeypatch):
  """flax's nnx.LoRA adds a·b unscaled: an alpha or scale given for its adapters would be
  ignored without a word, so it is refused (the library's and the command's names)."""
  root = runs['flax']['root']
  dst = tmp_path / 'merged' / '1'
  for flag in ('--lora-alpha', '--lora-scale'):
    status, _, err = run(capsys, 'convert', root / 'full', dst, '--merge-lora', flag, '16')
    assert status == 2 and f'{flag} 16' not in err and flag in err, err
    assert "flax's" in err and 'no alpha' in err, err
    assert not dst.exists()
  forbid_reads(monkeypatch)
  with pytest.raises(ot.LoraError, match="`lora_alpha` given, but these adapters are flax's"):
    ot.restore_merged_lora(root / 'full', abstract_weights('flax', mesh), lora_alpha=16.0)
  with pytest.raises(ot.LoraError, match="`lora_scale` given, but these adapters are flax's"):
    maxtext.restore_train_state(root / 'full', {'params': {'params': abstract_weights(
        'flax', mesh)}}, params_only=True, merge_lora=True, lora_scale=2.0)


def test_a_target_leaf_that_is_not_an_array_is_a_target_mismatch(runs, mesh, monkeypatch):
  """A float or int in the target (not a ShapeDtypeStruct or array): the package's own
  error naming every such leaf, before any read (was a raw AttributeError)."""
  target = abstract_weights('qwix', mesh)
  target['layers'][0]['q_proj']['w'] = 1.0
  target['layers'][1]['up']['bias'] = 3
  forbid_reads(monkeypatch)
  with pytest.raises(ot.TargetMismatchError, match='2 leaves that are not arrays') as e:
    ot.restore_merged_lora(runs['qwix']['root'] / 'full', target, lora_alpha=lm.ALPHA)
  assert 'layers/0/q_proj/w: float' in str(e.value) and 'layers/1/up/bias: int' in str(e.value)


def test_adapters_are_not_merged_twice(runs, mesh, tmp_path, capsys, monkeypatch):
  """A merged step records what was merged into it (the adapters' step, the base, the scales),
  and keeps that record when converted again; merging the same adapters into it (as `base`) is
  refused: they would be added twice, silently."""
  root = runs['qwix']['root']
  merged = tmp_path / 'merged' / '1'
  status, _, err = run(capsys, 'convert', root / 'only', merged, '--merge-lora', '--lora-alpha',
                       str(lm.ALPHA), '--base', root / 'base')
  assert status == 0, err
  relaid = tmp_path / 'relaid' / '1'  # converted again, no merge: the record is kept
  status, _, err = run(capsys, 'convert', merged, relaid, '--layout', 'maxtext', '--params-only')
  assert status == 0, err
  for step in (merged, relaid):
    record = json.loads((step / '_CHECKPOINT_METADATA').read_text())['custom_metadata'][
        'orbax_tunix']
    (done,) = record['lora_merges']
    assert done['adapters'] == str(root / 'only' / '1') and done['adapters_step'] == 1, done
    assert done['base'] == str(root / 'base' / '1'), done
    assert done['adapted']['layers/0/q_proj/w']['scale'] == lm.ALPHA / lm.RANK
  for base in (merged, relaid):
    dst = tmp_path / f'twice_{base.parent.name}' / '1'
    status, _, err = run(capsys, 'convert', root / 'only', dst, '--merge-lora', '--lora-alpha',
                         str(lm.ALPHA), '--base', base)
    assert status == 2, err
    assert f'records the adapters of {root / "only" / "1"} merged into already' in err, err
    assert 'add them twice' in err and '--base' in err, err
    assert not dst.exists()
  # The same adapters, however their path is spelled: through a link, with `..`.
  (tmp_path / 'link').symlink_to(root / 'only')
  for spelled in (tmp_path / 'link', root / 'base' / '..' / 'only'):
    dst = tmp_path / 'twice_again' / '1'
    status, _, err = run(capsys, 'convert', spelled, dst, '--merge-lora', '--lora-alpha',
                         str(lm.ALPHA), '--base', merged)
    assert status == 2, err
    assert f'records the adapters of {root / "only" / "1"} (here {spelled / "1"})' in err, err
    assert not dst.exists()
  forbid_reads(monkeypatch)
  with pytest.raises(ot.LoraError, match='add them twice'):
    ot.restore_merged_lora(root / 'only', abstract_weights('qwix', mesh), lora_alpha=lm.ALPHA,
                           base=relaid)


def test_a_place_is_one_however_it_is_spelled(tmp_path):
  """What the merged-twice check compares: links followed, `.` and `..` taken out, a bucket's
  URL normalized; other places differ."""
  from orbax_tunix.store import fileio
  (tmp_path / 'a' / 'b').mkdir(parents=True)
  (tmp_path / 'l').symlink_to(tmp_path / 'a')
  for same in (tmp_path / 'l' / 'b', f'{tmp_path}/a/./b/', tmp_path / 'a' / 'x' / '..' / 'b'):
    assert fileio.same_place(same, tmp_path / 'a' / 'b'), same
  assert not fileio.same_place(tmp_path / 'a', tmp_path / 'a' / 'b')
  for same in ('gs://bkt/runs//lora/./1/', 'gs://bkt/runs/x/../lora/1'):
    assert fileio.same_place(same, 'gs://bkt/runs/lora/1'), same
  assert not fileio.same_place('gs://bkt/runs/lora/1', 'gs://other/runs/lora/1')
  assert not fileio.same_place('gs://bkt/runs/lora/1', tmp_path / 'runs' / 'lora' / '1')

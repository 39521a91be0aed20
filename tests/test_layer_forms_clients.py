"""`convert --layout maxtext --scan-layers {false,true}` against the steps MaxText 0.2.5 writes.

For each family, tests/maxtext_client.py's `layer_forms` job (in the MaxText venv,
scripts/maxtext_venv.sh) builds MaxText's own model in both layer forms from the same
weights and adam moments: the unscanned model's drawn, the scanned one's the same stacked by
hand as CLIENTS.md says MaxText stacks them, which MaxText's forward pass proves (the two
models compute the same logits, while the same weights with two layers swapped do not). Each
form is saved as MaxText saves it (a params-only step; the full train state, its
TrainStateNNX with adamw, by `checkpointing.save_checkpoint`) and as a Tunix run (the
TunixMaxTextAdapter and an adamw(schedule) nnx.Optimizer, as google-tunix 0.1.7 saves them).

  llama3    llama3.1-8b, 3 layers: MaxText's plain scanned form (`decoder/layers`)
  qwen3_moe qwen3-30b-a3b, 3 layers: the same, its experts stacked beside the layers
  gemma3    gemma3-4b, 8 layers: one scanned block of 6 (`decoder/layers/layers_{0..5}`)
            and a remainder of 2 (`decoder/layers_remainder/layers_{0,1}`)
  gemma4    gemma4-31b, 14 layers: two blocks of 5 local layers (an inner scan,
            `scanned_blocks/local_layers`) and a global one, then a remainder of 2 local

Each source of one form is converted (the CLI, in this process) to the other form: a Tunix
run with and without `--params-only`, and MaxText's own params-only step. The converted
step must hold exactly the leaves of MaxText's own step of that form: the same key paths
and, for each, the same shape, dtype and values, read here by plain Orbax; the full state's
`_METADATA` (key types, value types, the `None` of adamw's empty state) alike. `nnx_aux`
(MaxText's RNG state) is left out on purpose by the converter (tests/test_maxtext_client.py)
and of the comparison. And MaxText's own abstract state of the other form is restored from the
Tunix run by `maxtext.restore_train_state` in the MaxText venv (gemma3, gemma4): the same
values. Nothing expected comes from orbax_tunix.

~2.5 min: MaxText's imports and four families' models in both forms, saved three ways
(the conversions run here meanwhile).
"""

from __future__ import annotations

import contextlib
import io
import json
import pathlib
import time

import numpy as np
import pytest

from orbax_tunix import cli
from tests import builders, clients
from tests.clients import client_env

ROOT = pathlib.Path(__file__).resolve().parent.parent
CLIENT = ROOT / 'tests' / 'maxtext_client.py'
WORKER_TIMEOUT = 900
STEP = 3  # the step every source is saved at (MaxText's full state: directory STEP-1)
# The tiny dims every family shares (all distinct).
DIMS = ['base_emb_dim=36', 'base_num_query_heads=4', 'base_num_kv_heads=2', 'base_mlp_dim=40',
        'vocab_size=72', 'head_dim=8']
FAMILIES = {
    'llama3': ('llama3.1-8b', ['base_num_decoder_layers=3']),
    'qwen3_moe': ('qwen3-30b-a3b', ['base_num_decoder_layers=3', 'base_moe_mlp_dim=20',
                                    'num_experts=4', 'num_experts_per_tok=2']),
    'gemma3': ('gemma3-4b', ['base_num_decoder_layers=8', 'sliding_window_size=6']),
    'gemma4': ('gemma4-31b', ['global_head_dim=16', 'global_num_kv_heads=1',
                              'base_num_decoder_layers=14', 'sliding_window_size=6']),
}
# form -> (--scan-layers value writing the other form, the other form)
OTHER = {'scan': ('false', 'unscan'), 'unscan': ('true', 'scan')}
# (name, source, flags): the source of one form, converted to the other.
SOURCES = {
    'tunix_params': ('tunix', ('--params-only',)),
    'tunix_full': ('tunix', ()),
    'maxtext_params': ('maxtext_params', ('--params-only',)),
}
# What each conversion is compared with: MaxText's own step of the other form.
EXPECTED = {'tunix_params': ('maxtext_params', STEP), 'tunix_full': ('maxtext_full', STEP - 1),
            'maxtext_params': ('maxtext_params', STEP)}
RESTORED = ('gemma3', 'gemma4')  # restored by restore_train_state into the other form too
LOGITS_ATOL = 1e-5  # scanned and unrolled forward passes of the same float32 weights
CASES = [(family, form, source) for family in FAMILIES for form in OTHER for source in SOURCES]


def convert(src: pathlib.Path, dst: pathlib.Path, *flags: str) -> dict:
  """`orbax-tunix convert SRC DST FLAGS`, in this process."""
  out, err = io.StringIO(), io.StringIO()
  with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
    rc = cli.main(['convert', str(src), str(dst), '--layout', 'maxtext', *flags])
  return {'argv': ['convert', str(src), str(dst), *flags], 'rc': rc, 'stderr': err.getvalue(),
          'dst': dst}


class Run:
  def __init__(self, worker, converts):
    self.worker, self.converts = worker, converts

  def family(self, family: str) -> dict:
    r = self.worker.results.get(family)
    assert r is not None, f'no MaxText result for {family}; log:\n{self.worker.log()}'
    assert r['ok'], f"MaxText's {family} job failed: {r['error']}\n{r['traceback'][-3000:]}"
    return r

  def converted(self, case: tuple[str, str, str]) -> pathlib.Path:
    c = self.converts.get(case)
    assert c is not None, f'{case}: not converted (its MaxText job failed)'
    assert c['rc'] == 0, f"`orbax-tunix {' '.join(c['argv'])}` exited {c['rc']}:\n{c['stderr']}"
    return c['dst']


@pytest.fixture(scope='module')
def run(tmp_path_factory):
  work = tmp_path_factory.mktemp('layer_forms')
  worker = clients.Worker('MaxText', client_env('maxtext_venv.sh'), CLIENT, work / 'mt_out',
                          work / 'maxtext.log')
  (work / 'mt_out').mkdir()
  for i, (family, (model, dims)) in enumerate(FAMILIES.items()):
    worker.send({'id': family, 'job': 'layer_forms', 'model_name': model,
                 'dims': [*DIMS, *dims], 'seed': i, 'step': STEP, 'out': str(work / family)})
  converts = {}
  deadline = time.time() + WORKER_TIMEOUT
  for family in FAMILIES:  # each family converted as soon as MaxText made it
    while family not in worker.results and worker.proc.poll() is None and time.time() < deadline:
      time.sleep(0.2)
    if not worker.results.get(family, {}).get('ok'):
      continue
    for form, (scan, _) in OTHER.items():
      for source, (kind, flags) in SOURCES.items():
        converts[family, form, source] = convert(
            work / family / form / kind, work / 'conv' / '_'.join((family, form, source))
            / str(STEP), '--scan-layers', scan, *flags)
    if family in RESTORED:  # MaxText's abstract state of the other form, restored
      model, dims = FAMILIES[family]
      for form, (_, other) in OTHER.items():
        worker.send({'id': f'restore_{family}_{form}', 'job': 'restore_train_state',
                     'path': str(work / family / form / 'tunix'), 'scan': other == 'scan',
                     'model_name': model, 'dims': [*DIMS, *dims]})
  worker.finish(max(60.0, deadline - time.time()))
  return Run(worker, converts)


@pytest.mark.parametrize('family', FAMILIES)
def test_a_the_forms_are_maxtexts_from_the_same_weights(run, family):
  """The scanned model, stacked by hand, computes the unscanned one's logits; stacked with
  two layers swapped, it would not (the check can fail)."""
  r = run.family(family)
  with np.load(r['npz']) as z:
    scan, unscan, swapped = z['logits_scan'], z['logits_unscan'], z['logits_swapped']
  np.testing.assert_allclose(scan, unscan, rtol=0, atol=LOGITS_ATOL)
  assert np.abs(swapped - unscan).max() > 100 * LOGITS_ATOL
  gemma = {'gemma3': 'decoder/layers_remainder/layers_1/', 'gemma4': 'decoder/scanned_blocks/'}
  if family in gemma:  # MaxText's own interleaved forms, with a remainder
    assert any(p.startswith(gemma[family]) for p in r['scanned']), r['scanned'][:20]
    assert any(p.startswith('decoder/layers_remainder/') for p in r['scanned'])


def _leaves(step_dir: pathlib.Path) -> dict[str, np.ndarray]:
  return {k: np.asarray(v) for k, v in builders.raw_leaves(step_dir / 'items').items()
          if not k.startswith('nnx_aux/')}


def _tree(step_dir: pathlib.Path) -> dict[tuple, tuple]:
  """`items`' _METADATA: key path -> (key types, value type), nnx_aux left out."""
  meta = json.loads((step_dir / 'items' / '_METADATA').read_text())['tree_metadata']
  out = {}
  for entry in meta.values():
    keys = tuple(k['key'] for k in entry['key_metadata'])
    if keys[0] != 'nnx_aux':
      out[keys] = (tuple(k['key_type'] for k in entry['key_metadata']),
                   entry['value_metadata']['value_type'])
  return out


@pytest.mark.parametrize('family, form, source', CASES, ids=['-'.join(c) for c in CASES])
def test_b_the_other_form_is_maxtexts_own_step_of_it(run, family, form, source):
  case = (family, form, source)
  r = run.family(family)
  kind, step = EXPECTED[source]
  other = OTHER[form][1]
  want_dir = pathlib.Path(r['out']) / other / kind / str(step)
  got_dir = run.converted(case)
  got, want = _leaves(got_dir), _leaves(want_dir)
  assert sorted(got) == sorted(want), (
      f'{case}: only converted {sorted(set(got) - set(want))[:8]},'
      f' only MaxText\'s {sorted(set(want) - set(got))[:8]}')
  for path, value in want.items():
    assert (got[path].shape, got[path].dtype) == (value.shape, value.dtype), (
        path, got[path].shape, got[path].dtype, value.shape, value.dtype)
    np.testing.assert_array_equal(got[path], value, err_msg=f'{case}: {path}')
  if source == 'tunix_full':
    assert _tree(got_dir) == _tree(want_dir)
  meta = json.loads((got_dir / '_CHECKPOINT_METADATA').read_text())['custom_metadata']
  assert meta['scan_layers'] is (other == 'scan')


@pytest.mark.parametrize('family', RESTORED)
@pytest.mark.parametrize('form', OTHER)
def test_c_restore_train_state_restores_maxtexts_abstract_state_of_the_other_form(
    run, family, form):
  """`maxtext.restore_train_state(tunix run, MaxText's abstract state of the other form)`:
  every params, opt_state and step leaf the value MaxText's own full step of that form holds."""
  r = run.family(family)
  other = OTHER[form][1]
  want = _leaves(pathlib.Path(r['out']) / other / 'maxtext_full' / str(STEP - 1))
  job = run.worker.results.get(f'restore_{family}_{form}')
  assert job is not None and job['ok'], (job or {}).get('traceback', run.worker.log())[-3000:]
  assert job['structure_equal']
  with np.load(job['npz']) as z:
    got = {k: z[k] for k in z.files if not k.startswith('nnx_aux/')}
  assert sorted(got) == sorted(want)
  for path, value in want.items():
    assert (got[path].shape, got[path].dtype) == (value.shape, value.dtype), path
    np.testing.assert_array_equal(got[path], value, err_msg=path)

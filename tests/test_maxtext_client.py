"""MaxText 0.2.5 itself accepts what orbax-tunix writes from a real Tunix run.

The sources are `tests/data/maxtext/tunix_llama2_{scan,unscan}`: MaxText's own
tiny llama2, wrapped in MaxText's TunixMaxTextAdapter, trained two steps by
google-tunix's PeftTrainer and saved by its CheckpointManager
(scripts/make_maxtext_fixtures.py). MaxText runs in its own venv (Python 3.12,
jax 0.12; scripts/maxtext_venv.sh builds it, ~40 s cold, then reused): one
worker process (tests/maxtext_client.py) runs every MaxText job of this
module, since each process pays ~12 s of imports. The conversions run here
with the `orbax-tunix` CLI (`python -m orbax_tunix.cli`), in parallel, while the
worker imports MaxText and trains MaxText's own reference runs.

Expected values are the raw arrays plain Orbax (`ocp.PyTreeCheckpointHandler`)
reads from the Tunix fixture, with the Tunix levels stripped here by hand: the
adapter's `base/` prefix, nnx's `/value` suffix, and the optimizer's chain
positions (`opt_state/0` adam, `opt_state/2` the schedule's count). Nothing
expected comes from orbax_tunix.

Conventions the tests encode:
  * A converted step is written as `<dst>/<S-1>`, S being the stored step: in
    MaxText, directory N holds step N+1 (here S=2, so `<dst>/1`).
  * `--layout maxtext` without `--params-only` writes the full train state:
    `items` with exactly the key paths, key types, shapes and dtypes MaxText's
    own train.main writes for the same config, except `nnx_aux`, left out on
    purpose (MaxText then keeps its init RNG state; Tunix's threefry keys
    would not load into MaxText's unsafe_rbg ones).
  * `--scan-layers true|false` restacks the decoder layers on MaxText's layer
    axis 1 (`param_scan_axis`).
"""

from __future__ import annotations

import pathlib
import re
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest

from tests import builders, clients
from tests.clients import client_env, subprocess_env

ROOT = pathlib.Path(__file__).resolve().parent.parent
DATA = ROOT / 'tests' / 'data' / 'maxtext'
CLIENT = ROOT / 'tests' / 'maxtext_client.py'
FORMS = {'scan': True, 'unscan': False}
FIXTURE = {form: DATA / f'tunix_llama2_{form}' for form in FORMS}
STEP = 2  # the stored step of both fixtures (MANIFEST.json)
DIR = STEP - 1  # MaxText's directory for it: directory N holds step N+1
LAYERS = 3  # base_num_decoder_layers of the tiny config
ADAM_B1 = 0.9  # MaxText's adam_b1 (base.yml)
WORKER_TIMEOUT = 900


# --------------------------------------------------------------------------- #
# Expected values: the Tunix fixture read with plain Orbax, levels stripped
# --------------------------------------------------------------------------- #
class Tunix:
  """The raw arrays of one fixture's step, by MaxText-side names."""

  def __init__(self, root: pathlib.Path):
    step_dir = root / str(STEP)
    model = builders.raw_leaves(step_dir / 'model_params')
    opt = builders.raw_leaves(step_dir / 'optimizer_state')
    self.weights, self.rngs = {}, {}
    for path, value in model.items():
      assert path.startswith('base/') and path.endswith('/value'), path  # adapter, nnx levels
      name = path[len('base/'):-len('/value')]
      (self.rngs if '/rngs/' in name else self.weights)[name] = value
    self.mu, self.nu = {}, {}
    for path, value in opt.items():
      if m := re.fullmatch(r'opt_state/0/(mu|nu)/base/(.+)/value', path):
        getattr(self, m[1])[m[2]] = value
      elif path == 'opt_state/0/count/value':
        self.count = value
      elif path == 'opt_state/2/count/value':
        self.schedule_count = value  # adamw(schedule): the chain's scale_by_schedule
      elif path == 'step/value':
        self.step = value
      else:
        raise AssertionError(f'unexpected Tunix optimizer leaf {path}')
    assert sorted(self.mu) == sorted(self.nu) == sorted(self.weights)
    assert int(self.step) == STEP


@pytest.fixture(scope='module')
def tunix():
  return {form: Tunix(FIXTURE[form]) for form in FORMS}


def unscanned(weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  """decoder/layers/<w> stacked on axis 1 -> decoder/layers_<i>/<w>, by hand."""
  out = {}
  for name, value in weights.items():
    if name.startswith('decoder/layers/'):
      rest = name[len('decoder/layers/'):]
      assert value.shape[1] == LAYERS, (name, value.shape)
      for i in range(LAYERS):
        out[f'decoder/layers_{i}/{rest}'] = np.take(value, i, axis=1)
    else:
      out[name] = value
  return out


def scanned(weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  """decoder/layers_<i>/<w> -> decoder/layers/<w> = np.stack(..., axis=1), by hand."""
  out, per_layer = {}, {}
  for name, value in weights.items():
    if m := re.fullmatch(r'decoder/layers_(\d+)/(.+)', name):
      per_layer.setdefault(m[2], {})[int(m[1])] = value
    else:
      out[name] = value
  for rest, layers in per_layer.items():
    assert sorted(layers) == list(range(LAYERS)), (rest, sorted(layers))
    out[f'decoder/layers/{rest}'] = np.stack([layers[i] for i in range(LAYERS)], axis=1)
  return out


def assert_equal_arrays(got: dict, want: dict, what: str):
  """Same names, and each array bit-exact with the same dtype."""
  assert sorted(got) == sorted(want), (
      f'{what}: names differ: only MaxText {sorted(set(got) - set(want))}, '
      f'only expected {sorted(set(want) - set(got))}')
  for name, value in want.items():
    assert got[name].dtype == value.dtype, f'{what} {name}: {got[name].dtype} != {value.dtype}'
    np.testing.assert_array_equal(got[name], value, err_msg=f'{what} {name}')


# --------------------------------------------------------------------------- #
# The MaxText venv and the worker
# --------------------------------------------------------------------------- #
@pytest.fixture(scope='session')
def maxtext_python() -> str:
  """The MaxText venv's python, built by scripts/maxtext_venv.sh on first use (~40 s)."""
  return client_env('maxtext_venv.sh')


def convert(src: pathlib.Path, dst: pathlib.Path, *flags: str) -> dict:
  """`orbax-tunix convert SRC DST FLAGS` in this venv, started (waited for in `done`)."""
  argv = [sys.executable, '-m', 'orbax_tunix.cli', 'convert', str(src), str(dst), *flags]
  proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          cwd=ROOT, env=subprocess_env())
  return {'argv': argv[3:], 'dst': dst, 'proc': proc}


def done(c: dict) -> dict:
  c['stdout'], c['stderr'] = c['proc'].communicate(timeout=300)
  c['rc'] = c.pop('proc').returncode
  return c


class Client:
  """What the module's tests assert on: the conversions and the worker's results."""

  def __init__(self, converts, worker, work):
    self.converts, self.worker, self.work = converts, worker, work

  def converted(self, name: str) -> pathlib.Path:
    c = self.converts[name]
    assert c['rc'] == 0, (f"`orbax-tunix {' '.join(c['argv'])}` failed (exit {c['rc']}):\n"
                          f"{c['stderr'][-3000:]}")
    return c['dst']

  def result(self, job_id: str, *needs: str) -> dict:
    for name in needs:
      self.converted(name)
    r = self.worker.results.get(job_id)
    assert r is not None, f'the worker gave no result for {job_id}; its log:\n{self.worker.log()}'
    assert r['ok'], (f"MaxText job {job_id} ({r['job']}) failed: {r['error']}\n"
                     + '\n  caused by: '.join(r['error_chain']) + f"\n{r['traceback'][-4000:]}")
    return r

  def arrays(self, job_id: str, *needs: str, prefix: str = '') -> dict[str, np.ndarray]:
    """The job's arrays whose names start with `prefix`, the prefix removed."""
    with np.load(self.result(job_id, *needs)['npz']) as z:
      return {k[len(prefix):]: z[k] for k in z.files if k.startswith(prefix)}


def _weights(arrays: dict) -> dict:
  return {k: v for k, v in arrays.items() if '/rngs/' not in k}


@pytest.fixture(scope='module')
def client(maxtext_python, tmp_path_factory):
  t0 = time.time()
  work = tmp_path_factory.mktemp('maxtext_client')
  runs = work / 'runs'
  worker = clients.Worker('MaxText', maxtext_python, CLIENT, work / 'out', work / 'worker.log')
  # MaxText's own steps for the same config (test b), while the conversions run here.
  for form, scan in FORMS.items():
    worker.send({'id': f'ref_{form}', 'job': 'train', 'out': str(runs), 'run': f'ref_{form}',
                 'steps': STEP, 'scan': scan},
                {'id': f'ref_{form}_metadata', 'job': 'metadata',
                 'path': str(runs / f'ref_{form}' / 'checkpoints' / str(DIR))})
  conv = work / 'conv'
  started = {}
  for form in FORMS:
    other = 'unscan' if form == 'scan' else 'scan'
    to = 'false' if form == 'scan' else 'true'
    src = FIXTURE[form]
    started[f'params_{form}'] = convert(src, conv / f'params_{form}' / str(DIR),
                                        '--layout', 'maxtext', '--params-only')
    started[f'full_{form}'] = convert(src, conv / f'full_{form}' / str(DIR), '--layout', 'maxtext')
    started[f'params_{form}_to_{other}'] = convert(
        src, conv / f'params_{form}_to_{other}' / str(DIR), '--layout', 'maxtext',
        '--params-only', '--scan-layers', to)
    started[f'full_{form}_to_{other}'] = convert(
        src, conv / f'full_{form}_to_{other}' / str(DIR), '--layout', 'maxtext',
        '--scan-layers', to)
  converts = {name: done(c) for name, c in started.items()}
  ok = {name for name, c in converts.items() if c['rc'] == 0}
  convert_seconds = time.time() - t0

  jobs = []
  for form, scan in FORMS.items():
    other = 'unscan' if form == 'scan' else 'scan'
    params, full = conv / f'params_{form}' / str(DIR), conv / f'full_{form}' / str(DIR)
    if f'params_{form}' in ok:  # a
      jobs += [
          {'id': f'a_{form}_step', 'job': 'load_params', 'path': str(params), 'scan': scan},
          {'id': f'a_{form}_items', 'job': 'load_params', 'path': str(params / 'items'),
           'scan': scan},
          {'id': f'a_{form}_from_pretrained', 'job': 'from_pretrained',
           'load_parameters_path': str(params / 'items'), 'scan': scan},
      ]
    if f'full_{form}' in ok:  # b, c
      jobs += [
          {'id': f'b_{form}_metadata', 'job': 'metadata', 'path': str(full)},
          {'id': f'c_{form}_step', 'job': 'load_full', 'path': str(full), 'scan': scan},
      ]
      if form == 'scan':  # MaxText normalises <step>/items to <step>: one layout is enough
        jobs.append({'id': f'c_{form}_items', 'job': 'load_full', 'path': str(full / 'items'),
                     'scan': scan})
      # d: the converted step as this run's own directory S-1, then train to S+1.
      ckpts = runs / f'resume_{form}' / 'checkpoints'
      ckpts.mkdir(parents=True)
      shutil.copytree(full, ckpts / str(DIR))
      jobs.append({'id': f'd_{form}_resume', 'job': 'resume', 'out': str(runs),
                   'run': f'resume_{form}', 'steps': STEP + 1, 'scan': scan})
    if f'params_{form}' in ok:
      # d's reference: the same weights with a freshly initialised optimizer, one step.
      jobs.append({'id': f'd_{form}_fresh', 'job': 'train', 'out': str(runs),
                   'run': f'fresh_{form}', 'steps': 1, 'scan': scan,
                   'overrides': [f"load_parameters_path={params / 'items'}"]})
    # e: the raw Tunix step, natively.
    jobs.append({'id': f'e_{form}', 'job': 'from_pretrained', 'scan': scan,
                 'load_parameters_path': str(FIXTURE[form] / str(STEP) / 'model_params')})
    # f: MaxText's own abstract state, through the library.
    for params_only in (False, True):
      jobs.append({'id': f'f_{form}_{"params" if params_only else "full"}',
                   'job': 'restore_train_state', 'path': str(FIXTURE[form]), 'scan': scan,
                   'params_only': params_only})
    # g: the other layer layout.
    name = f'params_{form}_to_{other}'
    if name in ok:
      jobs.append({'id': f'g_{name}', 'job': 'load_params', 'path': str(conv / name / str(DIR)),
                   'scan': not scan})
      jobs.append({'id': f'g_{name}_logits', 'job': 'logits',
                   'path': str(conv / name / str(DIR)), 'scan': not scan})
    if f'params_{form}' in ok:
      jobs.append({'id': f'g_params_{form}_logits', 'job': 'logits', 'path': str(params),
                   'scan': scan})
    name = f'full_{form}_to_{other}'
    if name in ok:
      jobs.append({'id': f'g_{name}', 'job': 'load_full', 'path': str(conv / name / str(DIR)),
                   'scan': not scan})
  worker.send(*jobs)
  worker.finish(WORKER_TIMEOUT)
  ready = worker.results.get('__ready__', {})
  print(f"\n[maxtext client] conversions {convert_seconds:.1f} s (parallel with the worker's"
        f" imports, {ready.get('import_seconds', float('nan')):.1f} s); all done in"
        f' {time.time() - t0:.1f} s; {len(worker.results) - 1} MaxText jobs', file=sys.stderr)
  return Client(converts, worker, work)


# --------------------------------------------------------------------------- #
# a. params-only conversion -> MaxText's load_params_from_path (and from_pretrained)
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize('form', FORMS)
@pytest.mark.parametrize('where', ['step', 'items'])
def test_a_params_only_loads_with_load_params_from_path(client, tunix, form, where):
  got = client.arrays(f'a_{form}_{where}', f'params_{form}')
  assert_equal_arrays(got, tunix[form].weights, f'load_params_from_path(<dst>/{DIR}/{where})')


@pytest.mark.parametrize('form', FORMS)
def test_a_params_only_loads_with_from_pretrained(client, tunix, form):
  r = client.result(f'a_{form}_from_pretrained', f'params_{form}')
  assert r['scan_layers'] is FORMS[form]
  got = client.arrays(f'a_{form}_from_pretrained')
  assert_equal_arrays(got, tunix[form].weights, 'from_pretrained(<dst>/items)')


# --------------------------------------------------------------------------- #
# b. full-state conversion: the step MaxText itself writes, minus nnx_aux
# --------------------------------------------------------------------------- #
def _entries(result: dict) -> dict[tuple, tuple]:
  return {tuple(e['path']): (tuple(e['key_types']), e['value_type'], e.get('shape'), e.get('dtype'))
          for e in result['entries']}


@pytest.mark.parametrize('form', FORMS)
def test_b_full_state_metadata_is_maxtexts_own(client, form):
  ours = client.result(f'b_{form}_metadata', f'full_{form}')
  theirs = client.result(f'ref_{form}_metadata')
  mine, ref = _entries(ours), _entries(theirs)
  aux = sorted('/'.join(p) for p in mine if p[0] == 'nnx_aux')
  assert not aux, f'the converted step holds nnx_aux, which it leaves out on purpose: {aux[:3]}'
  ref = {p: v for p, v in ref.items() if p[0] != 'nnx_aux'}
  assert ref, 'MaxText wrote no items entries'
  only_ours = sorted('/'.join(p) for p in set(mine) - set(ref))
  only_ref = sorted('/'.join(p) for p in set(ref) - set(mine))
  assert not only_ours and not only_ref, (
      f'key paths differ from the step MaxText writes: only ours {only_ours}, only MaxText\'s'
      f' {only_ref}')
  diffs = [f"{'/'.join(p)}: ours (key types, value type, shape, dtype) {mine[p]}, MaxText's {v}"
           for p, v in sorted(ref.items()) if mine[p] != v]
  assert not diffs, '\n'.join(diffs)
  assert {'items', '_CHECKPOINT_METADATA'} <= set(ours['files']), ours['files']
  custom = (ours['checkpoint_metadata'] or {}).get('custom_metadata') or {}
  if 'scan_layers' in custom:  # what from_pretrained checks; resume does not read it
    assert custom['scan_layers'] is FORMS[form]


# --------------------------------------------------------------------------- #
# c. MaxText's full-state loader on the converted step
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize('form, where', [('scan', 'step'), ('scan', 'items'), ('unscan', 'step')])
def test_c_full_state_loads_bit_exact(client, tunix, form, where):
  job, t = f'c_{form}_{where}', tunix[form]
  assert_equal_arrays(_weights(client.arrays(job, f'full_{form}', prefix='model/')), t.weights,
                      'model')
  opt = 'optimizer/opt_state/'
  assert_equal_arrays(client.arrays(job, prefix=f'{opt}0/mu/'), t.mu, 'adam mu')
  assert_equal_arrays(client.arrays(job, prefix=f'{opt}0/nu/'), t.nu, 'adam nu')
  state = client.arrays(job)
  assert int(state[f'{opt}0/count']) == int(t.count)
  # The Tunix optimizer had a schedule: its count, not the step.
  assert int(state[f'{opt}2/count']) == int(t.schedule_count)
  assert int(state['optimizer/step']) == int(t.step) == STEP


# --------------------------------------------------------------------------- #
# d. resume: the converted step as the run's directory S-1, train.main to S+1
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize('form', FORMS)
def test_d_train_main_resumes_from_the_converted_step(client, tunix, form):
  r = client.result(f'd_{form}_resume', f'full_{form}')
  t = tunix[form]
  assert r['restored_dir'] == DIR, r['log']
  assert f"restoring from this run's directory step {DIR}" in r['log'], r['log']
  assert r['completed_steps'] == [STEP], f'trained {r["completed_steps"]}, expected [{STEP}]'
  assert r['saved_dirs'] == [DIR, DIR + 1], r['saved_dirs']
  last = r['last']
  assert last['dir'] == DIR + 1 and last['step'] == STEP + 1, last
  assert last['adam_count'] == int(t.count) + 1, 'the optimizer was re-initialised'
  assert last['schedule_count'] == int(t.schedule_count) + 1, last

  fresh = client.result(f'd_{form}_fresh', f'params_{form}')
  assert fresh['last']['adam_count'] == 1 and fresh['last']['dir'] == 0, fresh['last']
  resumed_mu = client.arrays(f'd_{form}_resume', prefix='opt_state/0/mu/params/')
  fresh_mu = client.arrays(f'd_{form}_fresh', prefix='opt_state/0/mu/params/')
  assert sorted(resumed_mu) == sorted(fresh_mu) == sorted(t.mu)
  assert any(not np.array_equal(resumed_mu[w], fresh_mu[w]) for w in t.mu), (
      "the resumed mu equals a fresh optimizer's: the optimizer state was not restored")
  # Both runs took one step from the same weights on the same data: adam's first moment is
  # b1 * mu_before + (1 - b1) * g, and mu_before is Tunix's mu (resumed) or 0 (fresh).
  for w, mu in t.mu.items():
    np.testing.assert_allclose(
        resumed_mu[w].astype(np.float64) - ADAM_B1 * mu.astype(np.float64),
        fresh_mu[w].astype(np.float64), rtol=1e-4,
        atol=1e-6 * max(float(np.abs(fresh_mu[w]).max()), 1e-12), err_msg=w)


# --------------------------------------------------------------------------- #
# e. from_pretrained on the raw Tunix step, natively
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize('form', FORMS)
def test_e_from_pretrained_reads_the_raw_tunix_step(client, tunix, form):
  r = client.result(f'e_{form}')
  assert r['scan_layers'] is FORMS[form]
  assert_equal_arrays(client.arrays(f'e_{form}'), tunix[form].weights,
                      'from_pretrained(<tunix step>/model_params)')


# --------------------------------------------------------------------------- #
# f. restore_train_state with MaxText's own (NNX-derived) abstract state
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize('form', FORMS)
@pytest.mark.parametrize('params_only', [False, True], ids=['full', 'params'])
def test_f_restore_train_state_with_maxtexts_abstract_state(client, tunix, form, params_only):
  job, t = f'f_{form}_{"params" if params_only else "full"}', tunix[form]
  r = client.result(job)
  assert r['structure_equal'], 'the result is not in the structure of the target'
  assert sorted(r['leaves']) == sorted(r['target'])
  for path, leaf in r['leaves'].items():  # dtypes and shapes are the target's
    want = r['target'][path]
    if leaf['kind'].startswith('prng_key'):
      continue
    assert (leaf['shape'], leaf['dtype']) == (want['shape'], want['dtype']), path
  arrays = client.arrays(job)
  assert_equal_arrays(
      {k[len('params/params/'):]: v for k, v in arrays.items() if k.startswith('params/params/')},
      t.weights, 'params/params')
  aux = {p: leaf for p, leaf in r['leaves'].items() if p.startswith('nnx_aux/')}
  assert aux, "MaxText's target has nnx_aux"
  if params_only:
    kept = [p for p, leaf in r['leaves'].items()
            if not p.startswith('params/') and leaf['kind'] != 'as_given']
    assert not kept, f'params_only restored leaves besides the weights: {kept}'
    return
  assert_equal_arrays({k[len('opt_state/0/mu/params/'):]: v for k, v in arrays.items()
                       if k.startswith('opt_state/0/mu/params/')}, t.mu, 'mu')
  assert_equal_arrays({k[len('opt_state/0/nu/params/'):]: v for k, v in arrays.items()
                       if k.startswith('opt_state/0/nu/params/')}, t.nu, 'nu')
  assert int(arrays['opt_state/0/count']) == int(t.count)
  assert int(arrays['opt_state/2/count']) == int(t.schedule_count)
  assert arrays['step'].dtype == np.int32 and int(arrays['step']) == STEP
  # nnx_aux: MaxText's RNG keys are unsafe_rbg, Tunix saved threefry ones (another key type):
  # they come back as given. A count may be taken from the checkpoint, where it is the same.
  for path, leaf in aux.items():
    name = path[len('nnx_aux/model/'):]
    if path.endswith('/key'):
      assert leaf['kind'] == 'as_given', f'{path}: {leaf}'
    elif leaf['kind'] != 'as_given':
      assert name in t.rngs, path
      np.testing.assert_array_equal(arrays[path], t.rngs[name].astype(arrays[path].dtype),
                                    err_msg=path)
  assert any('nnx_aux' in note for note in r['notes']), (
      f'no note says which nnx_aux leaves were kept as given: {r["notes"]}')


# --------------------------------------------------------------------------- #
# g. scanned <-> unscanned conversions
# --------------------------------------------------------------------------- #
def test_g_scan_to_unscan_loads_and_computes_the_same_logits(client, tunix):
  name = 'params_scan_to_unscan'
  got = client.arrays(f'g_{name}', name)
  assert_equal_arrays(got, unscanned(tunix['scan'].weights), 'np.take(raw, i, axis=1)')
  with np.load(client.result(f'g_{name}_logits')['npz']) as z:
    unscan_logits = z['logits']
  with np.load(client.result('g_params_scan_logits', 'params_scan')['npz']) as z:
    scan_logits = z['logits']
  assert unscan_logits.dtype == scan_logits.dtype == np.float32
  diff = float(np.max(np.abs(unscan_logits - scan_logits)))
  assert diff < 1e-5, f'logits of the unscanned conversion differ by {diff}'


def test_g_unscan_to_scan_stacks_on_axis_1(client, tunix):
  name = 'params_unscan_to_scan'
  got = client.arrays(f'g_{name}', name)
  assert_equal_arrays(got, scanned(tunix['unscan'].weights), 'np.stack(raw, axis=1)')
  with np.load(client.result(f'g_{name}_logits')['npz']) as z:
    scan_logits = z['logits']
  with np.load(client.result('g_params_unscan_logits', 'params_unscan')['npz']) as z:
    unscan_logits = z['logits']
  diff = float(np.max(np.abs(unscan_logits - scan_logits)))
  assert diff < 1e-5, f'logits of the scanned conversion differ by {diff}'


@pytest.mark.parametrize('form', FORMS)
def test_g_full_state_changes_layout_too(client, tunix, form):
  other = 'unscan' if form == 'scan' else 'scan'
  name, t = f'full_{form}_to_{other}', tunix[form]
  relayout = unscanned if form == 'scan' else scanned
  job = f'g_{name}'
  assert_equal_arrays(_weights(client.arrays(job, name, prefix='model/')), relayout(t.weights),
                      'model')
  opt = 'optimizer/opt_state/'
  assert_equal_arrays(client.arrays(job, prefix=f'{opt}0/mu/'), relayout(t.mu), 'adam mu')
  assert_equal_arrays(client.arrays(job, prefix=f'{opt}0/nu/'), relayout(t.nu), 'adam nu')
  state = client.arrays(job)
  assert int(state[f'{opt}0/count']) == int(t.count)
  assert int(state[f'{opt}2/count']) == int(t.schedule_count)
  assert int(state['optimizer/step']) == STEP

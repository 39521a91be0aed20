"""MaxText 0.2.5 as a client of our checkpoints: a worker run INSIDE the MaxText venv.

Not a test module and not imported by the main suite (which runs another
Python and jax): `tests/test_maxtext_client.py` starts it with the venv's
python from `scripts/maxtext_venv.sh`. It imports MaxText once (~12 s) and
then runs named jobs, each with MaxText's own code (trainer, checkpoint
loaders, model builders, abstract train state) on the tiny llama2 config.

  python tests/maxtext_client.py REQUEST.json|- [RESULTS.json]
      REQUEST = {"out_dir": DIR, "jobs": [JOB, ...]} (a file, or stdin for '-'); writes the list
      of results to RESULTS.json, or prints it after a line '=== maxtext_client results ==='.
  python tests/maxtext_client.py --serve --reply-fd N
      one JOB per line on stdin (`out_dir` in each), one result per line on fd N; EOF ends.

A JOB is {"id": unique name, "job": one of JOBS, ...arguments}. A result is
{"id", "job", "ok", "seconds", ...}; a job that raises gives ok=false with
`error` (type: first line), `error_chain` (every message of the cause chain)
and `traceback`, and the worker goes on with the next job. Arrays go to
`<out_dir>/<id>.npz`, keyed by '/'-joined key paths (`npz` in the result);
`leaves` maps each path to its shape, dtype and kind ('array', 'prng_key' for
a typed key saved as its key data, 'as_given' for a leaf returned as the
abstract leaf it was given).

Jobs and their arguments (scan: scan_layers, a bool; overrides: extra
pyconfig `k=v` strings):
  train           out, run, steps, scan[, overrides]: train.main in-process with the tiny
                  config (checkpoint_period=1, synchronous saves). Returns the log lines
                  about restoring and completed steps, `restored_dir` (N of "restoring from
                  this run's directory step N"), `fresh`, `completed_steps`, `saved_dirs`,
                  and `last` = {dir, step, adam_count, schedule_count} of the last saved
                  step; its `items` leaves go to the npz.
  resume          the same as train (a name for the intent).
  load_params     path, scan: checkpointing.load_params_from_path(path, <abstract weights>).
  load_full       path, scan: checkpointing.load_state_if_possible(..., load_full_state_from_path=path).
  from_pretrained load_parameters_path, scan (or null: left unset, so MaxText may adopt the
                  checkpoint's): model_creation_utils.from_pretrained; its nnx.Param leaves;
                  `scan_layers` of the model's config.
  metadata        path (a step, or an item dir)[, item='items']: every `_METADATA` entry
                  (key path, key types, value type) with shape and dtype from the array's
                  zarr.json (or .zarray) read through tensorstore; the step's
                  _CHECKPOINT_METADATA.
  logits          path, scan[, loader=params|full|pretrained]: a forward pass (dtype=float32)
                  on fixed tokens with weights from that loader; npz key 'logits'.
  restore_train_state  path, scan[, params_only, model_name, dims]:
                  orbax_tunix.maxtext.restore_train_state(path,
                  train_state_nnx.to_checkpoint_dict(<MaxText's abstract state>), params_only=...)
                  (the tiny llama2's, or with model_name and dims a family's as family_case
                  builds it); `notes` = the orbax_tunix log messages.
  family_case     model_name, dims, scan[, seed, step=3, jit_logits=false, convert_tunix=false,
                  params_only_logits=true, lora, repair_shape_map,
                  fit_global_heads], out: a tiny random MaxText
                  model of one family saved as a Tunix run and a MaxText step under `out`,
                  MaxText 0.2.5's own HF conversion of it (with convert_tunix, of the Tunix run
                  too: npz 'hf_tunix/<name>'), the fitted HF config and its logits (see
                  job_family_case); with `lora`, also a LoRA run of it as MaxText applies LoRA,
                  and its logits (see family_extras).
  layer_forms     model_name, dims, seed, step, out: one family's model in both layer forms
                  from the same weights, saved as MaxText saves each and as Tunix runs (see
                  job_layer_forms).
  lora_case       model_name, dims, scan, seed, step, out[, rank, alpha]: a family's tiny model
                  with qwix LoRA as MaxText applies it, saved as a Tunix run, and its logits
                  with and without the adapters (see job_lora_case).
  read_hf         path: every tensor of a Hugging Face folder, read with `safetensors`.
  auto_config     path: transformers.AutoConfig.from_pretrained(path).
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

import serve_jobs  # tests/serve_jobs.py: this file's own folder is on sys.path

os.environ.setdefault('JAX_PLATFORMS', 'cpu')
os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '3')

_T0 = time.time()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

# train.py's initialize() does this first; the abstract state's RNG keys must match what
# train.main writes (unsafe_rbg, uint32[..., 4]).
jax.config.update('jax_default_prng_impl', 'unsafe_rbg')

import tensorstore as ts  # noqa: E402
from absl import logging as absl_logging  # noqa: E402
from flax import nnx  # noqa: E402
from flax.linen import partitioning as nn_partitioning  # noqa: E402
from maxtext.common import checkpointing, train_state_nnx  # noqa: E402
from maxtext.common.common_types import MODEL_MODE_TRAIN  # noqa: E402
from maxtext.configs import pyconfig  # noqa: E402
from maxtext.trainers.pre_train import train as mt_train  # noqa: E402
from maxtext.utils import maxtext_utils, model_creation_utils, train_utils  # noqa: E402
from maxtext_convert import maxtext_to_hf, repaired_shape_map  # noqa: E402  (a sibling)
from orbax.checkpoint import v1 as ocp_v1  # noqa: E402

# orbax_tunix (installed editable in this venv) is imported by the one job that calls it, so a
# broken library fails that job, not the worker.

IMPORT_SECONDS = time.time() - _T0

# MaxText's tiny llama2 (scripts/make_maxtext_fixtures.py's TINY_MODEL): every dim distinct.
TINY_MODEL = [
    'hardware=cpu',
    'skip_jax_distributed_system=True',
    'dataset_type=synthetic',
    'per_device_batch_size=1',
    'max_target_length=16',
    'base_emb_dim=16',
    'base_num_query_heads=4',
    'base_num_kv_heads=2',
    'head_dim=8',
    'base_mlp_dim=48',
    'base_num_decoder_layers=3',
    'vocab_size=64',
    'attention=dot_product',
]
TRAIN_KEYS = ['enable_checkpointing=True', 'async_checkpointing=False', 'checkpoint_period=1']
BASE_YML = str(Path(pyconfig.__file__).resolve().parent / 'base.yml')

# MaxText's INFO lines ("restoring from ...", "completed step: N") need absl at INFO: app.run is
# not called here.
absl_logging.use_absl_handler()
absl_logging.set_verbosity(absl_logging.INFO)


class Capture(logging.Handler):
  """Collects the messages of the loggers it is attached to."""

  def __init__(self):
    super().__init__(logging.DEBUG)
    self.records: list[logging.LogRecord] = []

  def emit(self, record):
    self.records.append(record)

  def messages(self, name_prefix: str = '') -> list[str]:
    out = []
    for r in self.records:
      if r.name.startswith(name_prefix):
        try:
          out.append(r.getMessage())
        except Exception:  # noqa: BLE001 - a bad format string is still a record
          out.append(str(r.msg))
    return out


def config(scan: bool | None, *overrides: str):
  argv = ['maxtext_client', BASE_YML, *TINY_MODEL,
          'enable_checkpointing=False', 'run_name=maxtext_client',
          'base_output_directory=/tmp/maxtext_client_unused']
  if scan is not None:
    argv.append(f'scan_layers={bool(scan)}')
  return pyconfig.initialize([*argv, *overrides])


def train_argv(out: str, run: str, steps: int, scan: bool, overrides=()) -> list[str]:
  # argv[0] is train.py's own path: pyconfig then takes configs/base.yml.
  return [mt_train.__file__, *TINY_MODEL, *TRAIN_KEYS, f'base_output_directory={out}',
          f'run_name={run}', f'steps={steps}', f'scan_layers={bool(scan)}', *overrides]


# --------------------------------------------------------------------------- #
# Trees
# --------------------------------------------------------------------------- #
def _key(k) -> str:
  for attr in ('key', 'name', 'idx'):
    if hasattr(k, attr):
      return str(getattr(k, attr))
  return str(k)


def flat(tree) -> dict[str, Any]:
  """{'a/b/c': leaf} of nested dicts/lists/NamedTuples/nnx.State (None leaves dropped)."""
  if hasattr(tree, 'to_pure_dict'):
    tree = tree.to_pure_dict()
  leaves = jax.tree_util.tree_flatten_with_path(
      tree, is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct))[0]
  return {'/'.join(_key(k) for k in path): leaf for path, leaf in leaves}


def is_key(leaf) -> bool:
  return jax.dtypes.issubdtype(getattr(leaf, 'dtype', np.float32), jax.dtypes.prng_key)


def save_leaves(out_dir: str, job_id: str, tree, given=None) -> dict[str, Any]:
  """Saves the array leaves of `tree` to <out_dir>/<id>.npz; describes every leaf."""
  given_flat = flat(given) if given is not None else {}
  arrays, leaves = {}, {}
  for path, leaf in flat(tree).items():
    if path in given_flat and leaf is given_flat[path]:
      leaves[path] = {'kind': 'as_given', 'shape': list(getattr(leaf, 'shape', ())),
                      'dtype': str(getattr(leaf, 'dtype', None))}
      continue
    if isinstance(leaf, jax.ShapeDtypeStruct):
      leaves[path] = {'kind': 'abstract', 'shape': list(leaf.shape), 'dtype': str(leaf.dtype)}
      continue
    kind = 'array'
    if is_key(leaf):
      kind = f'prng_key:{jax.random.key_impl(leaf)}'
      leaf = jax.random.key_data(leaf)
    value = np.asarray(jax.device_get(leaf))
    arrays[path] = value
    leaves[path] = {'kind': kind, 'shape': list(value.shape), 'dtype': str(value.dtype)}
  npz = os.path.join(out_dir, f'{job_id}.npz')
  np.savez(npz, **arrays)
  return {'npz': npz, 'leaves': leaves}


# --------------------------------------------------------------------------- #
# MaxText's own state and loaders
# --------------------------------------------------------------------------- #
def abstract_train_state(cfg):
  """The abstract TrainStateNNX exactly as train_utils.setup_train_loop builds it."""
  mesh = maxtext_utils.get_mesh_from_config(cfg)
  create_model, abstract_model = model_creation_utils.create_nnx_abstract_model(cfg, mesh)
  _, tx = train_utils.create_training_optimizer(cfg, abstract_model, mesh=mesh)

  def init_state_fn():
    model = create_model()
    return train_state_nnx.TrainStateNNX(model, nnx.Optimizer(model, tx, wrt=nnx.Param))

  abstract, _, _ = maxtext_utils.get_abstract_state(cfg, mesh, init_state_fn, True)
  return abstract


def load_params(cfg, path: str):
  abstract = abstract_train_state(cfg)
  with nn_partitioning.axis_rules(cfg.logical_axis_rules):
    return checkpointing.load_params_from_path(
        path, checkpointing._abstract_params(abstract),  # what load_state_if_possible passes
        cfg.checkpoint_storage_concurrent_gb,
        use_ocdbt=cfg.checkpoint_storage_use_ocdbt, use_zarr3=cfg.checkpoint_storage_use_zarr3)


def load_full(cfg, path: str):
  abstract = abstract_train_state(cfg)
  with nn_partitioning.axis_rules(cfg.logical_axis_rules):
    restored, params = checkpointing.load_state_if_possible(
        None, None, '', path, cfg.checkpoint_storage_concurrent_gb, abstract,
        use_ocdbt=cfg.checkpoint_storage_use_ocdbt, use_zarr3=cfg.checkpoint_storage_use_zarr3,
        maxtext_config=cfg)
  assert params is None, 'a full-state load returned params alone'
  assert restored is not None, f'load_state_if_possible restored nothing from {path}'
  return restored['items']


def model_with(cfg, weights):
  """A fresh Transformer whose nnx.Param leaves are `weights` (an nnx.State or pure dict)."""
  mesh = maxtext_utils.get_mesh_from_config(cfg)
  create_model, _ = model_creation_utils.create_nnx_abstract_model(cfg, mesh)
  with nn_partitioning.axis_rules(cfg.logical_axis_rules):
    model = create_model()
  pure = weights.to_pure_dict() if hasattr(weights, 'to_pure_dict') else weights
  pure = pure.get('model', pure)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  def only(src, like):  # drops the RNG entries a full state carries
    if isinstance(like, dict):
      return {k: only(src[k], v) for k, v in like.items()}
    return src

  nnx.replace_by_pure_dict(params, only(pure, params.to_pure_dict()))
  return nnx.merge(graphdef, params, rest)


def fixed_tokens(cfg) -> np.ndarray:
  rng = np.random.default_rng(0)
  return rng.integers(0, cfg.vocab_size, size=(1, cfg.max_target_length), dtype=np.int32)


def _call(model, tokens):
  positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
  return model(tokens, positions, decoder_segment_ids=jnp.ones_like(tokens),
               enable_dropout=False, model_mode=MODEL_MODE_TRAIN)


_JITTED_CALL = nnx.jit(_call)


def forward_logits(model, tokens, jit: bool = False) -> np.ndarray:
  """The model's logits on `tokens`, run op by op (`jit`: compiled once per model structure,
  several times faster for MoE models on a CPU; the same computation)."""
  tokens = jnp.asarray(tokens, jnp.int32)
  cfg = model.config
  with jax.set_mesh(model.mesh), nn_partitioning.axis_rules(cfg.logical_axis_rules):
    logits = (_JITTED_CALL if jit else _call)(model, tokens)
  return np.asarray(jax.device_get(logits), np.float32)


# --------------------------------------------------------------------------- #
# Jobs
# --------------------------------------------------------------------------- #
# The log lines that tell what a run restored and trained.
INTERESTING = ("restoring from this run's directory", 'trying to load', 'No existing checkpoints',
               'completed step', 'Loading full state', 'restoring params', 'already exists',
               'Requested training up to step')


def job_train(job, out_dir):
  out = os.path.abspath(job['out'])
  capture = Capture()
  root = logging.getLogger()
  root.addHandler(capture)
  try:
    mt_train.main(train_argv(out, job['run'], int(job['steps']), job['scan'],
                             job.get('overrides', ())))
  finally:
    root.removeHandler(capture)
  messages = capture.messages()
  log = [m for m in messages if any(s in m for s in INTERESTING)]
  restored = [int(m.rsplit(' ', 1)[1]) for m in messages
              if m.startswith("restoring from this run's directory step ")]
  completed = []
  for m in messages:
    if 'completed step: ' in m:
      completed.append(int(m.split('completed step: ', 1)[1].split(',')[0].split()[0]))
  ckpt_dir = Path(out) / job['run'] / 'checkpoints'
  dirs = sorted(int(p.name) for p in ckpt_dir.iterdir() if p.name.isdigit())
  result = {'log': log, 'restored_dir': restored[0] if restored else None,
            'fresh': any('No existing checkpoints found' in m for m in messages),
            'completed_steps': completed, 'saved_dirs': dirs}
  if dirs:
    last = ckpt_dir / str(dirs[-1])
    items = ocp_v1.load(str(last), checkpointable_name='items')
    opt = items['opt_state']
    result['last'] = {'dir': dirs[-1], 'step': int(items['step']),
                      'adam_count': int(opt[0]['count']), 'schedule_count': int(opt[2]['count'])}
    result.update(save_leaves(out_dir, job['id'], items))
  return result


def job_load_params(job, out_dir):
  params = load_params(config(job['scan'], *job.get('overrides', ())), job['path'])
  return save_leaves(out_dir, job['id'], params)


def job_load_full(job, out_dir):
  state = load_full(config(job['scan'], *job.get('overrides', ())), job['path'])
  return save_leaves(out_dir, job['id'], state)


def job_from_pretrained(job, out_dir):
  cfg = config(job.get('scan'), f"load_parameters_path={job['load_parameters_path']}",
               *job.get('overrides', ()))
  model, _mesh = model_creation_utils.from_pretrained(cfg)
  _, params, _ = nnx.split(model, nnx.Param, ...)
  return {'scan_layers': bool(model.config.scan_layers), **save_leaves(out_dir, job['id'], params)}


def _stored_arrays(item_dir: Path, use_ocdbt: bool) -> dict[str, dict[str, Any]]:
  """{param name: {'shape', 'dtype', 'zarr'}} from each array's zarr.json / .zarray."""
  found = {}

  def take(name: str, raw: bytes, fmt: str):
    spec = json.loads(raw)
    if fmt == 'zarr3':
      dtype = np.dtype(spec['data_type']).name if spec['data_type'] != 'bfloat16' else 'bfloat16'
    else:
      dtype = spec['dtype'] if spec['dtype'] == 'bfloat16' else np.dtype(spec['dtype']).name
    found[name] = {'shape': list(spec['shape']), 'dtype': dtype, 'zarr': fmt}

  if use_ocdbt:
    kv = ts.KvStore.open({'driver': 'ocdbt', 'base': f'file://{item_dir}/'}).result()
    for key in kv.list().result():
      key = key.decode()
      for suffix, fmt in (('/zarr.json', 'zarr3'), ('/.zarray', 'zarr2')):
        if key.endswith(suffix):
          take(key[:-len(suffix)], kv.read(key).result().value, fmt)
  else:
    for p in item_dir.rglob('*'):
      for suffix, fmt in (('zarr.json', 'zarr3'), ('.zarray', 'zarr2')):
        if p.name == suffix:
          take(str(p.parent.relative_to(item_dir)), p.read_bytes(), fmt)
  return found


def job_metadata(job, out_dir):
  path = Path(job['path'])
  item = job.get('item', 'items')
  item_dir = path if (path / '_METADATA').exists() else path / item
  step_dir = item_dir.parent
  meta = json.loads((item_dir / '_METADATA').read_text())
  stored = _stored_arrays(item_dir, meta.get('use_ocdbt', True))
  entries = []
  for entry in meta['tree_metadata'].values():
    keys = [k['key'] for k in entry['key_metadata']]
    vm = entry['value_metadata']
    row = {'path': keys, 'key_types': [k['key_type'] for k in entry['key_metadata']],
           'value_type': vm.get('value_type')}
    if vm.get('value_type') != 'None':
      arr = stored.get('.'.join(keys))
      row.update(shape=arr and arr['shape'], dtype=arr and arr['dtype'], zarr=arr and arr['zarr'])
    entries.append(row)
  ckpt_meta = step_dir / '_CHECKPOINT_METADATA'
  return {
      'entries': entries,
      'top': {k: v for k, v in meta.items() if k != 'tree_metadata'},
      'checkpoint_metadata': json.loads(ckpt_meta.read_text()) if ckpt_meta.exists() else None,
      'files': sorted(str(p.relative_to(step_dir)) for p in step_dir.iterdir()),
  }


def job_logits(job, out_dir):
  loader = job.get('loader', 'params')
  overrides = ('dtype=float32', *job.get('overrides', ()))
  cfg = config(job['scan'], *overrides)
  if loader == 'pretrained':
    model, _ = model_creation_utils.from_pretrained(
        config(job['scan'], *overrides, f"load_parameters_path={job['path']}"))
  elif loader == 'full':
    model = model_with(cfg, load_full(cfg, job['path']))
  else:
    model = model_with(cfg, load_params(cfg, job['path']))
  logits = forward_logits(model, fixed_tokens(cfg))
  npz = os.path.join(out_dir, f"{job['id']}.npz")
  np.savez(npz, logits=logits)
  return {'npz': npz, 'shape': list(logits.shape), 'dtype': str(logits.dtype)}


def job_restore_train_state(job, out_dir):
  import orbax_tunix.maxtext  # here, not at the top: see the imports above

  cfg = (family_config(job['model_name'], job['scan'], job['dims']) if 'model_name' in job
         else config(job['scan'], *job.get('overrides', ())))
  target = train_state_nnx.to_checkpoint_dict(abstract_train_state(cfg))
  capture = Capture()
  lib_logger = logging.getLogger('orbax_tunix')
  old_level = lib_logger.level
  lib_logger.addHandler(capture)
  lib_logger.setLevel(logging.DEBUG)
  try:
    restored = orbax_tunix.maxtext.restore_train_state(
        job['path'], target, params_only=bool(job.get('params_only', False)))
  finally:
    lib_logger.removeHandler(capture)
    lib_logger.setLevel(old_level)
  notes = [f'{r.levelname}: {r.getMessage()}' for r in capture.records
           if r.levelno >= logging.INFO]
  target_leaves = {p: {'shape': list(v.shape), 'dtype': str(v.dtype)} for p, v in flat(target).items()}
  return {'notes': notes, 'target': target_leaves,
          'structure_equal': str(jax.tree.structure(restored)) == str(jax.tree.structure(target)),
          **save_leaves(out_dir, job['id'], restored, given=target)}


# --------------------------------------------------------------------------- #
# Tiny models of each family, their checkpoints, and MaxText's own HF conversion
# --------------------------------------------------------------------------- #
# The keys every family's tiny model shares (tests/test_export_maxtext.py gives the dims).
FAMILY_BASE = [
    'hardware=cpu',
    'skip_jax_distributed_system=True',
    'dataset_type=synthetic',
    'per_device_batch_size=1',
    'max_target_length=16',
    'attention=dot_product',
    'override_model_config=True',
    'dtype=float32',
    'weight_dtype=float32',
    'enable_dropout=False',
    'enable_checkpointing=False',
    'run_name=maxtext_client_family',
    'base_output_directory=/tmp/maxtext_client_unused',
]


def family_config(model_name: str, scan: bool, dims, *extra: str):
  return pyconfig.initialize(['maxtext_client', BASE_YML, f'model_name={model_name}',
                              *FAMILY_BASE, *dims, f'scan_layers={bool(scan)}', *extra])


def drawn_variables():
  """The variable types `random_model` draws: nnx.Param, and the weights MaxText keeps in
  other variables (DeepSeek's routing bias, a `moe.MoEBiasVar`, and V4's hash routing table, a
  `moe.Tid2EidVar`: Tunix saves them with the rest of `nnx.state`, MaxText's params-only step
  leaves them out)."""
  from maxtext.layers import moe  # noqa: PLC0415

  return (nnx.Param, moe.MoEBiasVar, moe.Tid2EidVar)


def random_model(cfg, seed: int):
  """MaxText's own model for `cfg`, every nnx.Param leaf (norms too), and every other weight
  variable (`drawn_variables`), drawn from N(0, 0.3²), rounded to values bfloat16 holds
  exactly.

  MaxText initialises norms to ones (or zeros) and some kernels alike: a fixture with such
  leaves cannot tell `scale - 1` from `scale`, or one layer from another.
  """
  mesh = maxtext_utils.get_mesh_from_config(cfg)
  create_model, _ = model_creation_utils.create_nnx_abstract_model(cfg, mesh)
  with nn_partitioning.axis_rules(cfg.logical_axis_rules):
    model = create_model()
  graphdef, params, rest = nnx.split(model, drawn_variables(), ...)
  pure = params.to_pure_dict()
  rng = np.random.default_rng(seed)
  leaves = flat(pure)
  # Values bfloat16 can hold exactly (stored as float32): MaxText 0.2.5 casts the embedding
  # table to bfloat16 in its tied logits (layers/embeddings.py attend_on_embedding), which must
  # not round them.
  drawn = {path: rng.normal(0.0, 0.3, np.shape(leaf)).astype(jnp.bfloat16).astype(np.float32)
           for path, leaf in sorted(leaves.items())}
  for path in drawn:  # a hash routing table holds expert ids (as float32, as MaxText keeps it)
    if path.endswith('/tid2eid'):
      drawn[path] = rng.integers(0, cfg.num_experts, drawn[path].shape).astype(np.float32)

  def fill(tree, prefix=''):
    if isinstance(tree, dict):
      return {k: fill(v, f'{prefix}{k}/') for k, v in tree.items()}
    return jnp.asarray(drawn[prefix[:-1]], tree.dtype)

  nnx.replace_by_pure_dict(params, fill(pure))
  return nnx.merge(graphdef, params, rest), drawn


def save_tunix_run(root: Path, step: int, model, optimizer=None) -> None:
  """A Tunix run: `nnx.state(TunixMaxTextAdapter(model))` saved exactly as google-tunix 0.1.7's
  `tunix.sft.checkpoint_manager.CheckpointManager.save` saves it (Orbax v0 CheckpointManager,
  item `model_params`, PyTreeSave of the whole nnx.State: `base/<path>/value`, RNG state too;
  with an `nnx.Optimizer` of the adapter, item `optimizer_state`: its `OptState`s)."""
  import orbax.checkpoint as ocp  # noqa: PLC0415 - v0 API, as Tunix 0.1.7 uses it
  from maxtext.integration.tunix.tunix_adapter import TunixMaxTextAdapter  # noqa: PLC0415

  adapter = model if optimizer is not None else TunixMaxTextAdapter(base_model=model)
  items = {'model_params': nnx.state(adapter)}
  if optimizer is not None:
    items['optimizer_state'] = nnx.state(optimizer, nnx.optimizer.OptState)
  mngr = ocp.CheckpointManager(
      str(root), item_handlers={name: ocp.PyTreeCheckpointHandler() for name in items},
      options=ocp.CheckpointManagerOptions(enable_async_checkpointing=False))
  mngr.save(step, args=ocp.args.Composite(**{
      name: ocp.args.PyTreeSave(item=tree, save_args=jax.tree.map(lambda _: ocp.SaveArgs(), tree))
      for name, tree in items.items()}))
  mngr.wait_until_finished()
  mngr.close()


def save_maxtext_step(root: Path, step: int, model) -> None:
  """A MaxText params-only step: `<root>/<step>/items` = {'params': {'params': <weights>}}, the
  layout MaxText's own checkpointing (and generate_param_only_checkpoint) writes."""
  import orbax.checkpoint as ocp  # noqa: PLC0415

  weights = nnx.state(model, nnx.Param).to_pure_dict()
  item = {'params': {'params': weights}}
  mngr = ocp.CheckpointManager(
      str(root), item_handlers={'items': ocp.PyTreeCheckpointHandler()},
      options=ocp.CheckpointManagerOptions(enable_async_checkpointing=False))
  mngr.save(step, args=ocp.args.Composite(items=ocp.args.PyTreeSave(item=item)))
  mngr.wait_until_finished()
  mngr.close()


def converting(job, params: Path):
  """The pyconfig MaxText's converter runs with on the params item at `params`."""
  return family_config(job['model_name'], job['scan'], job['dims'],
                       f'load_parameters_path={params}')


def with_lora(model, cfg, seed: int) -> tuple[Any, dict[str, np.ndarray]]:
  """`model` with LoRA applied as MaxText 0.2.5 applies it (lora_utils.apply_lora_to_model:
  qwix's LoraProvider on the modules cfg's `lora_module_path` names, its rank and alpha), and
  its adapters drawn from N(0, 0.3²) rounded to bfloat16 (qwix starts lora_b at zeros: a merge
  would change nothing); the drawn values by adapter path."""
  from maxtext.utils import lora_utils  # noqa: PLC0415

  nnx.pop(model, nnx.Intermediate)  # what a forward pass sowed (an MoE block's overflow flag)
  with jax.set_mesh(model.mesh), nn_partitioning.axis_rules(cfg.logical_axis_rules):
    made = lora_utils.apply_lora_to_model(model, model.mesh, cfg)
  graphdef, adapters, rest = nnx.split(made, nnx.LoRAParam, ...)
  rng = np.random.default_rng(seed + 100)
  pure = adapters.to_pure_dict()
  drawn = {p: rng.normal(0.0, 0.3, np.shape(v)).astype(jnp.bfloat16).astype(np.float32)
           for p, v in sorted(flat(pure).items())}
  nnx.replace_by_pure_dict(adapters, _filled(pure, lambda p, v: jnp.asarray(drawn[p], v.dtype)))
  made = nnx.merge(graphdef, adapters, rest)
  nnx.pop(made, nnx.Intermediate)  # qwix traced the model once: its sown flags again
  return made, drawn


def job_family_case(job, out_dir):
  """A tiny MaxText model of one family: checkpoints, MaxText's HF conversion, its logits.

  Arguments: model_name (a MaxText model, e.g. gemma3-4b), dims (pyconfig overrides), scan,
  seed, out (a folder). Writes `<out>/tunix/<step>/model_params` (a Tunix run),
  `<out>/maxtext/<step>/items` (a MaxText params-only step), `<out>/hf_config/config.json`
  (MaxText's HF_MODEL_CONFIGS entry fitted to the tiny model), and to `<id>.npz`: the HF
  weights MaxText's converter makes from the MaxText step ('hf/<name>'), the model's logits
  on fixed tokens ('logits'), the tokens ('tokens'), and the drawn weights ('mt/<path>').
  A model with weights outside nnx.Param (DeepSeek's routing bias) also gets the logits of the
  model MaxText makes of its params-only step, those weights at their init
  ('logits_params_only').
  With fit_global_heads: gemma4's global head dim and key/value heads fitted too, which MaxText's
  gemma4 shape map reads once `per_layer_config` is null (without: the local ones, so its
  converter fails on a tiny gemma4 whose global heads differ).
  """
  out = Path(job['out']).resolve()
  step = int(job.get('step', 3))
  cfg = family_config(job['model_name'], job['scan'], job['dims'])
  times = {}
  t = time.time()
  model, drawn = random_model(cfg, int(job.get('seed', 0)))
  times['model'] = time.time() - t
  save_tunix_run(out / 'tunix', step, model)
  save_maxtext_step(out / 'maxtext', step, model)
  times['save'] = time.time() - t - sum(times.values())
  tokens = fixed_tokens(cfg)
  jit = bool(job.get('jit_logits', False))
  logits = forward_logits(model, tokens, jit)
  more = {}
  params = flat(nnx.state(model, nnx.Param).to_pure_dict())
  # Weights outside nnx.Param, which the params-only step lacks (unless told not to look).
  if set(drawn) - set(params) and job.get('params_only_logits', True):
    # The model MaxText makes of that step: its nnx.Param leaves, the rest at their init.
    more['logits_params_only'] = forward_logits(model_with(cfg, nnx.state(model, nnx.Param)),
                                                tokens, jit)
  times['logits'] = time.time() - t - sum(times.values())
  hf, hf_config, convert_error = maxtext_to_hf(
      converting(job, out / 'maxtext' / str(step) / 'items'), fit_global_heads=bool(job.get('fit_global_heads')))
  if job.get('convert_tunix'):  # MaxText's converter reads Tunix's runs too (its 'base' level)
    hf_tunix, _, tunix_error = maxtext_to_hf(
        converting(job, out / 'tunix' / str(step) / 'model_params'))
    more.update({f'hf_tunix/{k}': v for k, v in (hf_tunix or {}).items()})
  times['convert'] = time.time() - t - sum(times.values())
  (out / 'hf_config').mkdir(parents=True, exist_ok=True)
  (out / 'hf_config' / 'config.json').write_text(json.dumps(hf_config, indent=2, default=str) + '\n')
  # MaxText's converted weights under the text model's names (gemma3's converter writes the
  # multimodal `model.language_model.*`), for Tunix's loaders: the reference chain's own check.
  from safetensors.numpy import save_file  # noqa: PLC0415

  (out / 'reference_hf').mkdir(exist_ok=True)
  save_file({text_name(k): np.ascontiguousarray(v) for k, v in (hf or {}).items()},
            str(out / 'reference_hf' / 'model.safetensors'), metadata={'format': 'pt'})
  arrays = {'logits': logits, 'tokens': tokens, **more,
            **{f'hf/{k}': v for k, v in (hf or {}).items()}, **{f'mt/{k}': v for k, v in drawn.items()}}
  extras = family_extras(job, model, tokens, out, step, times, hf_config)
  arrays.update(extras.pop('arrays'))
  npz = os.path.join(out_dir, f"{job['id']}.npz")
  np.savez(npz, **arrays)
  keys = {k: getattr(cfg, k) for k in (
      'emb_dim', 'num_query_heads', 'num_kv_heads', 'head_dim', 'mlp_dim', 'num_decoder_layers',
      'vocab_size', 'normalization_layer_epsilon', 'rope_max_timescale', 'scan_layers',
      'param_scan_axis', 'logits_via_embedding', 'sliding_window_size',
      'local_rope_max_timescale', 'rope_linear_scaling_factor', 'num_experts',
      'num_experts_per_tok', 'moe_mlp_dim', 'norm_topk_prob', 'use_qk_norm',
      'final_logits_soft_cap', 'query_pre_attn_scalar', 'global_head_dim',
      'global_num_kv_heads', 'rope_use_scale', 'global_rope_max_timescale',
      'global_rope_proportion', 'local_rope_proportion',
      # DeepSeek's
      'first_num_dense_layers', 'shared_experts', 'routed_scaling_factor', 'routed_score_func',
      'routed_bias', 'n_routing_groups', 'topk_routing_group', 'q_lora_rank', 'kv_lora_rank',
      'qk_nope_head_dim', 'qk_rope_head_dim', 'v_head_dim', 'rope_type', 'rope_factor',
      'max_position_embeddings', 'original_max_position_embeddings', 'mscale', 'beta_fast',
      'beta_slow', 'rope_truncate', 'rope_interleave', 'use_indexer', 'indexer_topk',
      'indexer_n_heads', 'indexer_head_dim', 'first_num_hash_layers', 'compress_ratios',
      'compressed_rope_max_timescale', 'mhc_expansion_rate', 'o_groups',
      'o_lora_rank', *HYBRID_KEYS) if hasattr(cfg, k)}
  return {'npz': npz, 'tunix': str(out / 'tunix'), 'maxtext': str(out / 'maxtext'),
          'step': step, 'hf_config': str(out / 'hf_config'), 'config': keys, 'times': times,
          'hf': {k: [list(v.shape), str(v.dtype)] for k, v in (hf or {}).items()},
          'convert_error': convert_error,
          'convert_tunix_error': tunix_error if job.get('convert_tunix') else None,
          'mt': {k: list(v.shape) for k, v in drawn.items()}, **extras}


# The hybrid decoders' config keys a family_case result reports too.
HYBRID_KEYS = ('inhomogeneous_layer_cycle_interval', 'gdn_num_key_heads', 'gdn_num_value_heads',
               'gdn_key_head_dim', 'gdn_value_head_dim', 'gdn_conv_kernel_dim', 'gdn_chunk_size',
               'partial_rotary_factor', 'use_mrope', 'mrope_section', 'shared_experts')


def family_extras(job, model, tokens, out: Path, step: int, times: dict, hf_dict: dict) -> dict:
  """family_case's optional parts (`arrays` for its npz, the rest for its result):

  repair_shape_map (true): `repaired_shape_map`'s evidence ('shape_map') and MaxText's
    converter run with the map its shape function builds ('hf_repaired/<name>' arrays,
    'repaired_error');
  lora ({rank, alpha[, module_path]}: MaxText's lora_module_path for the model unless given):
    the model with LoRA as MaxText applies it
    (`with_lora`), saved as a Tunix run at `<out>/tunix_lora` ('tunix_lora'), its logits
    ('logits_lora') and its adapters' shapes ('lora').
  """
  arrays, result, t = {}, {}, time.time()
  if job.get('repair_shape_map'):
    evidence, shape_map = repaired_shape_map(job['model_name'], model.config
                                             .inhomogeneous_layer_cycle_interval)
    hf, _, error = maxtext_to_hf(converting(job, out / 'maxtext' / str(step) / 'items'),
                                 shape_map=shape_map)
    arrays.update({f'hf_repaired/{k}': v for k, v in (hf or {}).items()})
    result.update(shape_map=evidence(hf_dict), repaired_error=error)
  if job.get('lora'):
    lora = job['lora']
    path = [f"lora.lora_module_path={lora['module_path']}"] if 'module_path' in lora else []
    made, _ = with_lora(model, family_config(
        job['model_name'], job['scan'], job['dims'], 'lora.enable_lora=True',
        f"lora.lora_rank={lora['rank']}", f"lora.lora_alpha={lora['alpha']}", *path),
        int(job.get('seed', 0)))
    save_tunix_run(out / 'tunix_lora', step, made)
    arrays['logits_lora'] = forward_logits(made, tokens, bool(job.get('jit_logits')))
    result['tunix_lora'] = str(out / 'tunix_lora')
    result['lora'] = {k: list(np.shape(v)) for k, v in flat(
        nnx.state(made, nnx.LoRAParam).to_pure_dict()).items()}
  times['extras'] = time.time() - t
  return {'arrays': arrays, **result}


# --------------------------------------------------------------------------- #
# One family's steps in both layer forms, from the same weights
# --------------------------------------------------------------------------- #
GEMMA_PERIOD = 6  # gemma3's and gemma4's attention pattern: the layers of a scanned block


def stacked(paths: dict[str, tuple], per_layer: dict[str, np.ndarray], axis: int,
            layers: int) -> dict[str, np.ndarray]:
  """The scanned model's leaves (`paths`: path -> shape) from the unscanned one's
  (`decoder/layers_<i>/<w>`), stacked as CLIENTS.md says MaxText 0.2.5 stacks them on
  `param_scan_axis` (`axis`): written here by hand, and proven by the forward pass."""
  full = layers // GEMMA_PERIOD * GEMMA_PERIOD

  def layer(i, w):
    return per_layer[f'decoder/layers_{i}/{w}']

  out = {}
  for path, shape in paths.items():
    blocks = shape[axis] if len(shape) > axis else 0
    if m := re.fullmatch(r'decoder/layers/layers_(\d+)/(.+)', path):  # gemma3's blocks
      value = np.stack([layer(GEMMA_PERIOD * a + int(m[1]), m[2]) for a in range(blocks)], axis)
    elif m := re.fullmatch(r'decoder/layers_remainder/layers_(\d+)/(.+)', path):  # ... the rest
      value = layer(full + int(m[1]), m[2])
    elif m := re.fullmatch(r'decoder/scanned_blocks/local_layers/(.+)', path):  # gemma4's
      value = np.stack([np.stack([layer(GEMMA_PERIOD * a + k, m[1])
                                  for k in range(GEMMA_PERIOD - 1)], axis)
                        for a in range(blocks)], axis)
    elif m := re.fullmatch(r'decoder/scanned_blocks/global_layer/(.+)', path):
      value = np.stack([layer(GEMMA_PERIOD * a + GEMMA_PERIOD - 1, m[1])
                        for a in range(blocks)], axis)
    elif m := re.fullmatch(r'decoder/layers_remainder/local_layers/(.+)', path):
      value = np.stack([layer(full + r, m[1]) for r in range(blocks)], axis)
    elif m := re.fullmatch(r'decoder/layers/(.+)', path):  # every other model
      value = np.stack([layer(i, m[1]) for i in range(blocks)], axis)
    else:
      value = per_layer[path]
    assert value.shape == tuple(shape), (path, value.shape, shape)
    out[path] = value
  return out


def _filled(tree, values) -> dict:
  """A pure dict's leaves replaced by `values(path, leaf)` (None: kept)."""
  def fill(node, prefix):
    if isinstance(node, dict):
      return {k: fill(v, f'{prefix}{k}/') for k, v in node.items()}
    found = values(prefix[:-1], node)
    return node if found is None else jnp.asarray(found, node.dtype)
  return fill(tree, '')


def _optimizer_values(weights: dict, mu: dict, nu: dict, step: int, prefix: str):
  """The leaves of a model's state and its adamw optimizer's: the model's weights, adam's mu
  and nu (under `opt_state/<i>/{mu,nu}/<prefix>`), every count and the step `step`."""
  def values(path, leaf):
    if m := re.fullmatch(rf'(?:.*/)?opt_state/\d+/(mu|nu)/{prefix}(.+)', path):
      return (mu if m[1] == 'mu' else nu)[m[2]]
    if path.endswith('count') and 'rngs' not in path or path.endswith('step'):
      return np.asarray(step)
    return weights.get(path.split('/', 1)[1] if path.startswith(('model/', 'base/')) else path)
  return values


def job_layer_forms(job, out_dir):
  """One family's model in both of MaxText's layer forms, from the same weights: MaxText's
  own steps of each form, and Tunix runs of each.

  Arguments: model_name, dims, seed, step, out. The unscanned model's nnx.Param leaves, and
  adam's mu and nu for them, are drawn as `random_model` draws; the scanned model's are the
  same stacked (`stacked`), which its forward pass proves: its logits are the unscanned
  one's. Writes under `<out>/<form>` (form: scan, unscan): `maxtext_params` (a params-only
  step, `save_maxtext_step`), `maxtext_full` (the full train state as MaxText's train loop
  saves it: its TrainStateNNX with adamw, by `checkpointing.save_checkpoint`, at directory
  step-1), `tunix` (a Tunix run of the TunixMaxTextAdapter with an adamw(schedule)
  nnx.Optimizer, both items, as Tunix 0.1.7 saves them).
  """
  import optax  # noqa: PLC0415
  from maxtext.integration.tunix.tunix_adapter import TunixMaxTextAdapter  # noqa: PLC0415

  out, step, seed = Path(job['out']).resolve(), int(job.get('step', 3)), int(job.get('seed', 0))
  cfgs = {form: family_config(job['model_name'], form == 'scan', job['dims'])
          for form in ('unscan', 'scan')}
  model, weights = {}, {}
  model['unscan'], weights['unscan'] = random_model(cfgs['unscan'], seed)
  rng = np.random.default_rng(seed + 1)
  moments = {f: {p: rng.normal(0, 0.3, v.shape).astype(jnp.bfloat16).astype(np.float32)
                 for p, v in weights['unscan'].items()} for f in ('mu', 'nu')}
  cfg = cfgs['scan']
  mesh = maxtext_utils.get_mesh_from_config(cfg)
  create_model, _ = model_creation_utils.create_nnx_abstract_model(cfg, mesh)
  with nn_partitioning.axis_rules(cfg.logical_axis_rules):
    made = create_model()
  graphdef, params, rest = nnx.split(made, nnx.Param, ...)
  shapes = {p: tuple(v.shape) for p, v in flat(params.to_pure_dict()).items()}
  weights['scan'] = stacked(shapes, weights['unscan'], cfg.param_scan_axis,
                            cfg.num_decoder_layers)
  moments = {'unscan': moments, 'scan': {f: stacked(shapes, m, cfg.param_scan_axis,
                                                    cfg.num_decoder_layers)
                                         for f, m in moments.items()}}
  nnx.replace_by_pure_dict(params, _filled(params.to_pure_dict(),
                                           lambda p, _: weights['scan'][p]))
  model['scan'] = nnx.merge(graphdef, params, rest)
  for form, cfg in cfgs.items():
    root = out / form
    save_maxtext_step(root / 'maxtext_params', step, model[form])
    mesh = maxtext_utils.get_mesh_from_config(cfg)
    _, tx = train_utils.create_training_optimizer(cfg, model[form], mesh=mesh)
    values = _optimizer_values(weights[form], moments[form]['mu'], moments[form]['nu'], step, '')
    with nn_partitioning.axis_rules(cfg.logical_axis_rules):
      state = train_state_nnx.TrainStateNNX(model[form], nnx.Optimizer(model[form], tx,
                                                                        wrt=nnx.Param))
    full = nnx.state(state)
    nnx.replace_by_pure_dict(full, _filled(full.to_pure_dict(), values))
    manager = checkpointing.create_orbax_checkpoint_manager(
        str(root / 'maxtext_full'), True, False, 1, use_ocdbt=cfg.checkpoint_storage_use_ocdbt,
        use_zarr3=cfg.checkpoint_storage_use_zarr3)
    checkpointing.save_checkpoint(manager, step - 1, full, cfg)
    checkpointing.wait_until_finished(manager)
    adapter = TunixMaxTextAdapter(base_model=model[form])
    optimizer = nnx.Optimizer(adapter, optax.adamw(optax.linear_schedule(1e-3, 1e-4, 10)),
                              wrt=nnx.Param)
    opt = nnx.state(optimizer, nnx.optimizer.OptState)
    moved = _optimizer_values(weights[form], moments[form]['mu'], moments[form]['nu'], step,
                              'base/')
    nnx.replace_by_pure_dict(opt, _filled(opt.to_pure_dict(), moved))
    nnx.update(optimizer, opt)
    save_tunix_run(root / 'tunix', step, adapter, optimizer)
  # Last: a forward pass adds state to some models (an MoE block's overflow flags).
  tokens = fixed_tokens(cfgs['scan'])
  logits = {form: forward_logits(model[form], tokens) for form in model}
  # The same check fails for weights stacked otherwise: the first two layers swapped.
  first, second = (f'decoder/layers_{i}/' for i in (0, 1))
  swapped = {p.replace(first, '@').replace(second, first).replace('@', second): v
             for p, v in weights['unscan'].items()}
  logits['swapped'] = forward_logits(model_with(cfgs['unscan'], _filled(
      nnx.state(model['unscan'], nnx.Param).to_pure_dict(), lambda p, _: swapped[p])), tokens)
  npz = os.path.join(out_dir, f"{job['id']}.npz")
  np.savez(npz, **{f'logits_{form}': v for form, v in logits.items()})
  return {'npz': npz, 'out': str(out), 'step': step,
          'layers': cfgs['scan'].num_decoder_layers,
          'param_scan_axis': cfgs['scan'].param_scan_axis,
          'scanned': sorted(shapes)}


def job_lora_case(job, out_dir):
  """A tiny random MaxText model of one family with qwix LoRA applied as MaxText applies it
  (`lora_utils.apply_lora_to_model`: `enable_lora`, `lora_rank`, `lora_alpha`,
  `lora_module_path` among the pyconfig keys, or `rank` and `alpha` given), saved as a Tunix run
  (the adapter's whole `nnx.State`: `<w>_lora_a`/`<w>_lora_b` beside each adapted weight).

  Arguments: model_name, dims, scan, seed, step, out, and optionally rank, alpha (added as
  `lora.*` keys) and jit_logits. The base is drawn as `random_model` draws it, every LoRA leaf
  likewise (qwix starts `b` at zeros: a merge would change nothing). npz: the logits of the
  model with its adapters ('logits', as qwix computes `x·W + (alpha / rank)·(x·a)·b`) and
  without them ('base_logits'), the tokens, the adapters ('lora/<path>'). Result: `tunix` (the
  run), `lora` (adapter path -> shape), `adapted` (the adapted modules' paths), `config` keys.
  """
  out, step = Path(job['out']).resolve(), int(job.get('step', 3))
  keys = ([] if job.get('rank') is None else
          ['lora.enable_lora=True', f"lora.lora_rank={int(job['rank'])}",
           f"lora.lora_alpha={job['alpha']}"])
  cfg = family_config(job['model_name'], job['scan'], job['dims'], *keys)
  jit = bool(job.get('jit_logits', False))
  model, _ = random_model(cfg, int(job.get('seed', 0)))
  tokens = fixed_tokens(cfg)
  base_logits = forward_logits(model, tokens, jit)
  lora_model, drawn = with_lora(model, cfg, int(job.get('seed', 0)))
  save_tunix_run(out / 'tunix', step, lora_model)
  logits = forward_logits(lora_model, tokens, jit)
  npz = os.path.join(out_dir, f"{job['id']}.npz")
  np.savez(npz, logits=logits, base_logits=base_logits, tokens=tokens,
           **{f'lora/{k}': v for k, v in drawn.items()})
  return {'npz': npz, 'tunix': str(out / 'tunix'), 'step': step,
          'lora': {k: list(v.shape) for k, v in drawn.items()},
          'adapted': sorted({p.rsplit('/', 1)[0] for p in drawn}),
          'config': {'lora_rank': cfg.lora.lora_rank, 'lora_alpha': cfg.lora.lora_alpha,
                     'num_decoder_layers': cfg.num_decoder_layers}}


def text_name(name: str) -> str:
  """A multimodal checkpoint's text-model name as the text model names it."""
  return name.replace('model.language_model.', 'model.', 1)


def job_read_hf(job, out_dir):
  """Every tensor of a Hugging Face folder (path) read with the `safetensors` package.

  npz: 'hf/<name>' as float32 (bfloat16 is widened exactly); result: {name: [shape, dtype,
  file]} and the folder's files.
  """
  from safetensors import safe_open  # noqa: PLC0415

  path = Path(job['path'])
  arrays, tensors = {}, {}
  for f in sorted(path.glob('*.safetensors')):
    with safe_open(str(f), framework='flax') as st:
      for name in st.keys():
        value = st.get_tensor(name)
        tensors[name] = [list(value.shape), str(value.dtype), f.name]
        arrays[f'hf/{name}'] = np.asarray(value.astype(jnp.float32))
  npz = os.path.join(out_dir, f"{job['id']}.npz")
  np.savez(npz, **arrays)
  return {'npz': npz, 'tensors': tensors, 'files': sorted(p.name for p in path.iterdir())}


def job_auto_config(job, out_dir):
  """transformers.AutoConfig.from_pretrained(path): what it loads, or its error."""
  import transformers  # noqa: PLC0415

  cfg = transformers.AutoConfig.from_pretrained(job['path'])
  return {'class': type(cfg).__name__, 'model_type': cfg.model_type,
          'architectures': list(getattr(cfg, 'architectures', None) or []),
          'transformers': transformers.__version__,
          'config': json.loads(cfg.to_json_string())}


JOBS = {
    'train': job_train,
    'resume': job_train,
    'load_params': job_load_params,
    'load_full': job_load_full,
    'from_pretrained': job_from_pretrained,
    'metadata': job_metadata,
    'logits': job_logits,
    'restore_train_state': job_restore_train_state,
    'family_case': job_family_case,
    'layer_forms': job_layer_forms,
    'lora_case': job_lora_case,
    'auto_config': job_auto_config,
    'read_hf': job_read_hf,
}


def main(argv: list[str]) -> int:
  print(f'[maxtext_client] imports took {IMPORT_SECONDS:.1f} s', file=sys.stderr, flush=True)
  return serve_jobs.main(argv, JOBS, 'maxtext_client', {'import_seconds': IMPORT_SECONDS})


if __name__ == '__main__':
  sys.exit(main(sys.argv[1:]))

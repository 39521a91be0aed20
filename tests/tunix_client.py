"""google-tunix 0.1.7 as a client of our Hugging Face exports: a worker run in a SUBPROCESS.

Not a test module and never imported by the test suite: importing Tunix's model modules sets
flax's `flax_always_shard_variable` to False process-wide, which must not leak into the
pytest process. `tests/test_export_hf.py` starts it as

    PYTHONPATH=<scripts/tunix_pkgs.sh's dir> <test venv python> tests/tunix_client.py ...

so jax, flax, optax, orbax-checkpoint, qwix and numpy are the test venv's pinned ones and
google-tunix (with its few extras) comes from that directory. It imports Tunix once (~4 s) and
then runs named jobs, each with Tunix's own code.

  python tests/tunix_client.py REQUEST.json|- [RESULTS.json]
      REQUEST = {"out_dir": DIR, "jobs": [JOB, ...]} (a file, or stdin for '-'); writes the list
      of results to RESULTS.json, or prints it after a line '=== tunix_client results ==='.
  python tests/tunix_client.py --serve --reply-fd N
      one JOB per line on stdin (`out_dir` in each), one result per line on fd N; EOF ends.

A JOB is {"id": unique name, "job": one of JOBS, ...arguments}. A result is {"id", "job",
"ok", "seconds", ...}; a job that raises gives ok=false with `error` (type: first line),
`error_chain` and `traceback`, and the worker goes on with the next job. Arrays go to
`<out_dir>/<id>.npz`: each nnx.Param of a model under 'param/<path>' (path '/'-joined as Tunix
saves it without the trailing 'value': 'layers/0/attn/q_proj/w'; qwix's nnx.LoRAParam under
'lora/<path>'), logits under 'logits'. bfloat16 arrays are stored as their uint16 bits (.npz
has no bfloat16); the result's `leaves` gives every path's real dtype.

Common arguments: family (a tunix.models package: qwen3|llama3|gemma3|qwen2|gemma|gemma4),
config (the ModelConfig keyword arguments, as in tests/data/tunix/MANIFEST.json: values of keys
ending in 'dtype' are dtype names, of attention_types/attention_pattern AttentionType names), tokens
(a (B, T) list of ints; logits are computed with positions 0..T-1 and a causal mask, as
scripts/make_tunix_fixtures.py does).

Jobs:
  load        dir[, dtype, mode, logits=true, gemma1_norm_name]:
              `<family>.params[_safetensors].create_model_from_safe_tensors(dir,
              ModelConfig(**config))` (default mode unless `mode`; `dtype` a dtype name,
              default None = keep the files' dtype). gemma1_norm_name: Tunix's Gemma loader
              with its one Gemma-2-only entry put right for Gemma 1 (see `load_gemma1`).
              Saves every nnx.Param and the logits. `leaves` = {path: {shape, dtype, type}}
              over the whole nnx.state (a leaf the loader left abstract has type
              'ShapeDtypeStruct'); `log` = the loader's absl/python log messages at WARNING
              and above (e.g. "Skipped loading N keys").
  reference   root[, step, lora]: the model a Tunix user gets back from the checkpoint:
              `nnx.eval_shape(lambda: Model(cfg, rngs=...))` filled by Tunix's
              `CheckpointManager(root).maybe_restore`, and its logits. With
              lora = {rank, alpha, module_path[, base_root, base_step]}: qwix's LoRA applied
              as Tunix does (`qwix.apply_lora_to_model(model, LoraProvider(...),
              **model.get_model_input(), rngs=...)`), the LoRA model's own logits (qwix in the
              loop). A full save (no base_root) is restored into the LoRA model as a whole; an
              adapters-only save is the base restored from base_root first, then the adapters
              with `maybe_restore(..., restore_only_lora_params=True)`, as PeftTrainer resumes.
              Saves the model's plain params (LoRA ones under 'lora/<path>') and the logits.
  tunix_merge the `reference` arguments with lora, plus base_dir (a Hugging Face folder with
              the base's single model.safetensors) and out: Tunix's own
              `tunix.models.qwen3.params.save_lora_merged_model_as_safetensors(base_dir, out,
              <LoRA model>, rank, alpha)` (qwen3 and llama3 only). Returns out.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import Any

import serve_jobs  # tests/serve_jobs.py: this file's own folder is on sys.path

os.environ.setdefault('JAX_PLATFORMS', 'cpu')
os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '3')

_T0 = time.time()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import qwix  # noqa: E402
from flax import nnx  # noqa: E402
from tunix.models import (  # noqa: E402
  safetensors_loader,
  safetensors_saver,  # noqa: F401 - fail now if it does not import
)
from tunix.models.gemma import model as gemma_model  # noqa: E402
from tunix.models.gemma import params_safetensors as gemma_params  # noqa: E402
from tunix.models.gemma3 import model as gemma3_model  # noqa: E402
from tunix.models.gemma3 import params_safetensors as gemma3_params  # noqa: E402
from tunix.models.gemma4 import model as gemma4_model  # noqa: E402
from tunix.models.gemma4 import params_safetensors as gemma4_params  # noqa: E402
from tunix.models.llama3 import model as llama3_model  # noqa: E402
from tunix.models.llama3 import params as llama3_params  # noqa: E402
from tunix.models.qwen2 import model as qwen2_model  # noqa: E402
from tunix.models.qwen2 import params as qwen2_params  # noqa: E402
from tunix.models.qwen3 import model as qwen3_model  # noqa: E402
from tunix.models.qwen3 import params as qwen3_params  # noqa: E402
from tunix.sft import checkpoint_manager as tunix_ckpt  # noqa: E402

IMPORT_SECONDS = time.time() - _T0

FAMILIES = {
    'qwen3': (qwen3_model, qwen3_model.Qwen3, qwen3_params),
    'llama3': (llama3_model, llama3_model.Llama3, llama3_params),
    'gemma3': (gemma3_model, gemma3_model.Gemma3, gemma3_params),
    'qwen2': (qwen2_model, qwen2_model.Qwen2, qwen2_params),
    'gemma': (gemma_model, gemma_model.Gemma, gemma_params),
    'gemma4': (gemma4_model, gemma4_model.Gemma4, gemma4_params),
}
# ModelConfig fields holding AttentionType values (MANIFEST.json records their names).
ENUM_FIELDS = ('attention_types', 'attention_pattern')


def _gemma1_key_mapping(cfg):
  """Tunix 0.1.7's Gemma map with Gemma 1's norm as transformers names it.

  Tunix maps `post_attention_layernorm` to Gemma 2's `post_attn_norm` for every Gemma; in
  Gemma 1 (GemmaForCausalLM, transformers' GemmaDecoderLayer) that tensor is the norm before
  the MLP, Tunix's `pre_ffw_norm`. Every other entry is Tunix's own.
  """
  mapping = dict(gemma_params._get_key_and_transform_mapping(cfg))  # noqa: SLF001
  key = r'model\.layers\.([0-9]+)\.post_attention_layernorm\.weight'
  assert key in mapping, sorted(mapping)
  mapping[key] = (r'layers.\1.pre_ffw_norm.scale', None)
  return mapping


def load_gemma1(file_dir, config, dtype=None, mode='auto'):
  """Tunix's Gemma loader (its reshapes, q/k/v stacking, loader) with Gemma 1's norm name."""
  return safetensors_loader.load_and_create_model(
      file_dir=file_dir, model_class=gemma_model.Gemma, config=config,
      key_mapping=_gemma1_key_mapping,
      preprocess_fn=gemma_params._make_preprocess_fn(config),  # noqa: SLF001
      dtype=dtype, mode=mode)


class Capture(logging.Handler):
  """Collects WARNING+ messages (absl logs through the 'absl' python logger)."""

  def __init__(self):
    super().__init__(logging.WARNING)
    self.messages: list[str] = []

  def emit(self, record):
    try:
      self.messages.append(f'{record.levelname}: {record.getMessage()}')
    except Exception:  # noqa: BLE001 - a bad format string is still a record
      self.messages.append(f'{record.levelname}: {record.msg}')


def model_config(family: str, kwargs: dict[str, Any]):
  module = FAMILIES[family][0]
  return module.ModelConfig(
      **{k: (jnp.dtype(v) if k.endswith('dtype') else
             tuple(module.AttentionType[n] for n in v) if k in ENUM_FIELDS else v)
         for k, v in kwargs.items()})


def abstract_model(family: str, cfg):
  cls = FAMILIES[family][1]
  return nnx.eval_shape(lambda: cls(cfg, rngs=nnx.Rngs(params=0)))


def forward(model, tokens) -> np.ndarray:
  tokens = jnp.asarray(tokens, jnp.int32)
  b, t = tokens.shape
  positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  mask = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), dtype=jnp.bool_)), (b, t, t))
  logits, _ = model(tokens, positions, None, mask)
  return np.asarray(jax.device_get(logits))


def _key(k) -> str:
  for attr in ('key', 'name', 'idx'):
    if hasattr(k, attr):
      return str(getattr(k, attr))
  return str(k)


def variables(model) -> dict[str, Any]:
  """{path: nnx.Variable} over the whole graph ('layers/0/attn/q_proj/w')."""
  out = {}
  for path, value in nnx.iter_graph(model):
    if isinstance(value, nnx.Variable):
      out['/'.join(_key(k) for k in path)] = value
  return out


def save_model(out_dir: str, job_id: str, model, logits: np.ndarray | None) -> dict[str, Any]:
  arrays, leaves = {}, {}
  for path, var in variables(model).items():
    value = var.get_value() if hasattr(var, 'get_value') else var.value
    kind = type(var).__name__
    if isinstance(value, jax.ShapeDtypeStruct):
      leaves[path] = {'shape': list(value.shape), 'dtype': str(value.dtype),
                      'type': 'ShapeDtypeStruct', 'variable': kind}
      continue
    leaves[path] = {'shape': list(value.shape), 'dtype': str(value.dtype), 'type': 'array',
                    'variable': kind}
    array = np.asarray(jax.device_get(value))
    if array.dtype == jnp.bfloat16:  # .npz has no bfloat16: its bits, as uint16
      array = array.view(np.uint16)
    if isinstance(var, nnx.LoRAParam):
      arrays[f'lora/{path}'] = array
    elif isinstance(var, nnx.Param):
      arrays[f'param/{path}'] = array
  extra = {}
  if logits is not None:
    extra['logits_dtype'] = str(logits.dtype)
    arrays['logits'] = logits.astype(np.float32) if logits.dtype == jnp.bfloat16 else logits
  npz = os.path.join(out_dir, f'{job_id}.npz')
  np.savez(npz, **arrays)
  return {'npz': npz, 'leaves': leaves, **extra}


# --------------------------------------------------------------------------- #
# Jobs
# --------------------------------------------------------------------------- #
def job_load(job, out_dir):
  family = job['family']
  cfg = model_config(family, job['config'])
  kwargs = {}
  if job.get('dtype'):
    kwargs['dtype'] = jnp.dtype(job['dtype'])
  if job.get('mode'):
    kwargs['mode'] = job['mode']
  capture = Capture()
  root = logging.getLogger()
  root.addHandler(capture)
  try:
    load = (load_gemma1 if job.get('gemma1_norm_name') else
            FAMILIES[family][2].create_model_from_safe_tensors)
    model = load(job['dir'], cfg, **kwargs)
  finally:
    root.removeHandler(capture)
  logits = forward(model, job['tokens']) if job.get('logits', True) else None
  return {'log': capture.messages, 'model_class': type(model).__name__,
          **save_model(out_dir, job['id'], model, logits)}


def restored_model(job):
  """The model restored from a Tunix checkpoint by Tunix (with qwix LoRA when job['lora'])."""
  family = job['family']
  cfg = model_config(family, job['config'])
  manager = tunix_ckpt.CheckpointManager(job['root'])
  lora = job.get('lora')
  if not lora:
    model = abstract_model(family, cfg)
    step, _ = manager.maybe_restore(model, step=job.get('step'))
    assert step, f"nothing restored from {job['root']}"
    return model, step
  rank, alpha = int(lora['rank']), float(lora['alpha'])
  provider = (qwix.LoraProvider([qwix.LoraRule(rank=rank, alpha=alpha, **rule)
                                 for rule in lora['rules']]) if lora.get('rules')
              else qwix.LoraProvider(module_path=lora['module_path'], rank=rank, alpha=alpha))
  base = abstract_model(family, cfg)
  if lora.get('base_root'):
    base_step, _ = tunix_ckpt.CheckpointManager(lora['base_root']).maybe_restore(
        base, step=lora.get('base_step'))
    assert base_step, f"no base restored from {lora['base_root']}"
  else:
    # A full save holds the base too; the base's values are overwritten by the restore below.
    base = FAMILIES[family][1](cfg, rngs=nnx.Rngs(params=0))
  model = qwix.apply_lora_to_model(base, provider, **base.get_model_input(),
                                   rngs=nnx.Rngs(12345))
  step, _ = manager.maybe_restore(model, step=job.get('step'),
                                  restore_only_lora_params=bool(lora.get('base_root')))
  assert step, f"nothing restored from {job['root']}"
  return model, step


def job_reference(job, out_dir):
  model, step = restored_model(job)
  logits = forward(model, job['tokens'])
  return {'step': step, 'model_class': type(model).__name__,
          **save_model(out_dir, job['id'], model, logits)}


def job_tunix_merge(job, out_dir):
  family = job['family']
  assert family in ('qwen3', 'llama3'), f'Tunix 0.1.7 has no such saver for {family}'
  model, step = restored_model(job)
  lora = job['lora']
  FAMILIES[family][2].save_lora_merged_model_as_safetensors(
      local_model_path=job['base_dir'], output_dir=job['out'], lora_model=model,
      rank=int(lora['rank']), alpha=float(lora['alpha']))
  return {'step': step, 'out': job['out'], 'files': sorted(os.listdir(job['out']))}


JOBS = {'load': job_load, 'reference': job_reference, 'tunix_merge': job_tunix_merge}


def main(argv: list[str]) -> int:
  import flax
  import tunix

  versions = {'tunix_file': tunix.__file__, 'jax': jax.__version__, 'flax': flax.__version__,
              'qwix_file': qwix.__file__,
              'flax_always_shard_variable': bool(flax.config.flax_always_shard_variable)}
  print(f'[tunix_client] imports took {IMPORT_SECONDS:.1f} s ({versions})', file=sys.stderr,
        flush=True)
  return serve_jobs.main(argv, JOBS, 'tunix_client', {'import_seconds': IMPORT_SECONDS, **versions})


if __name__ == '__main__':
  sys.exit(main(sys.argv[1:]))

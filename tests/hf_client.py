"""transformers + peft as clients of our Hugging Face exports: a worker run in a SUBPROCESS.

Not a test module and never imported by the test suite: it runs with the Hugging Face client
venv's own python (scripts/hf_venv.sh: Python 3.11, torch CPU, transformers, peft, safetensors)
and imports neither orbax_tunix nor jax. `tests/test_hf_clients.py` starts it as

    <hf venv python> tests/hf_client.py --serve --reply-fd N

It imports torch, transformers and peft once (a few seconds) and then runs named jobs, each with
the clients' own code (tests/serve_jobs.py: one JSON job per line on stdin, one result per line
on fd N; a job that raises gives ok=false with `error`, and the next job still runs).

Arrays go to `<out_dir>/<id>.npz`: 'logits' (float32, (B, T, V)), and for `peft` the merged
model's logits under 'merged_logits'. Logits are
computed on `tokens` (a (B, T) list of ints) with positions 0..T-1, a causal mask and no padding
(an all-ones attention mask), as tests/tunix_client.py computes Tunix's.

Jobs:
  load   dir, tokens: `AutoModelForCausalLM.from_pretrained(dir, dtype=torch.float32,
         attn_implementation='eager', output_loading_info=True)`. Returns `model_class`,
         `loading_info` (missing_keys, unexpected_keys, mismatched_keys, error_msgs, as lists of
         strings), `warnings` (the python warnings and transformers' WARNING logs while loading)
         and the logits. With router_reads_normed=true: Gemma 4's MoE routers fed what
         google-tunix 0.1.7's are (see `router_reads_normed`), `patched_routers` says how many.
         With auto=<transformers auto class>: loaded by that class instead (a multimodal model's
         AutoModelForImageTextToText; also for `peft`).
  peft   base, adapter, tokens: the base loaded as in `load`, then the adapter folder with what
         `PeftModel.from_pretrained` does (peft 0.21.2: the task type's PeftModel class on the
         base, then `load_adapter`), keeping the load result it drops (its missing keys are the
         adapter's own, `lora_` ones; its unexpected keys are the file's tensors no module took).
         Returns `peft_class`, `loading_info` of the base, `adapter_missing_keys`,
         `adapter_unexpected_keys`, `lora_modules` (the modules peft wrapped, by name),
         `adapter_config` (the PeftConfig as peft parsed it), the logits with the adapters live;
         then `merge_and_unload()`: its logits, and the merged model as `save_pretrained`
         writes it (the Hub's names) in `merged_dir`. router_reads_normed as for `load`.
         With as_vllm=true the adapter config is read as vLLM reads it (`VLLM_FIELDS`: its
         PEFTHelper keeps those fields alone, so one `lora_alpha / r` scales every module and
         `rank_pattern`/`alpha_pattern` are dropped).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
import warnings
from typing import Any

import serve_jobs  # tests/serve_jobs.py: this file's own folder is on sys.path

_T0 = time.time()

import numpy as np  # noqa: E402
import peft  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from peft import PeftConfig, PeftModel  # noqa: E402
from peft.auto import MODEL_TYPE_TO_PEFT_MODEL_MAPPING  # noqa: E402

IMPORT_SECONDS = time.time() - _T0
assert 'jax' not in sys.modules and 'orbax_tunix' not in sys.modules, 'the client must not see them'
torch.set_num_threads(1)  # Tiny models; the machine is shared.


class Capture(logging.Handler):
  """transformers' WARNING+ log records."""

  def __init__(self):
    super().__init__(logging.WARNING)
    self.messages: list[str] = []

  def emit(self, record):
    self.messages.append(f'{record.levelname}: {record.getMessage()}')


def load_model(path: str, auto: str = 'AutoModelForCausalLM'
               ) -> tuple[Any, dict[str, list[str]], list[str]]:
  """(model in float32, eval mode; its loading info as lists of strings; warnings), loaded by
  the transformers auto class `auto` (a multimodal model: AutoModelForImageTextToText)."""
  capture = Capture()
  log = logging.getLogger('transformers')
  log.addHandler(capture)
  try:
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter('always')
      model, info = getattr(transformers, auto).from_pretrained(
          path, dtype=torch.float32, attn_implementation='eager', output_loading_info=True)
  finally:
    log.removeHandler(capture)
  model.eval()
  info = {k: sorted(str(x) for x in v) for k, v in info.items()}
  return model, info, [*capture.messages, *(f'{w.category.__name__}: {w.message}' for w in caught)]


def logits(model, tokens) -> np.ndarray:
  ids = torch.tensor(tokens, dtype=torch.long)
  with torch.no_grad():
    out = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False)
  return out.logits.to(torch.float32).numpy()


def plain(value):
  """A value JSON can carry (peft's configs hold sets and enums)."""
  if isinstance(value, dict):
    return {str(k): plain(v) for k, v in value.items()}
  if isinstance(value, (list, tuple, set, frozenset)):
    items = [plain(v) for v in value]
    return sorted(items, key=str) if isinstance(value, (set, frozenset)) else items
  if value is None or isinstance(value, (bool, int, float, str)):
    return value
  return str(getattr(value, 'value', value))


def router_reads_normed(model) -> int:
  """Gemma 4's MoE router fed `pre_feedforward_layernorm_2(x)` instead of `x`, as google-tunix
  0.1.7's Gemma 4 computes it (its router reads `moe_pre_ffw_norm(x)`): a forward pre-hook on
  each layer's `router`. Returns how many routers it changed."""
  n = 0
  for layer in model.modules():
    router, norm = getattr(layer, 'router', None), getattr(layer, 'pre_feedforward_layernorm_2',
                                                           None)
    if router is not None and norm is not None:
      router.register_forward_pre_hook(lambda _, args, norm=norm: (norm(args[0]), *args[1:]))
      n += 1
  return n


def job_load(job, out_dir):
  model, info, caught = load_model(job['dir'], job.get('auto', 'AutoModelForCausalLM'))
  patched = router_reads_normed(model) if job.get('router_reads_normed') else 0
  npz = os.path.join(out_dir, f"{job['id']}.npz")
  np.savez(npz, logits=logits(model, job['tokens']))
  return {'model_class': type(model).__name__, 'loading_info': info, 'warnings': caught,
          'patched_routers': patched, 'npz': npz}


# What vLLM's PEFTHelper (vllm/lora/peft_helper.py) keeps of adapter_config.json (it drops
# every other field; its long-context `context_length` PEFT has not, and no export writes),
# and what PEFT needs to build the LoRA model from them.
VLLM_FIELDS = ('r', 'lora_alpha', 'target_modules', 'bias', 'modules_to_save', 'use_rslora',
               'use_dora')
PEFT_FIELDS = ('peft_type', 'task_type', 'base_model_name_or_path')


def vllm_config(adapter: str) -> PeftConfig:
  """The adapter's config with only the fields vLLM reads (and PEFT's type fields)."""
  with open(os.path.join(adapter, 'adapter_config.json')) as f:
    values = json.load(f)
  kept = {k: v for k, v in values.items() if k in VLLM_FIELDS + PEFT_FIELDS}
  return peft.LoraConfig(**{k: v for k, v in kept.items() if k != 'peft_type'})


def job_peft(job, out_dir):
  base, info, caught = load_model(job['base'], job.get('auto', 'AutoModelForCausalLM'))
  patched = router_reads_normed(base) if job.get('router_reads_normed') else 0
  config = (vllm_config(job['adapter']) if job.get('as_vllm')
            else PeftConfig.from_pretrained(job['adapter']))
  cls = MODEL_TYPE_TO_PEFT_MODEL_MAPPING.get(config.task_type, PeftModel)
  model = cls(base, config, 'default')
  result = model.load_adapter(job['adapter'], 'default')
  model.eval()
  lora_modules = sorted(name for name, m in model.named_modules()
                        if hasattr(m, 'lora_A') and 'default' in m.lora_A)
  live = logits(model, job['tokens'])
  merged = model.merge_and_unload()
  npz = os.path.join(out_dir, f"{job['id']}.npz")
  np.savez(npz, logits=live, merged_logits=logits(merged, job['tokens']))
  saved = os.path.join(out_dir, f"{job['id']}_merged")
  merged.save_pretrained(saved)
  return {'peft_class': cls.__name__, 'model_class': type(merged).__name__,
          'loading_info': info, 'warnings': caught,
          'adapter_missing_keys': sorted(result.missing_keys),
          'adapter_unexpected_keys': sorted(result.unexpected_keys),
          'lora_modules': lora_modules, 'adapter_config': plain(config.to_dict()),
          'patched_routers': patched, 'npz': npz, 'merged_dir': saved}


JOBS = {'load': job_load, 'peft': job_peft}


def main(argv: list[str]) -> int:
  versions = {'torch': torch.__version__, 'transformers': transformers.__version__,
              'peft': peft.__version__, 'python': sys.version.split()[0]}
  print(f'[hf_client] imports took {IMPORT_SECONDS:.1f} s ({versions})', file=sys.stderr,
        flush=True)
  return serve_jobs.main(argv, JOBS, 'hf_client', {'import_seconds': IMPORT_SECONDS, **versions})


if __name__ == '__main__':
  sys.exit(main(sys.argv[1:]))

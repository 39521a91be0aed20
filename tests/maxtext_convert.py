"""MaxText 0.2.5's own conversion to Hugging Face, as `to_huggingface.main` runs it, for the
MaxText client (tests/maxtext_client.py): its calls in its order, with the HF config fitted to a
tiny model, without the Hub and without writing; runs in the MaxText venv."""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

# MaxText's Qwen3-VL entries are bare PreTrainedConfigs holding their text_config and
# vision_config as dicts: _validate_or_update_architecture reads them with getattr and fits
# nothing. `fit_raw` fits them as it fits the others: the text model's dims from the tiny
# MaxText config, the vision tower's from its `*_for_vit` keys, mrope's sections.
RAW_TEXT_FIELDS = (('hidden_size', 'emb_dim'), ('intermediate_size', 'mlp_dim'),
                   ('num_hidden_layers', 'num_decoder_layers'), ('vocab_size', 'vocab_size'),
                   ('moe_intermediate_size', 'moe_mlp_dim'), ('num_experts', 'num_experts'),
                   ('num_local_experts', 'num_experts'),
                   ('num_experts_per_tok', 'num_experts_per_tok'))
RAW_VISION_FIELDS = (('depth', 'num_hidden_layers_for_vit'), ('hidden_size', 'hidden_size_for_vit'),
                     ('intermediate_size', 'intermediate_size_for_vit'),
                     ('num_heads', 'num_attention_heads_for_vit'),
                     ('out_hidden_size', 'out_hidden_size_for_vit'),
                     ('num_position_embeddings', 'num_position_embeddings_for_vit'),
                     ('patch_size', 'patch_size_for_vit'),
                     ('spatial_merge_size', 'spatial_merge_size_for_vit'),
                     ('temporal_patch_size', 'temporal_patch_size_for_vit'),
                     ('deepstack_visual_indexes', 'deepstack_visual_indexes_for_vit'),
                     ('in_channels', 'num_channels_for_vit'))


def fit_raw(hf_dict: dict, cfg) -> None:
  """Fits a raw config's `text_config` and `vision_config` (dicts) to the tiny model."""
  text, vision = hf_dict.get('text_config') or {}, hf_dict.get('vision_config') or {}
  for fields, into in ((RAW_TEXT_FIELDS, text), (RAW_VISION_FIELDS, vision)):
    for hf_attr, mt_attr in fields:
      value = getattr(cfg, mt_attr, None)
      if hf_attr in into and value is not None:
        into[hf_attr] = list(value) if isinstance(value, (list, tuple)) else value
  rope = text.get('rope_parameters')
  if isinstance(rope, dict) and 'mrope_section' in rope:
    rope['mrope_section'] = list(cfg.mrope_section)


# What _validate_or_update_architecture also leaves at the full model's values in the hybrid
# decoders' configs (Qwen3-Next, Qwen3.5): the linear attention's and the shared expert's
# sizes (HF attribute, MaxText attribute), fitted as the heads are.
HYBRID_FITTED = (('linear_num_key_heads', 'gdn_num_key_heads'),
                 ('linear_num_value_heads', 'gdn_num_value_heads'),
                 ('linear_key_head_dim', 'gdn_key_head_dim'),
                 ('linear_value_head_dim', 'gdn_value_head_dim'),
                 ('linear_conv_kernel_dim', 'gdn_conv_kernel_dim'),
                 ('shared_expert_intermediate_size', 'moe_mlp_dim'))


def maxtext_to_hf(cfg, shape_map=None, fit_global_heads: bool = False) -> tuple[dict[str, np.ndarray] | None, dict, str | None]:
  """MaxText 0.2.5's own to_huggingface.main, up to the dict it hands save_model_files.

  The same calls in the same order (load_orbax_checkpoint, HF_MODEL_CONFIGS fitted with
  _validate_or_update_architecture(override=True), _get_model_mappings,
  detect_and_extract_checkpoint, validate_and_filter_param_map_keys, the vision filter,
  _transform_weights_to_full_model), without the Hub (no tokenizer) and without writing.
  `cfg`: the model's pyconfig, its `load_parameters_path` the step's params item.
  Returns the HF weights by name (None when MaxText's converter fails on the model), the fitted
  HF config (a dict, as config.json holds it), and the converter's error or None.
  `shape_map`: (fitted HF config dict) -> the HF shape map the converter uses instead of its
  own `HF_SHAPE` entry (`repaired_shape_map`). `fit_global_heads`: gemma4's global head dim
  and key/value heads fitted too (transformers 5 keeps them in `per_layer_config` only, which
  is nulled below, so MaxText's shape map would read the local ones).
  """
  import copy  # noqa: PLC0415

  from maxtext.checkpoint_conversion import to_huggingface as th  # noqa: PLC0415
  from maxtext.checkpoint_conversion.utils import utils as conv  # noqa: PLC0415
  from maxtext.checkpoint_conversion.utils.hf_model_configs import HF_MODEL_CONFIGS  # noqa: PLC0415

  checkpoint = conv.load_orbax_checkpoint(cfg)
  hf_config = copy.deepcopy(HF_MODEL_CONFIGS[cfg.model_name])
  th._validate_or_update_architecture(hf_config, cfg, override=True)
  if getattr(cfg, 'rope_type', None) == 'yarn':  # as to_huggingface.main does next
    th._apply_yarn_rope_config(hf_config, cfg)
  # What _validate_or_update_architecture leaves at the full model's values and a tiny model
  # needs, fitted in the dict the mappings are built from and config.json is written from: the
  # per-layer attention kinds (truncated to the tiny model's layers: the pattern starts at layer
  # 0), the sliding window, and the head attributes gemma4's text config answers only per layer
  # (its getattr raises, so _validate_or_update_architecture skips them).
  hf_dict = hf_config.to_dict()
  text = hf_dict.get('text_config') or hf_dict
  for hf_attr, mt_attr in (('num_attention_heads', 'num_query_heads'),
                           ('num_key_value_heads', 'num_kv_heads'), ('head_dim', 'head_dim'),
                           ('global_head_dim', 'global_head_dim'),
                           ('num_global_key_value_heads', 'global_num_kv_heads'),
                           *HYBRID_FITTED):
    value = getattr(cfg, mt_attr, None)
    if value and value > 0 and hf_attr in text:
      text[hf_attr] = value
  if text.get('per_layer_config'):  # gemma4: the full model's heads per layer, derived again
    text['per_layer_config'] = None  # from the fitted attributes above when None
    if fit_global_heads:
      for hf_attr, mt_attr in (('global_head_dim', 'global_head_dim'),
                               ('num_global_key_value_heads', 'global_num_kv_heads')):
        text[hf_attr] = getattr(cfg, mt_attr)
  if text.get('layer_types'):  # (gemma2: two HF layers a MaxText layer, as fitted above)
    text['layer_types'] = list(text['layer_types'])[:text.get('num_hidden_layers')
                                                     or cfg.num_decoder_layers]
  if text.get('sliding_window') and cfg.sliding_window_size:
    text['sliding_window'] = cfg.sliding_window_size
  if isinstance(getattr(hf_config, 'text_config', None), dict):
    fit_raw(hf_dict, cfg)
  if 'first_k_dense_replace' in text:  # DeepSeek's dense layers (its mappings read it), its
    text['first_k_dense_replace'] = cfg.first_num_dense_layers  # query's width (its shapes)
    text['qk_head_dim'] = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    text['head_dim'] = cfg.qk_rope_head_dim  # and the rotary width (transformers' rope reads it)
  own = th.HF_SHAPE.get(cfg.model_name)  # None: MaxText has no shape map (its error, below)
  try:
    if shape_map is not None:
      th.HF_SHAPE[cfg.model_name] = shape_map
    maps = th._get_model_mappings(cfg.model_name, cfg.scan_layers, hf_dict, cfg)
    state = conv.detect_and_extract_checkpoint(checkpoint)
    keys = conv.validate_and_filter_param_map_keys(maps['param_mapping'], set(state))
    if not cfg.use_multimodal:  # to_huggingface.main's filter: the text model alone
      keys = [k for k in keys
              if 'vision_encoder' not in (k if isinstance(k, str) else ' '.join(k))]
    # Its loop calls gc.collect() after every weight (~1 s each in a process holding MaxText):
    # that frees memory and changes no value, so it is skipped here to keep the suite short.
    collect, th.gc.collect = th.gc.collect, lambda *a: 0
    try:
      out = th._transform_weights_to_full_model(cfg, keys, state, maps['param_mapping'],
                                                maps['hook_fn_mapping'], maps['shape_mapping'])
    finally:
      th.gc.collect = collect
  except Exception as e:  # noqa: BLE001 - MaxText's converter cannot take this model: said
    return None, hf_dict, f'{type(e).__name__}: {e}'.splitlines()[0]
  finally:
    if own is None:
      th.HF_SHAPE.pop(cfg.model_name, None)
    else:
      th.HF_SHAPE[cfg.model_name] = own
  return {k: np.asarray(v) for k, v in out.items()}, hf_dict, None


def repaired_shape_map(model_name: str, cycle: int) -> tuple[dict[str, Any], Any]:
  """What MaxText 0.2.5's HF shape map of `model_name` does with a fitted HF config, and the
  map its own body builds when given what it lacks.

  Qwen3-Next's (`QWEN3_NEXT_HF_WEIGHTS_TO_SHAPE`) reads `full_attention_interval`, which
  transformers 5's Qwen3NextConfig no longer keeps (it turns it into `layer_types`), and
  ends without `return`. Returns ({'as_given': the call's error or what it returned,
  'with_interval': what it returns given `full_attention_interval` = `cycle`, 'built': how
  many shapes its local `mapping` then holds}, a shape map returning that `mapping`,
  captured as the function returns: MaxText's own shapes, for `maxtext_to_hf`).
  """
  from maxtext.checkpoint_conversion.utils.hf_shape import HF_SHAPE  # noqa: PLC0415

  fn = HF_SHAPE[model_name]

  def built(hf_dict):
    found = {}

    def grab(frame, event, arg):
      if event == 'return' and frame.f_code is fn.__code__:
        found.update(frame.f_locals.get('mapping') or {})

    given = {**hf_dict, 'full_attention_interval': cycle}
    sys.setprofile(grab)
    try:
      returned = fn(given)
    finally:
      sys.setprofile(None)
    return returned, found

  def shape_map(hf_dict):
    return built(hf_dict)[1]

  def evidence(hf_dict):
    try:
      as_given = repr(fn(hf_dict))
    except Exception as e:  # noqa: BLE001 - the point: what MaxText's map does
      as_given = f'{type(e).__name__}: {e}'
    returned, found = built(hf_dict)
    return {'as_given': as_given, 'with_interval': repr(returned), 'built': len(found)}

  return evidence, shape_map

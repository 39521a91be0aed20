"""Exporting MaxText models (Tunix runs of one, MaxText's own steps) to Hugging Face safetensors.

The checkpoints are written here with plain Orbax in MaxText 0.2.5's exact parameter trees
(printed from `nnx.state` of tiny models MaxText builds: see `orbax_tunix/mapping/huggingface.py`'s
docstring): as a Tunix run (`model_params/base/<path>/value`, with RNG leaves and an AQT leaf
that are no weights) and as a MaxText step (`items/params/params/<path>`), scanned
(`param_scan_axis` 1), unscanned, and gemma3's scanned blocks of six plus a remainder.

Expected tensors come from this module's own numpy formulas per Hugging Face name (reshape,
transpose, `- 1` for gemma norms, `/ bfloat16(sqrt(hidden))` for gemma3's embedding, a row
slice for a padded vocabulary), applied to the per-layer arrays the checkpoints were built
from; the safetensors files are parsed here (8-byte length, JSON header, raw bytes). The
checks against MaxText's own conversion functions and Tunix's loaders are in the client tests.
"""

from __future__ import annotations

import json
import math
import pathlib
import subprocess
import sys

import jax
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
import pytest

import orbax_tunix
from tests.clients import subprocess_env

ROOT = pathlib.Path(__file__).resolve().parent.parent
D, N, K, H, F, V = 16, 4, 2, 8, 48, 64
ST_DTYPES = {'F32': np.dtype(np.float32), 'BF16': np.dtype(ml_dtypes.bfloat16)}

# --------------------------------------------------------------------------- #
# MaxText 0.2.5's per-layer weights (names and shapes as nnx.state prints them)
# --------------------------------------------------------------------------- #
LLAMA_LAYER = {
    'self_attention/query/kernel': (D, N, H), 'self_attention/key/kernel': (D, K, H),
    'self_attention/value/kernel': (D, K, H), 'self_attention/out/kernel': (N, H, D),
    'mlp/wi_0/kernel': (D, F), 'mlp/wi_1/kernel': (D, F), 'mlp/wo/kernel': (F, D),
    'pre_self_attention_layer_norm/scale': (D,), 'post_self_attention_layer_norm/scale': (D,),
}
QWEN3_LAYER = {**LLAMA_LAYER, 'self_attention/query_norm/scale': (H,),
               'self_attention/key_norm/scale': (H,)}
GEMMA3_LAYER = {
    **{k: v for k, v in LLAMA_LAYER.items() if 'layer_norm' not in k},
    'self_attention/query_norm/scale': (H,), 'self_attention/key_norm/scale': (H,),
    'pre_self_attention_norm/scale': (D,), 'post_self_attention_norm/scale': (D,),
    'pre_ffw_norm/scale': (D,), 'post_ffw_norm/scale': (D,),
}
E, FE = 4, 24  # qwen3 MoE: experts, expert MLP width
QWEN3_MOE_LAYER = {
    **{k: v for k, v in QWEN3_LAYER.items() if not k.startswith('mlp/')},
    'moe_block/gate/kernel': (D, E), 'moe_block/wi_0': (E, D, FE), 'moe_block/wi_1': (E, D, FE),
    'moe_block/wo': (E, FE, D),
}
GEMMA4_LOCAL = {**GEMMA3_LAYER, 'layer_scalar': (1,)}
NG, KG, HG = N, 3, 12  # gemma4's global layers: their own kv heads and head_dim, no value
GEMMA4_GLOBAL = {
    **{k: v for k, v in GEMMA4_LOCAL.items() if not k.startswith('self_attention/')},
    'self_attention/query/kernel': (D, NG, HG), 'self_attention/key/kernel': (D, KG, HG),
    'self_attention/out/kernel': (NG, HG, D), 'self_attention/query_norm/scale': (HG,),
    'self_attention/key_norm/scale': (HG,),
}
MODELS = {  # model -> (layer number -> its weights, layers, untied lm_head)
    'llama3': (lambda i: LLAMA_LAYER, 3, True),
    'qwen3': (lambda i: QWEN3_LAYER, 3, True),
    'qwen3_tied': (lambda i: QWEN3_LAYER, 2, False),
    'gemma3': (lambda i: GEMMA3_LAYER, 8, False),  # one block of six, a remainder of two
    'gemma4': (lambda i: GEMMA4_GLOBAL if i % 6 == 5 else GEMMA4_LOCAL, 8, False),
    'qwen3_moe': (lambda i: QWEN3_MOE_LAYER, 2, True),
}


def model_weights(model: str, seed: int = 0, models=MODELS) -> tuple[dict, dict]:
  """(the model's weights outside the layers, [per-layer weights]), random, norms near 1;
  `models[model]` = (layer number -> its weights, or one layer's for all, layers, untied)."""
  shapes, n, untied = models[model]
  layer = shapes if callable(shapes) else lambda _: shapes  # noqa: E731 - one for every layer
  rng = np.random.default_rng(seed)

  def w(name, shape):
    x = rng.normal(size=shape).astype(np.float32)
    return 1 + 0.1 * x if name.endswith('scale') else x

  top = {'token_embedder/embedding': w('e', (V, D)), 'decoder/decoder_norm/scale': w('scale', (D,))}
  if untied:
    top['decoder/logits_dense/kernel'] = w('k', (D, V))
  layers = [{k: w(k, s) for k, s in layer(i).items()} for i in range(n)]
  return top, layers


def maxtext_tree(model: str, form: str, seed: int = 0) -> dict[str, np.ndarray]:
  """MaxText's flat weight paths in `form` ('unscanned', 'scanned': layers on axis 1)."""
  top, layers = model_weights(model, seed)
  flat = dict(top)
  if form == 'unscanned':
    for i, weights in enumerate(layers):
      flat.update({f'decoder/layers_{i}/{k}': v for k, v in weights.items()})
  elif model == 'gemma4':  # per block of six: five local (axis 2) and a global layer
    blocks = len(layers) // 6
    for k in layers[0]:
      flat[f'decoder/scanned_blocks/local_layers/{k}'] = np.stack(
          [np.stack([layers[6 * b + j][k] for j in range(5)], axis=1) for b in range(blocks)],
          axis=1)
    for k in layers[5]:
      flat[f'decoder/scanned_blocks/global_layer/{k}'] = np.stack(
          [layers[6 * b + 5][k] for b in range(blocks)], axis=1)
    for k in layers[0]:
      flat[f'decoder/layers_remainder/local_layers/{k}'] = np.stack(
          [w[k] for w in layers[6 * blocks:]], axis=1)
  elif model == 'gemma3':  # blocks of six on axis 1, the rest unscanned
    blocks = len(layers) // 6
    for j in range(6):
      for k in layers[0]:
        flat[f'decoder/layers/layers_{j}/{k}'] = np.stack(
            [layers[6 * b + j][k] for b in range(blocks)], axis=1)
    for r, weights in enumerate(layers[6 * blocks:]):
      flat.update({f'decoder/layers_remainder/layers_{r}/{k}': v for k, v in weights.items()})
  else:
    for k in layers[0]:
      flat[f'decoder/layers/{k}'] = np.stack([w[k] for w in layers], axis=1)
  return flat


def nest(flat: dict[str, object]) -> dict:
  tree: dict = {}
  for path, value in flat.items():
    *parents, last = path.split('/')
    node = tree
    for key in parents:
      node = node.setdefault(key, {})
    node[last] = value
  return tree


def _save_args(tree: dict, per_layer: bool) -> dict | None:
  """Orbax's save args: stacked weights (layers on axis 1) stored a chunk per layer
  (`chunk_byte_size` of one layer, split on that axis first) and the large 2-d ones
  in eighths (as a sharded save stores them), or None: one chunk each."""
  if not per_layer:
    return None

  def args(node):
    if isinstance(node, dict):
      return {k: args(v) for k, v in node.items()}
    if isinstance(node, list):
      return [args(v) for v in node]
    if isinstance(node, np.ndarray) and node.ndim >= 3:
      return ocp.SaveArgs(chunk_byte_size=node.nbytes // node.shape[1], shard_axes=(1,))
    if isinstance(node, np.ndarray) and node.ndim == 2 and node.nbytes >= 4096:
      return ocp.SaveArgs(chunk_byte_size=node.nbytes // 8)  # The embedding and lm_head.
    return ocp.SaveArgs()
  return args(tree)


def save_tunix_run(root: pathlib.Path, flat: dict[str, np.ndarray], step: int = 2,
                   per_layer_chunks: bool = False, extra: dict | None = None) -> pathlib.Path:
  """A Tunix run of a MaxText model: `model_params/base/<path>/value`, RNG and AQT leaves too
  (and `extra` leaves, by their full paths)."""
  leaves = {f'base/{p}/value': v for p, v in flat.items()}
  leaves.update(extra or {})
  leaves['base/decoder/rngs/params/count/value'] = np.uint32(3)
  leaves['base/decoder/rngs/params/key/value'] = np.array([0, 7], np.uint32)
  leaves['base/decoder/rngs/dropout/count/value'] = np.uint32(1)
  leaves['base/decoder/rngs/dropout/key/value'] = np.array([1, 5], np.uint32)
  leaves['base/decoder/logits_dense/aqt/frozen_scale/value'] = np.ones((1, V), np.float32)
  step_dir = root / str(step)
  tree = nest(leaves)
  with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckptr:
    ckptr.save(step_dir, args=ocp.args.Composite(model_params=ocp.args.PyTreeSave(
        tree, save_args=_save_args(tree, per_layer_chunks))))
  return root


def save_maxtext_step(root: pathlib.Path, flat: dict[str, np.ndarray],
                      step: int = 5, per_layer_chunks: bool = False) -> pathlib.Path:
  """MaxText's own step: `items/params/params/<path>`, with a step counter and an optimizer."""
  tree = {'params': {'params': nest(flat)}, 'step': np.int64(step),
          'opt_state': [{'count': np.int32(step),
                         'mu': nest({p: np.zeros_like(v) for p, v in flat.items()})}]}
  save_args = _save_args(tree, per_layer_chunks)
  step_dir = root / str(step)
  with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckptr:
    ckptr.save(step_dir, args=ocp.args.Composite(items=ocp.args.PyTreeSave(
        tree, save_args=save_args)))
  return root


# --------------------------------------------------------------------------- #
# The Hugging Face tensors, by hand
# --------------------------------------------------------------------------- #
def _in(w):  # (D, X, H) -> (X*H, D)
  return w.reshape(w.shape[0], -1).T


def _out(w):  # (N, H, D) -> (D, N*H)
  return w.reshape(-1, w.shape[-1]).T


def _halves(w):  # interleaved rotary pairs on the last axis -> evens then odds
  return np.concatenate([w[..., 0::2], w[..., 1::2]], axis=-1)


def _llama_q(w):  # MaxText's llama stores q / sqrt(head_dim): times it in float32, rounded once
  return _in(_halves((w.astype(np.float32) * np.float32(math.sqrt(w.shape[-1]))).astype(w.dtype)))


def expected(model: str, vocab: int = V, seed: int = 0) -> dict[str, np.ndarray]:
  top, layers = model_weights(model, seed)
  gemma = model.startswith('gemma')
  # MaxText's gemma3 norms are 1 + w (gemma4's as Hugging Face's).
  norm = (lambda x: x - np.float32(1)) if model == 'gemma3' else (lambda x: x)
  embed = top['token_embedder/embedding'][:vocab]
  if model == 'gemma3':  # stored times sqrt(hidden); MaxText's converter divides by it in bf16
    embed = embed / np.float32(ml_dtypes.bfloat16(math.sqrt(D)))
  if model == 'gemma4':  # ... and gemma4's in float32
    embed = embed / np.float32(math.sqrt(D))
  out = {'model.embed_tokens.weight': embed,
         'model.norm.weight': norm(top['decoder/decoder_norm/scale'])}
  if 'decoder/logits_dense/kernel' in top:
    out['lm_head.weight'] = top['decoder/logits_dense/kernel'].T[:vocab]
  for i, w in enumerate(layers):
    p = f'model.layers.{i}'
    if model == 'llama3':  # MaxText's llama: q pre-scaled, q/k rotary pairs interleaved
      out[f'{p}.self_attn.q_proj.weight'] = _llama_q(w['self_attention/query/kernel'])
      out[f'{p}.self_attn.k_proj.weight'] = _in(_halves(w['self_attention/key/kernel']))
    else:
      out[f'{p}.self_attn.q_proj.weight'] = _in(w['self_attention/query/kernel'])
      out[f'{p}.self_attn.k_proj.weight'] = _in(w['self_attention/key/kernel'])
    if 'self_attention/value/kernel' in w:  # gemma4's global layers have none
      out[f'{p}.self_attn.v_proj.weight'] = _in(w['self_attention/value/kernel'])
    out[f'{p}.self_attn.o_proj.weight'] = _out(w['self_attention/out/kernel'])
    if 'moe_block/wi_0' in w:
      out[f'{p}.mlp.gate.weight'] = w['moe_block/gate/kernel'].T
      for e in range(E):
        out[f'{p}.mlp.experts.{e}.gate_proj.weight'] = w['moe_block/wi_0'][e].T
        out[f'{p}.mlp.experts.{e}.up_proj.weight'] = w['moe_block/wi_1'][e].T
        out[f'{p}.mlp.experts.{e}.down_proj.weight'] = w['moe_block/wo'][e].T
    else:
      out[f'{p}.mlp.gate_proj.weight'] = w['mlp/wi_0/kernel'].T
      out[f'{p}.mlp.up_proj.weight'] = w['mlp/wi_1/kernel'].T
      out[f'{p}.mlp.down_proj.weight'] = w['mlp/wo/kernel'].T
    if 'layer_scalar' in w:
      out[f'{p}.layer_scalar'] = w['layer_scalar']
    if 'self_attention/query_norm/scale' in w:
      out[f'{p}.self_attn.q_norm.weight'] = norm(w['self_attention/query_norm/scale'])
      out[f'{p}.self_attn.k_norm.weight'] = norm(w['self_attention/key_norm/scale'])
    if gemma:
      out[f'{p}.input_layernorm.weight'] = norm(w['pre_self_attention_norm/scale'])
      out[f'{p}.post_attention_layernorm.weight'] = norm(w['post_self_attention_norm/scale'])
      out[f'{p}.pre_feedforward_layernorm.weight'] = norm(w['pre_ffw_norm/scale'])
      out[f'{p}.post_feedforward_layernorm.weight'] = norm(w['post_ffw_norm/scale'])
    else:
      out[f'{p}.input_layernorm.weight'] = w['pre_self_attention_layer_norm/scale']
      out[f'{p}.post_attention_layernorm.weight'] = w['post_self_attention_layer_norm/scale']
  return out


def read_safetensors(path: pathlib.Path) -> dict[str, np.ndarray]:
  data = path.read_bytes()
  n = int.from_bytes(data[:8], 'little')
  header = json.loads(data[8:8 + n])
  header.pop('__metadata__', None)
  body = data[8 + n:]
  out = {}
  for name, e in header.items():
    start, end = e['data_offsets']
    out[name] = np.frombuffer(body[start:end], ST_DTYPES[e['dtype']]).reshape(e['shape'])
  return out


def family(model: str) -> str:
  return model.removesuffix('_tied')


def hf_config(folder: pathlib.Path, model: str, **fields) -> pathlib.Path:
  layer, n, untied = MODELS[model]
  config = {'vocab_size': V, 'hidden_size': D, 'num_hidden_layers': n,
            'num_attention_heads': N, 'num_key_value_heads': K, 'head_dim': H,
            'intermediate_size': F, **fields}
  if family(model) != 'gemma3':
    config['tie_word_embeddings'] = not untied
  folder.mkdir(parents=True)
  (folder / 'config.json').write_text(json.dumps(config))
  return folder


# --------------------------------------------------------------------------- #
# Tests
# --------------------------------------------------------------------------- #
ARCHITECTURES = {'llama3': 'LlamaForCausalLM', 'qwen3': 'Qwen3ForCausalLM',
                 'gemma3': 'Gemma3ForCausalLM', 'gemma4': 'Gemma4ForCausalLM',
                 'qwen3_moe': 'Qwen3MoeForCausalLM'}
CASES = [(m, form, kind) for m in MODELS for form in ('scanned', 'unscanned')
         for kind in ('tunix', 'maxtext')]


@pytest.mark.parametrize('model,form,kind', CASES)
def test_export_matches_the_hf_layout(tmp_path, model, form, kind):
  save = save_tunix_run if kind == 'tunix' else save_maxtext_step
  src = save(tmp_path / 'run', maxtext_tree(model, form))
  plan = orbax_tunix.tools.export.plan_export(src, tmp_path / 'out', model=family(model))
  notes = '\n'.join(plan.notes)
  layers = MODELS[model][1]
  assert f'weights: MaxText model ({form}, {layers} layers)' in notes
  # The text model's class: MaxText's decoders have no vision tower.
  assert plan.architecture == ARCHITECTURES[family(model)]
  if kind == 'tunix':
    assert 'left out 4 RNG state leaves' in notes
    assert 'left out 1 AQT quantization leaves' in notes
  orbax_tunix.tools.export.run_export(plan)
  got = read_safetensors(tmp_path / 'out' / 'model.safetensors')
  want = expected(model)
  assert sorted(got) == sorted(want)
  for name, value in want.items():
    assert got[name].dtype == np.float32, name
    np.testing.assert_array_equal(got[name], value, err_msg=name)


@pytest.mark.parametrize('chunks', ['per_layer', 'whole'])
@pytest.mark.parametrize('kind', ['tunix', 'maxtext'])
@pytest.mark.parametrize('model', ['llama3', 'qwen3_tied', 'gemma3', 'qwen3_moe'])
def test_a_scanned_export_reads_each_stored_chunk_once(tmp_path, model, kind, chunks):
  """A stacked weight stored a chunk per layer is read a layer at a time (not the stack
  per batch); one stored as one chunk is read once, whole (a store decodes whole chunks:
  a layer of it would decode it all, once per layer). Either way, what the export reads
  adds up to the weights' bytes once."""
  save = save_tunix_run if kind == 'tunix' else save_maxtext_step
  flat = maxtext_tree(model, 'scanned')
  plan = orbax_tunix.tools.export.plan_export(
      save(tmp_path / 'run', flat, per_layer_chunks=chunks == 'per_layer'), tmp_path / 'out',
      model=family(model))
  reads = {i.key: i for o in plan.outputs for i in o.inputs}
  assert sum(i.nbytes for i in reads.values()) == sum(v.nbytes for v in flat.values())
  stacked = [i for i in reads.values()  # (gemma3's remainder layers are not stacked)
             if len(i.leaf.shape) >= 3 and 'layers_remainder' not in i.leaf.path]
  if chunks == 'whole':
    assert stacked and all(not i.takes for i in stacked)
  else:
    top, layers = model_weights(model)
    largest = max(v.nbytes for v in [*top.values(), *layers[0].values()])
    # (gemma3's one block of six has one entry on the stacked axis: that is the layer.)
    assert all(i.takes or i.leaf.shape[1] == 1 for i in stacked)
    assert max(i.nbytes for i in reads.values()) <= largest
    if model == 'qwen3_moe':  # A layer's experts are one chunk: read once, split after.
      experts = [i for i in stacked if i.leaf.path[-1] in ('wi_0', 'wi_1', 'wo')]
      assert experts and all(len(i.takes) == 1 for i in experts)
  orbax_tunix.tools.export.run_export(plan)
  got = read_safetensors(tmp_path / 'out' / 'model.safetensors')
  for name, value in expected(model).items():
    np.testing.assert_array_equal(got[name], value, err_msg=name)


def test_experts_stored_a_chunk_each_are_read_once_each(tmp_path):
  """A MoE step saved sharded on the expert axis stores each expert's layers in one chunk: an
  expert is read once, whole, its layers then taken from it (a layer of it read per output
  would decode the chunk once per layer)."""
  flat = maxtext_tree('qwen3_moe', 'scanned')
  tree = {'params': {'params': nest(flat)}}

  def args(path, value):
    if path[-1] in ('wi_0', 'wi_1', 'wo'):  # (E, L, ...): a chunk per expert
      return ocp.SaveArgs(chunk_byte_size=value.nbytes // value.shape[0], shard_axes=(0,))
    return ocp.SaveArgs()

  save_args = jax.tree_util.tree_map_with_path(
      lambda p, v: args(tuple(k.key for k in p), v), tree)
  with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckptr:
    ckptr.save(tmp_path / 'run' / '5', args=ocp.args.Composite(items=ocp.args.PyTreeSave(
        tree, save_args=save_args)))
  plan = orbax_tunix.tools.export.plan_export(tmp_path / 'run', tmp_path / 'out',
                                              model='qwen3_moe')
  reads = {i.key: i for o in plan.outputs for i in o.inputs}
  assert sum(i.nbytes for i in reads.values()) == sum(v.nbytes for v in flat.values())
  experts = [i for i in reads.values() if i.leaf.path[-1] in ('wi_0', 'wi_1', 'wo')]
  assert sorted(i.takes for i in experts) == sorted([((0, e),) for e in range(E)] * 3)
  orbax_tunix.tools.export.run_export(plan)
  got = read_safetensors(tmp_path / 'out' / 'model.safetensors')
  want = expected('qwen3_moe')
  assert sorted(got) == sorted(want)
  for name, value in want.items():
    np.testing.assert_array_equal(got[name], value, err_msg=name)


@pytest.mark.parametrize('model', sorted(MODELS))
def test_a_tensor_larger_than_a_batch_is_made_in_blocks_of_rows(tmp_path, model):
  """A budget smaller than the embedding (and lm_head, vocabulary cut, gemma's division):
  they are read and written a block of rows at a time, and the files are the same."""
  src = save_maxtext_step(tmp_path / 'run', maxtext_tree(model, 'scanned', seed=3),
                          per_layer_chunks=True)
  config = hf_config(tmp_path / 'hf', model, vocab_size=V - 5)
  plan = orbax_tunix.tools.export.plan_export(src, tmp_path / 'out', model=family(model),
                                        memory_budget=20_000, hf_config=config)
  embed = next(o for o in plan.outputs if o.path == ('model.embed_tokens.weight',))
  blocks = orbax_tunix.mapping.outputs.row_blocks(embed, plan.batch_bytes)
  assert len(blocks) > 1 and [b.rows for b in blocks][-1][1] == V - 5
  assert max(b.nbytes for b in blocks) <= plan.batch_bytes
  orbax_tunix.tools.export.run_export(plan)
  got = read_safetensors(tmp_path / 'out' / 'model.safetensors')
  want = expected(model, vocab=V - 5, seed=3)
  assert sorted(got) == sorted(want)
  for name, value in want.items():
    np.testing.assert_array_equal(got[name], value, err_msg=name)


@pytest.mark.parametrize('model', ['qwen3', 'gemma3'])
def test_bfloat16_export_rounds_once_after_the_arithmetic(tmp_path, model):
  src = save_maxtext_step(tmp_path / 'run', maxtext_tree(model, 'scanned'))
  orbax_tunix.export_to_hf(src, tmp_path / 'out', model=family(model), dtype='bfloat16')
  got = read_safetensors(tmp_path / 'out' / 'model.safetensors')
  for name, value in expected(model).items():
    assert got[name].dtype == ml_dtypes.bfloat16, name
    # From the float32 result: a gemma norm near 1 keeps its small part (1 + w cast to
    # bfloat16 first, then - 1, would lose it).
    np.testing.assert_array_equal(got[name], value.astype(ml_dtypes.bfloat16), err_msg=name)


@pytest.mark.parametrize('model', ['qwen3', 'gemma3'])
def test_padded_vocabulary_is_cut_to_the_config(tmp_path, model):
  src = save_tunix_run(tmp_path / 'run', maxtext_tree(model, 'unscanned'))
  config = hf_config(tmp_path / 'hf', model, vocab_size=60)
  plan = orbax_tunix.tools.export.plan_export(src, tmp_path / 'out', model=family(model),
                                        hf_config=config)
  assert any('vocabulary padding cut, 64 -> 60' in n for n in plan.notes), plan.notes
  orbax_tunix.tools.export.run_export(plan)
  got = read_safetensors(tmp_path / 'out' / 'model.safetensors')
  want = expected(model, vocab=60)
  assert got['model.embed_tokens.weight'].shape == (60, D)
  for name, value in want.items():
    np.testing.assert_array_equal(got[name], value, err_msg=name)


def test_llama2_fixtures_export_as_llama3(tmp_path):
  """The committed Tunix runs of MaxText's own llama2 (LlamaForCausalLM's names too)."""
  data = ROOT / 'tests' / 'data' / 'maxtext'
  outs = {}
  for name in ('tunix_llama2_scan', 'tunix_llama2_unscan'):
    orbax_tunix.export_to_hf(data / name, tmp_path / name, model='llama3')
    outs[name] = read_safetensors(tmp_path / name / 'model.safetensors')
  raw = ocp.PyTreeCheckpointHandler().restore(data / 'tunix_llama2_unscan' / '2' / 'model_params')
  base = raw['base']
  got = outs['tunix_llama2_unscan']
  np.testing.assert_array_equal(got['model.embed_tokens.weight'],
                                base['token_embedder']['embedding']['value'])
  np.testing.assert_array_equal(got['lm_head.weight'],
                                np.asarray(base['decoder']['logits_dense']['kernel']['value']).T)
  attn = base['decoder']['layers_1']['self_attention']
  np.testing.assert_array_equal(got['model.layers.1.self_attn.q_proj.weight'],
                                _llama_q(np.asarray(attn['query']['kernel']['value'])))
  np.testing.assert_array_equal(got['model.layers.1.self_attn.k_proj.weight'],
                                _in(_halves(np.asarray(attn['key']['kernel']['value']))))
  np.testing.assert_array_equal(got['model.layers.1.self_attn.o_proj.weight'],
                                _out(np.asarray(attn['out']['kernel']['value'])))
  assert sorted(outs['tunix_llama2_scan']) == sorted(got)
  assert len(got) == 3 + 3 * 9


def run_cli(*argv: str) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, '-m', 'orbax_tunix.cli', *argv], capture_output=True,
                        text=True, cwd=ROOT, env=subprocess_env(), timeout=300, check=False)


def assert_refused(p: subprocess.CompletedProcess, out: pathlib.Path, *words: str) -> None:
  assert p.returncode == 2, (p.returncode, p.stderr)
  assert 'Traceback' not in p.stderr and '--debug' not in p.stderr, p.stderr
  for word in words:
    assert word in p.stderr, (word, p.stderr)
  assert not out.exists()


def test_refusals(tmp_path):
  src = save_tunix_run(tmp_path / 'run', maxtext_tree('qwen3', 'scanned'))
  out = tmp_path / 'out'
  # A family that does not fit: qwen3's weights as llama3 (q/k norms have no llama3 tensor).
  assert_refused(run_cli('export', str(src), str(out), '--model', 'llama3'), out,
                 'not a llama3 model', 'decoder/layers_0/self_attention/query_norm/scale',
                 '--model')
  # gemma3 wants gemma's norms: missing weights named.
  assert_refused(run_cli('export', str(src), str(out), '--model', 'gemma3'), out,
                 'not a gemma3 model', 'no gemma3 tensor')
  # A config that disagrees.
  bad = hf_config(tmp_path / 'hf_heads', 'qwen3', num_attention_heads=8)
  assert_refused(run_cli('export', str(src), str(out), '--model', 'qwen3', '--hf-config',
                         str(bad)), out, 'num_attention_heads', '8', '4')
  # A config's vocabulary larger than the weights'.
  big = hf_config(tmp_path / 'hf_vocab', 'qwen3', vocab_size=V + 8)
  assert_refused(run_cli('export', str(src), str(out), '--model', 'qwen3', '--hf-config',
                         str(big)), out, f'vocab_size {V + 8}', 'token_embedder/embedding')


def test_unknown_extra_weights_are_refused(tmp_path):
  flat = maxtext_tree('llama3', 'unscanned')
  flat['decoder/layers_0/self_attention/extra/kernel'] = np.zeros((D, 2), np.float32)
  src = save_maxtext_step(tmp_path / 'run', flat)
  out = tmp_path / 'out'
  assert_refused(run_cli('export', str(src), str(out), '--model', 'llama3'), out,
                 'decoder/layers_0/self_attention/extra/kernel', 'no llama3 tensor')


FAMILY_CONFIG = {  # what each family's config.json adds, from the weights' shapes
    'gemma4': {'global_head_dim': HG, 'num_global_key_value_heads': KG},
    'qwen3_moe': {'moe_intermediate_size': FE, 'num_experts': E},
}


@pytest.mark.parametrize('model', sorted(MODELS))
def test_a_config_that_fits_is_copied_and_one_that_does_not_is_refused(tmp_path, model):
  src = save_maxtext_step(tmp_path / 'run', maxtext_tree(model, 'scanned'))
  extra = FAMILY_CONFIG.get(family(model), {})
  good = hf_config(tmp_path / 'hf', model, **extra)
  orbax_tunix.export_to_hf(src, tmp_path / 'out', model=family(model), hf_config=good)
  written = json.loads((tmp_path / 'out' / 'config.json').read_text())
  base = json.loads((good / 'config.json').read_text())
  # The base's fields are kept; what it leaves to its class's defaults is written (issue 27).
  assert {k: written[k] for k in base} == base
  assert set(written) - set(base) <= {'architectures', 'model_type', 'tie_word_embeddings',
                                      'hidden_activation'}
  field, value = next(iter(extra.items())) if extra else ('num_hidden_layers', 99)
  bad = hf_config(tmp_path / 'hf_bad', model, **{**extra, field: value + 1})
  with pytest.raises(orbax_tunix.errors.UnsupportedLayoutError, match=field):
    orbax_tunix.tools.export.plan_export(src, tmp_path / 'out2', model=family(model), hf_config=bad)


@pytest.mark.parametrize('model,form', [('qwen3', 'scanned'), ('gemma3', 'scanned'),
                                        ('gemma4', 'scanned'), ('llama3', 'unscanned')])
def test_inspect_says_the_kind_of_model(tmp_path, model, form):
  src = save_tunix_run(tmp_path / 'run', maxtext_tree(model, form))
  p = run_cli('inspect', str(src), '--json')
  assert p.returncode == 0, p.stderr
  layers = MODELS[model][1]
  assert json.loads(p.stdout)['weights'] == f'MaxText model ({form}, {layers} layers)'


def test_inspect_says_a_tunix_model():
  p = run_cli('inspect', str(ROOT / 'tests' / 'data' / 'tunix' / 'hf_qwen3'), '--json')
  assert p.returncode == 0, p.stderr
  assert json.loads(p.stdout)['weights'] == 'Tunix model (tunix.models)'


def test_readme_shows_the_generated_maxtext_map():
  readme = (ROOT / 'docs' / 'huggingface.md').read_text()
  begin = '<!-- maxtext maps: generated by scripts/readme_hf_maps.py -->\n'
  table = readme.split(begin)[1].split('<!-- end of maxtext maps -->')[0]
  assert table == orbax_tunix.mapping.huggingface.markdown('maxtext'), 'run scripts/readme_hf_maps.py'
  hf, maxtext = orbax_tunix.mapping.huggingface, orbax_tunix.mapping.trainers.MAXTEXT
  for name in hf.names():  # every family MaxText's models name has rows
    if hf.get(name).naming_of(maxtext) is not None:
      assert f' {name} |' in table or f' {name},' in table, name


RANK, ALPHA = 3, 6.0
LORA_TARGETS = ('self_attention/query/kernel', 'self_attention/out/kernel', 'mlp/wo/kernel')


def with_lora(flat: dict[str, np.ndarray], seed: int = 1) -> tuple[dict, dict]:
  """qwix's adapters beside each target kernel, as qwix's LoRA on MaxText's layers writes them
  (unscanned: `kernel_lora_a` (contracted dims flattened, rank), `kernel_lora_b` (rank, the
  others flattened); printed from qwix.apply_lora_to_model on a tiny MaxText llama3.1), and
  the merged per-layer kernels W + (alpha / rank) a.b by hand."""
  rng = np.random.default_rng(seed)
  out, merged = dict(flat), {}
  for path, w in flat.items():
    if not path.endswith(LORA_TARGETS):
      continue
    contracted = 2 if path.endswith('out/kernel') else 1  # out contracts (heads, head_dim)
    rows, cols = math.prod(w.shape[:contracted]), math.prod(w.shape[contracted:])
    a = rng.normal(size=(rows, RANK)).astype(np.float32)
    b = rng.normal(size=(RANK, cols)).astype(np.float32)
    out[f'{path}_lora_a'], out[f'{path}_lora_b'] = a, b
    merged[path] = (w + np.float32(ALPHA / RANK) * (a @ b).reshape(w.shape)).astype(np.float32)
  return out, merged


def stacked_lora(flat_unscanned: dict, n: int) -> tuple[dict, dict]:
  """The scanned model with qwix's adapters stacked on axis 1 as its kernels are (printed from
  qwix.apply_lora_to_model on a scanned tiny MaxText llama3.1, rank 2, 3 layers:
  `query/kernel_lora_a` (16, 3, 2), `query/kernel_lora_b` (2, 3, 32)), and the merged
  per-layer kernels."""
  lora_flat, merged = with_lora(flat_unscanned)
  scanned = {}
  for path in lora_flat:
    if not path.startswith('decoder/layers_0/'):
      if not path.startswith('decoder/layers_'):
        scanned[path] = lora_flat[path]
      continue
    rest = path.removeprefix('decoder/layers_0/')
    scanned[f'decoder/layers/{rest}'] = np.stack(
        [lora_flat[f'decoder/layers_{i}/{rest}'] for i in range(n)], axis=1)
  return scanned, merged


@pytest.mark.parametrize('form', ['unscanned', 'scanned'])
def test_lora_run_of_a_maxtext_model_exports_merged(tmp_path, form):
  flat = maxtext_tree('qwen3', 'unscanned')
  if form == 'scanned':
    lora_flat, merged = stacked_lora(flat, MODELS['qwen3'][1])
  else:
    lora_flat, merged = with_lora(flat)
  src = save_tunix_run(tmp_path / 'run', lora_flat, per_layer_chunks=True)
  out = tmp_path / 'out'
  p = run_cli('export', str(src), str(out), '--model', 'qwen3')
  assert_refused(p, out, '--merge-lora')
  plan = orbax_tunix.tools.export.plan_export(src, out, model='qwen3', merge_lora=True,
                                        lora_alpha=ALPHA)
  if form == 'scanned':  # Each layer merged from its own slices, read alone (not the stacks).
    q = next(o for o in plan.outputs if o.path == ('model.layers.1.self_attn.q_proj.weight',))
    assert [i.leaf.path[-1] for i in q.inputs] == ['kernel', 'kernel_lora_a', 'kernel_lora_b']
    assert [i.takes for i in q.inputs] == [((1, 1),)] * 3
    assert q.transform.name.startswith('per_input(identity, identity, identity) -> lora_merge')
  orbax_tunix.tools.export.run_export(plan)
  got = read_safetensors(out / 'model.safetensors')
  # The expected export is the plain model's with the merged kernels.
  top, layers = model_weights('qwen3')
  want = expected('qwen3')
  for i in range(len(layers)):
    q = merged[f'decoder/layers_{i}/self_attention/query/kernel']
    o = merged[f'decoder/layers_{i}/self_attention/out/kernel']
    wo = merged[f'decoder/layers_{i}/mlp/wo/kernel']
    want[f'model.layers.{i}.self_attn.q_proj.weight'] = _in(q)
    want[f'model.layers.{i}.self_attn.o_proj.weight'] = _out(o)
    want[f'model.layers.{i}.mlp.down_proj.weight'] = wo.T
  assert sorted(got) == sorted(want)
  for name, value in want.items():
    np.testing.assert_allclose(got[name], value, rtol=0, atol=2e-6, err_msg=name)


def test_another_param_scan_axis(tmp_path):
  """A model scanned with param_scan_axis=0: its layers taken apart along the axis its shapes
  tell (as convert finds it), or along `--param-scan-axis 0`; another axis is refused naming
  the one that fits, before anything is written."""
  top, layers = model_weights('llama3')
  flat = dict(top)
  for k in layers[0]:
    flat[f'decoder/layers/{k}'] = np.stack([w[k] for w in layers], axis=0)
  src = save_maxtext_step(tmp_path / 'run', flat)
  want = expected('llama3')
  for name, flags in (('found', ()), ('given', ('--param-scan-axis', '0'))):
    out = tmp_path / name
    p = run_cli('export', str(src), str(out), '--model', 'llama3', *flags)
    assert p.returncode == 0, p.stderr
    assert f'MaxText model (scanned, {len(layers)} layers)' in p.stderr, p.stderr
    got = read_safetensors(out / 'model.safetensors')
    assert sorted(got) == sorted(want)
    for tensor, value in want.items():
      np.testing.assert_array_equal(got[tensor], value, err_msg=tensor)
  out = tmp_path / 'refused'
  assert_refused(run_cli('export', str(src), str(out), '--model', 'llama3',
                         '--param-scan-axis', '1'), out, 'param_scan_axis=1', '--param-scan-axis 0')
  assert_refused(run_cli('export', str(src), str(out), '--model', 'llama3',
                         '--param-scan-axis', '-1'), out, 'non-negative')


def test_export_takes_the_axis_a_converted_step_records(tmp_path):
  """`convert --scan-layers true --param-scan-axis 0` records the axis; export and inspect
  read the layers along it (the layer count is the model's, not another dim)."""
  src = save_maxtext_step(tmp_path / 'run', maxtext_tree('llama3', 'unscanned'))
  step = tmp_path / 'ax0' / '1'
  p = run_cli('convert', str(src), str(step), '--layout', 'maxtext', '--params-only',
              '--scan-layers', 'true', '--param-scan-axis', '0')
  assert p.returncode == 0, p.stderr
  n = len(model_weights('llama3')[1])
  shown = json.loads(run_cli('inspect', str(step), '--json').stdout)
  assert shown['layers'] == {'form': 'scanned', 'count': n, 'axis': 0}, shown['layers']
  assert shown['weights'] == f'MaxText model (scanned, {n} layers)', shown['weights']
  out = tmp_path / 'out'
  p = run_cli('export', str(step), str(out), '--model', 'llama3')
  assert p.returncode == 0, p.stderr
  got, want = read_safetensors(out / 'model.safetensors'), expected('llama3')
  assert sorted(got) == sorted(want)
  for tensor, value in want.items():
    np.testing.assert_array_equal(got[tensor], value, err_msg=tensor)


def test_an_axis_for_weights_without_stacked_layers_is_refused(tmp_path):
  src = save_maxtext_step(tmp_path / 'run', maxtext_tree('llama3', 'unscanned'))
  out = tmp_path / 'out'
  assert_refused(run_cli('export', str(src), str(out), '--model', 'llama3',
                         '--param-scan-axis', '0'), out, 'no stacked layers', 'unscanned')


def test_llama_aliases_name_the_llama3_family(tmp_path):
  src = save_maxtext_step(tmp_path / 'run', maxtext_tree('llama3', 'scanned'))
  for alias in ('llama3.1', 'llama2'):
    plan = orbax_tunix.tools.export.plan_export(src, tmp_path / alias, model=alias)
    assert plan.layout == 'llama3'


def test_a_family_without_the_sources_naming_is_refused(tmp_path):
  """A MaxText model as gemma (Gemma 1, which names only Tunix's own model class)."""
  src = save_maxtext_step(tmp_path / 'run', maxtext_tree('llama3', 'unscanned'))
  out = tmp_path / 'out'
  p = run_cli('export', str(src), str(out), '--model', 'gemma')
  assert_refused(p, out, 'MaxText model', 'gemma', '--model')


@pytest.mark.parametrize('weight,a,b,stacked', [
    ((16, 3, 4, 8), (16, 3, 2), (2, 3, 32), (1,)),     # a scanned query kernel
    ((4, 3, 8, 16), (32, 3, 2), (2, 3, 16), (1,)),     # a scanned out kernel
    ((16, 1, 5, 48), (16, 1, 5, 2), (2, 1, 5, 48), (1, 2)),  # gemma4's local layers
])
def test_stacked_adapters_merge_per_layer(weight, a, b, stacked):
  rng = np.random.default_rng(0)
  w, la, lb = (rng.normal(size=s).astype(np.float32) for s in (weight, a, b))
  arranged = orbax_tunix.mapping.lora.contraction(weight, a, b)
  assert arranged is not None and arranged.stacked == stacked
  got = orbax_tunix.mapping.merge.combine(arranged, 0.5)(w, la, lb)
  # By hand: every stacked layer's own product, reshaped into its kernel.
  want = w.copy()
  layers = [weight[i] for i in stacked]
  for index in np.ndindex(*layers):
    at = [slice(None)] * len(weight)
    at_a = [slice(None)] * len(a)
    at_b = [slice(None)] * len(b)
    for axis, i in zip(stacked, index, strict=True):
      at[axis] = at_a[axis] = at_b[axis] = i
    one = w[tuple(at)]
    delta = la[tuple(at_a)].reshape(-1, a[-1]) @ lb[tuple(at_b)].reshape(b[0], -1)
    want[tuple(at)] = one + np.float32(0.5) * delta.reshape(one.shape)
  np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)


@pytest.mark.parametrize('chunks', ['whole', 'per_layer'])
def test_a_maxtext_step_in_a_bucket(gcs, bucket, tmp_path, chunks):
  """MaxText's own step read from gs:// (uploaded file by file): the same tensors as locally,
  its stacks read whole or (a chunk per layer) a layer at a time from the bucket."""
  from tests import gcs as gcs_lib

  local = save_maxtext_step(tmp_path / 'run', maxtext_tree('qwen3', 'scanned'),
                            per_layer_chunks=chunks == 'per_layer')
  remote = bucket / 'checkpoints'
  gcs_lib.upload(local, remote)
  plan = orbax_tunix.tools.export.plan_export(str(remote), tmp_path / 'out', model='qwen3')
  parts = [i for o in plan.outputs for i in o.inputs if i.takes]
  assert bool(parts) == (chunks == 'per_layer')
  orbax_tunix.tools.export.run_export(plan)
  got = read_safetensors(tmp_path / 'out' / 'model.safetensors')
  want = expected('qwen3')
  assert sorted(got) == sorted(want)
  for name, value in want.items():
    np.testing.assert_array_equal(got[name], value, err_msg=name)


# --------------------------------------------------------------------------- #
# Qwen2.5, Mixtral, Gemma 2, OLMo 3 (issue 51): MaxText 0.2.5's trees (printed from nnx.state
# of tiny models MaxText builds: tests/test_zoo_dense_clients.py makes them with MaxText itself)
# --------------------------------------------------------------------------- #
_ATTENTION = {k: v for k, v in LLAMA_LAYER.items() if k.startswith('self_attention/')}
_MLP = {k: v for k, v in LLAMA_LAYER.items() if k.startswith('mlp/')}
_GEMMA_NORMS = ('pre_self_attention_norm', 'post_self_attention_norm', 'pre_ffw_norm',
                'post_ffw_norm')
ZOO_LAYERS = {  # model -> (a MaxText layer's weights, MaxText layers, untied lm_head)
    'qwen2': ({**LLAMA_LAYER, 'self_attention/query/bias': (N, H),
               'self_attention/key/bias': (K, H), 'self_attention/value/bias': (K, H)}, 3, True),
    'mixtral': ({**{k: v for k, v in LLAMA_LAYER.items() if not k.startswith('mlp/')},
                 'MoeBlock_0/gate/kernel': (D, E), 'MoeBlock_0/wi_0': (E, D, FE),
                 'MoeBlock_0/wi_1': (E, D, FE), 'MoeBlock_0/wo': (E, FE, D)}, 2, True),
    # One MaxText layer holds two of Hugging Face's: `<m>_local` and `<m>_global`.
    'gemma2': ({f'{m}_{kind}/{rest}': shape for kind in ('local', 'global')
                for m, rest, shape in [
                    *((k.split('/', 1)[0], k.split('/', 1)[1], v)
                      for k, v in {**_ATTENTION, **_MLP}.items()),
                    *((n, 'scale', (D,)) for n in _GEMMA_NORMS)]}, 2, False),
    'olmo3': ({**{k.replace('self_attention/', 'attention/'): v for k, v in _ATTENTION.items()},
               **_MLP, 'attention/query_norm/scale': (N * H,),
               'attention/key_norm/scale': (K * H,), 'post_self_attention_layer_norm/scale': (D,),
               'post_mlp_layer_norm/scale': (D,)}, 8, True),
}
ZOO_CLASSES = {'qwen2': 'Qwen2ForCausalLM', 'mixtral': 'MixtralForCausalLM',
               'gemma2': 'Gemma2ForCausalLM', 'olmo3': 'Olmo3ForCausalLM'}


def zoo_tree(model: str, form: str, seed: int = 0) -> tuple[dict, list[dict]]:
  """(MaxText's flat weight paths in `form`, the per-MaxText-layer weights): scanned on axis 1,
  olmo3's in blocks of four (`decoder/layers/layers_{j}`, stacked by block)."""
  flat, layers = model_weights(model, seed, ZOO_LAYERS)
  n = len(layers)
  for k in layers[0]:
    if form == 'unscanned':
      flat.update({f'decoder/layers_{i}/{k}': weights[k] for i, weights in enumerate(layers)})
    elif model == 'olmo3':
      for j in range(4):
        flat[f'decoder/layers/layers_{j}/{k}'] = np.stack(
            [layers[4 * b + j][k] for b in range(n // 4)], axis=1)
    else:
      flat[f'decoder/layers/{k}'] = np.stack([weights[k] for weights in layers], axis=1)
  return flat, layers


def _scaled_q(w):  # MaxText keeps q / sqrt(head_dim): times it in float32, rounded once
  return _in((w * np.float32(math.sqrt(w.shape[-1]))).astype(np.float32))


def zoo_expected(model: str, flat: dict, layers: list[dict]) -> dict[str, np.ndarray]:
  """The Hugging Face tensors by hand, as MaxText 0.2.5's converter makes them."""
  gemma2 = model == 'gemma2'
  out = {'model.embed_tokens.weight': flat['token_embedder/embedding'],
         'model.norm.weight': flat['decoder/decoder_norm/scale']}
  if gemma2:  # norms 1 + w, the embedding times sqrt(hidden) in float32
    out = {'model.embed_tokens.weight': out['model.embed_tokens.weight'] / np.float32(
        math.sqrt(D)), 'model.norm.weight': out['model.norm.weight'] - np.float32(1)}
  if 'decoder/logits_dense/kernel' in flat:
    out['lm_head.weight'] = flat['decoder/logits_dense/kernel'].T
  # (HF layer, its MaxText weights by the names the per-layer form gives them)
  hf_layers = [(2 * i + k, {name.replace(f'_{kind}/', '/'): v for name, v in w.items()
                            if f'_{kind}/' in name})
               for i, w in enumerate(layers) for k, kind in enumerate(('local', 'global'))
               ] if gemma2 else list(enumerate(layers))
  for i, w in hf_layers:
    p = f'model.layers.{i}'
    attn = 'attention' if model == 'olmo3' else 'self_attention'
    scaled = model in ('mixtral', 'gemma2')
    out[f'{p}.self_attn.q_proj.weight'] = (_scaled_q if scaled else _in)(
        w[f'{attn}/query/kernel'])
    out[f'{p}.self_attn.k_proj.weight'] = _in(w[f'{attn}/key/kernel'])
    out[f'{p}.self_attn.v_proj.weight'] = _in(w[f'{attn}/value/kernel'])
    out[f'{p}.self_attn.o_proj.weight'] = _out(w[f'{attn}/out/kernel'])
    if model == 'mixtral':
      moe = f'{p}.block_sparse_moe'
      out[f'{moe}.gate.weight'] = w['MoeBlock_0/gate/kernel'].T
      for e in range(E):
        for mt, hf in (('wi_0', 'w1'), ('wi_1', 'w3'), ('wo', 'w2')):
          out[f'{moe}.experts.{e}.{hf}.weight'] = w[f'MoeBlock_0/{mt}'][e].T
    else:
      for mt, hf in (('wi_0', 'gate'), ('wi_1', 'up'), ('wo', 'down')):
        out[f'{p}.mlp.{hf}_proj.weight'] = w[f'mlp/{mt}/kernel'].T
    if model == 'qwen2':
      for mt, hf in (('query', 'q'), ('key', 'k'), ('value', 'v')):
        out[f'{p}.self_attn.{hf}_proj.bias'] = w[f'self_attention/{mt}/bias'].reshape(-1)
    if model == 'olmo3':
      out[f'{p}.self_attn.q_norm.weight'] = w['attention/query_norm/scale']
      out[f'{p}.self_attn.k_norm.weight'] = w['attention/key_norm/scale']
      out[f'{p}.post_attention_layernorm.weight'] = w['post_self_attention_layer_norm/scale']
      out[f'{p}.post_feedforward_layernorm.weight'] = w['post_mlp_layer_norm/scale']
    elif gemma2:
      for mt, hf in zip(_GEMMA_NORMS, ('input_layernorm', 'post_attention_layernorm',
                                       'pre_feedforward_layernorm',
                                       'post_feedforward_layernorm'), strict=True):
        out[f'{p}.{hf}.weight'] = w[f'{mt}/scale'] - np.float32(1)
    else:
      out[f'{p}.input_layernorm.weight'] = w['pre_self_attention_layer_norm/scale']
      out[f'{p}.post_attention_layernorm.weight'] = w['post_self_attention_layer_norm/scale']
  return out


@pytest.mark.parametrize('model', sorted(ZOO_LAYERS))
@pytest.mark.parametrize('form', ['scanned', 'unscanned'])
@pytest.mark.parametrize('kind', ['tunix', 'maxtext'])
def test_zoo_dense_export_matches_the_hf_layout(tmp_path, model, form, kind):
  """Each family's MaxText weights, both forms and both sources, as the numpy formulas of
  MaxText's converter lay them out (gemma2: MaxText's layer i is layers 2i (local) and
  2i + 1 (global); olmo3: blocks of four; mixtral and gemma2: the query scaled back)."""
  flat, layers = zoo_tree(model, form)
  save = save_tunix_run if kind == 'tunix' else save_maxtext_step
  plan = orbax_tunix.tools.export.plan_export(save(tmp_path / 'run', flat), tmp_path / 'out',
                                              model=model)
  assert plan.architecture == ZOO_CLASSES[model]
  orbax_tunix.tools.export.run_export(plan)
  got = read_safetensors(tmp_path / 'out' / 'model.safetensors')
  want = zoo_expected(model, flat, layers)
  assert sorted(got) == sorted(want)
  for name, value in want.items():
    assert got[name].dtype == np.float32, name
    if model == 'gemma2' and name == 'model.embed_tokens.weight':  # x / 4: exact either way
      np.testing.assert_array_max_ulp(got[name], value, maxulp=1)
    else:
      np.testing.assert_array_equal(got[name], value, err_msg=name)


@pytest.mark.parametrize('model,layers', [('gemma2', 4), ('olmo3', 8), ('mixtral', 2)])
def test_zoo_dense_config_holds_the_hugging_face_layer_count(tmp_path, model, layers):
  """config.json's num_hidden_layers is Hugging Face's count (gemma2: twice MaxText's), and
  the fields the weights imply are written (mixtral's experts, their width)."""
  flat, _ = zoo_tree(model, 'scanned')
  src = save_maxtext_step(tmp_path / 'run', flat)
  fields = {'vocab_size': V, 'hidden_size': D, 'num_attention_heads': N,
            'num_key_value_heads': K, 'head_dim': H, 'num_hidden_layers': layers}
  good = tmp_path / 'hf'
  good.mkdir()
  (good / 'config.json').write_text(json.dumps(fields))
  orbax_tunix.export_to_hf(src, tmp_path / 'out', model=model, hf_config=good)
  written = json.loads((tmp_path / 'out' / 'config.json').read_text())
  assert written['num_hidden_layers'] == layers
  if model == 'mixtral':
    assert (written['num_local_experts'], written['intermediate_size']) == (E, FE), written
  bad = tmp_path / 'hf_bad'
  bad.mkdir()
  (bad / 'config.json').write_text(json.dumps({**fields, 'num_hidden_layers': layers // 2}))
  with pytest.raises(orbax_tunix.errors.UnsupportedLayoutError, match='num_hidden_layers'):
    orbax_tunix.tools.export.plan_export(src, tmp_path / 'out2', model=model, hf_config=bad)


def test_paired_form_takes_gemma2s_layers_apart_and_back():
  """`stacks.paired`: MaxText's gemma2 layer i (scanned on axis 1, or not) becomes layers 2i
  (`_local`) and 2i + 1 (`_global`) of the per-layer form; `restack` makes the stored tree
  again from them; a module with neither suffix is refused."""
  from orbax_tunix.keypaths import fmt
  from orbax_tunix.mapping import stacks

  form = stacks.paired('_local', '_global')
  for stored in ('scanned', 'unscanned'):
    flat, layers = zoo_tree('gemma2', stored)
    shapes = {tuple(p.split('/')): v.shape for p, v in flat.items()}
    per_layer = form.unstack(shapes)
    assert form.count(shapes) == 4
    for path, m in per_layer.items():
      if path[1].startswith('layers_'):
        i, module = int(path[1].removeprefix('layers_')), path[2]
        kind = ('local', 'global')[i % 2]
        want = layers[i // 2][f'{module}_{kind}/{"/".join(path[3:])}']
      else:
        want = flat[fmt(path)]
      got = m.transform.apply([flat[fmt(m.sources[0])]])
      np.testing.assert_array_equal(got, want, err_msg=fmt(path))
    assert len(per_layer) == 2 + 4 * len(ZOO_LAYERS['gemma2'][0]) // 2
    back = form.restack({p: m.shape for p, m in per_layer.items()}) if stored == 'scanned' else {}
    for path, m in back.items():
      parts = [per_layer[s].transform.apply([flat[fmt(per_layer[s].sources[0])]])
               for s in m.sources]
      np.testing.assert_array_equal(m.transform.apply(parts), flat[fmt(path)], err_msg=fmt(path))
    assert sorted(map(fmt, back)) == (sorted(flat) if stored == 'scanned' else [])
  odd = {('decoder', 'layers_0', 'mlp', 'wi_0', 'kernel'): (D, F)}
  with pytest.raises(orbax_tunix.errors.UnsupportedLayoutError, match="'_local', '_global'"):
    form.unstack(odd)


def test_block_forms_are_told_apart_by_their_numbering():
  """gemma3's blocks of six and olmo3's of four name their stacks alike
  (`decoder/layers/layers_{j}`), and MaxText's plain scanned form (`decoder/layers/...`)
  holds them all: the form whose positions the weights' numbers are is found (the convert
  layout re-lays the layers by it), a remainder or not (gemma3-12b's 48 layers have none)."""
  from orbax_tunix.mapping import huggingface, stacks

  olmo3 = huggingface.get('olmo3').naming_of(orbax_tunix.mapping.trainers.MAXTEXT).form
  gemma3 = huggingface.get('gemma3').naming_of(orbax_tunix.mapping.trainers.MAXTEXT).form
  whole = {p: v for p, v in maxtext_tree('gemma3', 'scanned').items()
           if 'layers_remainder' not in p}  # one block of six, no remainder
  for tree, form in ((zoo_tree('olmo3', 'scanned')[0], olmo3),
                     (maxtext_tree('gemma3', 'scanned'), gemma3), (whole, gemma3)):
    paths = [tuple(p.split('/')) for p in tree]
    assert huggingface.layer_form(paths) == form, form.name
    assert stacks.form_of(paths, (gemma3, olmo3)) == stacks.form_of(paths, (olmo3, gemma3)) == form


def _gemma4_moe_weights(seed: int = 0) -> tuple[dict, dict]:
  """MaxText's gemma4-26b, unscanned (8 layers: 5 local, 1 global, 2 local): gemma4's
  attention and norms (`maxtext_tree('gemma4')`), every MLP a MoE block: the router, its
  scales, E experts, a shared expert and three more norms, as nnx.state prints them. Returns
  (the flat tree, the MoE weights by layer and name)."""
  flat = {p: v for p, v in maxtext_tree('gemma4', 'unscanned').items() if '/mlp/' not in p}
  rng = np.random.default_rng(seed + 7)
  shapes = {'mlp/moe_block/MoeBlock_0/gate/kernel': (D, E),
            'mlp/moe_block/MoeBlock_0/per_expert_scale': (E,),
            'mlp/moe_block/MoeBlock_0/wi_0': (E, D, FE), 'mlp/moe_block/MoeBlock_0/wi_1': (E, D, FE),
            'mlp/moe_block/MoeBlock_0/wo': (E, FE, D),
            **{f'mlp/moe_block/shared_experts/{w}/kernel': s
               for w, s in (('wi_0', (D, F)), ('wi_1', (D, F)), ('wo', (F, D)))},
            'mlp/pre_forward_scale_2': (D,),
            **{f'mlp/{n}/scale': (D,) for n in ('pre_feedforward_layernorm_2',
                                                'post_feedforward_layernorm_1',
                                                'post_feedforward_layernorm_2')}}
  moe = {(i, w): rng.normal(size=s).astype(np.float32) for i in range(MODELS['gemma4'][1])
         for w, s in shapes.items()}
  flat.update({f'decoder/layers_{i}/{w}': v for (i, w), v in moe.items()})
  return flat, moe


@pytest.mark.parametrize('form', ['scanned', 'unscanned'])
def test_gemma4_moe_exports_the_router_and_fused_experts(tmp_path, form):
  """gemma4-26b's MoE layers in the gemma4 family's MaxText naming: the router (D, E) as
  `router.proj` (E, D), its scales copied, wi_0 and wi_1 (E, D, F) fused as MaxText's converter
  fuses them (`experts.gate_up_proj` = concat on F, then (E, 2F, D)), wo (E, F, D) as
  `experts.down_proj` (E, D, F), the shared expert as the dense MLP's names; scanned in gemma4's
  blocks (local layers on axes 1 and 2) as unscanned."""
  from orbax_tunix.mapping import stacks

  flat, moe = _gemma4_moe_weights()
  if form == 'scanned':  # restacked as MaxText's gemma4 form, by the form's own restack
    shapes = {tuple(p.split('/')): v.shape for p, v in flat.items()}
    made = stacks.local_global(6, 'gemma4').restack(shapes)
    flat = {'/'.join(p): m.transform.apply([flat['/'.join(s)] for s in m.sources])
            for p, m in made.items()}
    assert any(p.startswith('decoder/scanned_blocks/local_layers/mlp/moe_block/') for p in flat)
  # Scanned: stored a chunk per layer, so each layer's wi_0 and wi_1 are read alone and fused.
  src = save_maxtext_step(tmp_path / 'run', flat, per_layer_chunks=form == 'scanned')
  plan = orbax_tunix.tools.export.plan_export(src, tmp_path / 'out', model='gemma4')
  fused = next(o for o in plan.outputs if o.path == ('model.layers.6.experts.gate_up_proj',))
  assert [i.leaf.path[-1] for i in fused.inputs] == ['wi_0', 'wi_1']
  assert all(i.takes for i in fused.inputs) == (form == 'scanned'), fused.inputs
  orbax_tunix.tools.export.run_export(plan)
  got = read_safetensors(tmp_path / 'out' / 'model.safetensors')
  want = {k: v for k, v in expected('gemma4').items() if '.mlp.' not in k}
  for i in range(MODELS['gemma4'][1]):
    p, w = f'model.layers.{i}', {name: v for (j, name), v in moe.items() if j == i}
    m = 'mlp/moe_block/MoeBlock_0'
    want[f'{p}.router.proj.weight'] = w[f'{m}/gate/kernel'].T
    want[f'{p}.router.per_expert_scale'] = w[f'{m}/per_expert_scale']
    want[f'{p}.router.scale'] = w['mlp/pre_forward_scale_2']
    want[f'{p}.experts.gate_up_proj'] = np.concatenate(
        [w[f'{m}/wi_0'], w[f'{m}/wi_1']], axis=-1).swapaxes(-2, -1)
    want[f'{p}.experts.down_proj'] = w[f'{m}/wo'].transpose(0, 2, 1)
    for mt, hf in (('wi_0', 'gate'), ('wi_1', 'up'), ('wo', 'down')):
      want[f'{p}.mlp.{hf}_proj.weight'] = w[f'mlp/moe_block/shared_experts/{mt}/kernel'].T
    for n in ('pre_feedforward_layernorm_2', 'post_feedforward_layernorm_1',
              'post_feedforward_layernorm_2'):
      want[f'{p}.{n}.weight'] = w[f'mlp/{n}/scale']
  assert sorted(got) == sorted(want)
  for name, value in want.items():
    np.testing.assert_array_equal(got[name], value, err_msg=name)


@pytest.mark.parametrize('model', ['gemma2', 'olmo3', 'gemma3'])
def test_convert_stacks_per_layer_weights_in_their_familys_form(tmp_path, model):
  """`convert --layout maxtext --scan-layers true` of an unscanned step: gemma2's per-layer
  weights stacked as MaxText stores them (its layers, each holding a local and a global
  one: gemma2's naming is not met by gemma3's weights, whose names hold its per-layer names),
  olmo3's in blocks of four, gemma3's in blocks of six: each MaxText's own scanned tree."""
  from orbax_tunix.tools import convert

  if model == 'gemma3':
    flat, scanned = maxtext_tree(model, 'unscanned'), maxtext_tree(model, 'scanned')
  else:
    flat, scanned = zoo_tree(model, 'unscanned')[0], zoo_tree(model, 'scanned')[0]
  step = tmp_path / 'scanned' / '1'
  convert.run_convert(convert.plan_convert(save_maxtext_step(tmp_path / 'run', flat), step,
                                           layout='maxtext', params_only=True, scan_layers=True))
  got = ocp.PyTreeCheckpointHandler().restore(step / 'items')['params']['params']

  def leaves(tree, prefix=''):
    for k, v in tree.items():
      yield from leaves(v, f'{prefix}{k}/') if isinstance(v, dict) else [(f'{prefix}{k}', v)]

  got = dict(leaves(got))
  assert sorted(got) == sorted(scanned)
  for path, value in scanned.items():
    np.testing.assert_array_equal(np.asarray(got[path]), value, err_msg=path)

"""The Hugging Face model families, as data: each one `hf_naming.Family`, its namings by
trainer (`hf_tunix.py`, `hf_maxtext.py`), in the order `huggingface.names()` lists them.

A new family is one more value registered in `FAMILIES`, with its naming by each trainer that has the
model; a new trainer's naming of a family is one more entry of that family's `namings`.
"""

from __future__ import annotations

from orbax_tunix import catalog
from orbax_tunix.mapping import (
    hf_deepseek,
    hf_deepseek4,
    hf_maxtext,
    hf_maxtext_hybrid,
    hf_tunix,
)
from orbax_tunix.mapping.hf_naming import Family

# Gemma's MLP uses the tanh approximation of GELU; MaxText's converter writes "gelu",
# which transformers takes as the exact GELU and vLLM refuses (maxtext#2867).
GEMMA_GELU = {'hidden_activation': 'gelu_pytorch_tanh'}

# MaxText trains Qwen3-VL's text model as its qwen3 (`use_multimodal=False`: no vision tower):
# that is Qwen3ForCausalLM (transformers has no causal-LM class of Qwen3-VL's text model, and
# its mrope rotates text tokens as Qwen3's rope does).
QWEN3 = Family('qwen3', 'Qwen3ForCausalLM', 'qwen3', (hf_tunix.QWEN3, hf_maxtext.QWEN3),
               text_of=('qwen3_vl_text',))
LLAMA3 = Family('llama3', 'LlamaForCausalLM', 'llama', (hf_tunix.LLAMA3, hf_maxtext.LLAMA3),
                aliases=('llama3.1', 'llama2'))  # MaxText's names of the model.
GEMMA3 = Family(
    'gemma3', 'Gemma3ForCausalLM', 'gemma3_text',  # Gemma3ForConditionalGeneration's text_config.
    (hf_tunix.GEMMA3, hf_maxtext.GEMMA3), fixed=GEMMA_GELU,
    text_prefixes={'Gemma3ForCausalLM': 'model.', 'Gemma3ForConditionalGeneration':
                   'model.language_model.'})
QWEN2 = Family('qwen2', 'Qwen2ForCausalLM', 'qwen2', (hf_tunix.QWEN2, hf_maxtext.QWEN2))
# ... and Qwen3-Omni's thinker's text model as its qwen3 MoE (transformers has no causal-LM
# class of it either: its thinker class needs the audio and vision towers).
QWEN3_MOE = Family('qwen3_moe', 'Qwen3MoeForCausalLM', 'qwen3_moe',
                   (hf_tunix.QWEN3_MOE, hf_maxtext.QWEN3_MOE), text_of=('qwen3_omni_moe_text',))
GEMMA = Family('gemma', 'GemmaForCausalLM', 'gemma', (hf_tunix.GEMMA,),
               fixed={'hidden_act': 'gelu_pytorch_tanh'})
GEMMA2 = Family('gemma2', 'Gemma2ForCausalLM', 'gemma2', (hf_tunix.GEMMA2, hf_maxtext.GEMMA2),
                fixed=GEMMA_GELU)
GEMMA4 = Family(
    'gemma4', 'Gemma4ForConditionalGeneration', 'gemma4', (hf_tunix.GEMMA4, hf_maxtext.GEMMA4),
    fixed=GEMMA_GELU,
    text_prefixes={'Gemma4ForCausalLM': 'model.', 'Gemma4ForConditionalGeneration':
                   'model.language_model.'},
    embeddings=('embed_tokens', 'embed_tokens_per_layer'))

# gpt-oss: MaxText's model only (Tunix trains it through TunixMaxTextAdapter). Its biases are
# weights of every MaxText gpt-oss: the config must build them.
GPT_OSS = Family('gpt_oss', 'GptOssForCausalLM', 'gpt_oss', (hf_maxtext.GPT_OSS,),
                 fixed={'attention_bias': True}, aliases=('gpt-oss',))

# Qwen3-VL with its vision tower (MaxText's `use_multimodal`): the multimodal class, which holds
# the text model under `model.language_model.` (MaxText's text-only Qwen3-VL is a qwen3's).
QWEN3_VL = Family('qwen3_vl', 'Qwen3VLForConditionalGeneration', 'qwen3_vl',
                  (hf_maxtext.QWEN3_VL,), aliases=('qwen3-vl',))
QWEN3_VL_MOE = Family('qwen3_vl_moe', 'Qwen3VLMoeForConditionalGeneration', 'qwen3_vl_moe',
                      (hf_maxtext.QWEN3_VL_MOE,), aliases=('qwen3-vl-moe',))

# DeepSeek (mapping/hf_deepseek.py): MaxText's model only (Tunix 0.1.7 has no DeepSeek).
DEEPSEEK_V2 = Family('deepseek_v2', 'DeepseekV2ForCausalLM', 'deepseek_v2',
                     (hf_deepseek.DEEPSEEK_V2,), aliases=('deepseek2',))
DEEPSEEK_V3 = Family('deepseek_v3', 'DeepseekV3ForCausalLM', 'deepseek_v3',
                     (hf_deepseek.DEEPSEEK_V3,), aliases=('deepseek3',))
DEEPSEEK_V32 = Family('deepseek_v32', 'DeepseekV32ForCausalLM', 'deepseek_v32',
                      (hf_deepseek.DEEPSEEK_V32,), aliases=('deepseek3.2',))
# DeepSeek's own tensor names (`layers.{i}.attn.wq_a.weight`), which transformers renames on load.
DEEPSEEK_V4 = Family('deepseek_v4', 'DeepseekV4ForCausalLM', 'deepseek_v4',
                     (hf_deepseek4.DEEPSEEK4,), aliases=('deepseek4',))

# MaxText's hybrid decoders (linear attention interleaved with full attention): MaxText's
# models only (Tunix takes them as MaxText checkpoints). Qwen3.5's text model is exported as
# its text class; a multimodal base config's text_config becomes its config.
QWEN3_NEXT = Family('qwen3_next', 'Qwen3NextForCausalLM', 'qwen3_next',
                    (hf_maxtext_hybrid.QWEN3_NEXT,), aliases=('qwen3-next',))
QWEN3_5_MOE = Family(
    'qwen3_5_moe', 'Qwen3_5MoeForCausalLM', 'qwen3_5_moe_text', (hf_maxtext_hybrid.QWEN3_5_MOE,),
    aliases=('qwen3.5',),
    text_prefixes={'Qwen3_5MoeForCausalLM': 'model.', 'Qwen3_5MoeForConditionalGeneration':
                   'model.language_model.'})

# MaxText's Mixtral (no Tunix model): its experts under the Hub's `block_sparse_moe` names.
MIXTRAL = Family('mixtral', 'MixtralForCausalLM', 'mixtral', (hf_maxtext.MIXTRAL,))

# MaxText's OLMo 3 (no Tunix model).
OLMO3 = Family('olmo3', 'Olmo3ForCausalLM', 'olmo3', (hf_maxtext.OLMO3,))

# The catalog of families (`--model`'s names, and the registry a plugin adds a family to).
FAMILIES: catalog.Catalog[Family] = catalog.Catalog('model')
for _family in (QWEN3, LLAMA3, GEMMA3, QWEN2, QWEN3_MOE, GEMMA, GEMMA2, GEMMA4, MIXTRAL, OLMO3,
                GPT_OSS, QWEN3_VL, QWEN3_VL_MOE, DEEPSEEK_V2, DEEPSEEK_V3, DEEPSEEK_V32,
                DEEPSEEK_V4, QWEN3_NEXT, QWEN3_5_MOE):
  FAMILIES.register(_family)

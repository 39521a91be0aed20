"""The Hugging Face model families, as data: each one `hf_naming.Family`, its namings by
trainer (`hf_tunix.py`, `hf_maxtext.py`), in the order `huggingface.names()` lists them.

A new family is one more value in `FAMILIES`, with its naming by each trainer that has the
model; a new trainer's naming of a family is one more entry of that family's `namings`.
"""

from __future__ import annotations

from orbax_tunix.mapping import hf_maxtext, hf_tunix
from orbax_tunix.mapping.hf_naming import Family

# Gemma's MLP uses the tanh approximation of GELU; MaxText's converter writes "gelu",
# which transformers takes as the exact GELU and vLLM refuses (maxtext#2867).
GEMMA_GELU = {'hidden_activation': 'gelu_pytorch_tanh'}

QWEN3 = Family('qwen3', 'Qwen3ForCausalLM', 'qwen3', (hf_tunix.QWEN3, hf_maxtext.QWEN3))
LLAMA3 = Family('llama3', 'LlamaForCausalLM', 'llama', (hf_tunix.LLAMA3, hf_maxtext.LLAMA3),
                aliases=('llama3.1', 'llama2'))  # MaxText's names of the model.
GEMMA3 = Family(
    'gemma3', 'Gemma3ForCausalLM', 'gemma3_text',  # Gemma3ForConditionalGeneration's text_config.
    (hf_tunix.GEMMA3, hf_maxtext.GEMMA3), fixed=GEMMA_GELU,
    text_prefixes={'Gemma3ForCausalLM': 'model.', 'Gemma3ForConditionalGeneration':
                   'model.language_model.'})
QWEN2 = Family('qwen2', 'Qwen2ForCausalLM', 'qwen2', (hf_tunix.QWEN2, hf_maxtext.QWEN2))
QWEN3_MOE = Family('qwen3_moe', 'Qwen3MoeForCausalLM', 'qwen3_moe',
                   (hf_tunix.QWEN3_MOE, hf_maxtext.QWEN3_MOE))
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

# MaxText's Mixtral (no Tunix model): its experts under the Hub's `block_sparse_moe` names.
MIXTRAL = Family('mixtral', 'MixtralForCausalLM', 'mixtral', (hf_maxtext.MIXTRAL,))

# MaxText's OLMo 3 (no Tunix model).
OLMO3 = Family('olmo3', 'Olmo3ForCausalLM', 'olmo3', (hf_maxtext.OLMO3,))

FAMILIES = (QWEN3, LLAMA3, GEMMA3, QWEN2, QWEN3_MOE, GEMMA, GEMMA2, GEMMA4, MIXTRAL, OLMO3)

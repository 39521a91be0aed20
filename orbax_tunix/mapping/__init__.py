"""How source leaves become destination leaves, as data: transforms, rules, outputs, families.

  transforms.py   source arrays onto one destination array (`Transform` values)
  patterns.py     path patterns onto destination paths, each with a transform
  outputs.py      what a conversion writes: each destination leaf and its sources
  stacks.py       a decoder's layer forms (`LayerForm`): unstacked, restacked, their axis
  lora.py         LoRA adapters among the weights, and their merge's contraction
  merge.py        LoRA-merged weights, restored into a target or planned as outputs
  huggingface.py  the Hugging Face families (one value each), per source naming
"""

"""The tools the CLI runs, as library functions: inspect, convert, export, diff.

  inspection.py  what a checkpoint holds, from metadata only
  convert.py     a checkpoint rewritten as an Orbax step in a layout
  export.py      a model's weights as a Hugging Face safetensors folder
  diff.py        two checkpoints compared leaf by leaf
"""

"""The tools the CLI runs, as library functions: inspect, convert, export, diff.

  inspection.py  what a checkpoint holds, from metadata only
  pipeline.py    the one plan and run of every layout (an Orbax step, a Hugging Face folder)
  convert.py     a checkpoint rewritten as an Orbax step in a layout (the pipeline)
  export.py      a model's weights as a Hugging Face safetensors folder (the pipeline)
  diff.py        two checkpoints compared leaf by leaf
"""

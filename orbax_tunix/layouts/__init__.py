"""Output layouts, found by name: what a converted step (or an export) holds.

A `Layout` is a value: its name, a line for people, `lay_out(request)` (a
pure function of the source checkpoint's metadata that says every destination
item and leaf, `outputs.ItemOutput`, and how each is made from source leaves),
the kind of destination it fills (`sink`, a `Destination`: an Orbax step, a Hugging
Face folder or a PEFT adapter folder) and its options as data. The one pipeline (`tools/pipeline.py`) looks
layouts up here and hands the result to the one writer (`writer.py`); a new
output format is one more registered layout.

  canonical   an ordinary Orbax step in the canonical view (`layouts/canonical.py`)
  maxtext     MaxText's own step: weights, or the full train state (`layouts/maxtext.py`)
  qwen3, llama3, gemma3, ...
              a Hugging Face safetensors folder, one per family (`layouts/huggingface.py`)
  qwen3.peft, llama3.peft, ...
              a LoRA run's adapters as a PEFT adapter folder, one per family (`layouts/peft.py`)
"""

from __future__ import annotations

from orbax_tunix.layouts import canonical, huggingface, maxtext, peft  # noqa: F401  (they register)
from orbax_tunix.layouts.base import (
    LAYOUTS,
    Destination,
    LaidOut,
    Layout,
    Option,
    Request,
    check_options,
    get,
    named,
    names,
    options,
    register,
    weights,
)

__all__ = ['LAYOUTS', 'LaidOut', 'Layout', 'Option', 'Request', 'Destination', 'check_options',
           'get', 'named', 'names', 'options', 'register', 'weights']

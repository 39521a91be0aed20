"""Output layouts, found by name: what a converted step (or an export) holds, and where it goes.

A `Layout` is a value: its name, a line for people, `lay_out(request)` (a pure function of
the source checkpoint's metadata that says every destination item and leaf,
`outputs.ItemOutput`, and how each is made from source leaves), its options as data, and its
`destination`: one `Destination` value holding the kind of destination (what may be
replaced, how it is committed), how it is sharded and written through the one writer
(`writing/writer.py`), and the command and flag that choose it. The one pipeline
(`tools/pipeline.py`) looks layouts up here. A new output format is one module here (its
layouts, and its destination if it is a new kind) imported below.

  step        an Orbax step plain Orbax restores (`layouts/step.py`)
  folder      a Hugging Face safetensors folder (`layouts/folder.py`)
  adapter     a PEFT adapter folder (`layouts/peft.py`)

  canonical   step: an ordinary Orbax step in the canonical view (`layouts/canonical.py`)
  maxtext     step: MaxText's own step, weights or the full train state (`layouts/maxtext.py`)
  qwen3, llama3, gemma3, ...
              folder: one per family (`layouts/huggingface.py`)
  qwen3.peft, llama3.peft, ...
              adapter: a LoRA run's adapters, one per family (`layouts/peft.py`)
"""

from __future__ import annotations

from orbax_tunix.layouts import canonical, huggingface, maxtext, peft  # noqa: F401  (they register)
from orbax_tunix.layouts.base import (
    LAYOUTS,
    Destination,
    LaidOut,
    Layout,
    Option,
    Plan,
    Request,
    Switch,
    check_options,
    destinations,
    find,
    get,
    named,
    names,
    options,
    register,
    weights,
)

__all__ = ['LAYOUTS', 'Destination', 'LaidOut', 'Layout', 'Option', 'Plan', 'Request', 'Switch',
           'check_options', 'destinations', 'find', 'get', 'named', 'names', 'options',
           'register', 'weights']

"""Output layouts, found by name: what a converted step (or an export) holds.

A `Layout` is a value: its name, a line for people, and `lay_out(request)`,
a pure function of the source checkpoint's metadata that says every
destination item and leaf (`outputs.ItemOutput`), and how each is made from
source leaves. `convert` and `export` look layouts up here and hand the
result to the one writer (`writer.py`); a new output format is one more
registered layout.

  canonical   an ordinary Orbax step in the canonical view (`layouts/canonical.py`)
  maxtext     MaxText's own step: weights, or the full train state (`layouts/maxtext.py`)
"""

from __future__ import annotations

from orbax_tunix.layouts import canonical, maxtext  # noqa: F401  (they register)
from orbax_tunix.layouts.base import (
    LAYOUTS,
    LaidOut,
    Layout,
    Option,
    Request,
    check_options,
    get,
    names,
    options,
    register,
    weights,
)

__all__ = ['LAYOUTS', 'LaidOut', 'Layout', 'Option', 'Request', 'check_options', 'get', 'names',
           'options', 'register', 'weights']

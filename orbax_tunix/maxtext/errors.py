"""The MaxText view's own errors: two `TargetMismatchError`s with a known cause.

Each explains a whole set of missing weights at once; `weights.py` raises them
before any array is read.
"""

from orbax_tunix import errors


class LayerScanMismatchError(errors.TargetMismatchError):
  """One side stacks the layers into one array per weight (scanned), the other not."""


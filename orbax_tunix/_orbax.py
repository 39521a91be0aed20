"""Every use of Orbax's private API, in one place.

Orbax's public surface does not cover everything a plugin handler needs. Each
function here leans on one private detail of orbax-checkpoint 0.12.x, and
`tests/test_orbax_assumptions.py` pins each one, so that an Orbax upgrade that
moves it fails there, loudly, and nowhere else.
"""

from __future__ import annotations

from typing import Any

import orbax.checkpoint as ocp
from orbax.checkpoint._src.metadata import tree as _tree_metadata

# What a PyTree handler's `metadata()` returns (not exported by Orbax).
TreeMetadata = _tree_metadata.TreeMetadata


def tree_metadata_like(meta: TreeMetadata, tree: Any) -> TreeMetadata:
  """A `TreeMetadata` holding `tree` (of value metadata), keeping `meta`'s custom metadata."""
  return _tree_metadata.build_default_tree_metadata(tree, custom_metadata=meta.custom_metadata)


def standard_handler_over(pytree_handler: ocp.PyTreeCheckpointHandler) -> ocp.StandardCheckpointHandler:
  """Orbax's `StandardCheckpointHandler`, reading and describing through `pytree_handler`.

  Orbax's handler wraps a `PyTreeCheckpointHandler` as `_impl` and calls only
  its public `restore` and `metadata`; swapping it in gives `StandardRestore`
  exactly Orbax's semantics (type checks, shardings taken from the
  checkpoint's sharding metadata, `fallback_sharding`, `support_layout`,
  `strict`) on top of another PyTree handler.
  """
  standard = ocp.StandardCheckpointHandler()
  standard._impl = pytree_handler  # pylint: disable=protected-access
  return standard


def pytree_handler_of(standard: ocp.StandardCheckpointHandler) -> ocp.PyTreeCheckpointHandler:
  """The `PyTreeCheckpointHandler` a `StandardCheckpointHandler` reads with."""
  return standard._impl  # pylint: disable=protected-access


# TensorStore reports storage failures as ValueErrors whose text starts with a
# status code; Orbax wraps a failed array read in a bare `Exception`
# ('Encountered error while reading array index ...') whose `__cause__` is
# TensorStore's. Other codes (INVALID_ARGUMENT, ...) and JAX's
# own errors are about the request, i.e. the caller's.
_STORAGE_CODES = (
    'OUT_OF_RANGE:', 'NOT_FOUND:', 'DATA_LOSS:', 'UNAVAILABLE:', 'PERMISSION_DENIED:',
    'FAILED_PRECONDITION:', 'ABORTED:', 'INTERNAL:', 'UNKNOWN:',
)


def storage_failure(exc: BaseException) -> BaseException | None:
  """The exception in `exc`'s chain that says stored data is missing or damaged.

  Returns None when the failure is about the request (a sharding that does not
  divide an array, a wrong dtype...), which the caller must see as raised.
  """
  seen = set()
  while exc is not None and id(exc) not in seen:
    seen.add(id(exc))
    text = str(exc)
    if isinstance(exc, OSError) or text.startswith(_STORAGE_CODES):
      return exc
    exc = exc.__cause__ or exc.__context__
  return None


def failure_text(exc: BaseException) -> str:
  """A storage failure's first line, without the TensorStore spec Orbax appends."""
  text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
  return text.split(' [tensorstore_spec=')[0]

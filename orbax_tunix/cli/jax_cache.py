"""The commands' JAX persistent compilation cache: what one command compiled, the next loads.

A command's first merge, dequantize or re-layout compiles XLA programs; on an
accelerator a process's first compile alone takes most of a second (BENCHMARKS.md,
issue 53). The commands keep JAX's persistent compilation cache on by default:

  where     `JAX_COMPILATION_CACHE_DIR` (JAX's own variable) when set, else
            `default_directory()`: orbax-tunix/jax under the user's cache directory
            ($XDG_CACHE_HOME or ~/.cache; ~/Library/Caches on macOS, %LOCALAPPDATA%
            on Windows), made readable by its owner only (JAX runs what it finds there)
  what      every program, however short its compile (JAX's thresholds set to 0,
            unless JAX's own variables set them)
  off       `--no-compilation-cache`, or JAX's `JAX_ENABLE_COMPILATION_CACHE=false`
  shared    by processes at once: each entry is written whole, then renamed into place
            (`_orbax.jax_cache_writes_whole`)

JAX's settings are restored after the command (`main` may run in a caller's process).
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import sys
from collections.abc import Iterator, Mapping

from orbax_tunix.store import _orbax

# JAX's settings for what it writes to the cache, each with the variable JAX reads it from:
# the value here unless the variable is set.
_THRESHOLDS = {
    'jax_persistent_cache_min_compile_time_secs': ('JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS',
                                                   0.0),
    # -1: no minimum size (0 lets JAX choose one for the filesystem).
    'jax_persistent_cache_min_entry_size_bytes': ('JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES',
                                                  -1),
}


def default_directory(environ: Mapping[str, str] = os.environ,
                      platform: str = sys.platform) -> pathlib.Path:
  """Where the commands keep JAX's compiled programs unless `JAX_COMPILATION_CACHE_DIR` says:
  orbax-tunix/jax under the user's cache directory (as `platformdirs.user_cache_dir`)."""
  home = pathlib.Path(environ.get('HOME') or pathlib.Path.home())
  if platform == 'darwin':
    base = home / 'Library' / 'Caches'
  elif platform == 'win32':
    base = pathlib.Path(environ.get('LOCALAPPDATA') or home / 'AppData' / 'Local')
  else:  # XDG: a relative $XDG_CACHE_HOME is to be ignored.
    xdg = environ.get('XDG_CACHE_HOME', '')
    base = pathlib.Path(xdg) if os.path.isabs(xdg) else home / '.cache'
  return base / 'orbax-tunix' / 'jax'


@contextlib.contextmanager
def kept(enabled: bool = True) -> Iterator[str | None]:
  """JAX's persistent compilation cache on for a command (see the module).

  Args:
    enabled: False (`--no-compilation-cache`): as JAX is configured.

  Yields:
    The cache's directory, or None: off (asked to be, JAX's cache disabled, or the
    default directory cannot be made: the command runs without a cache).
  """
  import jax  # pylint: disable=g-import-not-at-top
  from jax.experimental.compilation_cache import compilation_cache  # pylint: disable=g-import-not-at-top

  directory = jax.config.jax_compilation_cache_dir
  if not enabled or not jax.config.jax_enable_compilation_cache:
    yield None
    return
  if not directory:
    path = default_directory()
    try:
      path.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError:
      yield None
      return
    directory = str(path)
  settings = {'jax_compilation_cache_dir': directory}
  settings.update((name, value) for name, (variable, value) in _THRESHOLDS.items()
                  if variable not in os.environ)
  before = {name: getattr(jax.config, name) for name in settings}
  _orbax.jax_cache_writes_whole()
  for name, value in settings.items():
    jax.config.update(name, value)
  try:
    yield directory
  finally:
    for name, value in before.items():
      jax.config.update(name, value)
    compilation_cache.reset_cache()  # Made again from the settings at the next compile.

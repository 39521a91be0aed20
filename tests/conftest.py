"""Shared test set-up: 8 simulated CPU devices, a mesh, the committed fixtures, the Hugging Face
client venv."""

import os

# Must happen before jax is imported anywhere.
os.environ['XLA_FLAGS'] = (
    os.environ.get('XLA_FLAGS', '') + ' --xla_force_host_platform_device_count=8'
).strip()
os.environ.setdefault('JAX_PLATFORMS', 'cpu')
# The commands keep JAX's persistent compilation cache under the user's cache directory by
# default (cli/jax_cache.py): not from the tests (theirs set it where they check it).
os.environ.setdefault('JAX_ENABLE_COMPILATION_CACHE', 'false')

from tests import gcs as gcs_lib  # noqa: E402

# Where the GCS emulator will listen: the clients take it from the
# environment at import, so it is set before anything imports them.
GCS_URL = f'http://127.0.0.1:{gcs_lib.free_port()}'
os.environ.update(gcs_lib.environment(GCS_URL))

import pathlib  # noqa: E402
import subprocess  # noqa: E402

import jax  # noqa: E402
import pytest  # noqa: E402

DATA = pathlib.Path(__file__).parent / 'data' / 'tunix'
ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.fixture(scope='session')
def mesh():
  assert jax.device_count() == 8, 'XLA_FLAGS was not applied before jax was imported'
  return jax.make_mesh((4, 2), ('data', 'model'))


@pytest.fixture(scope='session')
def tunix_data() -> pathlib.Path:
  """The committed checkpoints written by the real google-tunix package."""
  return DATA


@pytest.fixture(scope='session')
def gcs():
  """A GCS emulator (fake-gcs-server, in memory), started on first use."""
  emulator = gcs_lib.Emulator(GCS_URL)
  emulator.start()
  yield emulator
  emulator.stop()


@pytest.fixture
def bucket(gcs):
  """A fresh bucket, as an `epath.Path` ('gs://b-.../')."""
  from etils import epath  # pylint: disable=g-import-not-at-top

  return epath.Path(gcs.bucket())


@pytest.fixture(scope='session')
def hf_python() -> str:
  """The Hugging Face client venv's python (scripts/hf_venv.sh, built on first use).

  Skipped only where no Python 3.11 can be found to build it, and never on CI.
  """
  out = subprocess.run(
      ['bash', str(ROOT / 'scripts' / 'hf_venv.sh')], capture_output=True, text=True,
      timeout=1800, check=False)
  if out.returncode != 0 and 'no Python 3.11 found' in out.stderr and not os.environ.get('CI'):
    pytest.skip('the Hugging Face client venv needs Python 3.11 (scripts/hf_venv.sh): none here')
  assert out.returncode == 0, f'scripts/hf_venv.sh failed:\n{out.stderr[-5000:]}'
  return out.stdout.strip().splitlines()[-1]

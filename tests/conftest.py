"""Shared test set-up: 8 simulated CPU devices, a mesh, the committed fixtures."""

import os

# Must happen before jax is imported anywhere.
os.environ['XLA_FLAGS'] = (
    os.environ.get('XLA_FLAGS', '') + ' --xla_force_host_platform_device_count=8'
).strip()
os.environ.setdefault('JAX_PLATFORMS', 'cpu')

import pathlib  # noqa: E402

import jax  # noqa: E402
import pytest  # noqa: E402

DATA = pathlib.Path(__file__).parent / 'data' / 'tunix'


@pytest.fixture(scope='session')
def mesh():
  assert jax.device_count() == 8, 'XLA_FLAGS was not applied before jax was imported'
  return jax.make_mesh((4, 2), ('data', 'model'))


@pytest.fixture(scope='session')
def tunix_data() -> pathlib.Path:
  """The committed checkpoints written by the real google-tunix package."""
  return DATA

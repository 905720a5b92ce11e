"""8 simulated CPU devices for every test; strict numerics."""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")


@pytest.fixture(scope="session")
def devices():
  assert len(jax.devices()) == 8, "tests need 8 simulated CPU devices"
  return jax.devices()

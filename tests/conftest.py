"""8 simulated CPU devices for every test; strict numerics; a plan cache of
the test session's own, so no test reads a plan an earlier run left."""

import atexit
import os
import shutil
import tempfile

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8")
# LLVM's optimisation of XLA:CPU's kernels is most of a test's compile, and
# nothing a test reads: the compiled HLO's collectives, `memory_analysis()`
# and `cost_analysis()` come from XLA's passes before it (the same bytes at
# either level), and numerics are compared with jax.jit's, compiled alike.
if "--xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
  os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"
# XLA:TPU's compiler (libtpu, the `tpu` extra) compiles for TPU topologies
# here; the tests run on CPU devices, and two workers may hold libtpu at once.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
os.environ["AUTOMAP_CACHE_DIR"] = tempfile.mkdtemp(prefix="automap-test-cache-")
atexit.register(shutil.rmtree, os.environ["AUTOMAP_CACHE_DIR"], ignore_errors=True)
# XLA's executables shared by the session's tests and its workers (they
# inherit the folder the first process made, which removes it at exit): the
# same small steps, compiled by many tests, compile once.
if "AUTOMAP_TEST_XLA_CACHE" not in os.environ:
  os.environ["AUTOMAP_TEST_XLA_CACHE"] = tempfile.mkdtemp(prefix="automap-test-xla-")
  atexit.register(shutil.rmtree, os.environ["AUTOMAP_TEST_XLA_CACHE"], ignore_errors=True)

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_compilation_cache_dir", os.environ["AUTOMAP_TEST_XLA_CACHE"])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)


def pytest_configure(config):
  # An executable the cache cannot hold (compiled for compile-only TPU
  # devices) is compiled as before; jax says so with a warning.
  config.addinivalue_line(
      "filterwarnings", "ignore:Error (reading|writing) persistent compilation cache")


@pytest.fixture(scope="session")
def devices():
  assert len(jax.devices()) == 8, "tests need 8 simulated CPU devices"
  return jax.devices()


# Property tests: `ci` is reproducible and sized for CI; `long` explores.
from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile(
    "ci", max_examples=30, deadline=None, derandomize=True, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile(
    "long", max_examples=2000, deadline=None, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

"""Test set-up: 8 virtual CPU devices, set before JAX is imported anywhere."""

import os

# The tests compile hundreds of tiny programs whose run time is negligible;
# LLVM's optimisation of the CPU code is about a quarter of each compile and
# changes no figure a test checks (the HLO passes still run).
os.environ.setdefault(
    "XLA_FLAGS", "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Many tests compile the same program (the tiny GPT on 2x4, say). JAX's persistent
# cache, shared by the xdist workers, compiles each such program once per run; a
# cache entry is keyed by the HLO, the flags and the jax version, so a hit is the
# same executable. Compiles over half a second are kept (JAX's default is one):
# the jitted references and the small pipelines of the test matrices recur too.
os.environ.setdefault(
    "JAX_COMPILATION_CACHE_DIR",
    os.path.join(os.path.dirname(os.path.dirname(__file__)), ".pytest_cache", "xla"),
)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")

"""Test set-up: 8 virtual CPU devices, set before JAX is imported anywhere."""

import os

# The tests compile hundreds of tiny programs whose run time is negligible;
# LLVM's optimisation of the CPU code is about a quarter of each compile and
# changes no figure a test checks (the HLO passes still run).
os.environ.setdefault(
    "XLA_FLAGS", "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

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

# ---------------------------------------------------------------------------------
# The quick tier. A test is slow when it is marked so, or when its recorded time
# (tests/durations.json: seconds per test id, setup and teardown included, on the
# 2-core CI machine) exceeds QUICK_SECONDS; a test with no record yet counts as
# quick, and so does one marked `quick`. `make durations` records the whole suite
# again.

import json
from pathlib import Path

import pytest

QUICK_SECONDS = 2.0
DURATIONS = Path(__file__).with_name("durations.json")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--record-durations",
        action="store_true",
        help=f"write every test's time (setup, call, teardown) to {DURATIONS.name}",
    )


@pytest.hookimpl(tryfirst=True)  # before -m deselects by the marks
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    recorded = json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}
    for item in items:
        if (
            "slow" not in item.keywords
            and "quick" not in item.keywords
            and recorded.get(item.nodeid, 0.0) > QUICK_SECONDS
        ):
            item.add_marker(pytest.mark.slow)


_times: dict[str, float] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _times[report.nodeid] = _times.get(report.nodeid, 0.0) + report.duration


def pytest_sessionfinish(session: pytest.Session) -> None:
    # With xdist the controller sees every worker's reports; the workers write nothing.
    if session.config.getoption("record_durations") and not hasattr(session.config, "workerinput"):
        # Merged into the record, so a partial run updates only the tests it ran.
        times = json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}
        times.update({k: round(v, 1) for k, v in _times.items()})
        DURATIONS.write_text(json.dumps(dict(sorted(times.items())), indent=0) + "\n")

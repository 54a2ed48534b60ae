"""Where a command-line run goes when accelerators are too few (stubbed device lists)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from pjit_pipe.cli.device_choice import choose_devices
from pjit_pipe.errors import MeshError


@dataclass(frozen=True)
class Device:
    platform: str
    id: int


def devices(platform: str, n: int) -> list[Device]:
    return [Device(platform, i) for i in range(n)]


def test_enough_accelerators_run_there_without_a_note() -> None:
    chosen, note = choose_devices(8, devices("gpu", 8), devices("cpu", 8))
    assert chosen == devices("gpu", 8) and note is None


def test_one_gpu_falls_back_to_virtual_cpus_and_says_so() -> None:
    chosen, note = choose_devices(8, devices("gpu", 1), devices("cpu", 8))
    assert [d.platform for d in chosen] == ["cpu"] * 8
    assert note is not None and "only 1 gpu" in note and "8 virtual CPU devices" in note


def test_a_cpu_machine_uses_its_first_devices() -> None:
    chosen, note = choose_devices(4, devices("cpu", 8), devices("cpu", 8))
    assert chosen == devices("cpu", 4) and note is None


def test_too_few_everywhere_names_the_flag() -> None:
    with pytest.raises(MeshError, match="xla_force_host_platform_device_count=16"):
        choose_devices(16, devices("gpu", 1), devices("cpu", 8))

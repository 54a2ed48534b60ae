"""Random small planning instances, shared by the fast-vs-exact test and benchmark.

One generator, so that the test's seeds and the benchmark's instances are the
same problems: 8 layers with random F, B, activation and parameter bytes, and
4 devices with random speeds and asymmetric links (bandwidth[i][j] and
bandwidth[j][i] drawn independently), each holding 4 GB. Small enough for the
exhaustive engine (`pjit_pipe.planner.exhaustive`) to prove the optimum in about a
second.
"""

from __future__ import annotations

import json

import numpy as np

from pjit_pipe.planner.devices import Devices, devices_from_json
from pjit_pipe.planner.profile import Profile, parse_profile


def random_instance(seed: int, layers: int = 8, devices: int = 4) -> tuple[Profile, Devices]:
    """The instance of `seed`: F in [1, 10] ms, a backward in [1, 20] ms (B and W half each),
    activations in [1, 50] MB, parameters in [1, 100] MB, links in [1, 20] GB/s
    per direction, speeds in [0.5, 2], 4 GB per device."""
    rng = np.random.default_rng(seed)
    spec = [
        {
            "f": float(rng.uniform(1, 10)),
            "b": float(rng.uniform(1, 20)),
            "act_bytes": float(rng.uniform(1e6, 5e7)),
            "param_bytes": float(rng.uniform(1e6, 1e8)),
        }
        for _ in range(layers)
    ]
    bandwidth = rng.uniform(1e9, 2e10, size=(devices, devices)).tolist()
    speed = rng.uniform(0.5, 2, size=devices).tolist()
    profile = parse_profile(json.dumps({"layers": spec}))
    return profile, devices_from_json({"bandwidth": bandwidth, "memory": 4e9, "speed": speed})

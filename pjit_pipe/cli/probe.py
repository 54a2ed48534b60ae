"""`pjit-pipe probe`: measure the local devices for `pjit-pipe plan --devices`.

Times a ppermute between every ordered pair of the local devices (a few
buffer sizes, the median of several runs each), reads each device's memory,
and writes the devices JSON the planner reads (pjit_pipe.planner.device_probe).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from pjit_pipe.cli.schedule_command import positive_int


def _sizes(text: str) -> list[int]:
    try:
        sizes = [int(float(s)) for s in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated byte counts such as 1e6,4e6, got {text!r}"
        ) from None
    if any(s < 4 for s in sizes):
        raise argparse.ArgumentTypeError(f"every size must be at least 4 bytes, got {text!r}")
    return sizes


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `probe` subcommand (JAX is imported only when it runs)."""
    p = subparsers.add_parser(
        "probe",
        help="measure the local devices' link bandwidths and memory for `plan --devices`",
        description=__doc__.split(":", 1)[1].strip(),
    )
    p.add_argument(
        "--out", metavar="FILE.json", help="write the devices JSON here (default: stdout)"
    )
    p.add_argument(
        "--sizes",
        type=_sizes,
        metavar="BYTES,...",
        help="bytes per transfer (default: 1, 4 and 16 MiB; on CPU 1 and 16 KiB)",
    )
    p.add_argument(
        "--repeats", type=positive_int, default=5, metavar="R", help="timed runs per pair and size"
    )
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Probe the devices and write (or print) their JSON description."""
    import jax

    from pjit_pipe.planner import probe_devices

    devices = jax.devices()
    if len(devices) < 2 and devices[0].platform == "cpu":
        raise ValueError(
            "probe: one CPU device has no link to time; set "
            "XLA_FLAGS=--xla_force_host_platform_device_count=N before running"
        )
    text = json.dumps(probe_devices(devices, args.sizes, args.repeats).to_json())
    if args.out is None:
        print(text)
        return 0
    Path(args.out).write_text(text + "\n")
    print(f"wrote {args.out}: {len(devices)} {devices[0].platform} devices")
    return 0

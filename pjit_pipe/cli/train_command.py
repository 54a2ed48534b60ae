"""`pjit-pipe train`: train an example model with a pipeline schedule and print the loss.

This module is the subcommand: its options and the choice between training in
this process (`train.train`) and over `--processes N` local processes
(`train_processes.launch`). It is apart from the loop so that those processes,
which run the loop, never import the launcher that starts them.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from typing import Any

from pjit_pipe.cli.compile_cache import add_cache_args
from pjit_pipe.cli.train import step_printer, train
from pjit_pipe.cli.train_args import (
    add_checkpoint_args,
    add_failure_args,
    add_process_args,
    add_training_args,
    check_failure_plan,
)


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "train",
        help="train an example model on a pipeline",
        description="Train an example model on a DxP mesh of devices under a pipeline "
        "schedule and print the loss of each step, through injected worker failures "
        "and rejoins. On a CPU-only machine the D*P devices are simulated.",
    )
    add_training_args(parser)
    add_failure_args(parser)
    add_checkpoint_args(parser)
    add_cache_args(parser)
    add_process_args(parser)
    parser.add_argument("--json", action="store_true", help="one JSON object per step")
    parser.add_argument(
        "--show-costs",
        action="store_true",
        help="measure each stage's F, B, W and a tick's fixed cost (ms) on the mesh and print "
        "them first (with --json: one object with key 'costs'; 'costs_arg' is for "
        "`schedule --costs`, 'tick' for `schedule --tick-cost`)",
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.async_weights is not None and args.schedule != "async-1f1b":
        from pjit_pipe.cli import UsageError

        raise UsageError(
            f"--async-weights {args.async_weights} applies to --schedule async-1f1b only, "
            f"not {args.schedule}; drop it or use --schedule async-1f1b"
        )
    if args.processes is not None:
        from pjit_pipe.cli.train_processes import launch

        return launch(args)
    if args.restart:
        from pjit_pipe.cli import UsageError

        raise UsageError("--restart restarts the processes of a --processes run; add --processes N")
    directory = args.checkpoint_dir
    if not (directory and os.path.isdir(directory) and os.listdir(directory)):
        # Nothing to resume: refuse a bad plan before JAX loads (train() checks a
        # resumed run's plan against the workers its checkpoint has down).
        check_failure_plan(args.fail, args.rejoin, *args.mesh[:2], args.steps)
    on_step, close = step_printer(args)
    try:
        with warnings.catch_warnings():
            warnings.showwarning = one_line_warning
            train(args, on_step)
    finally:
        close()
    return 0


def one_line_warning(message: Warning | str, *_: Any, **__: Any) -> None:
    """Print a warning (a skipped step, a damaged checkpoint passed over) as one
    line on stderr, without the source line Python adds."""
    print(f"warning: {' '.join(str(message).split())}", file=sys.stderr, flush=True)

"""The simulator: prices schedules under a cost model (`pjit_pipe.ir.Costs`) and draws them."""

from pjit_pipe.simulator.bounds import lower_bound
from pjit_pipe.simulator.simulate import SimResult, simulate

__all__ = ["SimResult", "lower_bound", "simulate"]

"""The simulator: prices schedules under a cost model (`pjit_pipe.ir.Costs`) and draws them."""

from pjit_pipe.simulator.bounds import lower_bound
from pjit_pipe.simulator.simulate import SimResult, best_of, simulate, steady_period

__all__ = ["SimResult", "best_of", "lower_bound", "simulate", "steady_period"]

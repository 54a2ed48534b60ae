"""The simulator: prices schedules under a cost model and draws them."""

from pjit_pipe.simulator.costs import Costs
from pjit_pipe.simulator.simulate import SimResult, simulate

__all__ = ["Costs", "SimResult", "simulate"]

"""Asynchronous 1F1B in the lowering: which weights each op reads, and the steady-state window one call runs."""

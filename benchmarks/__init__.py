"""pjit_pipe's benchmarks: `make bench` runs them all (`python -m benchmarks.run`);
run one with `python -m benchmarks.<name> --help`. Each prints its figures."""

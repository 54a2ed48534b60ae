"""pjit_pipe: a pipeline-parallel training compiler for JAX."""

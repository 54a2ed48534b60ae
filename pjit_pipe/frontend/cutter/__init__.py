"""The stage cutter: trace a Flax module, find its cut points, split its parameters into stages."""

"""The compute of a tick: stage forwards and split backwards, the loss, random keys, and the tick body and loop."""

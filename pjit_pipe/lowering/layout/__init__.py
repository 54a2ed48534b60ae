"""The training state's device layout: parameters, gradients and optimizer state of the stages a device holds."""

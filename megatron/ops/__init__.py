"""Single-device tensor operations the model and the parallel packages share: the fused cross entropy, the MLP's
activations. Pure: no process group, no module state."""

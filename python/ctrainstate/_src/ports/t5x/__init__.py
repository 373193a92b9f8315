"""t5x's partitioner, train states and optimizers (ctrainstate.t5x's modules re-export them)."""

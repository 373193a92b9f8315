"""ctrainstate.random's implementation (the models layer)."""

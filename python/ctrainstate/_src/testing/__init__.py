"""ctrainstate.testing's assertions in the ports layer (ctrainstate.testing re-exports them)."""

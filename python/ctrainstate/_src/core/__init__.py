"""flax.core's dict helpers in the models layer (ctrainstate.core re-exports them)."""

"""jax.debug in the app layer (ctrainstate.debug re-exports it)."""

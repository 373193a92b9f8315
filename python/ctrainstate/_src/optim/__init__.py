"""optax's optimizers in the models layer: the fused plans (base), transforms, combinators,
wrappers, schedules, losses and aliases (the public modules in ctrainstate.optim re-export them)."""

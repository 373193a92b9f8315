"""flax.training.train_state and flax.struct in the app layer (ctrainstate.train_state and
ctrainstate.struct re-export them)."""

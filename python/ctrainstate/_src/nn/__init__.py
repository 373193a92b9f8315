"""flax.linen's core in the models layer: boxed metadata, scopes, logical partitioning, Module,
summaries, lifted transforms (the public modules in ctrainstate.nn re-export them)."""

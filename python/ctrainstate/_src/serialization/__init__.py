"""flax.serialization in the app layer: state dicts and their msgpack bytes
(ctrainstate.serialization and ctrainstate.t5x.serialization re-export them)."""

"""The ports layer: t5x's and HuggingFace's Flax training helpers over the layers below
(ctrainstate.t5x and ctrainstate.hf re-export them)."""

"""HuggingFace's Flax example helpers (ctrainstate.hf's modules re-export them)."""

"""Checkpoints in the app layer: safetensors files and a JSON index per step (fileio,
store), orbax-style managers, pretrained Flax msgpack parameters (ctrainstate.checkpoint
re-exports them)."""

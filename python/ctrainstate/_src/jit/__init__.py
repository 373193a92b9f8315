"""The jit layer."""

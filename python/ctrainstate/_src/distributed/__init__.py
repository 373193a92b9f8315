"""Processes in the app layer: jax.distributed over MPI and NCCL, and
jax.experimental.multihost_utils (ctrainstate.distributed and ctrainstate.experimental
re-export them)."""

"""The breadth of jax.numpy and jax.lax the ports use (sorting, convolution, control flow, vmap, pmap), above the ops."""

"""Partitioning helpers (the models layer): lifted transforms of flax.linen.partitioning, regex partition rules."""

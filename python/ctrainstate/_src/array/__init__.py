"""The array layer: Array helpers, abstract values, the operator methods."""

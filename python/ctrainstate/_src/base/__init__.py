"""The base layer: dtypes, devices, config helpers, trace state, the hooks registry."""

"""The ops layer: primitive wrappers and their composites (elementwise, math, linalg, slicing, data movement)."""

"""Regenerate tests/data/optax_vectors.npz: optax's final params for every case of
tests/optim_cases.py and optax's schedule values for counts 0..119.

    JAX_PLATFORMS=cpu python tests/data/gen_optax_vectors.py
"""
import os
import sys

import numpy as np

here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(here))
import optim_cases as oc  # noqa: E402


def main():
    import optax
    out = {}
    for name in oc.CASES:
        out["case/" + name] = oc.run_optax(name)
    for name, make in oc.SCHEDULES.items():
        s = make(optax)
        out["schedule/" + name] = np.array([float(s(i)) for i in range(120)], np.float32)
    out["meta/optax_version"] = np.array(optax.__version__)
    np.savez_compressed(os.path.join(here, "optax_vectors.npz"), **out)
    print(f"wrote {len(out)} vectors (optax {optax.__version__})")


if __name__ == "__main__":
    main()

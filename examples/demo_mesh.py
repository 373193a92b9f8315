"""Demo: a (2, 4) mesh of CPU virtual devices, an array sharded over it, its layout.

Run: python examples/demo_mesh.py
Uses 8 CPU virtual devices unless CTRAINSTATE_NUM_CPU_DEVICES is already set.
"""
import os

os.environ.setdefault("CTRAINSTATE_NUM_CPU_DEVICES", "8")

import numpy as np  # noqa: E402

import ctrainstate as cts  # noqa: E402
from ctrainstate import P, NamedSharding  # noqa: E402


def main():
    mesh = cts.make_mesh((2, 4), ("data", "model"))
    print(f"devices: {cts.devices()}")
    print(f"mesh:    {mesh}")
    x = np.arange(8 * 16, dtype=np.float32).reshape(8, 16)
    for spec in (P("data", "model"), P(None, "model"), P(("data", "model"), None)):
        a = cts.device_put(x, NamedSharding(mesh, spec))
        print(f"\n{spec}: shard shape {a.sharding.shard_shape(a.shape)}")
        cts.visualize_array_sharding(a)
        assert np.array_equal(np.asarray(a), x)
    a = cts.device_put(x, NamedSharding(mesh, P("data", "model")))
    print("\nshard of device 5:", a.addressable_shards[5].index)
    print("bytes in use per device:", [d.memory_stats()["bytes_in_use"] for d in cts.devices()])
    b = cts.device_put(a, NamedSharding(mesh, P("model", None)))  # reshard device to device
    print("resharded to", b.sharding.spec, "exact:", np.array_equal(np.asarray(b), x))


if __name__ == "__main__":
    main()

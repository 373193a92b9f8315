"""A user's test module that needs 8 CPU devices (ctrainstate's pytest plugin gives them)."""
import numpy as np
import pytest

import ctrainstate as cts
from ctrainstate import NamedSharding, P, testing

pytestmark = pytest.mark.devices(8)


def test_eight_devices(cpu_devices):
    assert len(cpu_devices) == 8 and cts.device_count("cpu") == 8


def test_params_sharded_on_a_2x4_mesh(mesh):
    m = mesh((2, 4), ("data", "model"))
    w = cts.device_put(np.arange(32, dtype=np.float32).reshape(4, 8),
                       NamedSharding(m, P("data", "model")))
    testing.assert_sharding(w, P("data", "model"))
    assert {s.data.shape for s in w.addressable_shards} == {(2, 2)}

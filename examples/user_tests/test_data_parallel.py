"""A user's test module that needs 4 CPU devices, in the same pytest session as the 8-device
module (ctrainstate's pytest plugin runs whichever does not match in a fresh interpreter)."""
import numpy as np
import pytest

import ctrainstate as cts
from ctrainstate import NamedSharding, P, testing

pytestmark = pytest.mark.devices(4)


def test_four_devices(cpu_devices):
    assert len(cpu_devices) == 4 and cts.device_count("cpu") == 4


def test_batch_split_over_four_devices(mesh):
    m = mesh((4,), ("data",))
    x = cts.device_put(np.ones((8, 3), np.float32), NamedSharding(m, P("data")))
    testing.assert_shape([s.data for s in x.addressable_shards], (2, 3))
    testing.assert_trees_all_close(np.asarray(x).sum(), 24.0)

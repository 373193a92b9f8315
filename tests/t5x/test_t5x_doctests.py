"""The docstring examples of the t5x and HF port modules run: the public modules' (their module
docstrings) and their implementations' in ``_src`` (the functions' and classes')."""
import doctest
import importlib

import pytest

MODULES = ["ctrainstate.t5x", "ctrainstate.t5x.partitioning", "ctrainstate.t5x.train_state",
           "ctrainstate.t5x.optimizers", "ctrainstate.t5x.adafactor",
           "ctrainstate.t5x.serialization", "ctrainstate.t5x.utils", "ctrainstate.hf",
           "ctrainstate.hf.cast", "ctrainstate.hf.train_state", "ctrainstate.hf.model_parallel",
           "ctrainstate._src.ports.t5x.partitioning", "ctrainstate._src.ports.t5x.train_state",
           "ctrainstate._src.ports.t5x.optimizers", "ctrainstate._src.ports.t5x.adafactor",
           "ctrainstate._src.serialization.state_dict", "ctrainstate._src.ports.t5x.utils",
           "ctrainstate._src.ports.hf.cast", "ctrainstate._src.ports.hf.train_state",
           "ctrainstate._src.ports.hf.model_parallel"]


@pytest.mark.parametrize("name", MODULES)
def test_doctests(name):
    mod = importlib.import_module(name)
    res = doctest.testmod(mod, optionflags=doctest.ELLIPSIS)
    assert res.failed == 0

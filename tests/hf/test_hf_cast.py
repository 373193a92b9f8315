"""ctrainstate.hf's casts (hf/cast.py; HF FlaxPreTrainedModel.to_bf16 / _cast_floating_to): regression
tests for parity bugs; expectations from shared/reference/t5x_hf.md (section cited per test) and the
upstream code it describes."""

import numpy as np
import pytest

import ctrainstate as cts
from ctrainstate._src.base import dtypes as _dtypes
from ctrainstate import hf


BF16 = _dtypes.bfloat16


def _params():
    return {'b': {'scale': cts.device_put(np.ones(2, np.float32)),
                  'k': cts.device_put(np.ones(2, np.float16))},
            'a': cts.device_put(np.ones(3, np.float32)),
            'i': cts.device_put(np.arange(2, dtype=np.int32))}


def test_to_bf16_takes_a_mask():
    """HF ``FlaxPreTrainedModel.to_bf16(params, mask=None)`` (``_cast_floating_to``): the mask
    is a tree like the params with boolean leaves, True = cast; every floating leaf is cast
    (float16 too), integers never. ctrainstate's to_bf16 had no ``mask`` (TypeError) and left
    float16 leaves alone."""
    mask = {'a': True, 'b': {'k': True, 'scale': False}, 'i': True}
    r = hf.to_bf16(_params(), mask)
    assert r['a'].dtype == BF16 and r['b']['k'].dtype == BF16
    assert r['b']['scale'].dtype == np.float32 and r['i'].dtype == np.int32
    r = hf.to_fp16(_params(), mask)
    assert r['a'].dtype == np.float16 and r['b']['scale'].dtype == np.float32
    r = hf.to_fp32(hf.to_bf16(_params()), {'a': False, 'b': {'k': True, 'scale': True},
                                          'i': False})
    assert r['a'].dtype == BF16 and r['b']['k'].dtype == np.float32
    assert r['b']['scale'].dtype == np.float32
    # no mask: every float leaf
    r = hf.to_bf16(_params())
    assert r['b']['k'].dtype == BF16 and r['a'].dtype == BF16 and r['i'].dtype == np.int32


def test_cast_mask_of_another_structure_is_an_error():
    """HF zips the flattened mask with the params and silently casts the wrong leaves when
    they differ; ctrainstate raises (DESIGN.md: a clear error for a user error)."""
    with pytest.raises(ValueError, match='mask does not have the structure of params'):
        hf.to_bf16(_params(), {'a': True})

"""The fused-chain check shared by the CPU (tests/jit) and GPU (tests/gpu) tests: a jitted chain
of float32 elementwise steps gives the same bits fused and tiled (CPU) or as one chain kernel
(GPU), fused untiled, step by step, and eager."""
import numpy as np

import ctrainstate as cts
import ctrainstate.numpy as cnp


def assert_chain_bits(put, shape, seed=7):
    """``put(array, *spec)`` places the operands (a spec per dimension of ``shape``'s rank 2:
    "x", "y"); the chain has a broadcast operand, a scalar on the left and a chained right
    operand."""
    rng = np.random.default_rng(seed)
    x = put(rng.standard_normal(shape).astype(np.float32), "x", "y")
    b = put(rng.standard_normal(shape[1:]).astype(np.float32), "y")
    y = put(rng.standard_normal(shape).astype(np.float32), "x", "y")

    def f(x, b, y):
        h = cnp.sin(cnp.tanh((x + b) * 30.0) - y)
        return y - 2.0 / (cnp.exp(h) + 1.0) * y
    j = cts.jit(f)
    j(x, b, y)
    prog = j._programs.program([x, b, y], {})[0]
    assert prog.chains and max(n for _, n in prog.chains) >= 5, prog.chains
    runs = []
    for fuse, tiled in ((True, True), (True, False), (False, False)):
        prog.set_fusion(fuse, tiled)
        runs.append(np.asarray(j(x, b, y)).tobytes())
    assert runs[0] == runs[1] == runs[2] == np.asarray(f(x, b, y)).tobytes()

"""Checks shared by the sampler tests (test_random_dist.py, test_random_gamma.py,
test_random_discrete.py): a sample mean or an empirical CDF point against its closed form,
within a number of standard errors of the estimate (so a test fails on a wrong distribution,
not on sampling noise), and a sharded sampler against its unsharded result."""
import math
import os

import numpy as np


def sample_count(n, sanitized):
    """`n` samples for a statistical check, or `sanitized` under the sanitizers
    (tools/sanitize.sh). There the samplers run 15-20x slower, and what the sanitizers check
    (buffer bounds, undefined behaviour) does not need the sample sizes the statistics do:
    the README's run checks those at `n`. A `sanitized` count keeps the draws above the CPU
    kernels' parallel threshold (32768 elements), so the same paths run; the checks' bounds
    scale with the sample size."""
    return sanitized if os.environ.get("CTRAINSTATE_SANITIZED") == "1" else n


def mean_ok(x, mean, var, sigmas=5.0):
    """The sample mean is within `sigmas` standard errors sqrt(var / n) of the true mean."""
    x = np.asarray(x, np.float64)
    assert abs(x.mean() - mean) < sigmas * math.sqrt(var / x.size), (x.mean(), mean)


def cdf_ok(x, q, p, sigmas=5.0):
    """The fraction of samples <= q is within `sigmas` binomial standard errors of p."""
    x = np.asarray(x, np.float64)
    frac = (x <= q).mean()
    assert abs(frac - p) < sigmas * math.sqrt(p * (1 - p) / x.size), (q, frac, p)


def sharded_like_host(samplers, mesh, specs):
    """Each ``samplers[name](sharding)`` with ``out_sharding=NamedSharding(mesh, spec)`` is an
    Array equal to the unsharded result (``sharding=None``), and every device holds exactly its
    block of it (NaNs compare equal)."""
    import ctrainstate as cts
    for spec in specs:
        sharding = cts.NamedSharding(mesh, spec)
        for name, f in samplers.items():
            host = f(None)
            a = f(sharding)
            assert isinstance(a, cts.Array), name
            assert a.dtype == host.dtype and a.shape == host.shape, name
            np.testing.assert_array_equal(np.asarray(a), host, err_msg=f"{name} {spec}")
            for shard in a.addressable_shards:
                np.testing.assert_array_equal(np.asarray(shard.data), host[shard.index],
                                              err_msg=f"{name} {spec} {shard.index}")

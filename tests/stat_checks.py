"""Statistical checks shared by the sampler tests (test_random_more.py, test_random_gamma.py):
a sample mean or an empirical CDF point against its closed form, within a number of standard
errors of the estimate (so a test fails on a wrong distribution, not on sampling noise)."""
import math

import numpy as np


def mean_ok(x, mean, var, sigmas=5.0):
    """The sample mean is within `sigmas` standard errors sqrt(var / n) of the true mean."""
    x = np.asarray(x, np.float64)
    assert abs(x.mean() - mean) < sigmas * math.sqrt(var / x.size), (x.mean(), mean)


def cdf_ok(x, q, p, sigmas=5.0):
    """The fraction of samples <= q is within `sigmas` binomial standard errors of p."""
    x = np.asarray(x, np.float64)
    frac = (x <= q).mean()
    assert abs(frac - p) < sigmas * math.sqrt(p * (1 - p) / x.size), (q, frac, p)

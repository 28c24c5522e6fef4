"""Mean and Student-t confidence interval, shared by the reports (evaluate.py's samples, benchmarks/
learning_report.py's seeds), and the percentile bootstrap of a mean. The distributions are scipy.stats' and
numpy's, not our own; tests/test_learning_report.py checks the results against hand-computed values."""
import numpy as np
from scipy import stats

LEVEL = 0.95


def mean_ci(values, level=LEVEL):
    """{n, mean, sd, lo, hi}: the mean of the values and its Student-t interval, mean -+ t(n-1) * sd / sqrt(n)
    (sd with n - 1). None values are dropped; with fewer than 2 values there is no interval (lo = hi = None)."""
    xs = np.array([float(v) for v in values if v is not None])
    n = len(xs)
    if n == 0:
        return {"n": 0, "mean": None, "sd": None, "lo": None, "hi": None}
    m = float(xs.mean())
    if n < 2:
        return {"n": 1, "mean": m, "sd": None, "lo": None, "hi": None}
    sd = float(xs.std(ddof=1))
    h = float(stats.t.ppf(0.5 + level / 2.0, n - 1)) * sd / np.sqrt(n)
    return {"n": n, "mean": m, "sd": sd, "lo": m - h, "hi": m + h}


def bootstrap_mean_ci(values, level=LEVEL, n_boot=10_000, seed=0):
    """{n, mean, sd, lo, hi} like mean_ci, the interval a percentile bootstrap of the mean: the values resampled
    with replacement n_boot times (numpy's generator, a fixed seed: the same report twice). For values that are
    themselves paired differences (learning_report.py's per-task end - start) this is the paired bootstrap."""
    d = np.array([float(v) for v in values if v is not None])
    if len(d) < 2:
        return {"n": len(d), "mean": None, "sd": None, "lo": None, "hi": None}
    boots = d[np.random.default_rng(seed).integers(0, len(d), size=(n_boot, len(d)))].mean(axis=1)
    lo, hi = np.quantile(boots, [(1 - level) / 2, (1 + level) / 2])
    return {"n": len(d), "mean": float(d.mean()), "sd": float(d.std(ddof=1)), "lo": float(lo), "hi": float(hi)}

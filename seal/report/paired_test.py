"""The paired t test the learning checks register their contrasts with, and the seed count a pilot asks of it.

Our own few lines rather than scipy's (a development dependency only: ``tests/step/test_paired_test.py`` checks these
against it): Student's t distribution through the regularized incomplete beta function (its continued fraction,
evaluated by the modified Lentz method), its quantile by bisection.
"""

from __future__ import annotations

import math
from statistics import NormalDist


def _incomplete_beta_fraction(a: float, b: float, x: float) -> float:
    """The continued fraction of I_x(a, b), by the modified Lentz method (converges fast for x < (a + 1) / (a + b + 2))."""
    tiny, eps = 1e-300, 1e-15
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    result = d
    for m in range(1, 1000):
        for numerator in (
            m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
            -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1)),
        ):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + numerator / c
            c = c if abs(c) > tiny else tiny
            result *= c * d
        if abs(c * d - 1.0) < eps:
            return result
    raise ArithmeticError(f"the incomplete beta fraction did not converge (a={a}, b={b}, x={x})")


def regularized_incomplete_beta(a: float, b: float, x: float) -> float:
    """I_x(a, b), the cumulative distribution function of Beta(a, b) at ``x``."""
    if not 0.0 <= x <= 1.0:
        raise ValueError(f"x must be within [0, 1], got {x}")
    if x in (0.0, 1.0):
        return x
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    if x < (a + 1) / (a + b + 2):
        return math.exp(log_front) * _incomplete_beta_fraction(a, b, x) / a
    return 1.0 - math.exp(log_front) * _incomplete_beta_fraction(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with ``df`` degrees of freedom. The tail P(T > |t|) is I_x(df/2, 1/2) at
    x = df / (df + t^2); near t = 0 that x rounds to 1, so there it is computed as 1 - I_(1-x)(1/2, df/2)."""
    t2 = t * t
    if t2 < df:
        tail = 0.5 * (1.0 - regularized_incomplete_beta(0.5, df / 2, t2 / (df + t2)))
    else:
        tail = 0.5 * regularized_incomplete_beta(df / 2, 0.5, df / (df + t2))
    return 1.0 - tail if t > 0 else tail


def t_quantile(q: float, df: float) -> float:
    """The ``q`` quantile of Student's t with ``df`` degrees of freedom (bisection on ``t_cdf``)."""
    if not 0.0 < q < 1.0:
        raise ValueError(f"q must be within (0, 1), got {q}")
    lo, hi = -1e3, 1e3
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if t_cdf(mid, df) < q else (lo, mid)
    return (lo + hi) / 2


def paired_t(differences: list[float], predicted: int = 0) -> dict:
    """The paired t test of per-seed differences against 0: mean, standard error, t, degrees of freedom and p, one-sided
    in the ``predicted`` direction (-1: below 0, +1: above 0) or two-sided (0). ``count`` is how many differences lie
    in the predicted direction (for a two-sided test: below 0). Differences that are all 0 give t = 0, p = 1 (one-sided:
    0.5): a link that does nothing passes no test."""
    n = len(differences)
    if n < 2:
        raise ValueError(f"a paired t test needs at least 2 differences, got {n}")
    mean = sum(differences) / n
    sd = math.sqrt(sum((d - mean) ** 2 for d in differences) / (n - 1))
    se = sd / math.sqrt(n)
    t = mean / se if se > 0 else (0.0 if mean == 0 else math.copysign(math.inf, mean))
    df = n - 1
    if predicted == 0:
        p = 2 * min(t_cdf(t, df), 1 - t_cdf(t, df)) if math.isfinite(t) else 0.0
        count = sum(d < 0 for d in differences)
    elif predicted in (-1, 1):
        tail = t_cdf(predicted * t, df) if math.isfinite(t) else float(predicted * t > 0)
        p = 1 - tail
        count = sum(predicted * d > 0 for d in differences)
    else:
        raise ValueError(f"predicted must be -1, 0 or +1, got {predicted}")
    return {"n": n, "mean": mean, "sd": sd, "se": se, "t": t, "df": df, "p": p, "count": count}


def paired_t_power(effect: float, sd: float, n: int, alpha: float) -> float:
    """The power of a one-sided paired t test at ``alpha`` over ``n`` seeds when the differences have mean ``effect``
    (in the predicted direction) and standard deviation ``sd``: P(t > the critical t), the normal approximation to
    the noncentral t (close from 10 seeds on; the seed counts chosen with it are rounded up)."""
    critical = t_quantile(1 - alpha, n - 1)
    return NormalDist().cdf(effect * math.sqrt(n) / sd - critical)


def seeds_for_power(effect: float, sd: float, alpha: float, power: float = 0.9, n_max: int = 200) -> int | None:
    """The fewest seeds (at least 3) for ``power`` at ``alpha``, or None when even ``n_max`` do not reach it."""
    return next((n for n in range(3, n_max + 1) if paired_t_power(effect, sd, n, alpha) >= power), None)

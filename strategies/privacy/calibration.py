"""Noise calibration: the smallest noise multiplier whose epsilon after a run's steps is within a target."""

from __future__ import annotations

import math
from collections.abc import Callable

from strategies.privacy.accounting import (
    _check_accountant,
    _check_delta,
    _check_sample_rate,
    _check_steps,
    _epsilon,
    _is_real,
)

_MAX_NOISE_MULTIPLIER = 1e4  # find_noise_multiplier gives up above this


def find_noise_multiplier(
    target_epsilon: float, sample_rate: float, steps: int, delta: float, accountant: str = "rdp"
) -> float:
    """The smallest noise multiplier (to 1% of the target) whose epsilon after `steps` steps is at most
    `target_epsilon`: a bracketed root search on sigma, since epsilon falls as the noise grows."""
    if not _is_real(target_epsilon) or not math.isfinite(target_epsilon) or target_epsilon <= 0:
        raise ValueError(f"target_epsilon must be a finite number > 0, got {target_epsilon!r}")
    q = _check_sample_rate(sample_rate)
    steps = _check_steps(steps)
    if steps == 0:
        raise ValueError("steps must be an int >= 1 to calibrate noise (0 steps spend no privacy), got 0")
    delta = _check_delta(delta)
    accountant = _check_accountant(accountant)
    target = float(target_epsilon)

    def eps(sigma: float, kind: str) -> float:
        return _epsilon([(sigma, q, steps)], delta, kind)

    # RDP first (cheap); PRV is never above RDP, so the RDP answer brackets the PRV one from above
    hi = 1.0
    while hi < _MAX_NOISE_MULTIPLIER and eps(hi, "rdp") > target:
        hi = min(2 * hi, _MAX_NOISE_MULTIPLIER)
    if eps(hi, "rdp") > target:
        if accountant == "rdp" or eps(hi, accountant) > target:
            raise ValueError(
                f"target_epsilon={target:g} is unreachable: epsilon is still {eps(hi, accountant):.4g} at "
                f"noise_multiplier={hi:g} (the largest tried) for sample_rate={q:g}, steps={steps}, "
                f"delta={delta:g}"
            )
        return _calibrate(lambda s: eps(s, accountant), target, hi / 2, hi)
    sigma = _calibrate(lambda s: eps(s, "rdp"), target, hi / 2, hi)
    if accountant == "rdp":
        return sigma
    return _calibrate(lambda s: eps(s, "prv"), target, 0.75 * sigma, sigma)


def _calibrate(eps_of: Callable[[float], float], target: float, lo: float, hi: float) -> float:
    """A sigma with 0.995 * target <= eps_of(sigma) <= target, given eps_of(hi) <= target (eps_of falls as
    sigma grows): widen `lo` until eps_of(lo) > target, then regula falsi (Illinois) on log sigma and
    log epsilon, with bisection steps where the interpolation would not shrink the bracket."""
    eps_hi = eps_of(hi)
    eps_lo = eps_of(lo)
    while eps_lo <= target:
        if lo < 1e-6:
            return lo
        hi, eps_hi, lo = lo, eps_lo, lo / 2
        eps_lo = eps_of(lo)
    f_lo = math.log(eps_lo / target) if math.isfinite(eps_lo) else math.inf
    f_hi = math.log(max(eps_hi, 1e-300) / target)
    kept = 0  # which end the last step kept: Illinois halves its f when it is kept twice
    for _ in range(200):
        if eps_hi >= 0.995 * target or hi - lo <= 1e-10 * hi:
            break
        x_lo, x_hi = math.log(lo), math.log(hi)
        x = x_hi - f_hi * (x_hi - x_lo) / (f_hi - f_lo) if math.isfinite(f_lo) else (x_lo + x_hi) / 2
        margin = 0.01 * (x_hi - x_lo)
        x = min(max(x, x_lo + margin), x_hi - margin)
        mid = math.exp(x)
        eps_mid = eps_of(mid)
        f_mid = math.log(max(eps_mid, 1e-300) / target)
        if eps_mid > target:
            lo, f_lo = mid, f_mid
            if kept == -1:
                f_hi /= 2
            kept = -1
        else:
            hi, eps_hi, f_hi = mid, eps_mid, f_mid
            if kept == 1:
                f_lo /= 2
            kept = 1
    return hi

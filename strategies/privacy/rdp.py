"""The RDP accountant: the sampled Gaussian mechanism's Renyi DP (Mironov et al. 2019) as (epsilon, delta)."""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Sequence

import numpy as np
import torch

# the RDP orders searched for the best conversion to (epsilon, delta): Opacus's and TF Privacy's grid
DEFAULT_ORDERS: tuple[float, ...] = tuple([1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64)))
_SERIES_CUTOFF = -30.0  # the fractional-order series stops once its terms fall below exp(-30)

Segment = tuple[float, float, int]  # (noise_multiplier, sample_rate, steps)


def _logsumexp(values: np.ndarray) -> float:
    """log(sum(exp(values))) without overflow; -inf for an empty or all -inf input."""
    if values.size == 0:
        return -math.inf
    top = float(np.max(values))
    if top == -math.inf:
        return -math.inf
    return top + math.log(float(np.sum(np.exp(values - top))))


def _log_erfc(x: np.ndarray) -> np.ndarray:
    """log(erfc(x)), accurate far in the tail: erfc(x) = erfcx(x) * exp(-x^2) for x > 0."""
    t = torch.from_numpy(np.asarray(x, dtype=np.float64))
    positive = torch.log(torch.special.erfcx(t.clamp(min=0.0))) - t.clamp(min=0.0) ** 2
    negative = torch.log(torch.special.erfc(t.clamp(max=0.0)))
    return torch.where(t > 0, positive, negative).numpy()


def _log_a_integer(q: float, sigma: float, alpha: int) -> float:
    """log A_alpha for an integer order: the binomial sum of Mironov et al. (2019), Section 3.3."""
    i = np.arange(alpha + 1, dtype=np.float64)
    log_binom = np.array(
        [math.lgamma(alpha + 1) - math.lgamma(k + 1) - math.lgamma(alpha - k + 1) for k in i]
    )
    terms = log_binom + i * math.log(q) + (alpha - i) * math.log1p(-q) + (i * i - i) / (2 * sigma**2)
    return _logsumexp(terms)


def _log_a_fractional(q: float, sigma: float, alpha: float) -> float:
    """log A_alpha for a fractional order: the two convergent series of Mironov et al. (2019), split at z0
    (where the mixture ratio crosses 1); summed in log-space with positive and negative terms apart."""
    z0 = sigma**2 * math.log(1 / q - 1) + 0.5
    log_q, log_1q = math.log(q), math.log1p(-q)
    n = 128
    while True:
        i = np.arange(n, dtype=np.float64)
        j = alpha - i
        # |binom(alpha, i)| = prod_{k<i} |alpha - k| / (k + 1); its sign flips at each k > alpha
        factors = np.log(np.abs(alpha - i[:-1])) - np.log(i[:-1] + 1)
        log_binom = np.concatenate(([0.0], np.cumsum(factors)))
        negatives = np.concatenate(([0], np.cumsum(alpha - i[:-1] < 0)))
        sign = np.where(negatives % 2 == 0, 1.0, -1.0)
        log_s0 = (
            log_binom
            + i * log_q
            + j * log_1q
            + (i * i - i) / (2 * sigma**2)
            + math.log(0.5)
            + _log_erfc((i - z0) / (math.sqrt(2) * sigma))
        )
        log_s1 = (
            log_binom
            + j * log_q
            + i * log_1q
            + (j * j - j) / (2 * sigma**2)
            + math.log(0.5)
            + _log_erfc((z0 - j) / (math.sqrt(2) * sigma))
        )
        small = np.nonzero(np.maximum(log_s0, log_s1) < _SERIES_CUTOFF)[0]
        small = small[small > alpha]  # past the order the terms only shrink
        if small.size or n >= 1 << 20:
            stop = int(small[0]) + 1 if small.size else n
            break
        n *= 2
    terms = np.concatenate((log_s0[:stop], log_s1[:stop]))
    signs = np.concatenate((sign[:stop], sign[:stop]))
    log_pos, log_neg = _logsumexp(terms[signs > 0]), _logsumexp(terms[signs < 0])
    if log_neg == -math.inf:
        return log_pos
    if log_neg >= log_pos:  # rounding: A_alpha >= 1 always, so this cannot be the true value
        return 0.0
    return log_pos + math.log1p(-math.exp(log_neg - log_pos))


def _rdp_one_step(sigma: float, q: float, alpha: float) -> float:
    """Renyi divergence of order alpha of one sampled Gaussian step (q=0: 0, q=1: the Gaussian's)."""
    if q == 0:
        return 0.0
    if q == 1:
        return alpha / (2 * sigma**2)
    if float(alpha).is_integer():
        log_a = _log_a_integer(q, sigma, int(alpha))
    else:
        log_a = _log_a_fractional(q, sigma, alpha)
    return max(log_a, 0.0) / (alpha - 1)


@functools.lru_cache(maxsize=256)
def _rdp_per_step(sigma: float, q: float, orders: tuple[float, ...]) -> np.ndarray:
    """One step's RDP at each order, cached: bisection and the PRV grid sizing ask for it repeatedly."""
    rdp = np.array([_rdp_one_step(sigma, q, a) for a in orders])
    rdp.flags.writeable = False
    return rdp


def _rdp(history: Iterable[Segment], orders: Sequence[float] = DEFAULT_ORDERS) -> np.ndarray:
    """RDP of the whole history at each order: RDP composes by adding."""
    total = np.zeros(len(orders))
    for sigma, q, steps in history:
        if steps:
            total += steps * _rdp_per_step(sigma, q, tuple(orders))
    return total


def _rdp_to_epsilon(rdp: np.ndarray, delta: float, orders: Sequence[float] = DEFAULT_ORDERS) -> float:
    """The smallest epsilon over the orders by Balle et al. (2020), Thm 21:
    eps = rdp + log((a-1)/a) - (log(delta) + log(a)) / (a-1)."""
    a = np.asarray(orders, dtype=np.float64)
    eps = rdp + np.log1p(-1 / a) - (math.log(delta) + np.log(a)) / (a - 1)
    return max(float(np.nanmin(eps)), 0.0)


def _rdp_epsilon(history: Sequence[Segment], delta: float) -> float:
    if not any(steps for _, _, steps in history):
        return 0.0
    return _rdp_to_epsilon(_rdp(history), delta)


def _tail_bound(rdp: np.ndarray, tau: float, orders: Sequence[float] = DEFAULT_ORDERS) -> float:
    """An s with P[|privacy loss| > s] <= tau (Chernoff bound from the RDP, both pair orders): the
    half-width of the PRV grid, so that truncating and wrapping around lose at most tau of the mass."""
    a = np.asarray(orders, dtype=np.float64)
    return float(np.min(rdp + math.log(1 / tau) / (a - 1)))

"""The PRV accountant: the privacy loss discretised on a grid and composed by FFT (Gopi et al. 2021)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from strategies.privacy.rdp import Segment, _rdp, _tail_bound

PRV_EPS_ERROR = 0.01  # the PRV accountant's discretisation error in epsilon (absolute)
PRV_DELTA_ERROR_FRACTION = 1e-3  # ... and in delta, as a fraction of delta
_PRV_MAX_CELLS = 1 << 21  # grid cap: beyond it the mesh widens and eps_error grows with it


def _erfc_pair(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(erfc(x), erfc(-x)), both accurate in their small tails, from one evaluation at |x|."""
    small = torch.special.erfc(torch.from_numpy(np.abs(np.asarray(x, dtype=np.float64)))).numpy()
    return np.where(x >= 0, small, 2 - small), np.where(x >= 0, 2 - small, small)


def _x_of_loss(t: np.ndarray, sigma: float, q: float) -> tuple[np.ndarray, np.ndarray]:
    """The noisy output x at which the loss log(P(x)/Q(x)) equals t, P = (1-q)N(0,s^2) + qN(1,s^2),
    Q = N(0,s^2); and where it exists (t > log(1-q))."""
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        arg = np.expm1(np.minimum(t, 0.0)) + q  # e^t - (1 - q) for t <= 0, exact near t = log(1 - q)
        log_big = t + np.log1p(-(1 - q) * np.exp(-np.maximum(t, 0.0)))  # log(e^t - (1 - q)) for t > 0
        valid = (t > 0) | (arg > 0)
        log_arg = np.where(t > 0, log_big, np.log(np.where(arg > 0, arg, 1.0)))
    return sigma**2 * (log_arg - math.log(q)) + 0.5, valid


def _survival_and_cdf(t: np.ndarray, sigma: float, q: float, remove: bool) -> tuple[np.ndarray, np.ndarray]:
    """P[Y > t] and P[Y <= t] of the privacy loss Y, each from its own erfc so both tails stay accurate.
    remove: Y = log(P/Q)(X), X ~ P; else (add) Y = log(Q/P)(X), X ~ Q."""
    r2s = math.sqrt(2) * sigma
    if remove:
        x, valid = _x_of_loss(t, sigma, q)
        upper0, lower0 = _erfc_pair(x / r2s)
        upper1, lower1 = _erfc_pair((x - 1) / r2s)
        survival = ((1 - q) * upper0 + q * upper1) / 2
        cdf = ((1 - q) * lower0 + q * lower1) / 2
        return np.where(valid, survival, 1.0), np.where(valid, cdf, 0.0)
    x, valid = _x_of_loss(-t, sigma, q)  # Y > t  <=>  loss of the other order < -t  <=>  X < x(-t)
    cdf, survival = _erfc_pair(x / r2s)
    return np.where(valid, survival / 2, 0.0), np.where(valid, cdf / 2, 1.0)


def _truncated_mean(sigma: float, q: float, remove: bool, lo: float, hi: float) -> float | None:
    """E[Y | lo < Y <= hi], integrated over the noisy output x (composite Gauss-Legendre): the mean the
    discretisation is shifted to match (Gopi et al. 2021, Section 5); None where the range holds no mass."""

    def x_at(t: float) -> float:
        x, valid = _x_of_loss(np.array([t]), sigma, q)
        return float(x[0]) if valid[0] else -math.inf

    if remove:  # Y = g(X), g increasing
        x_lo, x_hi = x_at(lo), x_at(hi)
    else:  # Y = -g(X)
        x_lo, x_hi = x_at(-hi), x_at(-lo)
        if x_hi == -math.inf:
            x_hi = math.inf
    x_lo, x_hi = max(x_lo, -14 * sigma), min(x_hi, 1 + 14 * sigma)  # beyond: density below e^-98
    if x_hi <= x_lo:
        return None
    width = min(sigma, sigma**2) / 2
    panels = int(min(max(math.ceil((x_hi - x_lo) / width), 1), 200_000))
    nodes, weights = np.polynomial.legendre.leggauss(16)
    edges = np.linspace(x_lo, x_hi, panels + 1)
    half = np.diff(edges)[:, None] / 2
    x = (edges[:-1, None] + half * (nodes[None, :] + 1)).ravel()
    w = (half * weights[None, :]).ravel()
    with np.errstate(divide="ignore"):
        g = np.logaddexp(math.log1p(-q) if q < 1 else -math.inf, math.log(q) + (x - 0.5) / sigma**2)
    density = np.exp(-(x**2) / (2 * sigma**2))
    if remove:
        density = (1 - q) * density + q * np.exp(-((x - 1) ** 2) / (2 * sigma**2))
    else:
        g = -g
    mass = float(np.sum(w * density))
    return float(np.sum(w * density * g)) / mass if mass > 0 else None


def _discretise(sigma: float, q: float, remove: bool, n: int, h: float) -> tuple[np.ndarray, float]:
    """The loss truncated to the grid j*h (j in [-n/2, n/2)), one cell per point, and the shift that
    makes its mean the truncated continuous mean."""
    edges = (np.arange(-n // 2, n // 2 + 1) - 0.5) * h
    survival, cdf = _survival_and_cdf(edges, sigma, q, remove)
    # mass of a cell from the cdf in the lower half and from the survival function in the upper half
    pmf = np.where(survival[1:] >= 0.5, cdf[1:] - cdf[:-1], survival[:-1] - survival[1:])
    pmf = np.clip(pmf, 0.0, None)
    total = float(pmf.sum())
    if total <= 0:  # cannot happen: the grid holds the loss's bulk by construction (see _tail_bound)
        raise RuntimeError(f"the privacy loss grid (half-width {n * h / 2:.3g}) holds no mass")
    pmf /= total
    points = np.arange(-n // 2, n // 2) * h
    mean = _truncated_mean(sigma, q, remove, float(edges[0]), float(edges[-1]))
    return pmf, 0.0 if mean is None else mean - float(points @ pmf)


def _epsilon_of_pmf(pmf: np.ndarray, z: np.ndarray, delta: float) -> float:
    """The smallest eps >= 0 with delta(eps) = sum_{z > eps} p (1 - exp(eps - z)) <= delta, for the
    discrete loss: bisection over the grid, then the exact root inside the bracketing cell."""

    def delta_at(eps: float, start: int) -> float:
        tail = slice(start, None)
        return float(np.sum(pmf[tail] * -np.expm1(np.minimum(eps - z[tail], 0.0))))

    first = int(np.searchsorted(z, 0.0, side="right"))  # grid points above 0
    if first >= len(z) or delta_at(0.0, first) <= delta:
        return 0.0
    lo, hi = first, len(z) - 1  # delta(z[lo]) > delta ... find the first grid point where it is <= delta
    if delta_at(float(z[hi]), hi) > delta:  # beyond the grid: no bound from here
        return math.inf
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if delta_at(float(z[mid]), mid) > delta:
            lo = mid
        else:
            hi = mid
    # on (z[lo], z[hi]]: delta(eps) = A - exp(eps - z[hi]) * B, the sums over the points from hi on
    a = float(np.sum(pmf[hi:]))
    b = float(np.sum(pmf[hi:] * np.exp(z[hi] - z[hi:])))
    if a - delta <= 0 or b <= 0:
        return float(z[hi])
    return float(min(max(z[hi] + math.log((a - delta) / b), z[lo]), z[hi]))


def _fft_size(n: int) -> int:
    """The smallest even n' >= n whose prime factors are 2, 3 and 5: FFTs of such sizes are fast."""
    best = 1 << max(n - 1, 1).bit_length()
    power5 = 1
    while power5 < best:
        power35 = power5
        while power35 < best:
            m = power35 * 2
            while m < n:
                m *= 2
            best = min(best, m)
            power35 *= 3
        power5 *= 5
    return best


def _prv_epsilon(
    history: Sequence[Segment],
    delta: float,
    eps_error: float = PRV_EPS_ERROR,
    delta_error: float | None = None,
) -> float:
    """Upper bound on epsilon by numerical composition of the privacy loss (Gopi et al. 2021): each
    (sigma, q) loss is discretised once, raised to its step count in the Fourier domain, and the segments
    multiplied there; eps_upper = eps(delta - delta_error) + eps_error, the max over both pair orders."""
    counts: dict[tuple[float, float], int] = {}
    for sigma, q, steps in history:  # composition commutes: equal (sigma, q) anywhere in the history merge
        if steps:
            counts[(sigma, q)] = counts.get((sigma, q), 0) + steps
    total = sum(counts.values())
    if total == 0:
        return 0.0
    if delta_error is None:
        delta_error = delta * PRV_DELTA_ERROR_FRACTION
    segments = [(s, q, k) for (s, q), k in counts.items()]
    rdp_total = _rdp(segments)
    half_width = _tail_bound(rdp_total, delta_error / 4)
    for sigma, q, _ in segments:
        half_width = max(half_width, _tail_bound(_rdp([(sigma, q, 1)]), delta_error / (8 * total)))
    half_width = max(half_width, eps_error) + 1.0
    # mesh of Gopi et al. (2021), Thm 5.5 / their reference code: the composed error stays below eps_error
    spread = math.sqrt(total / 2 * math.log(12 / delta_error))
    h = eps_error / spread
    n = _fft_size(2 * math.ceil(half_width / h))
    if n > _PRV_MAX_CELLS:  # a coarser mesh keeps the cost bounded; the error bound grows accordingly
        n = _PRV_MAX_CELLS
        h = 2 * half_width / n
        eps_error = h * spread
    points = np.arange(-n // 2, n // 2) * h
    epsilons = []
    for remove in (True, False):
        spectrum = np.ones(n // 2 + 1, dtype=np.complex128)
        shift = 0.0
        for sigma, q, steps in segments:
            pmf, mean_shift = _discretise(sigma, q, remove, n, h)
            spectrum *= np.fft.rfft(np.fft.ifftshift(pmf)) ** steps  # index 0 holds the loss 0
            shift += steps * mean_shift
        composed = np.fft.fftshift(np.fft.irfft(spectrum, n=n))
        # FFT rounding: its size shows in the negative entries (the true pmf is >= 0); a sum over the
        # grid may be off by n times it, which is charged to delta like delta_error
        rounding = n * max(-float(composed.min()), np.finfo(np.float64).eps * float(composed.max()))
        target = delta - delta_error - 2 * rounding
        if target < delta / 2:  # rounding would dominate: no bound from here (the caller falls back to RDP)
            return math.inf
        epsilons.append(_epsilon_of_pmf(composed, points + shift, target) + eps_error)
    return max(epsilons)

"""Privacy accountants for DP-SGD: how much (epsilon, delta) a run of Poisson-subsampled Gaussian steps spends.

Two accountants, both upper bounds for add/remove-one adjacency with clipping norm 1 (noise std = sigma):

* "rdp": Renyi DP of the sampled Gaussian mechanism (Mironov, Talwar, Zhang 2019, "Renyi Differential
  Privacy of the Sampled Gaussian Mechanism"), converted to (epsilon, delta) with Balle et al. 2020
  ("Hypothesis testing interpretations and Renyi DP", Thm 21) and minimised over a grid of orders.
* "prv": the privacy loss random variable discretised on a grid and composed by FFT (Gopi, Lee,
  Wutschitz 2021, "Numerical Composition of Differential Privacy"); tighter. It returns the upper end of
  the paper's error bounds (eps_error, delta_error), taken over both orders of the neighbouring pair, and
  never more than the RDP bound (both are valid upper bounds, so the smaller one is too).

A run's history is a list of (noise_multiplier, sample_rate, steps) segments, so a run whose sample rate
changes on a restart (another world size, another batch size) keeps counting correctly.
"""

from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
import torch

ACCOUNTANTS = ("rdp", "prv")
# the RDP orders searched for the best conversion to (epsilon, delta): Opacus's and TF Privacy's grid
DEFAULT_ORDERS: tuple[float, ...] = tuple([1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64)))
PRV_EPS_ERROR = 0.01  # the PRV accountant's discretisation error in epsilon (absolute)
PRV_DELTA_ERROR_FRACTION = 1e-3  # ... and in delta, as a fraction of delta
_PRV_MAX_CELLS = 1 << 21  # grid cap: beyond it the mesh widens and eps_error grows with it
_MAX_NOISE_MULTIPLIER = 1e4  # find_noise_multiplier gives up above this
_SERIES_CUTOFF = -30.0  # the fractional-order series stops once its terms fall below exp(-30)

Segment = tuple[float, float, int]  # (noise_multiplier, sample_rate, steps)


# ---------------------------------------------------------------------------------------------- input checks


def _is_real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _check_noise_multiplier(value: Any, name: str = "noise_multiplier") -> float:
    if not _is_real(value) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return float(value)


def _check_sample_rate(value: Any) -> float:
    if not _is_real(value) or not 0 < value <= 1:
        raise ValueError(f"sample_rate must be a number in (0, 1], got {value!r}")
    return float(value)


def _check_steps(value: Any, name: str = "steps") -> int:
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{name} must be an int >= 0, got {value!r}")
    return int(value)


def _check_delta(value: Any) -> float:
    if not _is_real(value) or not 0 < value < 1:
        raise ValueError(f"delta must be a number in (0, 1), got {value!r}")
    return float(value)


def _check_accountant(value: Any, name: str = "accountant") -> str:
    if value not in ACCOUNTANTS:
        raise ValueError(f"{name} must be one of {ACCOUNTANTS}, got {value!r}")
    return value


# ---------------------------------------------------------------------------------------------- numerics


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


def _erfc_pair(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(erfc(x), erfc(-x)), both accurate in their small tails, from one evaluation at |x|."""
    small = torch.special.erfc(torch.from_numpy(np.abs(np.asarray(x, dtype=np.float64)))).numpy()
    return np.where(x >= 0, small, 2 - small), np.where(x >= 0, 2 - small, small)


# ---------------------------------------------------------------------------------------------- RDP


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


# ---------------------------------------------------------------------------------------------- PRV


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


def _epsilon(history: Sequence[Segment], delta: float, accountant: str) -> float:
    rdp = _rdp_epsilon(history, delta)
    if accountant == "rdp" or rdp == 0.0:
        return rdp
    return min(_prv_epsilon(history, delta), rdp)


# ---------------------------------------------------------------------------------------------- public API


def compute_epsilon(
    noise_multiplier: float, sample_rate: float, steps: int, delta: float, accountant: str = "rdp"
) -> float:
    """Epsilon spent by `steps` DP-SGD steps (Poisson sampling at `sample_rate`, noise std
    `noise_multiplier` x clipping norm) at `delta`: an upper bound from the chosen accountant."""
    sigma = _check_noise_multiplier(noise_multiplier)
    q = _check_sample_rate(sample_rate)
    steps = _check_steps(steps)
    delta = _check_delta(delta)
    accountant = _check_accountant(accountant)
    return _epsilon([(sigma, q, steps)], delta, accountant)


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


class PrivacyAccountant:
    """Counts a run's privacy spending: a history of (noise_multiplier, sample_rate, steps) segments, saved
    in checkpoints so that a resumed run (even with another world size, hence another sample rate) keeps
    counting."""

    def __init__(self, kind: str = "rdp") -> None:
        self.kind = _check_accountant(kind, "kind")
        self.history: list[Segment] = []

    def step(self, noise_multiplier: float, sample_rate: float, n: int = 1) -> None:
        """Record `n` steps at (noise_multiplier, sample_rate); extends the last segment when they match."""
        sigma = _check_noise_multiplier(noise_multiplier)
        q = _check_sample_rate(sample_rate)
        n = _check_steps(n, "n")
        if n == 0:
            return
        if self.history and self.history[-1][:2] == (sigma, q):
            self.history[-1] = (sigma, q, self.history[-1][2] + n)
        else:
            self.history.append((sigma, q, n))

    @property
    def steps(self) -> int:
        """The number of steps recorded."""
        return sum(steps for _, _, steps in self.history)

    def epsilon(self, delta: float) -> float:
        """Epsilon spent by the whole history at `delta` (0 before the first step)."""
        return _epsilon(self.history, _check_delta(delta), self.kind)

    def epsilon_after(
        self, extra_steps: int, noise_multiplier: float, sample_rate: float, delta: float
    ) -> float:
        """Epsilon the run would have spent after `extra_steps` more steps at (noise_multiplier,
        sample_rate): lets a run stop before it exceeds its budget. The history is left as it is."""
        extra = (_check_noise_multiplier(noise_multiplier), _check_sample_rate(sample_rate))
        history = [*self.history, (*extra, _check_steps(extra_steps, "extra_steps"))]
        return _epsilon(history, _check_delta(delta), self.kind)

    def state_dict(self) -> dict[str, Any]:
        """The kind and the history as plain JSON-able values."""
        return {"kind": self.kind, "history": [[sigma, q, steps] for sigma, q, steps in self.history]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the history saved by `state_dict` (this accountant keeps its own kind: the history is
        valid for either)."""
        if not isinstance(state, dict) or "history" not in state:
            raise ValueError(f"state must be a dict from PrivacyAccountant.state_dict(), got {state!r}")
        _check_accountant(state.get("kind", self.kind), "state['kind']")
        history: list[Segment] = []
        for entry in state["history"]:
            if not isinstance(entry, (list, tuple)) or len(entry) != 3:
                raise ValueError(
                    f"state['history'] entries must be [noise_multiplier, sample_rate, steps], got {entry!r}"
                )
            sigma, q, steps = entry
            history.append((_check_noise_multiplier(sigma), _check_sample_rate(q), _check_steps(steps)))
        self.history = history

    def __repr__(self) -> str:
        return f"PrivacyAccountant(kind={self.kind!r}, history={self.history!r})"

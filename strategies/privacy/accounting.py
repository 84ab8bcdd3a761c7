"""Privacy accountants for DP-SGD: how much (epsilon, delta) a run of Poisson-subsampled Gaussian steps spends.

Two accountants, both upper bounds for add/remove-one adjacency with clipping norm 1 (noise std = sigma):

* "rdp" (rdp.py): Renyi DP of the sampled Gaussian mechanism (Mironov, Talwar, Zhang 2019, "Renyi
  Differential Privacy of the Sampled Gaussian Mechanism"), converted to (epsilon, delta) with Balle et al.
  2020 ("Hypothesis testing interpretations and Renyi DP", Thm 21) and minimised over a grid of orders.
* "prv" (prv.py): the privacy loss random variable discretised on a grid and composed by FFT (Gopi, Lee,
  Wutschitz 2021, "Numerical Composition of Differential Privacy"); tighter. It returns the upper end of
  the paper's error bounds (eps_error, delta_error), taken over both orders of the neighbouring pair, and
  never more than the RDP bound (both are valid upper bounds, so the smaller one is too).

A run's history is a list of (noise_multiplier, sample_rate, steps) segments, so a run whose sample rate
changes on a restart (another world size, another batch size) keeps counting correctly. Here: the
input checks, `compute_epsilon` and the `PrivacyAccountant`; `find_noise_multiplier` (calibration.py)
solves for the noise.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Any

from strategies.privacy.prv import _prv_epsilon
from strategies.privacy.rdp import Segment, _rdp_epsilon

ACCOUNTANTS = ("rdp", "prv")


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

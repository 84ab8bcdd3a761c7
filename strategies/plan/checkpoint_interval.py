"""How often to checkpoint, from the save cost and the failure rate: Young's interval sqrt(2 C MTBF) (Young
1974; Daly 2006 shows it is the first-order optimum), and the share of the run it loses to saving and to
the work redone after a failure. `trainer plan` prints it for the planned world; ModelCheckpoint(
every_n_steps="auto") sets its interval with it from the measured save cost."""

from __future__ import annotations

import math

# Llama 3's 54-day pre-training snapshot on 16,384 H100s had 466 job interruptions (419 unexpected, 47
# planned; "The Llama 3 Herd of Models", 2024, section 3.3.4): one per ~2.8 hours for the whole job.
LLAMA3_INTERRUPTIONS, LLAMA3_DAYS, LLAMA3_GPUS = 466, 54, 16384


def young_daly_interval(save_cost_s: float, mtbf_s: float) -> float:
    """The checkpoint interval (seconds) that loses least to saving and redoing: sqrt(2 * C * MTBF)."""
    if not (save_cost_s > 0 and mtbf_s > 0):
        raise ValueError(f"save_cost_s={save_cost_s!r}, mtbf_s={mtbf_s!r}: allowed: both positive seconds")
    return math.sqrt(2 * save_cost_s * mtbf_s)


def llama3_mtbf_s(gpus: int) -> float:
    """The job's mean time between interruptions (seconds) at Llama 3's failure rate per GPU, scaled to
    `gpus`: failures are independent per GPU, so the job's MTBF falls as 1 / gpus."""
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
        raise ValueError(f"gpus={gpus!r} is invalid; allowed: an int >= 1")
    per_gpu = LLAMA3_DAYS * 86400 * LLAMA3_GPUS / LLAMA3_INTERRUPTIONS
    return per_gpu / gpus


def lost_fraction(interval_s: float, save_cost_s: float, mtbf_s: float) -> float:
    """The share of wall time lost at `interval_s`, to first order: saving (C / interval) plus half an
    interval redone per failure (interval / (2 MTBF)); the effective training time is the rest."""
    return save_cost_s / interval_s + interval_s / (2 * mtbf_s)

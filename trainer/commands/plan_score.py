"""`trainer plan`'s lines on the recipe's own layout (what its strategy section runs over the planned GPUs):
its place among the searched layouts, tokens/s and MFU against the best, peak memory, its largest costs; or
the one constraint that keeps it from running there."""

from __future__ import annotations

from typing import Any


def recipe_lines(
    config: dict[str, Any], world: int, hardware: Any, plan: Any, inputs: Any, keep: Any
) -> list[str]:
    """The recipe's layout scored against `plan` (strategies.plan.search.Plan over `world` GPUs of
    `hardware`, searched under `keep`'s pins or None): four lines, or one when it cannot run there."""
    from strategies.plan.score import largest_costs, score
    from strategies.plan.search import layout_text
    from trainer.config.plan_inputs import recipe_layout

    if config["strategy"]["name"] == "auto":
        return ["recipe's layout: strategy auto, which runs the best above (#1) at start-up"]
    try:
        layout, run = recipe_layout(config, world, inputs)
    except ValueError as err:
        return [f"recipe's layout on {world} GPUs: {err}"]
    s = score(inputs.shape, layout, run, hardware, plan)
    text = f"recipe's layout: {layout_text(layout)} (micro-batch {run.micro_batch // layout.pp_microbatches})"
    if keep is not None and not keep(layout, run):
        text += f", outside --keep {keep}"
    device = hardware.device.memory_bytes
    if not s.fits:
        return [
            f"{text} does not fit: peak {_size(s.peak_bytes)} per GPU, over the {_size(s.usable_bytes)} "
            f"usable of {_size(device)} (the best above: {_size(s.best.peak_bytes)})"
        ]
    t, best = s.time, s.best.time
    costs = ", ".join(f"{name} {sec:.3g}s ({sec / t.step_s:.1%})" for name, sec in largest_costs(t))
    return [
        text,
        f"  rank {s.rank} ({s.rank - 1} of the {s.ranked} searched meshes faster): {t.tokens_per_s:,.0f} "
        f"tokens/s, MFU {t.mfu:.1%} ({t.tokens_per_s / best.tokens_per_s - 1:+.0%} against the best: "
        f"{best.tokens_per_s:,.0f} tokens/s, MFU {best.mfu:.1%})",
        f"  peak {_size(s.peak_bytes)} per GPU: fits ({_size(s.usable_bytes)} usable of {_size(device)})",
        f"  step {t.step_s:.3g}s, largest costs: {costs}",
    ]


def _size(n: float) -> str:
    """Bytes in GB (1e9, the table's unit), or in MB below a tenth of one (a tiny model's peak)."""
    from strategies.plan.hardware import GB

    return f"{n / GB:.1f} GB" if n >= GB / 10 else f"{n / 1e6:.1f} MB"

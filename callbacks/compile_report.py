"""CompileReport: what `torch.compile` did, said once: after the first step how many graphs were compiled
and in how long, later each new recompilation with its reason. Added by the Trainer when `compile` is on."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from callbacks.base import Callback
from strategies.techniques.compile_blocks import compiled_units
from trainer.core.logging import rank_zero_info

if TYPE_CHECKING:
    from trainer.module import TrainModule
    from trainer.trainer import Trainer


class CompileReport(Callback):
    """Reads dynamo's compilation records after the first step, on logged steps and at the end of
    training; reports what is new since the last look (rank zero)."""

    def __init__(self) -> None:
        self._seen: set[str] = set()
        self._reasons: set[str] = set()
        self._first = True

    def on_fit_start(self, trainer: Trainer, module: TrainModule) -> None:
        self._seen = {str(m.compile_id) for m in _compilation_metrics()}  # compiled before this fit

    def on_train_batch_end(
        self, trainer: Trainer, module: TrainModule, outputs: dict[str, Any], batch: Any, batch_idx: int
    ) -> None:
        if self._first or trainer.global_step % trainer.log_every_n_steps == 0:
            self._report(trainer, module)

    def on_train_end(self, trainer: Trainer, module: TrainModule) -> None:
        self._report(trainer, module)

    def _report(self, trainer: Trainer, module: TrainModule) -> None:
        new = [m for m in _compilation_metrics() if str(m.compile_id) not in self._seen]
        self._seen.update(str(m.compile_id) for m in new)
        if self._first:
            self._first = False
            rank_zero_info(first_step_line(module, new, trainer.strategy.compile))
            new = [m for m in new if m.recompile_reason]  # the first step's recompiles are reported too
        for m in new:
            reason = m.recompile_reason or m.fail_reason
            if reason and reason not in self._reasons and not _expected(reason):
                self._reasons.add(reason)
                rank_zero_info(
                    f"warning: torch.compile recompiled {m.co_name} at step {trainer.global_step}: {reason}"
                )


def _expected(reason: str) -> bool:
    """No news: evaluation runs without autograd (its own graph), and a first block whose input is the
    batch itself differs from the others in needing no input gradient; each is compiled once."""
    return "GLOBAL_STATE changed: grad_mode" in reason or "requires_grad mismatch" in reason


def first_step_line(module: TrainModule, records: list[Any], mode: str) -> str:
    """One line: the compiled units, the graphs compiled in the first step and the seconds it took."""
    units = compiled_units(module)
    graphs = sum(1 for m in records if m.co_name)  # the others: backward graphs, compiled lazily
    names = sorted({u.name for u in units})
    if not any(u.calls for u in units):
        return (
            f"warning: torch.compile (mode {mode}): none of the {len(units)} compiled forward(s) ({', '.join(names)}) "
            "ran in the first step, so nothing runs compiled (does training_step call the model?)"
        )
    split = sorted({u.name for u in units if not u.fullgraph})
    seconds = sum(m.entire_frame_compile_time_s or 0.0 for m in records)
    how = f"{', '.join(split)} compiled in pieces (graph breaks)" if split else "each unit one full graph"
    return (
        f"torch.compile (mode {mode}): {len(units)} unit(s) ({', '.join(names)}), {graphs} graph(s) "
        f"compiled in {seconds:.1f} s by the end of the first step (0: compiled earlier in this process); {how}"
    )


def _compilation_metrics() -> list[Any]:
    """dynamo's records of every compilation in this process. Imported here, not with this module (which the
    Trainer imports): torch._dynamo is half a second of every process's start-up, paid only by a run that
    compiles."""
    from torch._dynamo.utils import get_compilation_metrics

    return get_compilation_metrics()

"""The techniques strategies/parallelize.py applies, each in one place: a package per parallel technique
(pp, cp, tp, ep, fsdp, ddp, zero1), its mechanism beside its `apply_*` (apply.py), which changes a module
(or wraps it) in place; and the two per-block techniques every strategy applies (Strategy.prepare_blocks):
activation_checkpointing.py, compile_blocks.py. parallelize.py calls them in their one valid order."""

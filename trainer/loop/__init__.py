"""The loop: what each entry point runs (stages), one fit's loop and the one evaluation loop, the hook
dispatcher, the step log, the stop conditions and the Trainer's Lightning-named views. Only the Trainer
imports it; modules import their parts by path (this package imports nothing)."""

"""The foundation: what every layer above may use and nothing here imports from above (precision, RNG,
tensor trees, timing, logging, metrics, LR schedules, process launch, DTensor checks, host memory, fused
optimizers, the MoE dispatch seam, version_N folders). This package imports nothing; its modules are
imported by path."""

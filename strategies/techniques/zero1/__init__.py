"""ZeRO stage 1: sliced_parameters.py splits the optimizer state of replicated parameters over the
data-parallel ranks (ParallelStrategy.setup_optimizer); its checkpoint layout is
strategies/checkpoint_io/zero1_slices.py."""

"""Tensor (and sequence, and loss) parallelism: apply.py applies the model's own plan over the "tp" mesh."""

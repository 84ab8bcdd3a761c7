"""Context parallelism: the sequence sharded over the "cp" ranks in load-balanced chunks; attention.py
computes exact causal attention over the gathered keys and values, apply.py hands it to the model."""

"""Data parallel by replication: apply.py wraps the model in DistributedDataParallel over the batch group
(with an optional gradient-compression hook)."""

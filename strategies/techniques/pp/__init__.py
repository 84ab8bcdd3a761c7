"""Pipeline parallelism: stages.py cuts a model into stages at block boundaries, apply.py keeps this rank's
stages, schedule.py runs them over the micro-batches (imported only when pp > 1: it imports torch._dynamo)."""

"""Sharded data parallel (ZeRO 2/3) with FSDP2: apply.py shards per transformer block, then the root;
MoE experts as units of their own."""

"""`trainer doctor`: the collectives of the world it is launched into, measured (bus bandwidth per group and
message size, as nccl-tests reports it), against the link's nominal rate, plus on GPUs the NVML topology,
the GPUs' error state and the NCCL variables in effect, each with a hint where a value looks wrong."""

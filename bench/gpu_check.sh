#!/usr/bin/env bash
# One prepared device check (a lent H200, `run` from the repo root): the CUDA tests, the CUDA paths of the
# session's changes (bench/gpu_paths.py), the four-arm throughput bench and the recipe smoke, each bounded in
# time, every log under $OUT (or ./gpu_check). SKIP_BENCH=1 leaves the two benches out (a rerun).
set -u
out=${OUT:-gpu_check}; mkdir -p "$out"
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1 WANDB_MODE=offline HF_HUB_OFFLINE=1  # absolute: test servers run elsewhere
nvidia-smi -L; python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
timeout 100 python3 -m pytest -q -rs -p no:cacheprovider tests/loop/test_fused_optimizer.py tests/loop/test_input_pipeline.py \
  tests/loop/test_devices.py tests/observability/test_gpu_health.py tests/unit/test_step_time.py 2>&1 | tee "$out/tests.log" | tail -15
timeout 150 python3 bench/gpu_paths.py 2>&1 | tee "$out/paths.log" | grep -v "^\[trainer\]"
[ -n "${SKIP_BENCH:-}" ] && exit 0
timeout 220 python3 bench/gpu_throughput.py --steps 15 --warmup 3 --arm-timeout 100 --log-dir "$out/arms" 2>&1 | tee "$out/throughput.log"
timeout 110 python3 bench/gpu_smoke.py 2>&1 | tee "$out/smoke.log" | tail -25

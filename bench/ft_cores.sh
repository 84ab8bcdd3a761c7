#!/usr/bin/env bash
# Issue 53's rows for replica groups of 2 processes (DDP and FSDP2 inside each group: 4 trainers, 2 torchrun
# agents and a lighthouse) on a machine with a core for each: on 2 cores they share, rounds of the same run
# differ by 10-25% and the medians straddle the 1.02 / 1.10 bars. On gloo, on the CPU, with the GPU hidden; on a
# lent device (16 cores, Python 3.12, no torchft) from the repo root, after `make device-wheels` here:
#   run(command="bash bench/ft_cores.sh", carry=[".device-wheels"], timeout_s=590)
# Every log under $OUT (or ./ft_cores). WHEELS: another folder of wheels (none there: the installed torchft);
# ROUNDS: interleaved rounds of each arm (3).
set -u
out=${OUT:-ft_cores}; mkdir -p "$out"
wheels=${WHEELS:-.device-wheels}
lib=$(mktemp -d); trap 'rm -rf "$lib"' EXIT
if compgen -G "$wheels/*.whl" > /dev/null; then  # (--no-deps: torch and the rest are the machine's own)
  python3 -m pip install -q --no-index --no-deps --target "$lib" "$wheels"/*.whl || exit 1
fi
export PYTHONPATH="$lib:$PWD" PYTHONUNBUFFERED=1 WANDB_MODE=offline CUDA_VISIBLE_DEVICES=
nproc; python3 -c "import torch, torchft; print('torch', torch.__version__, 'torchft from', torchft.__file__)" ||
  { echo "ft_cores: torch and torchft must import (torchft: \`make device-wheels\` here, then carry $wheels)"; exit 1; }
ft=(python3 bench/fault_tolerance.py --no-drill --quorum-every 8 --group-size 2 --rounds "${ROUNDS:-3}")
# one bench per row, each bounded (SIGINT: the bench stops its trainers and lighthouses before it exits), so a
# row that runs out of time costs only its own table; the row furthest from its bar first
while read -r configs width limit; do
  timeout -s INT "$limit" "${ft[@]}" --configs "$configs" --widths "$width" < /dev/null 2>&1 | tee "$out/$configs-$width.log"
  if [ "${PIPESTATUS[0]}" = 124 ]; then echo "ft_cores: --configs $configs --widths $width ran out of its $limit s"; fi
done <<'ROWS'
fsdp,fsdp-clip 1024 180
fsdp,fsdp-clip 16 150
plain 1024 120
plain 16 90
ROWS

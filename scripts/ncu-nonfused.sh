#!/usr/bin/env bash
# Per-kernel time, FMA pipe, registers and DRAM bytes of non-fused Winograd plans under ncu (GPU machine).
#   scripts/ncu-nonfused.sh ['LAYER;LAYER'] ['VARIANT VARIANT']   (layer names as in gpu_wino_sweep.py)
export PYTHONPATH=src:tests
IFS=';' read -ra LAYERS <<< "${1:-res512@7 N128;res128@28 N128;res256@14 N32}"
for L in "${LAYERS[@]}"; do
 for v in ${2:-winograd_nonfused_f4}; do
  echo "== $L $v"
  timeout 100 ncu --metrics gpu__time_duration.sum,sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active,launch__registers_per_thread,dram__bytes.sum,launch__grid_size,launch__block_size python3 scripts/gpu_wino_sweep.py --one "$L" $v default 2>&1 | grep -E "wino_|duration|pipe_fma|registers|dram__bytes|grid_size|block_size" | sed -E 's/  +/ /g'
 done
done

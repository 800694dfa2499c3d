#!/usr/bin/env bash
# Dump a 2-way tensor-parallel model started by torchrun, then compare the two ranks.
#
#   ./run.sh [OUTPUT_DIR] [-- tp_block.py options, e.g. --device cuda --dtype bfloat16]
#
# DEVICE=1 ./run.sh      dumps only the process on device 1 (the config's "device" filter)
# MASTER_PORT=29600      when 29500 is taken
#
# The model program knows nothing of the probe: sourcing the load script is all it takes, and
# every process torchrun starts from this shell (one per rank) dumps into its own
# atb_dump_data/data/<device>_<pid>/ folder.
set -eo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
out="${1:-$PWD/tp_dump}"
[ "$#" -gt 0 ] && shift
[ "${1:-}" = "--" ] && shift
mkdir -p "$out"

# "all": tensors and statistics. The layer-level ops are the ParallelBlocks; op_name adds the
# row-parallel linears (their output is the all_reduce result) wherever they are.
cat > "$out/config.json" <<JSON
{
  "task": "all",
  "dump_enable": true,
  "exec_range": "all",
  "ids": "",
  "op_name": "ParallelBlock,RowParallelLinear",
  "save_child": false,
  "device": "${DEVICE:-}",
  "filter_level": 1
}
JSON

source "$(atb-probe where)/load_atb_probe.sh" --output="$out" --config="$out/config.json"
OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 --master-port "${MASTER_PORT:-29500}" \
    "$here/tp_block.py" "$@"
source "$(atb-probe where)/unload_atb_probe.sh"

atb-probe status --wait 60 "$out"     # every rank's data is on disk (exit 0)
echo "--- one folder per process (<device>_<pid>):"
ls "$out/atb_dump_data/data"
echo "--- ranks compared (after the all_reduce they must agree):"
python "$here/compare_ranks.py" "$out"

#!/usr/bin/env bash
# The recall suite on one GPU in a time budget (experiments/recall_sweep.py); rerun to resume.
#   bash experiments/recall_sweep.sh [WORKDIR] [BUDGET_S] [EXPORT_DIR] [more flags]
# e.g. bash experiments/recall_sweep.sh runs/recall_gpu 500 "$OUT/recall_gpu" \
#        --restore_from=runs/recall_gpu_export/runs.tar.gz   (an earlier export; experiments/RECALL.md)
set -euo pipefail
cd "$(dirname "$0")/.."
workdir="${1:-runs/recall_gpu}"
budget="${2:-540}"
export_dir="${3:-}"
shift $(( $# < 3 ? $# : 3 ))
exec python3 experiments/recall_sweep.py --workdir="$workdir" --time_budget_s="$budget" \
  --export_dir="$export_dir" "$@"

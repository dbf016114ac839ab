#!/usr/bin/env bash
# Submit a throughput sweep: one Slurm job per point of PRESETS x REGIONS x TPS x PPS x MBS.
#
#   PRESETS="125m 350m" REGIONS="0 0.25 0.5" MBS="4 8" slurm/sweep.sh
#   PRESETS=7b TPS="2 4" PPS="1 2" REGIONS="0 0.5" SWEEP_NODES=2 slurm/sweep.sh --seq-length 4096
#   python tools/sweep_report.py runs/sweep/sweep.csv          # table + plots when jobs are done
#
# A region is a layer count or a fraction of the layers sharing Q/K (0 = the baseline without
# EPAS); the whole region is in place from iteration 1 (--epas-first-switch 1 --epas-interval 1
# --epas-growth <region layers>). Each job runs slurm/sweep_point.sbatch and appends one row
# (job id, point, tokens/s, torch/megatron-core versions, git commit, nodes, date) to SWEEP_CSV
# under flock; the CSV must be on a file system all nodes share. Arguments are extra trainer
# flags for every point.
#
# Environment (defaults in brackets):
#   PRESETS [125m]  REGIONS [0 0.5]  TPS [1]  PPS [1]  MBS [8]    the grid (space-separated)
#   SWEEP_ITERS [50]       iterations per point
#   SWEEP_WARMUP [5]       untimed iterations (>= 1); tokens/s is over iterations WARMUP+1..ITERS
#   SWEEP_NODES [1]        nodes per point
#   SWEEP_DIR [runs/sweep] logs/, runs/<jobid>/ and the CSV go here
#   SWEEP_CSV [$SWEEP_DIR/sweep.csv]
#   SBATCH_ARGS            extra sbatch options for every point, e.g. "--partition=h100 --time=30"
#   SWEEP_WAIT [0]         1: wait for all points (polling squeue every SWEEP_POLL [10] s), then
#                          write the report (tools/sweep_report.py) next to the CSV
#   NPROC_PER_NODE, OMP_NUM_THREADS, EPAS_CACHE_DIR, ... reach the launcher of every point.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(dirname "$HERE")"
cd "$REPO"
if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x "$REPO/.venv/bin/python" ]]; then PYTHON="$REPO/.venv/bin/python"; else PYTHON=python3; fi
fi

PRESETS="${PRESETS:-125m}"
REGIONS="${REGIONS:-0 0.5}"
TPS="${TPS:-1}"
PPS="${PPS:-1}"
MBS="${MBS:-8}"
SWEEP_ITERS="${SWEEP_ITERS:-50}"
SWEEP_NODES="${SWEEP_NODES:-1}"
SWEEP_DIR="$(realpath -m "${SWEEP_DIR:-runs/sweep}")"
SWEEP_CSV="$(realpath -m "${SWEEP_CSV:-$SWEEP_DIR/sweep.csv}")"
SWEEP_POLL="${SWEEP_POLL:-10}"
read -r -a EXTRA_SBATCH <<< "${SBATCH_ARGS:-}"

command -v sbatch >/dev/null || { echo "error: sbatch not found; run this on a Slurm login node" >&2; exit 2; }
mkdir -p "$SWEEP_DIR/logs" "$SWEEP_DIR/runs"

# Check every region against every preset before submitting anything (one process for the whole
# grid); each point gets its region's flags from here (SWEEP_REGION_FLAGS).
TABLE=$("$PYTHON" "$REPO/tools/sweep_record.py" region-table --presets "$PRESETS" --regions "$REGIONS" -- "$@") || exit 2
declare -A REGION_FLAGS=()
while read -r preset region flags; do
    REGION_FLAGS["$preset $region"]=$flags
done <<< "$TABLE"

# What every point job needs (sbatch passes the environment on).
SWEEP_WARMUP="${SWEEP_WARMUP:-5}"
EPAS_ROOT="$REPO"
export SWEEP_ITERS SWEEP_WARMUP SWEEP_CSV SWEEP_DIR EPAS_ROOT PYTHON

JOBS=()
for preset in $PRESETS; do
  for region in $REGIONS; do
    for tp in $TPS; do
      for pp in $PPS; do
        for mbs in $MBS; do
          job=$(SWEEP_PRESET="$preset" SWEEP_REGION="$region" SWEEP_TP="$tp" SWEEP_PP="$pp" SWEEP_MBS="$mbs" \
                SWEEP_REGION_FLAGS="${REGION_FLAGS["$preset $region"]}" \
                sbatch --parsable --nodes="$SWEEP_NODES" --job-name="epas-sweep-$preset" \
                       --output="$SWEEP_DIR/logs/%x-%j.out" "${EXTRA_SBATCH[@]}" \
                       "$REPO/slurm/sweep_point.sbatch" "$@")
          job="${job%%;*}"
          JOBS+=("$job")
          echo "submitted $job preset=$preset region=$region tp=$tp pp=$pp mbs=$mbs"
          echo "$job preset=$preset region=$region tp=$tp pp=$pp mbs=$mbs" >> "$SWEEP_DIR/jobs.txt"
        done
      done
    done
  done
done
echo "sweep: ${#JOBS[@]} job(s); rows go to $SWEEP_CSV"

if [[ "${SWEEP_WAIT:-0}" == 1 ]]; then
    ids=$(IFS=,; echo "${JOBS[*]}")
    # Done when squeue lists none of them (or no longer knows them); a failing squeue (busy
    # slurmctld) is not "done".
    while true; do
        if out=$(squeue -h -j "$ids" -o %i 2>&1); then
            [[ -z "$out" ]] && break
        elif [[ "$out" == *"Invalid job id"* ]]; then
            break
        fi
        sleep "$SWEEP_POLL"
    done
    "$PYTHON" "$REPO/tools/sweep_report.py" "$SWEEP_CSV"
else
    echo "when they are done: $PYTHON tools/sweep_report.py $SWEEP_CSV"
fi

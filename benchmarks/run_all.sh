#!/usr/bin/env bash
# One command for a full benchmark run on this machine; commit what it writes.
#   bash benchmarks/run_all.sh h100          # -> benchmarks/results/h100-YYYY-MM-DD{,-compare}.json
# Sizes: GPU-sized with CUDA, CPU-sized otherwise (extra arguments go to `fastspec bench`).
# Every step runs even if an earlier one reports a failure; the exit status is 1 if any did.
# `python -m fastspec`, not the `fastspec` script: the same interpreter as the pytest step, and it
# also works from a checkout that was built in place but not pip-installed.
set -uo pipefail
cd "$(dirname "$0")/.."
name=${1:?usage: bash benchmarks/run_all.sh DEVICE-NAME [fastspec bench flags...]}
shift
day=$(date -u +%F)
status=0
python -m fastspec bench --json "benchmarks/results/${name}-${day}.json" "$@" || status=1
python -m fastspec compare --json "benchmarks/results/${name}-${day}-compare.json" || status=1
mkdir -p benchmarks/results/pytest
python -m pytest benchmarks -q --benchmark-enable \
  --benchmark-json "benchmarks/results/pytest/${name}-${day}.json" || status=1
# README.md's table from benchmarks/results/*.json (-m: the checkout's fastspec, installed or not)
python -m benchmarks.readme_table || status=1
exit "$status"

#!/usr/bin/env bash
# Run the demo as a Ray job on a local head started by this checkout, then stop that head.
# Token authentication stays on: `cluster submit` sends the head's token (README, "Job
# submission"; on a cluster you did not start, use --address and --token-file).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/run.sh cluster start
trap 'bash scripts/run.sh cluster stop' EXIT
bash scripts/run.sh cluster submit -- python -m weightsync demo --workers 2 --steps 5

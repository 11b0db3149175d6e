#!/usr/bin/env bash
# Run the demo as a Ray job on an existing cluster (start one with `ray start --head`).
# The entry point joins the cluster that `ray job submit` names in RAY_ADDRESS.
set -euo pipefail
cd "$(dirname "$0")/.."
ray job submit --working-dir . -- python -m weightsync demo --workers 2 --steps 5

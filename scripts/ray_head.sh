#!/usr/bin/env bash
# Start the head of a Ray cluster for Molt on this machine. Extra arguments go to `ray start`
# (e.g. --block to stay in the foreground, --num-gpus=8). Other machines join with
#   scripts/ray_worker.sh THIS_HOST_IP:6379
# and runs are submitted with scripts/submit.sh (or `molt-run ray_address=auto ...` on this machine).
set -euo pipefail
PATH="$(cd "$(dirname "$0")/.." && pwd)/.venv/bin:$PATH"  # the project's venv, when there is one

ray start --head --port="${MOLT_RAY_PORT:-6379}" "$@"

#!/usr/bin/env bash
# Submit a Molt run to a running Ray cluster as a Ray job. Arguments are molt-run's Hydra overrides:
#   RAY_ADDRESS=http://HEAD_IP:8265 scripts/submit.sh experiment=qwen3_4b_math hydra.run.dir=/shared/runs/qwen3_4b
# The job uploads this checkout (--working-dir) and runs molt-run on the head node, which joins the cluster
# (Ray sets RAY_ADDRESS for it). Use a run dir on a file system all nodes share: checkpoints are written there.
set -euo pipefail
cd "$(dirname "$0")/.."
PATH="$PWD/.venv/bin:$PATH"  # the project's venv, when there is one

exec ray job submit --address="${RAY_ADDRESS:-http://127.0.0.1:8265}" --working-dir . -- molt-run "$@"

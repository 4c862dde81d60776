#!/usr/bin/env bash
# Join this machine to a Ray cluster started by scripts/ray_head.sh:
#   scripts/ray_worker.sh HEAD_IP:6379 [ray start arguments, e.g. --block]
set -euo pipefail
PATH="$(cd "$(dirname "$0")/.." && pwd)/.venv/bin:$PATH"  # the project's venv, when there is one

if [ $# -lt 1 ]; then
  echo "usage: $0 HEAD_IP:PORT [ray start arguments]" >&2
  exit 2
fi
address="$1"
shift
ray start --address="$address" "$@"

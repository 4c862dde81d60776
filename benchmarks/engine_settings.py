"""vLLM-CPU threading knobs (rollout.cpu_omp_threads_bind, rollout.cpu_reserved_cores, rollout.cpu_preload_iomp)
for the default recipe, measured side by side in one invocation (issue 8, item 5).

    .venv/bin/python benchmarks/engine_settings.py [--steps 15] [--repeats 1] [--settings auto,nobind,...]

Each setting runs the default recipe (async) through `molt-run`, then a bare AsyncLLM with the same setting on
that run's prompts. The loop number decides: on 2 cores the engine shares the machine with the trainer rank,
so the setting that makes the bare engine fastest can slow the loop down.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile

from loop import ROOT, bare_engine, compare, median_of, print_table

SETTINGS = {
    "auto": [],  # vLLM's default: binds one core, reserves the other
    "nobind": ["rollout.cpu_omp_threads_bind=nobind"],
    "0-1": ["rollout.cpu_omp_threads_bind=0-1", "rollout.cpu_reserved_cores=0"],
    "0-1+iomp": ["rollout.cpu_omp_threads_bind=0-1", "rollout.cpu_reserved_cores=0", "rollout.cpu_preload_iomp=true"],
    "auto+iomp": ["rollout.cpu_preload_iomp=true"],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--settings", default=",".join(SETTINGS), help="comma-separated, from: " + ", ".join(SETTINGS))
    args = parser.parse_args()
    names = args.settings.split(",")
    unknown = sorted(set(names) - set(SETTINGS))
    if unknown:
        parser.error(f"--settings: unknown {unknown}; choose from {', '.join(SETTINGS)}")

    root = tempfile.mkdtemp(prefix="molt-bench-engine-")
    runs = compare({name: (SETTINGS[name], ROOT) for name in names}, args.steps, args.repeats, root)
    bare = {name: [bare_engine(r["run_dir"], generator=False)["bare"] for r in runs[name]] for name in names}

    print(f"\ndefault recipe (async), {args.steps} steps per run, medians of {args.repeats} repetition(s); "
          f"load average {os.getloadavg()[0]:.1f}")
    for name in names:
        print(f"  {name}: {' '.join(SETTINGS[name]) or '(rollout/cpu.yaml as it is)'}")
    print_table(runs)
    print(f"{'bare AsyncLLM generated tokens/s':44}" + "".join(
        f"{statistics.median(bare[name]):>16.0f}" for name in names))
    base = median_of(runs[names[0]], "trained_tok_s")
    print(f"{'loop trained tokens/s vs ' + names[0]:44}" + "".join(
        f"{median_of(runs[name], 'trained_tok_s') / base:>16.2f}" for name in names))
    print(f"run directories: {root}")


if __name__ == "__main__":
    main()

"""What a run prints on the console, and where the libraries' own logs go instead.

A run's console holds Molt's lines only: `molt: ...` (what is starting and how long it took, warnings, the
summary), one line per step and per eval. Everything the libraries log in the driver process (torch and
torchao, transformers, Ray, MLflow and alembic, vLLM, httpx, Python warnings) goes to
<run dir>/libraries.log, their errors to the console as well; `logger.library_logs=console` shows it all on
the console instead, together with the output of the actor and engine processes (Ray workers and the vLLM
engine-core processes they start), which otherwise stays in Ray's session logs
(/tmp/ray/session_latest/logs by default).
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import sys
import time

LIBRARY_LOGS = ("file", "console")  # logger.library_logs
LIBRARY_LOG_FILE = "libraries.log"
# Each gives loggers of its own a console handler when imported and stops them propagating to the root
# (torch: "torch" and every logger it registers; mlflow: also alembic's and sqlalchemy's; transformers: also
# huggingface_hub's). Imported here first, so that those handlers can be taken back.
SELF_CONFIGURING = ("torch", "ray", "mlflow", "transformers")


def route_library_logs(where: str, run_dir: str) -> None:
    """Send every library log record of this process to <run_dir>/libraries.log and those of level ERROR and
    above to stderr too (where="file"), or all of them to stderr (where="console"). Call it before importing
    the rest of the stack (molt.loop): importing torchao and nemo_automodel logs already."""
    root = logging.getLogger()
    for handler in list(root.handlers):  # Hydra's job logging, if any
        root.removeHandler(handler)
        handler.close()
    console = logging.StreamHandler(sys.stderr)
    console.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    if where == "file":
        console.setLevel(logging.ERROR)
        os.makedirs(run_dir, exist_ok=True)
        file = logging.FileHandler(os.path.join(run_dir, LIBRARY_LOG_FILE))
        file.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        root.addHandler(file)
    root.addHandler(console)
    root.setLevel(logging.INFO)
    logging.captureWarnings(True)  # warnings.warn(...) -> logger "py.warnings" -> the handlers above
    for module in SELF_CONFIGURING:
        importlib.import_module(module)
    if where == "file":  # transformers' progress bars are not log records: e.g. "Writing model shards" (build_tiny)
        from transformers.utils.logging import disable_progress_bar

        disable_progress_bar()
    for logger in list(logging.root.manager.loggerDict.values()):
        if not isinstance(logger, logging.Logger):  # a placeholder for a logger not yet created
            continue
        own = [h for h in logger.handlers if _writes_to_console(h)]
        for handler in own:
            logger.removeHandler(handler)
        if own:
            logger.propagate = True


def _writes_to_console(handler: logging.Handler) -> bool:
    # not a FileHandler, nor torch's trace handler before TORCH_TRACE gives it a file (its stream is None)
    return (isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler)
            and handler.stream is not None)


@contextlib.contextmanager
def starting(what: str, count: int | None = None):
    """Say that `what` (`count` of them) is starting, and when the block ends without an error how long it
    took: `molt: starting 1 rollout engine` ... `molt: 1 rollout engine started in 31.9 s`."""
    if count is not None:
        what = f"{count} {what}{'' if count == 1 else 's'}"
    print(f"molt: starting {what}", file=sys.stderr, flush=True)
    begin = time.perf_counter()
    yield
    print(f"molt: {what} started in {time.perf_counter() - begin:.1f} s", file=sys.stderr, flush=True)


def console_line(step: int, steps: int, m: dict[str, float]) -> str:
    return (
        f"step {step + 1}/{steps}  reward {m['rollout/reward_mean']:.3f}  len {m['rollout/response_length']:.1f}"
        f"  loss {m['loss/policy']:.4f}  stale {m['staleness/mean']:.2f}"
        f"  {m['throughput/trained_tokens_per_s']:.0f} tok/s  step {m['timing/step']:.2f}s"
        f" (wait {m['timing/gen_wait']:.2f} train {m['timing/train']:.2f} refit {m['timing/refit']:.2f})"
    )


def print_summary(summary: dict) -> None:
    rewards = summary["reward_by_step"]
    k = max(1, min(5, len(rewards) // 4))
    first, last = sum(rewards[:k]) / k, sum(rewards[-k:]) / k
    print(
        f"molt: {summary['steps']} steps in {summary['wall_s']:.0f}s; mean reward first {k} steps {first:.3f}, "
        f"last {k} steps {last:.3f}; groups dropped {summary['groups_dropped']}; rollouts failed "
        f"{summary['rollouts_failed']}; export {summary.get('hf_export')}",
        flush=True,
    )

"""Checkpoint directories: root/step_<n>, written to a temporary name and renamed when complete, so a run that
dies while saving leaves the last complete checkpoint intact. The ranks write their shards
(molt/ranks.py `save`); this module owns the directory, the JSON `extra` and which checkpoints are kept."""

from __future__ import annotations

import json
import os
import shutil
from typing import Callable, Optional

PREFIX = "step_"
COMPLETE_MARKER = "extra.json"  # written last, just before the atomic rename


def _complete_checkpoints(root: str) -> list[str]:
    """Complete checkpoint directories under root, oldest first."""
    if not os.path.isdir(root):
        return []
    names = [n for n in os.listdir(root) if n.startswith(PREFIX)]
    paths = [os.path.join(root, n) for n in sorted(names)]
    return [p for p in paths if os.path.isfile(os.path.join(p, COMPLETE_MARKER))]


def latest(root: str) -> Optional[str]:
    """The newest complete checkpoint under root, or None; unfinished writes are ignored."""
    checkpoints = _complete_checkpoints(root)
    return checkpoints[-1] if checkpoints else None


def save(root: str, step: int, keep: int, extra: dict, write_shards: Callable[[str], None]) -> str:
    """Write root/step_<step>: `write_shards(directory)` writes the ranks' files, then the JSON `extra` marks
    it complete and it is renamed into place (a second save at the same step replaces the first). All but
    the newest `keep` complete checkpoints are deleted (0 keeps all). Returns its path."""
    json.dumps(extra)  # fail before writing anything if `extra` is not JSON-able
    final = os.path.join(os.path.abspath(root), f"{PREFIX}{step:08d}")
    tmp = os.path.join(os.path.dirname(final), f".tmp-{os.path.basename(final)}")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    write_shards(tmp)
    with open(os.path.join(tmp, COMPLETE_MARKER), "w") as f:
        json.dump(extra, f)
    shutil.rmtree(final, ignore_errors=True)
    os.rename(tmp, final)
    if keep > 0:
        for old in _complete_checkpoints(root)[:-keep]:
            shutil.rmtree(old)
    return final


def read_extra(path: str) -> dict:
    """The `extra` of the complete checkpoint at `path` (root/step_<n>, not the root)."""
    if not os.path.isfile(os.path.join(path, COMPLETE_MARKER)):
        raise FileNotFoundError(f"{path} is not a complete checkpoint (no {COMPLETE_MARKER})")
    with open(os.path.join(path, COMPLETE_MARKER)) as f:
        return json.load(f)

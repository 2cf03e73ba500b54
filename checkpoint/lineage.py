"""Checkpoint branches: resuming from an older step abandons the newer checkpoints of that folder.

Invariant: after a resume from step R, every `step-N` folder that auto-resume or retention can see (complete
ones, see `complete_steps`) has N <= R or was saved by the current run. The newer complete checkpoints of the
old branch are renamed `abandoned-step-N` (never matched by auto-resume, retention or stale-folder cleanup,
never deleted automatically), so that a later restart cannot silently continue the abandoned branch, and
keep_latest_k cannot delete the current branch's checkpoints in favour of the abandoned ones.
"""

from __future__ import annotations

import logging
import os
import re

_STEP_RE = re.compile(r"^step-(\d+)$")
ABANDONED_PREFIX = "abandoned-"
logger = logging.getLogger(__name__)


def _complete_steps_after(folder: str, step: int) -> list[int]:
    """Sorted N > step with a complete `folder/step-N` (its DCP `.metadata` exists)."""
    newer = []
    for name in os.listdir(folder):
        m = _STEP_RE.match(name)
        if m and int(m.group(1)) > step and os.path.isfile(os.path.join(folder, name, ".metadata")):
            newer.append(int(m.group(1)))
    return sorted(newer)


def _free_name(folder: str, name: str) -> str:
    """`name`, or `name.1`, `name.2`, ... : the first that does not exist in folder (a step may be abandoned twice)."""
    candidate, n = name, 0
    while os.path.lexists(os.path.join(folder, candidate)):
        n += 1
        candidate = f"{name}.{n}"
    return candidate


def abandon_newer_steps(folder: str, resumed_step: int) -> list[str]:
    """Rank 0, after resuming from `resumed_step`: rename every newer complete step-N to `abandoned-step-N`.

    Returns the new names (empty when the resume step was the newest). Prints one line saying what was moved
    and why, since the user chose an older step and may not know newer ones exist. Incomplete newer folders
    are left alone: they are never resumed from and a new save of that step replaces them.
    """
    if not os.path.isdir(folder):
        return []
    moved = []
    for step in _complete_steps_after(folder, resumed_step):
        new_name = _free_name(folder, f"{ABANDONED_PREFIX}step-{step}")
        os.rename(os.path.join(folder, f"step-{step}"), os.path.join(folder, new_name))
        moved.append(new_name)
    if moved:
        logger.warning(
            f"resumed from step-{resumed_step}, older than the newest checkpoint: this run starts a new branch. "
            f"Moved the newer checkpoints aside in {folder}: {', '.join(moved)}. Auto-resume and "
            "checkpoint.keep_latest_k ignore them and nothing deletes them: delete them when no longer needed."
        )
    return moved

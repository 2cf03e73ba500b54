"""How a training process reacts to its launcher and its scheduler.

- `die_with_launcher()`: a worker started by torchrun is killed by the kernel the moment torchrun dies, even by
  `kill -9` (which torchrun cannot forward). Without it the orphaned workers train on and keep writing
  checkpoints into a folder that a restarted run is already using.
- `GracefulStop`: SIGTERM (what SLURM, Kubernetes and torchrun send first) asks the run to stop at the end of the
  current step: the step finishes, a checkpoint is saved when checkpointing is on, and the process exits. The
  request is agreed on by every rank (see train.py: the flag rides on the step's loss all-reduce), since ranks
  receive the signal at slightly different moments and must stop, and save, at the same step. A second SIGTERM
  kills the process at once (the default action).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import signal
import sys

# prctl(2) option: the signal this process receives when its parent thread exits (linux/prctl.h).
_PR_SET_PDEATHSIG = 1
EXIT_CODE_TERMINATED = 128 + signal.SIGTERM  # what a shell reports for a process ended by SIGTERM
logger = logging.getLogger(__name__)


def started_by_torchrun() -> bool:
    """torchrun's elastic agent sets TORCHELASTIC_RUN_ID in every worker's environment."""
    return "TORCHELASTIC_RUN_ID" in os.environ


def die_with_launcher() -> bool:
    """Under torchrun on Linux: ask the kernel to SIGKILL this worker when its launcher exits; returns whether set.

    SIGKILL, not SIGTERM: with the launcher gone there is nobody to coordinate a last save with the other ranks,
    and a checkpoint in flight is safe to abandon (it is published by rename only when complete).
    """
    if not sys.platform.startswith("linux") or not started_by_torchrun():
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        return False
    if os.getppid() == 1:  # the launcher died before the request was in place: nobody will signal us
        os.kill(os.getpid(), signal.SIGKILL)
    return True


class GracefulStop:
    """Records a SIGTERM instead of dying; `requested` is read once per step by the training loop."""

    def __init__(self) -> None:
        self.requested = False
        self._previous = None

    def install(self) -> "GracefulStop":
        self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)
        return self

    def _on_sigterm(self, signum, frame) -> None:
        self.requested = True
        # A second SIGTERM means "now": back to the default action.
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        logger.warning(
            "SIGTERM received: finishing this step, then saving (if checkpointing is on) and exiting; "
            "send SIGTERM again to stop at once"
        )

    def uninstall(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None

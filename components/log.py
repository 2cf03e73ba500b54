"""The one logging set-up of the entry points (train.py, evaluate.py, generate.py): Python `logging`, rank-aware.

    setup_logging()                       # once, at the start of main()
    logger = logging.getLogger(__name__)  # in every module; logger.info / logger.warning

A line reads `[rank0] 2026-11-23 08:12:01 resumed from step 3` (warnings and errors carry their level name).
Our own modules (the top-level packages and scripts of this repository) log INFO and up on rank 0, and on the
ranks that LOG_RANK names (run_train.sh's comma-separated list of the ranks whose output torchrun shows);
other ranks log warnings and errors only. Other libraries' loggers (torch, ...) show warnings and errors only.

No doubled rank prefix: under `torchrun --tee` (run_train.sh, slurm/launch.py) each rank's stdout / stderr is
a file, `<log_dir>/<run>/attempt_K/<local_rank>/stdout.log`, that the launcher copies to the console with its
own `[<role><local_rank>]:` header on every line; the `[rankN]` tag is then left out (the file's path names
the rank too). Everywhere else (one process, torchrun without --tee) the tag is written.
"""

from __future__ import annotations

import logging
import os
import re
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The loggers that are ours: every top-level module / package of the repository, and a script run as __main__.
OWN_LOGGERS = sorted(
    {"__main__"}
    | {name[:-3] for name in os.listdir(REPO) if name.endswith(".py") and name[:-3].isidentifier()}
    | {name for name in os.listdir(REPO) if os.path.isfile(os.path.join(REPO, name, "__init__.py"))}
)


class RankFormatter(logging.Formatter):
    """`[rankN] <time> <message>`; WARNING / ERROR / CRITICAL put their level name before the message."""

    def __init__(self, tag: str):
        super().__init__(datefmt="%Y-%m-%d %H:%M:%S")
        self.tag = tag

    def format(self, record: logging.LogRecord) -> str:
        level = "" if record.levelno <= logging.INFO else f"{record.levelname} "
        # rstrip: a captured warnings.warn message ends with a newline (its source line follows it)
        line = f"{self.tag} {self.formatTime(record, self.datefmt)} {level}{record.getMessage().rstrip()}"
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


class CurrentStreamHandler(logging.StreamHandler):
    """Writes to sys.stdout / sys.stderr as they are at each call, so that pytest's capture (and anything else
    that swaps the stream after set-up) sees the lines."""

    def __init__(self, stream_name: str):
        super().__init__()
        self.stream_name = stream_name

    @property
    def stream(self):
        return getattr(sys, self.stream_name)

    @stream.setter
    def stream(self, _value) -> None:  # logging.StreamHandler.__init__ assigns it; the property decides
        pass


def launcher_prefixes_lines(stream_name: str = "stdout") -> bool:
    """Whether this rank's stream is a torchrun log file (--tee / --redirects), which the launcher prefixes with
    the rank on the console (see the module docstring). Linux only (/proc); elsewhere False."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return False
    fd = 1 if stream_name == "stdout" else 2
    try:
        target = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return False
    local_rank = os.environ.get("LOCAL_RANK", "0")
    return re.search(rf"/attempt_\d+/{local_rank}/std(out|err)\.log$", target) is not None


def ranks_asked_for() -> set[int]:
    """The ranks named by LOG_RANK ('0,1'); empty when unset or not a list of integers."""
    try:
        return {int(r) for r in os.environ.get("LOG_RANK", "").split(",") if r.strip()}
    except ValueError:
        return set()


def setup_logging(stream_name: str = "stdout", rank: int | None = None) -> logging.Handler:
    """Install the one handler on the root logger (replacing one installed before: idempotent, so that train.main
    can run twice in one interpreter) and set our loggers' level for this rank. Returns the handler.

    stream_name: "stdout" for train.py / evaluate.py (log lines interleave in order with the step lines);
    "stderr" for generate.py, whose stdout is the generated text.
    """
    rank = int(os.environ.get("RANK", 0)) if rank is None else rank
    root = logging.getLogger()
    for old in [h for h in root.handlers if isinstance(h, CurrentStreamHandler)]:
        root.removeHandler(old)
    handler = CurrentStreamHandler(stream_name)
    handler.setFormatter(RankFormatter("" if launcher_prefixes_lines(stream_name) else f"[rank{rank}]"))
    root.addHandler(handler)
    root.setLevel(logging.WARNING)  # other libraries: warnings and errors
    ours = logging.INFO if rank == 0 or rank in ranks_asked_for() else logging.WARNING
    for name in OWN_LOGGERS:
        logging.getLogger(name).setLevel(ours)
    logging.captureWarnings(True)  # warnings.warn goes through the same handler (logger "py.warnings")
    return handler


def format_bytes(n: int) -> str:
    """1536 -> '1.5 KiB' (for log lines)."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def format_seconds(seconds: float) -> str:
    """75.2 -> '1m15s'; 3.21 -> '3.2 s' (for log lines)."""
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m{secs:02d}s" if hours else f"{minutes}m{secs:02d}s"

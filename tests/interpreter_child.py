"""Cases of a test module run in ONE child process under Triton's interpreter (Triton reads TRITON_INTERPRET when it
is first imported, so the parent pytest process cannot switch it on for some tests only).

    def child():                                    # in the test module: runs in the child
        run_checks({"case_a": check_a, ...})
    @pytest.fixture(scope="module")
    def results():
        return child_results("tests.test_my_kernel")  # {name: {"ok": bool, "out": result or traceback}}
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback
from collections.abc import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_checks(checks: dict[str, Callable[[], object]]) -> None:
    """In the child: every check, one JSON object {name: {ok, out}} on stdout; a failing check does not stop the
    others (its traceback is its out)."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    results = {}
    for name, check in checks.items():
        try:
            results[name] = {"ok": True, "out": check()}
        except BaseException:  # a failed check or any error: reported under its case, the others still run
            results[name] = {"ok": False, "out": traceback.format_exc()}
    print(json.dumps(results))


def child_results(module: str, timeout: float = 300) -> dict:
    """Runs `module`.child() in a child process with TRITON_INTERPRET=1 and returns its JSON results."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    code = f"import {module} as t; t.child()"
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, f"the interpreter child failed:\n{proc.stderr[-6000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])

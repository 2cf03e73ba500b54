"""The layering docs/DESIGN.md draws: models/ is the bottom layer and imports none of the trainer's packages.

Checked with ast over every models/**.py (imports inside functions included), so no import has to run.
"""

from __future__ import annotations

import ast
from pathlib import Path

from data.packing import IGNORE_INDEX as DATA_IGNORE_INDEX
from models.loss import IGNORE_INDEX as LOSS_IGNORE_INDEX

REPO = Path(__file__).resolve().parents[1]
# The packages that sit above models/ (they import it; it must not import them).
ABOVE_MODELS = {
    "data",
    "configs",
    "parallelisms",
    "checkpoint",
    "components",
    "generation",
    "integrations",
    "train",
    "evaluate",
    "generate",
}


def _imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, dotted module) of every import statement in `path`; relative imports resolve inside models/."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            out.append((node.lineno, "models" if node.level else node.module or ""))
    return out


def test_models_import_nothing_from_the_packages_above_them():
    files = sorted((REPO / "models").rglob("*.py"))
    assert files, "models/ has no Python files: the check would pass vacuously"
    bad = [
        f"{path.relative_to(REPO)}:{line} imports {module}"
        for path in files
        for line, module in _imported_modules(path)
        if module.split(".")[0] in ABOVE_MODELS
    ]
    assert not bad, "models/ must depend on none of " + ", ".join(sorted(ABOVE_MODELS)) + ":\n" + "\n".join(bad)


def test_data_and_loss_agree_on_the_ignored_label():
    # data/ keeps its own copy (its preprocessing workers import neither torch nor models/); the loss must skip
    # exactly the labels the packer writes for document ends and padding.
    assert DATA_IGNORE_INDEX == LOSS_IGNORE_INDEX == -100

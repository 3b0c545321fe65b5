"""The functional core imports nothing of the imperative shell (STYLE: functional core)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support import FORBIDDEN_ROOTS, _imports

PACKAGE = Path(__file__).resolve().parents[1] / "flodl_run"

# The pure decision modules of ElChe and the simulated rig.
CORE = ("phase", "timing", "election", "batch_counts", "autotune", "guard", "meta", "throttle",
        "elche", "simrig")
# What the core may import from the package: itself and the typed config schemas.
ALLOWED_INTERNAL = {f"flodl_run.{name}" for name in CORE} | {"flodl_run", "flodl_run.config.schema"}
@pytest.mark.parametrize("module", CORE)
def test_core_module_imports_no_shell(module: str) -> None:
    """Pins the import boundary: a clock, socket, file, logger, tracker, tensor or Hydra import
    sneaking into a pure ElChe module (or one of the package's shell modules) fails here."""
    imported = _imports(PACKAGE / f"{module}.py")
    shell = [n for n in imported if n.split(".")[0] in FORBIDDEN_ROOTS]
    internal = [n for n in imported if n.startswith("flodl_run") and n not in ALLOWED_INTERNAL]
    assert not shell, f"flodl_run/{module}.py imports shell modules {shell}"
    assert not internal, f"flodl_run/{module}.py imports non-core package modules {internal}"


def test_boundary_check_catches_a_shell_import(tmp_path: Path) -> None:
    """Pins that the checker itself sees `import time`, `from torch import x` and a relative
    import of a shell module (a checker that parses nothing would pass every module)."""
    sample = tmp_path / "sample.py"
    sample.write_text("import time\nfrom torch import nn\nfrom . import launcher\n")
    assert _imports(sample) == ["time", "torch", "flodl_run", "flodl_run.launch.launcher"]

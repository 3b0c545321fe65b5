"""The README's quick start is what CI runs (so the documented install can never rot)."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _quick_start() -> list[str]:
    text = (REPO / "README.md").read_text()
    block = text.split("## Quick start", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    return [line for line in block.strip().splitlines() if line.strip()]


def test_quick_start_is_two_commands_run_verbatim_by_ci():
    """Pins the contract: exactly two shell lines, both present verbatim in .ci/run."""
    lines = _quick_start()
    assert len(lines) == 2
    ci = (REPO / ".ci" / "run").read_text().splitlines()
    for line in lines:
        assert line in ci
    assert "python -m flodl_run" in lines[0] and "pytest" in lines[1]

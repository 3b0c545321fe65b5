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


SLOW_RECIPES = ("recipe=byte_lm", "recipe=byte_lm_cpu")
"""Recipes whose epoch takes about a minute on a 2-core CPU (byte_lm_cpu on cpu_pair: 626 s for
its 10 epochs)."""


def _runner_commands() -> list[tuple[str, str]]:
    """(file, command) for every `python -m flodl_run` command (the runner, not its other
    modules) in the README's and docs/'s bash blocks, continuation lines joined, comment kept."""
    found = []
    for path in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        for block in path.read_text().split("```bash")[1:]:
            text = block.split("```", 1)[0].replace("\\\n", " ")
            found += [(path.name, line.strip()) for line in text.splitlines()
                      if "python -m flodl_run " in line]
    return found


def test_a_docs_command_of_a_slow_recipe_names_its_epochs_and_says_how_long_past_one():
    """Pins docs/elche.md's byte_lm_cpu DiLoCo command with no num_epochs: it ran 626 s without
    a word of warning. A command of a slow recipe sets num_epochs, and past one epoch says how
    long it takes (`# about 3 minutes ...`). Commands for a GPU (their comment says so) are not
    2-core commands."""
    commands = _runner_commands()
    assert len(commands) > 20  # the scan finds the documented commands
    unsaid = []
    for name, command in commands:
        words, _, comment = command.partition("#")
        words = words.split()
        if "GPU" in comment or not any(w in SLOW_RECIPES for w in words):
            continue
        epochs = [w.split("=", 1)[1] for w in words if w.startswith("num_epochs=")]
        said = "minute" in comment
        if not epochs or (epochs[0] != "1" and not said):
            unsaid.append(f"{name}: {command}")
    assert unsaid == []

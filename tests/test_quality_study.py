"""tools/quality_study.py's `--variant NAME:OVERRIDE;...`: a variant's bench keys go to the bench,
a run's keys (elche.reduce_optimizer_state=true) join bench.overrides, which every run takes."""

from __future__ import annotations

import importlib.util
from pathlib import Path

TOOL = Path(__file__).resolve().parents[1] / "tools" / "quality_study.py"


def _study():
    spec = importlib.util.spec_from_file_location("quality_study", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_variant_routes_a_runs_keys_into_the_bench_overrides():
    """Pins the variant hook: `moments:elche.reduce_optimizer_state=true` is nccl_cadence alone
    (outer from the bench preset) with the key in bench.overrides (given bare to the bench it
    would be an unknown bench key); with bench.overrides of its own the key is appended to that
    list, and bench keys pass through unchanged."""
    parts = _study().variant_parts([
        "moments:elche.reduce_optimizer_state=true",
        "both:bench.outers=[diloco];bench.overrides=['outer.lr=0.7'];elche.reduce_optimizer_state=true",
    ])
    assert parts["moments"][0] == "bench.modes=[nccl_cadence]"
    assert "bench.torch_ddp=false" in parts["moments"]
    assert parts["moments"][-1] == "bench.overrides=['elche.reduce_optimizer_state=true']"
    assert not any(o.startswith("elche.") for o in parts["moments"])
    assert "bench.outers=[diloco]" in parts["both"]
    assert [o for o in parts["both"] if o.startswith("bench.overrides")] == [
        "bench.overrides=['outer.lr=0.7','elche.reduce_optimizer_state=true']"]

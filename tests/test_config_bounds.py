"""Each config key's range is declared once, on its schema field (`config.bounds.bounded`), and
both the validator and the printed docs (`config.keydocs`, `review --explain`) use it.

Walks every schema field with a bound: a value just outside each end is refused naming the
dotted key in the validator's words, the end itself (when closed) is accepted, and the key's
rendered meaning shows the same rule.
"""

from __future__ import annotations

import dataclasses
import re
import typing

import pytest

from flodl_run.config.bounds import Bound, bounded
from flodl_run.config.keydocs import KeyDoc, docstrings, key_docs
from flodl_run.config.schema import ExperimentConfig, Topology, WorkerConfig
from flodl_run.config.validate import bound_problems, validate
from flodl_run.review.cli import main as review_main
from tests.support import make

BOUNDED = [doc for doc in key_docs().values() if doc.bound is not None]

CONTEXT = {
    "cluster.slurm.": dict(cluster__topology=Topology.slurm, cluster__num_ranks=2),
    "cluster.workers.*.": dict(cluster__topology=Topology.hosts),
}
"""Keys checked only where they apply (the slurm block with topology slurm, a worker's keys with
topology hosts): the config each key's cases start from."""


def config_with(key: str, value: object) -> ExperimentConfig:
    """The default config (in the key's context) with `key` set to `value`; `*` = worker 0."""
    context = next((c for prefix, c in CONTEXT.items() if key.startswith(prefix)), {})
    cfg = make(**context)
    if key.startswith("cluster.workers.*."):
        cfg.cluster.workers = [WorkerConfig()]
    *path, leaf = key.replace("*", "0").split(".")
    target = cfg
    for name in path:
        target = target[int(name)] if name.isdigit() else getattr(target, name)
    setattr(target, leaf, value)
    return cfg


def is_int(doc: KeyDoc) -> bool:
    """The key holds an int (Optional[int] included): its cases step by 1, not by 0.001."""
    return isinstance(doc.default, int) or (doc.default is None and doc.nullable and all(
        isinstance(end, int) for end in (doc.bound.low, doc.bound.high) if end is not None))


def outside(doc: KeyDoc) -> typing.List[float]:
    """A value just past each end: the end itself where it is open."""
    step = 1 if is_int(doc) else 0.001
    b = doc.bound
    return [v for v in (None if b.low is None else (b.low - step if b.ge is not None else b.low),
                        None if b.high is None else (b.high + step if b.le is not None else b.high))
            if v is not None]


def closed_ends(doc: KeyDoc) -> typing.List[float]:
    return [end for end in (doc.bound.ge, doc.bound.le) if end is not None]


def test_every_bound_declared_in_the_schema_is_walked():
    """Pins the walk itself: a schema whose bounds the test no longer sees would pass vacuously."""
    keys = {doc.key for doc in BOUNDED}
    assert {"seed", "elche.anchor", "outer.momentum", "data.vram_max_usage", "dashboard.serve",
            "max_failure.percent", "cluster.controller.port", "cluster.slurm.nodes",
            "cluster.workers.*.ssh.port", "tracking.system_metrics_interval_s",
            "recipe.batch_size"} <= keys
    assert len(keys) >= 40


@pytest.mark.parametrize("doc", BOUNDED, ids=[doc.key for doc in BOUNDED])
def test_the_validator_enforces_every_declared_bound(doc: KeyDoc):
    """Pins: a bound added to a schema field that no section of the validator checks (a new
    nested config, a section that forgot `bound_problems`), or a check whose words or key
    differ from the declaration. Also pins that each closed end is accepted."""
    key = doc.key.replace("*", "0")
    for value in outside(doc):
        messages = [str(p) for p in validate(config_with(doc.key, value)).problems]
        assert f"{key}: {doc.bound.rule}, got {value}" in messages, (value, messages)
    for value in closed_ends(doc):
        keys = [p.key for p in validate(config_with(doc.key, value)).problems]
        assert key not in keys, (value, keys)


@pytest.mark.parametrize("doc", BOUNDED, ids=[doc.key for doc in BOUNDED])
def test_the_rendered_docs_show_every_declared_bound(doc: KeyDoc):
    """Pins: a key's printed meaning without its range, or with a range of its own (a docstring
    that restates one can drift from the bound the validator checks)."""
    rule = doc.bound.rule
    assert doc.text.endswith(f"{rule[0].upper()}{rule[1:]}{' (or null)' if doc.nullable else ''}.")
    assert doc.doc and not re.search(r"[<>]=?\s*-?\d|\bin [\[(]\s*-?\d|\d\s*-\s*\d{3,}", doc.doc), \
        f"{doc.key}'s docstring states a range: declare it with bounded(...) only"


def test_review_explain_prints_each_bound_in_the_validators_words(capsys):
    """Pins `python -m flodl_run.review --explain`: every bounded key's row carries the rule the
    validator would refuse a value with."""
    assert review_main(["--explain", "--format", "markdown"]) == 0
    rows = {line.split("|")[1].strip().strip("`"): line for line in capsys.readouterr().out.splitlines()
            if line.startswith("| `")}
    for doc in BOUNDED:
        assert doc.bound.rule[1:] in rows[doc.key], rows[doc.key]
    assert set(rows) == set(key_docs())


def test_explain_refuses_a_key_that_does_not_exist(capsys):
    """Pins: `--explain` answering nothing (exit 0) for a mistyped key."""
    assert review_main(["--explain", "elche.anchr"]) == 1
    assert "elche.anchr" in capsys.readouterr().err


EXACT = [
    (dict(elche__overhead_target=0.6), "elche.overhead_target: must be in [0.01, 0.5], got 0.6"),
    (dict(elche__easgd_alpha=0.0), "elche.easgd_alpha: must be in (0, 1], got 0.0"),
    (dict(outer__momentum=1.0), "outer.momentum: must be in [0, 1), got 1.0"),
    (dict(data__ram_max_usage=0.95), "data.ram_max_usage: must be in [0.0, 0.9], got 0.95"),
    (dict(max_log_size=100), "max_log_size: must be >= 4096, got 100"),
    (dict(tracking__system_metrics_interval_s=0.0),
     "tracking.system_metrics_interval_s: must be > 0, got 0.0"),
    (dict(cluster__emulate_jitter=0.6), "cluster.emulate_jitter: must be in [0.0, 0.5], got 0.6"),
]


@pytest.mark.parametrize("changes,message", EXACT, ids=[m.split(":")[0] for _, m in EXACT])
def test_a_bound_reads_as_the_rules_written_out_did(changes, message):
    """Pins the wording byte for byte (the rules were written out one by one before bounds):
    ends shown as declared, ints as ints, `[`/`(` for closed/open ends."""
    assert message in [str(p) for p in validate(make(**changes)).problems]


def test_none_passes_only_where_the_field_is_optional():
    """Pins null handling: an Optional bounded key may be null, a plain one may not (the slurm
    block refused a null node count before bounds)."""
    assert "max_grad_norm" not in [p.key for p in validate(make(max_grad_norm=None)).problems]
    nodes = [str(p) for p in validate(config_with("cluster.slurm.nodes", None)).problems]
    assert "cluster.slurm.nodes: must be >= 1, got None" in nodes


def test_bound_problems_checks_any_dataclass_with_bounds():
    """Pins the helper on a schema of its own: the key it names, the rule, declaration order,
    and the docstring reader pairing each field with the string under it."""

    @dataclasses.dataclass
    class Knobs:
        rate: float = bounded(0.5, gt=0, lt=1)
        """A share."""
        count: typing.Optional[int] = bounded(None, ge=2)
        """How many; null = auto."""

    problems = [str(p) for p in bound_problems(Knobs(rate=1.0, count=1), "knobs")]
    assert problems == ["knobs.rate: must be in (0, 1), got 1.0", "knobs.count: must be >= 2, got 1"]
    assert list(bound_problems(Knobs(count=None), "knobs")) == []
    assert docstrings(Knobs) == {"rate": "A share.", "count": "How many; null = auto."}
    with pytest.raises(TypeError):
        Bound(ge=1, gt=1)

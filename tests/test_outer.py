"""Outer optimizers on the consensus against a float64 reference."""

from __future__ import annotations

import pytest
import torch

from flodl_run.averaging.outer import OuterOptimizer
from flodl_run.config.schema import OuterConfig, OuterKind


def _reference(kind: OuterKind, lr: float, mu: float, consensus_seq):
    """Float64 replay of the formulas: first window prev := consensus; then g = prev - c."""
    prev, v, out = None, None, []
    for c in consensus_seq:
        c = c.double()
        if prev is None:
            prev, v = c.clone(), torch.zeros_like(c)
            out.append(c.clone())
            continue
        g = prev - c
        v = mu * v + g
        new = prev - lr * (v if kind is OuterKind.slowmo else mu * v + g)
        out.append(new)
        prev = new
    return out


@pytest.mark.parametrize("kind,lr,mu", [(OuterKind.slowmo, 1.0, 0.9), (OuterKind.diloco, 0.7, 0.9),
                                        (OuterKind.slowmo, 0.5, 0.5)])
def test_outer_step_matches_float64_reference(kind, lr, mu):
    """Pins the SlowMo and Nesterov DiLoCo updates, velocity carried across windows, and the
    no-op first window."""
    gen = torch.Generator().manual_seed(0)
    seq = [torch.randn(50, generator=gen) for _ in range(6)]
    opt = OuterOptimizer(OuterConfig(kind=kind, lr=lr, momentum=mu))
    expected = _reference(kind, lr, mu, seq)
    for i, c in enumerate(seq):
        params = [c.clone()]
        moved = opt.step_(params)
        assert moved == (i > 0)
        assert torch.allclose(params[0].double(), expected[i], rtol=1e-5, atol=1e-6), i


def test_outer_none_leaves_consensus_alone():
    """Pins outer=none as plain averaging: the consensus is adopted as is."""
    opt = OuterOptimizer(OuterConfig())
    params = [torch.ones(3)]
    assert not opt.step_(params) and not opt.step_(params)
    assert torch.equal(params[0], torch.ones(3))


def test_outer_replicas_stay_identical():
    """Pins bit-identical results of two replicated outer optimizers fed the same consensus
    (collective modes run one per rank with no extra collective)."""
    a = OuterOptimizer(OuterConfig(kind=OuterKind.diloco, lr=0.7, momentum=0.9))
    b = OuterOptimizer(OuterConfig(kind=OuterKind.diloco, lr=0.7, momentum=0.9))
    gen = torch.Generator().manual_seed(3)
    for _ in range(5):
        c = torch.randn(20, generator=gen)
        pa, pb = [c.clone()], [c.clone()]
        a.step_(pa)
        b.step_(pb)
        assert torch.equal(pa[0], pb[0])


def test_a_resumed_state_of_another_layout_starts_afresh(capsys):
    """Pins that outer state from a bundle whose flat buffers had another length (written before
    the views were aligned) is dropped with a warning instead of failing mid-step: the window
    acts as a first one, then steps resume."""
    opt = OuterOptimizer(OuterConfig(kind=OuterKind.slowmo, lr=1.0, momentum=0.9))
    opt.load_state_dict({"prev": [torch.zeros(30)], "velocity": [torch.zeros(30)]})
    params = [torch.ones(32)]
    assert not opt.step_(params)
    assert torch.equal(params[0], torch.ones(32)) and opt.prev[0].shape == (32,)
    assert "another flat layout" in capsys.readouterr().err
    assert opt.step_([torch.zeros(32)])

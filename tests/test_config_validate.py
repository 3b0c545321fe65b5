"""Every rule of flodl_run/config/validate.py, the warnings, and the resolution of auto values.

Pure tests on typed objects (no Hydra): each rule row breaks one rule of a valid config and
checks that the problem names the dotted key as a user types it, and the bad value.
"""

from __future__ import annotations

import dataclasses
import os

import pytest

from flodl_run.config.materialize import ConfigError, materialize
from flodl_run.config.schema import (
    Backend,
    ExperimentConfig,
    Mode,
    OuterKind,
    Reduction,
    SshConfig,
    Topology,
    TrackingKind,
    WindowEnd,
    WorkerConfig,
)
from flodl_run.config.validate import resolve, validate
from tests.support import make


def hosts(*workers: WorkerConfig) -> dict:
    return {"cluster__topology": Topology.hosts, "cluster__workers": list(workers)}


def cpu(num_ranks: int = 2) -> dict:
    return {"cluster__topology": Topology.cpu, "cluster__num_ranks": num_ranks}


# (id, config changes, dotted key of the problem, the value as the message shows it)
RULES = [
    ("seed", dict(seed=-1), "seed", "-1"),
    ("batch_size", dict(batch_size=0), "batch_size", "0"),
    ("num_epochs", dict(num_epochs=0), "num_epochs", "0"),
    ("device", dict(device="gpu"), "device", "'gpu'"),
    ("anchor", dict(elche__anchor=0), "elche.anchor", "0"),
    ("progressive_async", dict(elche__mode=Mode.cpu_async, progressive_dispatch=False),
     "progressive_dispatch", "False"),
    ("min_anchor", dict(elche__min_anchor=0), "elche.min_anchor", "0"),
    ("max_anchor", dict(elche__max_anchor=0), "elche.max_anchor", "0"),
    ("min>max", dict(elche__min_anchor=50, elche__max_anchor=20), "elche.min_anchor", "50"),
    ("anchor>max", dict(elche__anchor=50, elche__max_anchor=20), "elche.anchor", "50"),
    ("overhead_low", dict(elche__overhead_target=0.001), "elche.overhead_target", "0.001"),
    ("overhead_high", dict(elche__overhead_target=0.6), "elche.overhead_target", "0.6"),
    ("max_batch_diff", dict(elche__max_batch_diff=-1), "elche.max_batch_diff", "-1"),
    ("max_overshoot", dict(elche__max_overshoot=-1), "elche.max_overshoot", "-1"),
    ("divergence", dict(elche__divergence_threshold=0.0), "elche.divergence_threshold", "0.0"),
    ("gamma", dict(elche__gamma=-0.5), "elche.gamma", "-0.5"),
    ("easgd_high", dict(elche__easgd_alpha=1.5), "elche.easgd_alpha", "1.5"),
    ("easgd_zero", dict(elche__easgd_alpha=0.0), "elche.easgd_alpha", "0.0"),
    ("deadline_headroom_negative", dict(elche__deadline_headroom=-0.1), "elche.deadline_headroom", "-0.1"),
    ("deadline_headroom_high", dict(elche__deadline_headroom=1.5), "elche.deadline_headroom", "1.5"),
    ("ratios_positive", dict(elche__partition_ratios=[1.0, 0.0]), "elche.partition_ratios", "[1.0, 0.0]"),
    ("ratios_length", dict(elche__partition_ratios=[1.0, 2.0, 3.0], **cpu(2)),
     "elche.partition_ratios", "[1.0, 2.0, 3.0]"),
    ("moments_central", dict(elche__mode=Mode.cpu_cadence, elche__reduce_optimizer_state=True),
     "elche.reduce_optimizer_state", "True"),
    ("outer_lr", dict(outer__lr=0.0), "outer.lr", "0.0"),
    ("outer_momentum", dict(outer__momentum=1.0), "outer.momentum", "1.0"),
    ("vram", dict(data__vram_max_usage=0.4), "data.vram_max_usage", "0.4"),
    ("ram", dict(data__ram_max_usage=0.95), "data.ram_max_usage", "0.95"),
    ("gpu_ram_share", dict(data__gpu_ram_share=0.0), "data.gpu_ram_share", "0.0"),
    ("disk_stage_gb", dict(data__disk_stage_gb=-1.0), "data.disk_stage_gb", "-1.0"),
    ("prefetch", dict(data__prefetch=0), "data.prefetch", "0"),
    ("augment", dict(data__augment=0), "data.augment", "0"),
    ("epoch_splits", dict(data__epoch_splits=0), "data.epoch_splits", "0"),
    ("transform", dict(data__transform="my.fn"), "data.transform", "'my.fn'"),
    ("checkpoint_every", dict(checkpoint_every=0), "checkpoint_every", "0"),
    ("snapshot_timeout", dict(snapshot_timeout_secs=0.0), "snapshot_timeout_secs", "0.0"),
    ("max_grad_norm", dict(max_grad_norm=0.0), "max_grad_norm", "0.0"),
    ("lr_scale_ratio", dict(lr_scale_ratio=-1.0), "lr_scale_ratio", "-1.0"),
    ("heartbeat", dict(heartbeat_timeout_secs=0.0), "heartbeat_timeout_secs", "0.0"),
    ("max_nonfinite", dict(max_nonfinite=0), "max_nonfinite", "0"),
    ("progress_timeout", dict(progress_timeout_secs=0.0), "progress_timeout_secs", "0.0"),
    ("progress_factor", dict(progress_factor=0.5), "progress_factor", "0.5"),
    ("eval_every", dict(eval_every_epochs=0), "eval_every_epochs", "0"),
    ("reports_per_epoch", dict(reports_per_epoch=0), "reports_per_epoch", "0"),
    ("max_log_size", dict(max_log_size=100), "max_log_size", "100"),
    ("max_failure_both", dict(max_failure__absolute=1, max_failure__percent=0.5),
     "max_failure", "'absolute=1, percent=0.5'"),
    ("max_failure_absolute", dict(max_failure__absolute=0), "max_failure.absolute", "0"),
    ("max_failure_percent", dict(max_failure__percent=1.5), "max_failure.percent", "1.5"),
    ("policy_format", dict(epoch_callback_policy="slowest"), "epoch_callback_policy", "'slowest'"),
    ("policy_rank", dict(epoch_callback_policy="rank:2", **cpu(2)), "epoch_callback_policy", "'rank:2'"),
    ("core_reduction", dict(scalar_reductions={"loss": Reduction.max}), "scalar_reductions.loss", "'max'"),
    ("checkpoint_at_epoch", dict(checkpoint_at_epoch=10, num_epochs=10), "checkpoint_at_epoch", "10"),
    ("resume_from", dict(resume_from="/nonexistent/ckpt"), "resume_from", "'/nonexistent/ckpt'"),
    ("cpu_num_ranks", dict(cluster__topology=Topology.cpu), "cluster.num_ranks", "None"),
    ("num_ranks", cpu(0), "cluster.num_ranks", "0"),
    ("threads_per_rank", dict(cluster__threads_per_rank=0), "cluster.threads_per_rank", "0"),
    ("master_port", dict(cluster__master_port=70000), "cluster.master_port", "70000"),
    ("controller_port", dict(cluster__controller__port=-1), "cluster.controller.port", "-1"),
    ("devices_empty", dict(cluster__topology=Topology.local_gpus), "cluster.devices", "[]"),
    ("devices_repeat", dict(cluster__topology=Topology.local_gpus, cluster__devices=["0", "0"]),
     "cluster.devices", "['0', '0']"),
    ("backend_nccl_on_cpu", dict(**cpu(), cluster__backend=Backend.nccl), "cluster.backend", "'nccl'"),
    ("slowdown_factor", dict(cluster__emulate_slowdown=[0.5]), "cluster.emulate_slowdown", "[0.5]"),
    ("slowdown_length", dict(cluster__emulate_slowdown=[1.0, 2.0, 3.0], **cpu(2)),
     "cluster.emulate_slowdown", "[1.0, 2.0, 3.0]"),
    ("jitter_range", dict(cluster__emulate_jitter=0.6), "cluster.emulate_jitter", "0.6"),
    ("workers_empty", hosts(), "cluster.workers", "[]"),
    ("worker_devices_repeat", hosts(WorkerConfig(local_devices=[0, 0])),
     "cluster.workers.0.local_devices", "[0, 0]"),
    ("worker_devices_word", hosts(WorkerConfig(local_devices="some")),
     "cluster.workers.0.local_devices", "'some'"),
    ("worker_ifname", hosts(WorkerConfig(host="a", nccl_socket_ifname="eth0"), WorkerConfig(host="b")),
     "cluster.workers.1.nccl_socket_ifname", "None"),
    ("worker_ssh_port", hosts(WorkerConfig(ssh=SshConfig(port=0))), "cluster.workers.0.ssh.port", "0"),
    ("worker_env_torchrun", hosts(WorkerConfig(env={"RANK": "3"})), "cluster.workers.0.env.RANK", "'3'"),
    ("worker_env_ours", hosts(WorkerConfig(env={"FLODL_RUN_SECRET": "x"})),
     "cluster.workers.0.env.FLODL_RUN_SECRET", "'x'"),
    ("worker_device_twice", hosts(WorkerConfig(local_devices=[0]), WorkerConfig(local_devices=[0])),
     "cluster.workers", "['localhost:0']"),
    ("server_uri", dict(tracking__kind=TrackingKind.mlflow_server, tracking__uri="sqlite:///x.db"),
     "tracking.uri", "'sqlite:///x.db'"),
    ("local_uri", dict(tracking__uri="http://host:5000"), "tracking.uri", "'http://host:5000'"),
    ("experiment", dict(tracking__experiment=""), "tracking.experiment", "''"),
    ("recipe_batch_size", dict(recipe__batch_size=0), "recipe.batch_size", "0"),
    ("sysmetrics_interval", dict(tracking__system_metrics_interval_s=0.0),
     "tracking.system_metrics_interval_s", "0.0"),
]


def test_default_config_is_valid_without_warnings():
    """Pins: a rule that fires on the defaults (every run would fail or warn)."""
    report = validate(ExperimentConfig())
    assert report.ok and report.problems == [] and report.warnings == []


@pytest.mark.parametrize("changes,key,shown", [r[1:] for r in RULES], ids=[r[0] for r in RULES])
def test_rule_names_dotted_key_and_value(changes, key, shown):
    """Pins: a rule that stops firing, or whose message loses the dotted key or the bad value."""
    report = validate(make(**changes))
    messages = [str(p) for p in report.problems]
    assert not report.ok
    assert any(m.startswith(f"{key}: ") and m.endswith(f"got {shown}") for m in messages), messages


def test_resume_from_existing_bundle_is_valid(tmp_path):
    """Pins: resume_from rejecting a bundle that does exist (its stem + .meta.json, which names
    the generation's other files), and accepting a stem without one."""
    stem = tmp_path / "ckpt"
    assert not validate(make(resume_from=str(stem))).ok
    stem.with_name(stem.name + ".meta.json").write_text("x")
    assert validate(make(resume_from=str(stem))).ok


def test_every_problem_is_reported_together():
    """Pins: validation stopping at the first problem (users would fix errors one run at a time)."""
    cfg = make(batch_size=0, elche__easgd_alpha=1.5, elche__min_anchor=50, elche__max_anchor=20,
               data__vram_max_usage=0.1)
    keys = [p.key for p in validate(cfg).problems]
    assert keys == ["batch_size", "elche.min_anchor", "elche.easgd_alpha", "data.vram_max_usage"]
    with pytest.raises(ConfigError) as err:
        materialize(cfg, check_recipe=False)
    assert str(err.value).startswith("invalid config (4 problems):")
    assert len(err.value.problems) == 4


WARNINGS = [
    ("easgd_outside_async", dict(elche__easgd_alpha=0.5), "elche.easgd_alpha"),
    ("overshoot_outside_async", dict(elche__max_overshoot=4), "elche.max_overshoot"),
    ("batch_diff_collective", dict(elche__max_batch_diff=2), "elche.max_batch_diff"),
    ("relax_up_sync", dict(elche__mode=Mode.cpu_sync, elche__anchor=1, elche__relax_up=True),
     "elche.relax_up"),
    ("deadline_sync", dict(elche__mode=Mode.cpu_sync, elche__anchor=1,
                           elche__window_end=WindowEnd.deadline), "elche.window_end"),
    ("outer_none_momentum", dict(outer__momentum=0.9), "outer.lr/outer.momentum"),
    ("outer_none_reset", dict(outer__reset_inner_state=True), "outer.reset_inner_state"),
    ("moments_exact_sync", dict(elche__mode=Mode.nccl_sync, elche__anchor=1,
                                elche__reduce_optimizer_state=True), "elche.reduce_optimizer_state"),
    ("max_failure_above_world", dict(max_failure__absolute=3, **cpu(2)), "max_failure.absolute"),
    ("checkpoint_at_epoch_sync", dict(elche__mode=Mode.nccl_sync, checkpoint_at_epoch=1),
     "checkpoint_at_epoch"),
    ("num_ranks_outside_cpu", dict(cluster__num_ranks=2), "cluster.num_ranks"),
]


@pytest.mark.parametrize("changes,key", [w[1:] for w in WARNINGS], ids=[w[0] for w in WARNINGS])
def test_knob_without_effect_is_a_warning_not_an_error(changes, key):
    """Pins: a no-effect knob turned into an error (or silently accepted without a warning)."""
    report = validate(make(**changes))
    assert report.ok, report.problems
    assert any(w.startswith(key) for w in report.warnings), report.warnings


def test_knobs_in_their_own_mode_do_not_warn():
    """Pins: warning about easgd_alpha/max_overshoot where they do work (cpu_async)."""
    cfg = make(elche__mode=Mode.cpu_async, elche__easgd_alpha=0.5, elche__max_overshoot=4,
               elche__window_end=WindowEnd.deadline, outer__kind=OuterKind.slowmo, outer__momentum=0.9)
    assert validate(cfg).warnings == []


@pytest.mark.parametrize("easgd_alpha,explicit,expected", [
    (None, None, 0.05), (0.5, None, 0.3), (0.5, 0.1, 0.1), (None, 0.2, 0.2)])
def test_resolve_divergence_threshold(easgd_alpha, explicit, expected):
    """Pins: the guard threshold default (0.05; 0.3 with EASGD's elastic spread)."""
    cfg = make(elche__easgd_alpha=easgd_alpha, elche__divergence_threshold=explicit)
    assert resolve(cfg).elche.divergence_threshold == expected


def test_resolve_min_anchor_follows_anchor_unless_set():
    """Pins: min_anchor null meaning `anchor`, and an explicit floor being kept."""
    assert resolve(make(elche__anchor=7)).elche.min_anchor == 7
    assert resolve(make(elche__anchor=7, elche__min_anchor=3)).elche.min_anchor == 3


@pytest.mark.parametrize("mode,explicit,expected", [
    (Mode.nccl_sync, None, False), (Mode.cpu_sync, None, False), (Mode.nccl_cadence, None, True),
    (Mode.cpu_cadence, None, True), (Mode.cpu_async, None, True), (Mode.nccl_cadence, False, False)])
def test_resolve_progressive_dispatch_by_mode(mode, explicit, expected):
    """Pins: progressive dispatch auto (on for cadence/async, off for sync)."""
    assert resolve(make(elche__mode=mode, progressive_dispatch=explicit)).progressive_dispatch is expected


def test_resolve_save_path_defaults_into_run_dir(tmp_path):
    """Pins: save_path null meaning <run dir>/checkpoint, and an explicit path being kept."""
    assert resolve(make(), run_dir=str(tmp_path)).save_path == str(tmp_path / "checkpoint")
    assert resolve(make(save_path="/data/ckpt"), run_dir=str(tmp_path)).save_path == "/data/ckpt"
    assert resolve(make()).save_path is None


@pytest.mark.parametrize("cores,num_ranks,expected", [(8, 2, 4), (2, 4, 1), (1, 2, 1)])
def test_resolve_threads_per_rank(monkeypatch, cores, num_ranks, expected):
    """Pins: CPU ranks' thread count (the cores this process may use / ranks, at least 1): a
    process pinned to fewer cores (taskset, a group sweep's job) splits those, not the host's."""
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)))
    assert resolve(make(**cpu(num_ranks))).cluster.threads_per_rank == expected
    assert resolve(make(cluster__threads_per_rank=3, **cpu(num_ranks))).cluster.threads_per_rank == 3


def test_resolve_normalizes_ratios_and_leaves_input_untouched():
    """Pins: resolve mutating the caller's config, and partition_ratios not summing to 1."""
    cfg = make(elche__partition_ratios=[1.0, 3.0])
    before = dataclasses.replace(cfg, elche=dataclasses.replace(cfg.elche))
    resolved = resolve(cfg)
    assert resolved.elche.partition_ratios == [0.25, 0.75]
    assert resolved.run_name == "nccl_cadence-digits_mlp"
    assert cfg == before


def test_ranks_may_share_a_gpu_in_collective_modes_over_gloo():
    """Pins cluster.backend=gloo: two ranks on one GPU in nccl_sync (as torchrun users debug on
    one GPU) are valid over Gloo, and over NCCL the refusal names the key that allows it."""
    shared = dict(cluster__topology=Topology.local_gpus, cluster__devices=["0", "0"],
                  elche__mode=Mode.nccl_sync)
    assert validate(make(**shared, cluster__backend=Backend.gloo)).ok
    problems = [str(p) for p in validate(make(**shared)).problems]
    assert any("set cluster.backend=gloo to share one" in m for m in problems), problems


@pytest.mark.parametrize("path,rule", [
    ("/dev/null", "must name a bundle's stem in a directory of files, not a device"),
    ("{tmp}/", "must name a bundle's stem, not a directory"),
    ("{tmp}", "must name a bundle's stem, not a directory"),
])
def test_save_path_names_a_stem_not_a_directory_or_a_device(tmp_path, path, rule):
    """Pins: `save_path=/dev/null` wrote `null.g1.pt` into /dev, and `save_path=/x/` wrote
    hidden `.g1.pt` files inside /x while its lock went to `/.x.lock`. Each is now refused
    before the run starts, naming save_path, the value and the rule."""
    path = path.format(tmp=tmp_path)
    messages = [str(p) for p in validate(make(save_path=path)).problems]
    assert any(m.startswith("save_path: ") and rule in m and repr(path) in m for m in messages), messages

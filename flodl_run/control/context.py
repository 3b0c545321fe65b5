"""What the coordinator's parts share, and what each may ask of another.

`RunContext` is built once per run by the coordinator and handed to every part: the config, the
channel's `send`/`next`/`payloads`, the record of the run (observer, recorder, summary) and the
run's shared facts (`control.runstate`: the stop request, the balance, the holdings). The
protocols name what a part offers the others; a part takes, by keyword, only those it uses.
It imports none of the coordinator's parts; they and the coordinator import it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, List, NoReturn, Optional, Protocol, Set, Tuple

from flodl_run.config.schema import ExperimentConfig, Mode
from flodl_run.contracts.recipe import CallbackFailed
from flodl_run.contracts.summary import Summary
from flodl_run.control.runstate import Balance, Holdings, StopRequest
from flodl_run.control.tallies import EpochTally
from flodl_run.observe.observer import Observer
from flodl_run.observe.timeline import Recorder

Send = Callable[..., None]
"""send(rank, message, payloads=()): an order to one rank."""
Next = Callable[..., object]
"""next(expect, deadline=None, accept=None): the next message expected, or None (see Coordinator)."""
Payloads = Callable[[], List[memoryview]]
"""payloads(): the frames that came with the message `next` returned last."""
OnLost = Callable[[int, str], None]
"""on_lost(rank, reason): what a death does (the rank's work given back, a re-plan)."""


@dataclass
class RunContext:
    """What every part of one run shares. The coordinator builds it once the socket is bound;
    a test builds one with fakes (`send`/`next` of scripted ranks) and the defaults for the rest."""

    config: ExperimentConfig
    world_size: int
    send: Optional[Send] = None
    next: Optional[Next] = None
    payloads: Optional[Payloads] = None
    observer: Observer = field(default_factory=Observer)
    recorder: Recorder = field(default_factory=Recorder)
    summary: Summary = field(default_factory=Summary)
    stop: StopRequest = field(default_factory=StopRequest)
    balance: Balance = field(default_factory=Balance)
    holdings: Optional[Holdings] = None
    """What each rank holds since its last fold; None: a fresh ledger of `world_size` ranks."""

    def __post_init__(self) -> None:
        if self.holdings is None:
            self.holdings = Holdings(self.world_size)

    @property
    def mode(self) -> Mode:
        return self.config.elche.mode


class OrderDeadlines(Protocol):
    """How long a rank may take over an ordered eval or save, and who is on one now
    (membership's OrderClock)."""

    def limit_s(self, kind: str) -> float: ...

    def took(self, kind: str, seconds: float) -> None: ...

    def sent(self, kind: str, rank: int) -> float: ...

    def answered(self, rank: int) -> None: ...


class Members(Protocol):
    """What the membership offers the other parts: who is alive, whether a regroup is due
    (a part that sees a round broken sets it), the order deadlines, a verdict on a rank late
    with its order, and which rank runs the callbacks (evals, the model's save)."""

    alive: Set[int]
    regroup_needed: bool
    orders: OrderDeadlines

    def overdue(self, kind: str, ranks: Set[int], began: float) -> bool: ...

    def callback_rank(self) -> int: ...


class Bundles(Protocol):
    """What saving offers: a bundle now, and the saves that end a run (they raise RunAborted)."""

    def save_bundle(self, reason: str, epoch: int, uncovered: List[List[int]]) -> Optional[str]: ...

    def fail_callback(self, failure: CallbackFailed, epoch: int,
                      uncovered: List[List[int]]) -> NoReturn: ...

    def graceful_stop(self, epoch: int, uncovered: List[List[int]]) -> NoReturn: ...


class Trajectory(Protocol):
    """What the reduces offer saving: where the run stands, as a bundle records it."""

    def trajectory(self) -> Tuple[int, int]: ...


class Group(Protocol):
    """What the coordinator offers the parts that break a round: rebuild the survivors' group
    (the orders sent ahead voided first, the old group's answers dropped after); `source`: the
    member whose state all adopt (-1: none)."""

    def regroup(self, source: int = -1) -> None: ...


class Run(Group, Protocol):
    """What the coordinator offers the reduces besides a regroup: a save, what of the epoch
    under way the survivors' weights may not include, and the samples an epoch holds."""

    def save_bundle(self, reason: str, epoch: int, uncovered: List[List[int]]) -> Optional[str]: ...

    def uncovered_now(self) -> List[List[int]]: ...

    def epoch_samples(self, epoch: int) -> int: ...


class Closes(Protocol):
    """What the epochs offer the async loop: close a finished epoch (its record, eval, callbacks)."""

    def close(self, epoch: int, tally: EpochTally) -> None: ...

"""What the coordinator's parts share, and what each may ask of another.

`RunContext` is built once per run by the coordinator and handed to every part: the config, the
`link` to the ranks (`send`; `next`, which returns a message, and `next_with_frames`, which
returns it with its frames), the record of the run (observer, recorder, summary, data-plane
metrics) and the run's shared facts (`control.runstate`: the stop request, the balance, the
holdings; the train set's size once the ranks joined). The protocols name what a part offers
the others; a part takes, by keyword, only those it uses.
It imports none of the coordinator's parts; they and the coordinator import it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, List, NoReturn, Optional, Protocol, Sequence, Set, Tuple

from flodl_run.config.schema import ExperimentConfig
from flodl_run.contracts.recipe import CallbackFailed
from flodl_run.contracts.summary import Summary
from flodl_run.contracts.wire import Message, Received
from flodl_run.control.dispatch import EpochSpan, epoch_span
from flodl_run.control.runstate import Balance, Holdings, StopRequest
from flodl_run.control.tallies import EpochTally
from flodl_run.data.datametrics import DataTally
from flodl_run.observe.observer import Observer
from flodl_run.observe.timeline import Recorder


class Link(Protocol):
    """The coordinator's end of the control plane (control.pump's Pump): an order to one rank,
    and the next message expected (`expect`: a type or tuple of types; `accept`: a filter on
    it), or None when a rank died meanwhile or `deadline` (time.monotonic) passed."""

    def send(self, rank: int, message: Message, payloads: Sequence[memoryview] = ()) -> None: ...

    def next(self, expect: type | tuple, deadline: Optional[float] = None,
             accept: Optional[Callable[[Message], bool]] = None) -> Optional[Message]: ...

    def next_with_frames(self, expect: type | tuple, deadline: Optional[float] = None,
                         accept: Optional[Callable[[Message], bool]] = None) -> Optional[Received]: ...

    def drop_reduce_answers(self) -> None: ...


class Losses(Protocol):
    """What a death does beyond the membership (the coordinator's RankLosses): the rank recorded
    and killed, its work given back, its speed forgotten."""

    def lost(self, rank: int, reason: str) -> None: ...


@dataclass
class RunContext:
    """What every part of one run shares. The coordinator builds it once the socket is bound;
    a test builds one with fakes (a `link` of scripted ranks) and the defaults for the rest."""

    config: ExperimentConfig
    world_size: int
    link: Optional[Link] = None
    observer: Observer = field(default_factory=Observer)
    recorder: Recorder = field(default_factory=Recorder)
    summary: Summary = field(default_factory=Summary)
    stop: StopRequest = field(default_factory=StopRequest)
    balance: Balance = field(default_factory=Balance)
    holdings: Optional[Holdings] = None
    """What each rank holds since its last fold; None: a fresh ledger of `world_size` ranks."""
    data: Optional[DataTally] = None
    """Per-rank data-plane metrics, per epoch (fed every WindowDone); None: a fresh one."""
    num_samples: int = 0
    """The train set's size, as the ranks reported it when they joined (0 until then)."""

    def __post_init__(self) -> None:
        if self.holdings is None:
            self.holdings = Holdings(self.world_size)
        if self.data is None:
            self.data = DataTally(self.world_size)

    def send(self, rank: int, message: Message, payloads: Sequence[memoryview] = ()) -> None:
        """An order to one rank, through the link."""
        self.link.send(rank, message, payloads)

    def next(self, expect: type | tuple, deadline: Optional[float] = None,
             accept: Optional[Callable[[Message], bool]] = None) -> Optional[Message]:
        """The next message expected, through the link (see Link)."""
        return self.link.next(expect, deadline, accept)

    def epoch_span(self, epoch: int) -> EpochSpan:
        """The samples `epoch` trains (its pass and range of the train set)."""
        data = self.config.data
        return epoch_span(epoch, self.num_samples, data.augment, data.epoch_splits)


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

    def regroup(self, source: int = -1) -> None: ...


class Bundles(Protocol):
    """What saving offers: a bundle now, and the saves that end a run (they raise RunAborted)."""

    def save_bundle(self, reason: str, epoch: int, uncovered: List[List[int]]) -> Optional[str]: ...

    def fail_callback(self, failure: CallbackFailed, epoch: int,
                      uncovered: List[List[int]]) -> NoReturn: ...

    def graceful_stop(self, epoch: int, uncovered: List[List[int]]) -> NoReturn: ...


class Trajectory(Protocol):
    """What the round book offers saving: where the run stands, as a bundle records it."""

    def trajectory(self) -> Tuple[int, int]: ...


class Closes(Protocol):
    """What the epochs offer the async loop: close a finished epoch (its record, eval, callbacks)."""

    def close(self, epoch: int, tally: EpochTally) -> None: ...

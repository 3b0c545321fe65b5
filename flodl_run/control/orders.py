"""Train orders: the window number they carry, their deadlines (elche.window_end=deadline),
what a rank's report says it trained of its order, and the progress a report makes. Each
trainer (windows, exact steps, async chunks) numbers its own windows with one `Orders`.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Set

from flodl_run.contracts.wire import SyncNow, Train, WindowDone
from flodl_run.control.deadlines import Deadlines
from flodl_run.control.dispatch import EpochPool, SliceT, split_trained
from flodl_run.control.runstate import Balance, Holdings
from flodl_run.control.tallies import EpochTally, WindowTally
from flodl_run.observe.observer import Observer
from flodl_run.observe.timeline import Recorder


class Orders:
    """Owns the window number Train orders carry (`window`), the deadlines of a deadline
    window, and a resumed epoch's batches the bundle holds (`batches_before`, for progress).
    Given: batch_size, the recorder (the coordinator's clock), the balance (the plan's window
    duration), and `deadline_headroom` when windows end on a deadline (None: on their counts;
    control.modes decides)."""

    def __init__(self, batch_size: int, recorder: Recorder, balance: Balance,
                 deadline_headroom: Optional[float]):
        self.batch_size, self.balance = batch_size, balance
        self.deadline_windows = deadline_headroom is not None
        self.window = 0
        self.deadlines = Deadlines(recorder, deadline_headroom or 0.0)
        self.batches_before: Dict[int, int] = {}  # a resumed epoch's batches the bundle holds

    def next_window(self) -> None:
        """A reduce begins: orders from now on belong to the next window."""
        self.window += 1

    def train_order(self, epoch: int, slices: list, overshoot: int = 0,
                    then_sync: Optional[SyncNow] = None, ahead_of: int = 0,
                    deadline_ns: Optional[int] = None) -> Train:
        """`ahead_of`: an order of the next window, sent before the reduce of round `ahead_of`.
        With elche.window_end=deadline a cadence or async order carries the plan's duration
        and its end on the coordinator's clock: `deadline_ns` (a cadence window's, shared by
        its orders), else the duration from now (an async chunk)."""
        batches = sum(-(-s[2] // self.batch_size) for s in slices)
        deadline_ms = self.deadline_ms()
        if deadline_ms is not None and deadline_ns is None:
            deadline_ns = self.deadlines.chunk_ns(deadline_ms)
        return Train(self.window + (1 if ahead_of else 0), epoch, slices, batches, overshoot, then_sync,
                     after_round=ahead_of, deadline_ms=deadline_ms,
                     deadline_ns=None if deadline_ms is None else deadline_ns)

    def deadline_ms(self) -> Optional[float]:
        """The window's deadline: deadline windows in the cadence and async modes, once ElChe
        timed the anchor rank; None ends the window on its counts."""
        if not self.deadline_windows:
            return None
        return self.balance.window_ms()

    def progress(self, observer: Observer, epoch: int, epoch_tally: EpochTally, window: WindowTally,
                 done: WindowDone) -> None:
        """The batches of the epoch done so far, and the loss the rank's report brings."""
        batches = self.batches_before.get(epoch, 0) + sum(epoch_tally.batches) + sum(window.batches)
        # the rank's window loss; a rank given no sample has none: the window's, else the epoch's
        loss = done.loss_sum / done.loss_count if done.loss_count else window.mean_loss()
        observer.on_batch(epoch, batches, loss if loss is not None else epoch_tally.mean_loss())


def take_back(done: WindowDone, slices: List[SliceT], pool: EpochPool, alive: Set[int],
              holdings: Holdings, batch_size: int) -> List[SliceT]:
    """What the rank trained of the order of `slices` it reports on; the batches it left
    (its deadline passed first) go back to `pool` and out of its holdings, so each sample
    is still trained once in the epoch. A dead rank's report changes nothing (all it held
    went back already)."""
    if not done.left:
        return slices
    trained, left = split_trained(slices, done.batches, batch_size)
    if done.rank in alive:
        pool.give_back(left)
        holdings.trim(done.rank, done.epoch, slices, trained)
    return trained

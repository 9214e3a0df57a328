"""The step waiting to start: its kind, its estimate, and whether it fits the grant held now.

A step starts only if its estimated duration fits before the grant's deadline
minus the margin (:mod:`freeride.admission`), with two exceptions at a grant's
start, where a step too long or too little known to fit any bubble runs as a
probe. A task that packs (``IterativeTask.fit_piece``) chooses the kind of its
next piece by the room left first.
"""

from __future__ import annotations

import logging
import time

from freeride.sidetask import IterativeTask, StepEstimates
from freeride.sidetask.estimates import TRUSTED_RUNS
from freeride.worker.ledger import GrantLedger

__all__ = ["PendingStep"]

logger = logging.getLogger(__name__)

_LOG_CHANGE = 1.1
"""The scale of little-measured kinds' estimates is logged when it moves by this factor ..."""
_LOG_EVERY_NS = 60_000_000_000
"""... at most once a minute after the first time."""


class PendingStep:
    """The pending step of ``task`` against the grants kept in ``ledger``.

    Args:
        task: The task whose steps wait here.
        estimates: What each kind of step is expected to take; measured here.
        ledger: The grant held, which a step must fit.
    """

    def __init__(self, task: IterativeTask, estimates: StepEstimates, ledger: GrantLedger) -> None:
        self._task = task
        self.estimates = estimates
        self._ledger = ledger
        self.kind = task.step_kind()
        """The kind of the step waiting to start (or of the next one)."""
        self.packs = type(task).fit_piece is not IterativeTask.fit_piece
        """The task chooses its pieces by the room left (packing)."""
        self._scale_logged = 1.0
        self._scale_logged_at = -_LOG_EVERY_NS

    @property
    def estimate_ns(self) -> int:
        """The running estimate of the pending kind (what the manager must fit).

        -1 for a kind not measured yet even where its cost gives an estimate: the
        manager then grants it a bubble's start, where it runs as a probe.
        """
        return self.estimates.known_ns(self.kind)

    def fits(self, now: int) -> bool:
        """Whether the pending step may start now.

        A kind not measured yet starts mid-grant where its cost-scaled estimate
        fits, and at a grant's start in any case (a probe: its estimate errs
        high, and one long enough to fit no bubble would keep it out of all).
        A kind measured only in an earlier run pays its warm-up again in this
        process: where that first step's time there does not fit, it starts only
        at the start of a grant, as an unmeasured kind would, rather than wait
        for a bubble that long.
        """
        ledger = self._ledger
        need = self.estimates.estimate_ns(self.kind)
        if self.estimate_ns < 0 and ledger.at_start(now):
            return True  # unmeasured: a probe, as ever, however long its cost makes it look
        if not ledger.fits(now, need):
            return False
        cold = self.estimates.cold_ns(self.kind)
        return cold <= need or ledger.fits(now, cold) or ledger.at_start(now)

    def pack(self, now: int) -> None:
        """Let a packing task choose its next piece for the room left (see ``IterativeTask.fit_piece``).

        It only changes which kind is pending; whether that fits is then
        checked as for any step.
        """
        grant = self._ledger.open
        if not self.packs or grant is None or grant.probe:
            return
        room = self._ledger.room_ns(grant, now)
        if room > 0:
            kind = self._task.fit_piece(room, self.estimates.estimate_ns)
            if kind is not None:
                self.kind = kind

    def ran(self, took_ns: int) -> None:
        """Learn the time of the step that ran, then ask the task which kind comes next.

        The time is the pending kind's: a packing task may have chosen another
        piece than the one its step was asked for.
        """
        self.estimates.observe(self.kind, took_ns)
        self.kind = self._task.step_kind()
        self._log_scale()

    def _log_scale(self) -> None:
        scale, logged = self.estimates.calibration.factor, self._scale_logged
        if logged / _LOG_CHANGE < scale < logged * _LOG_CHANGE:
            return
        now = time.monotonic_ns()
        if now - self._scale_logged_at >= _LOG_EVERY_NS:
            self._scale_logged, self._scale_logged_at = scale, now
            logger.info(
                "[worker] estimates of kinds run in bubbles fewer than %d times are scaled x%.2f:"
                " such steps took that much over their estimate (90th percentile of the last ones)",
                TRUSTED_RUNS,
                scale,
            )

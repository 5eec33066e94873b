"""SIGINT/SIGTERM during training: finish the step, save checkpoint-last, exit with a one-line message."""

from __future__ import annotations

import signal
import threading
from pathlib import Path
from typing import Any, Optional

from .. import distributed as D
from ..errors import Stopped, param
from .checkpoint import CHECKPOINT


class TrainingStopped(Stopped):
    """A stop signal arrived: the checkpoint was saved in ``run``, and resuming it continues the run."""

    def __init__(self, message: str, signal_name: str = "SIGINT", run: Optional[Path] = None):
        super().__init__(message, signal_name)
        self.run = run


class StopRequest:
    """The handlers set a flag the loop reads after each optimizer step, after the last epoch and before the final
    model is written (the whole of ``fit``: a stop in the last epoch is a stop too); a second signal acts at once."""

    def __init__(self) -> None:
        self.requested: Optional[str] = None
        self.previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: Any) -> None:
        self.requested = signal.Signals(signum).name
        signal.signal(signum, self.previous.get(signum, signal.SIG_DFL))

    def asked(self, env: D.DistEnv) -> bool:
        """Whether any rank got a stop signal (a collective: every rank asks at the same point)."""
        return D.any_rank(env, self.requested is not None)

    def stopped(self, when: str, run: Path) -> TrainingStopped:
        """The stop, once ``run``'s checkpoint-last holds the point a resume continues from."""
        return TrainingStopped(f"stopped by {self.requested or 'a signal'} {when}; checkpoint saved in "
                               f"{run / CHECKPOINT}: continue with {param('resume', True)}",
                               self.requested or "SIGINT", run=run)

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():  # signals can only be caught there
            for sig in (signal.SIGINT, signal.SIGTERM):
                self.previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)

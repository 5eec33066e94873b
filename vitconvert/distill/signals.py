"""SIGINT/SIGTERM during training: finish the step, save checkpoint-last, exit with a one-line message."""

from __future__ import annotations

import signal
import threading
from pathlib import Path
from typing import Any, Optional

from ..errors import Stopped


class TrainingStopped(Stopped):
    """A stop signal arrived: the checkpoint was saved in ``run``, and resuming it continues the run."""

    def __init__(self, message: str, signal_name: str = "SIGINT", run: Optional[Path] = None):
        super().__init__(message, signal_name)
        self.run = run


class StopRequest:
    """The handlers set a flag the loop reads after each optimizer step; a second signal acts at once."""

    def __init__(self) -> None:
        self.requested: Optional[str] = None
        self.previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: Any) -> None:
        self.requested = signal.Signals(signum).name
        signal.signal(signum, self.previous.get(signum, signal.SIG_DFL))

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():  # signals can only be caught there
            for sig in (signal.SIGINT, signal.SIGTERM):
                self.previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)

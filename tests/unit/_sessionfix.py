"""A stand-in for a rank's sockets, shared by the session's unit tests (import it into the test module)."""

from __future__ import annotations

from freeride import protocol as p

__all__ = ["Recorder"]


class Recorder:
    """Stands in for the EventEmitter and the BubblePublisher: keeps what would have been sent, in order."""

    def __init__(self, holdback: p.Holdback | None = None) -> None:
        self.events: list[p.BackendEvent] = []
        self.dropped = self.sent = 0
        self.holdback = holdback
        """The rule of held-back steps a manager's acknowledgement named (a publisher's)."""

    def wait_connected(self, timeout_ms: int) -> bool:
        return True

    def emit(self, event: p.BackendEvent) -> bool:
        self.events.append(event)
        return True

    def publish(self, event: p.BubbleStarted | p.BubbleEnded) -> None:
        self.events.append(event)

    def acknowledged(self, *, look: bool = False) -> bool:
        return True

    def close(self, goodbye: p.Goodbye | None = None, *, linger_ms: int = 200) -> None:
        if goodbye is not None:
            self.events.append(goodbye)

    def ended(self) -> list[p.BubbleEnded]:
        return [e for e in self.events if isinstance(e, p.BubbleEnded)]

    def kinds(self) -> list[str]:
        return [type(e).__name__ for e in self.events]

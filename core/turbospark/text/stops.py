"""Stop strings: cutting a streamed text at the first one, without emitting half of one."""

from __future__ import annotations

from collections.abc import Sequence


class StopStrings:
    """Cuts a text stream at the first stop string, holding back a possible partial match.

    ``feed`` returns the text safe to emit now; once a stop string completes,
    ``stopped`` is set and the text before it is the last thing returned.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self.stopped: str | None = None
        self._pending = ""

    def feed(self, delta: str) -> str:
        if not self.stops:  # nothing to hold back (every token of most requests)
            return delta
        if self.stopped is not None:
            return ""
        text = self._pending + delta
        hits = [(text.find(s), s) for s in self.stops if s in text]
        if hits:
            index, stop = min(hits)
            self.stopped = stop
            self._pending = ""
            return text[:index]
        hold = max((_partial_suffix(text, s) for s in self.stops), default=0)
        self._pending = text[len(text) - hold :] if hold else ""
        return text[: len(text) - hold]

    def flush(self) -> str:
        """At the end of the stream a held partial match is ordinary text."""
        text, self._pending = self._pending, ""
        return "" if self.stopped is not None else text


def _partial_suffix(text: str, stop: str) -> int:
    """Length of the longest suffix of *text* that is a proper prefix of *stop*."""
    for n in range(min(len(text), len(stop) - 1), 0, -1):
        if text.endswith(stop[:n]):
            return n
    return 0

"""The replies the engine generated, by their text: so a re-sent reply is fed as the ids it was.

A client continuing a conversation re-sends each assistant reply as text.
Tokenising that text again need not give the ids that were generated (a
non-canonical split, a special token the text dropped), and a prompt built
from the re-tokenised text leaves the session inside the reply. The server
looks each re-sent reply up here and splices the generated ids in its place
(``server/service.py``), so the prompt continues the session through the reply.

Written on the runner thread (a row's finish), read on the server's text pool:
one lock. Bounded by count and by ids, least recently used out; a reply that
left the index is tokenised as text, as any other client's reply is.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

MAX_REPLIES = 512  # the replies of that many recent requests
MAX_REPLY_IDS = 1 << 20  # ids held in all (4 bytes each in a list of ints: a few MiB at most)


class ReplyIndex:
    """Generated replies: their text (as decoded for the client) to their ids."""

    def __init__(self, max_replies: int = MAX_REPLIES, max_ids: int = MAX_REPLY_IDS) -> None:
        self.max_replies = max_replies
        self.max_ids = max_ids
        self._by_text: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self._ids = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._by_text)

    def add(self, text: str, ids: Sequence[int]) -> None:
        """Remember that *ids* were generated and reached the client as *text*
        (empty text or ids prove nothing and are not kept)."""
        if not text or not ids or len(ids) > self.max_ids:
            return
        with self._lock:
            old = self._by_text.pop(text, None)
            if old is not None:
                self._ids -= len(old)
            self._by_text[text] = tuple(int(t) for t in ids)
            self._ids += len(ids)
            while len(self._by_text) > self.max_replies or self._ids > self.max_ids:
                _, gone = self._by_text.popitem(last=False)
                self._ids -= len(gone)

    def ids_of(self, text: str) -> tuple[int, ...] | None:
        """The ids generated as exactly *text*, or None (not a reply generated here)."""
        with self._lock:
            ids = self._by_text.get(text)
            if ids is not None:
                self._by_text.move_to_end(text)
            return ids

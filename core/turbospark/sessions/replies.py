"""The replies the engine generated, by their text and the prompt they followed: so a re-sent reply is fed as the ids it was.

A client continuing a conversation re-sends each assistant reply as text.
Tokenising that text again need not give the ids that were generated (a
non-canonical split, a special token the text dropped), and a prompt built
from the re-tokenised text leaves the session inside the reply. The server
looks each re-sent reply up here and splices the generated ids in its place
(``server/chat_ids.py``), so the prompt continues the session through the reply.

A reply is found only after the very prompt ids it was generated after: the
ids are then exactly what the model produced in that conversation, and a
client learns nothing of another conversation it could not already tell from
the shared prompt cache (it must send that conversation's whole prompt).

Written on the runner thread (a row's finish), read on the server's text pool:
one lock. Bounded by count and by ids, least recently used out; a reply that
left the index is tokenised as text, as any other client's reply is.

With a *path* (the session directory's ``replies-<model>.jsonl``, one file a
model: ids mean tokens only under the tokenizer they came from) each reply is
also appended there as one JSON line and read back at the next start, so a
session restored from disk after a restart is continued through its re-sent
replies as a live one is. The file is rewritten from memory once it holds
twice the replies kept; a line cut short by a crash is skipped.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO

MAX_REPLIES = 512  # the replies of that many recent requests
MAX_REPLY_IDS = 1 << 20  # ids held in all (a few MiB at most)


def prompt_digest(ids: Sequence[int]) -> bytes:
    """A prompt's ids in 16 bytes: which prompt a reply followed."""
    return hashlib.blake2b(array("q", ids).tobytes(), digest_size=16).digest()


class ReplyIndex:
    """Generated replies: (their text as decoded for the client, the digest of
    the prompt they followed) to their ids."""

    def __init__(
        self, max_replies: int = MAX_REPLIES, max_ids: int = MAX_REPLY_IDS, path: Path | None = None
    ) -> None:
        self.max_replies = max_replies
        self.max_ids = max_ids
        self.path = path
        self._replies: OrderedDict[tuple[str, bytes], tuple[int, ...]] = OrderedDict()
        self._texts: dict[str, int] = {}  # text -> how many entries hold it (a cheap miss)
        self._ids = 0
        self._lock = threading.Lock()
        self._file: IO[str] | None = None
        self._lines = 0  # lines in the file
        if path is not None:
            self._load(path)

    def __len__(self) -> int:
        return len(self._replies)

    def add(self, prompt: Sequence[int], text: str, ids: Sequence[int]) -> None:
        """Remember that *ids* were generated after *prompt* and reached the
        client as *text*. Empty *text* is kept too (ids that all decode to
        nothing, as special tokens do, reach the client as an empty message);
        no ids prove nothing and are not kept."""
        if not ids or len(ids) > self.max_ids:
            return
        key = (text, prompt_digest(prompt))
        kept = tuple(int(t) for t in ids)
        with self._lock:
            self._keep(key, kept)
            if self._file is not None:
                self._file.write(_line(key, kept))
                self._file.flush()
                self._lines += 1
                if self._lines > 2 * self.max_replies:
                    self._rewrite()

    def _keep(self, key: tuple[str, bytes], ids: tuple[int, ...]) -> None:
        self._drop(key)
        self._replies[key] = ids
        self._texts[key[0]] = self._texts.get(key[0], 0) + 1
        self._ids += len(ids)
        while len(self._replies) > self.max_replies or self._ids > self.max_ids:
            self._drop(next(iter(self._replies)))

    def _load(self, path: Path) -> None:
        """The replies *path* holds, oldest first, then the file rewritten
        from them (so it starts at the replies kept, and any line cut short is gone)."""
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except FileNotFoundError:
            lines = []
        for line in lines:
            try:
                entry = json.loads(line)
                key = (entry["text"], bytes.fromhex(entry["prompt"]))
                ids = tuple(int(t) for t in entry["ids"])
            except (ValueError, KeyError, TypeError):
                continue  # a line a crash cut short
            if ids and len(ids) <= self.max_ids:
                self._keep(key, ids)
        self._rewrite()

    def _rewrite(self) -> None:
        """The file anew from the replies kept, written aside and moved in place."""
        assert self.path is not None
        if self._file is not None:
            self._file.close()
        temp = self.path.with_name(f".tmp-{self.path.name}")
        with temp.open("w", encoding="utf-8") as out:
            out.writelines(_line(key, ids) for key, ids in self._replies.items())
        os.replace(temp, self.path)
        self._lines = len(self._replies)
        self._file = self.path.open("a", encoding="utf-8")

    def _drop(self, key: tuple[str, bytes]) -> None:
        gone = self._replies.pop(key, None)
        if gone is None:
            return
        self._ids -= len(gone)
        self._texts[key[0]] -= 1
        if not self._texts[key[0]]:
            del self._texts[key[0]]

    def knows(self, text: str) -> bool:
        """Whether some reply generated here reached its client as exactly *text*."""
        with self._lock:
            return text in self._texts

    def ids_of(self, text: str, prompt: Callable[[], Sequence[int]]) -> tuple[int, ...] | None:
        """The ids generated as exactly *text* after the prompt *prompt()* returns
        (called only when some reply has this text), or None."""
        with self._lock:
            if text not in self._texts:
                return None
        key = (text, prompt_digest(prompt()))
        with self._lock:
            ids = self._replies.get(key)
            if ids is not None:
                self._replies.move_to_end(key)
            return ids


def _line(key: tuple[str, bytes], ids: tuple[int, ...]) -> str:
    text, prompt = key
    return json.dumps({"text": text, "prompt": prompt.hex(), "ids": ids}) + "\n"

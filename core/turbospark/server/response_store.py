"""Stored responses (the Responses API's ``store``): the items of each, bounded.

A stored response is the conversation it ended (its input items, the earlier
responses' items before them, and its output items) plus the token ids its
session held. The state itself stays where every conversation's state is, in
the session pool, found by token content: a continuation
(``previous_response_id``) renders the stored items plus its new input, so
the pool resumes the response's session and prefills only the new turn. When
that session has left the pool (and disk), the stored items are still enough
to prefill the conversation again; only when the items have gone too is the
id unknown (404).

The store is bounded by count, bytes and age, least recently used first out;
an evicted id is remembered (boundedly) so a continuation can say why it is
gone. With a directory (``--session-dir``'s ``responses/``) every entry is a
JSON file written atomically, so responses survive a restart beside the
session files. Light on purpose (pydantic and the standard library only):
``turbospark serve --help`` reads its defaults.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

log = logging.getLogger(__name__)

MiB = 1024 * 1024
# Evicted ids remembered so a continuation can say "evicted" rather than "unknown".
REMEMBERED_EVICTIONS = 4096


class ResponseStoreLimits(BaseModel):
    """The bounds of the response store (``turbospark serve`` flags)."""

    model_config = ConfigDict(frozen=True)

    max_count: int = Field(
        default=1000, ge=0, description="stored responses kept (0: store nothing)"
    )
    max_bytes: int = Field(
        default=64 * MiB, gt=0, description="bytes of stored items (their JSON) kept"
    )
    max_age: float = Field(
        default=7 * 24 * 3600.0, gt=0, description="seconds a stored response is kept"
    )


class StoredResponse(BaseModel):
    """One stored response: the response object as returned, the conversation
    before its output (``context``: earlier items, then this request's input
    items), and the token ids its session held (prompt, then output)."""

    model_config = ConfigDict(extra="ignore")

    id: str
    created_at: float
    response: dict[str, Any]
    context: list[dict[str, Any]]
    tokens: list[int]

    @property
    def items(self) -> list[dict[str, Any]]:
        """The whole conversation: context, then the output items."""
        return [*self.context, *self.response.get("output", [])]


class ResponseStore:
    """Stored responses in memory (and in *directory* when given), under *limits*.

    Called from the event loop and from the text pool, so one lock guards it."""

    def __init__(self, limits: ResponseStoreLimits, directory: Path | None = None) -> None:
        self.limits = limits
        self.directory = directory
        self.evictions = 0
        self._entries: OrderedDict[str, tuple[StoredResponse, int]] = OrderedDict()
        self._evicted: OrderedDict[str, str] = OrderedDict()  # id -> why
        self._bytes = 0
        self._lock = threading.Lock()
        if directory is not None:
            directory.mkdir(parents=True, exist_ok=True)
            self._scan()

    @property
    def nbytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, entry: StoredResponse) -> None:
        """Store *entry* (newest), then evict to fit the bounds."""
        raw = entry.model_dump_json()
        with self._lock:
            self._insert(entry, len(raw))
            if self.directory is not None:
                self._write(entry.id, raw)
            self._fit(keep=entry.id)

    def get(self, ident: str) -> StoredResponse | None:
        """The stored response *ident* (now the most recently used), or None."""
        with self._lock:
            self._expire()
            held = self._entries.get(ident)
            if held is None:
                return None
            self._entries.move_to_end(ident)
            return held[0]

    def delete(self, ident: str) -> bool:
        """Forget *ident*; False if it was not stored."""
        with self._lock:
            held = self._entries.pop(ident, None)
            if held is None:
                return False
            self._bytes -= held[1]
            self._unlink(ident)
            return True

    def why_gone(self, ident: str) -> str | None:
        """Why *ident* was evicted (None: never stored here, or deleted)."""
        with self._lock:
            return self._evicted.get(ident)

    # -- bounds -------------------------------------------------------------------

    def _insert(self, entry: StoredResponse, nbytes: int) -> None:
        old = self._entries.pop(entry.id, None)
        if old is not None:
            self._bytes -= old[1]
        self._entries[entry.id] = (entry, nbytes)
        self._bytes += nbytes

    def _fit(self, keep: str | None = None) -> None:
        self._expire()
        limits = self.limits
        while self._entries and (
            len(self._entries) > limits.max_count or self._bytes > limits.max_bytes
        ):
            oldest = next(iter(self._entries))
            if oldest == keep and len(self._entries) == 1 and limits.max_count > 0:
                break  # one response larger than the byte bound is still kept alone
            why = (
                f"the response store holds at most {limits.max_count} responses (--max-stored-responses)"
                if len(self._entries) > limits.max_count
                else f"the response store holds at most {limits.max_bytes:,} bytes "
                "(--response-store-memory)"
            )
            self._evict(oldest, why)

    def _expire(self) -> None:
        cutoff = time.time() - self.limits.max_age
        # Recency order is use order, not age order: every entry is looked at.
        for ident in [i for i, (e, _) in self._entries.items() if e.created_at < cutoff]:
            self._evict(ident, self._age_why())

    def _age_why(self) -> str:
        return f"it is older than {self.limits.max_age:g} seconds (--response-ttl)"

    def _evict(self, ident: str, why: str) -> None:
        _, nbytes = self._entries.pop(ident)
        self._bytes -= nbytes
        self.evictions += 1
        self._evicted[ident] = why
        while len(self._evicted) > REMEMBERED_EVICTIONS:
            self._evicted.popitem(last=False)
        self._unlink(ident)
        log.info("evicted stored response %s: %s", ident, why)

    # -- files --------------------------------------------------------------------

    def _path(self, ident: str) -> Path:
        assert self.directory is not None
        return self.directory / f"{ident}.json"

    def _write(self, ident: str, raw: str) -> None:
        path = self._path(ident)
        temp = path.with_name(f".tmp-{path.name}")
        temp.write_text(raw, encoding="utf-8")
        os.replace(temp, path)

    def _unlink(self, ident: str) -> None:
        if self.directory is not None:
            self._path(ident).unlink(missing_ok=True)

    def _scan(self) -> None:
        """Index the directory's responses, oldest first; a file that does not
        parse is logged and left out (never served)."""
        assert self.directory is not None
        for temp in self.directory.glob(".tmp-*.json"):
            temp.unlink(missing_ok=True)
        found: list[tuple[StoredResponse, int]] = []
        for path in self.directory.glob("resp_*.json"):
            try:
                raw = path.read_text(encoding="utf-8")
                entry = StoredResponse.model_validate(json.loads(raw))
            except (OSError, ValueError, ValidationError) as exc:
                log.warning("ignored stored response file %s: %s", path.name, exc)
                continue
            if entry.id != path.stem:
                log.warning("ignored stored response file %s: it holds %s", path.name, entry.id)
                continue
            found.append((entry, len(raw)))
        for entry, nbytes in sorted(found, key=lambda pair: pair[0].created_at):
            self._insert(entry, nbytes)
        with self._lock:
            self._fit()

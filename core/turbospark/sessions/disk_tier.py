"""The disk tier: sessions that outlive memory and restarts (``--session-dir``).

RAM is a cache over the directory. A session leaves memory (the LRU slot, the
parked-memory cap) by being written here instead of dropped; the server also
writes the live session after every request (write-through), so a ``kill -9``
between two requests loses nothing, and the session store writes every warm session
on shutdown. The directory's index (every file's token record, read from the
safetensors headers when the runner opens) lives in memory: a prompt scores
disk sessions exactly like parked ones, with no file read, and only the one
that wins is loaded (and verified).

A file that cannot be trusted (torn, corrupt, built under another model) is
refused with a log line and a reason and moved into ``rejected/`` beside a
``.reason`` note: never served, never silently deleted. The directory is
bounded by ``max_bytes``: files whose session is also in memory are deleted
first (nothing is lost; the session is written again when it leaves memory),
and only then, least recently used first, files that are a conversation's
only copy, each such loss logged and counted in :attr:`DiskTier.evictions`.
A file that changed since it was indexed is re-indexed from what it holds,
and a session whose directory vanished is written to a recreated one; a
failure to write is logged once per session state, however often it is retried.

Everything here runs on the runner's thread; one process per directory
(a second one is refused: an advisory lock on ``.lock``).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from turbospark.errors import InvalidInput
from turbospark.sessions.prefix import PrefixRecord
from turbospark.sessions.session import Session, SessionSnapshot
from turbospark.sessions.session_file import (
    SUFFIX,
    ModelIdentity,
    RejectReason,
    SessionFileError,
    check_model,
    fsync_dir,
    read_meta,
    read_session,
    write_session,
)

log = logging.getLogger("turbospark.sessions")

REJECTED = "rejected"


@dataclass
class DiskEntry:
    """One file in the index: its record (for scoring), checkpoints, size, recency."""

    name: str
    record: PrefixRecord
    checkpoints: list[int]
    nbytes: int
    tick: int


class DiskTier:
    """The index and the files of one session directory, for one model.

    *capture* turns a session into a snapshot through the family's hooks,
    *materialize* builds a new session from one; *resident* names the files
    whose sessions are in memory right now (their disk copy is never scored,
    and deleting it loses nothing).
    """

    def __init__(
        self,
        root: Path,
        model: ModelIdentity,
        *,
        components: list[str],
        context_length: int,
        max_bytes: int | None,
        capture: Callable[[Session], SessionSnapshot],
        materialize: Callable[[SessionSnapshot], Session],
        resident: Callable[[], set[str]],
    ) -> None:
        self.root = root
        self.model = model
        self.components = components
        self.context_length = context_length
        self.max_bytes = max_bytes
        self._capture = capture
        self._materialize = materialize
        self._resident = resident
        self.entries: dict[str, DiskEntry] = {}
        self.evictions = 0  # files deleted for the bound whose session was not in memory
        self.rejected: list[tuple[str, str]] = []  # (file, reason) refused since opening
        self._clock = 0
        # (conversation, tokens) of session states whose write failed since the last
        # write that worked: each is logged once, however often a flush retries it.
        self._unwritten: set[tuple[int, int]] = set()
        self._lock = _lock(root)
        self._scan()

    # -- the index ----------------------------------------------------------------

    def _scan(self) -> None:
        """Index every session file by its header; refuse the ones that cannot be trusted."""
        (self.root / REJECTED).mkdir(exist_ok=True)
        for temp in self.root.glob(f".tmp-*{SUFFIX}"):
            # A write that never reached its rename: the previous file (if any) is intact.
            log.warning("removing %s: an interrupted write (the previous version is intact)", temp)
            temp.unlink(missing_ok=True)
        files = sorted(self.root.glob(f"*{SUFFIX}"), key=lambda p: p.stat().st_mtime_ns)
        for path in files:
            try:
                meta = read_meta(path)
                check_model(path, meta, self.model)
            except SessionFileError as exc:
                self.reject(exc)
                continue
            if meta.tainted or len(meta.tokens) >= self.context_length:
                log.info("not indexing %s: %s", path.name, "tainted" if meta.tainted else
                         f"{len(meta.tokens)} tokens do not fit context {self.context_length}")  # fmt: skip
                continue
            self._index(path.stem, meta.tokens, meta.checkpoints, path.stat().st_size)
        self.enforce_bound(keep=None)

    def _index(self, name: str, tokens: Sequence[int], checkpoints: list[int], nbytes: int) -> None:
        record = PrefixRecord()
        record.write(0, tokens)
        self._clock += 1
        self.entries[name] = DiskEntry(name, record, list(checkpoints), nbytes, self._clock)

    @property
    def nbytes(self) -> int:
        return sum(entry.nbytes for entry in self.entries.values())

    def path(self, name: str) -> Path:
        return self.root / f"{name}{SUFFIX}"

    def candidates(self, prompt: Sequence[int]) -> Iterator[tuple[DiskEntry, int]]:
        """Files not in memory that share a prefix with *prompt*, best first
        (ties: most recently used), scored by their records alone."""
        resident = self._resident()
        scored = [
            (entry.record.common_prefix(prompt), entry)
            for entry in self.entries.values()
            if entry.name not in resident
        ]
        for score, entry in sorted(scored, key=lambda s: (s[0], s[1].tick), reverse=True):
            if score == 0:
                return
            yield entry, score

    # -- moving sessions ------------------------------------------------------------

    def is_saved(self, session: Session) -> bool:
        """Whether *session*'s file holds exactly its record and checkpoints."""
        entry = None if session.disk_name is None else self.entries.get(session.disk_name)
        return (
            entry is not None
            and not session.record.tainted
            and entry.record.tokens == session.record.tokens
            and entry.checkpoints == [c.position for c in session.checkpoints]
        )

    def backup_evicted(self, session: Session) -> bool:
        """Whether *session*'s file was deleted for the bound while it was in memory:
        write-through leaves it alone (rewriting it would only push another file
        out); it is written again when it leaves memory, or at shutdown."""
        return session.disk_name is not None and session.disk_name not in self.entries

    def save(self, session: Session) -> bool:
        """Make sure *session* is on disk (written if it changed since); False when
        it cannot be: a tainted record (nothing could ever find it), no room
        under the bound, or a failed write (logged; the memory copy is intact)."""
        if self.is_saved(session):
            return True
        tokens = list(session.record.tokens)
        if session.record.tainted or not tokens or len(tokens) != session.position:
            return False
        if session.steering.identity != self.model.steering:
            return False  # built under a request's own steering: its files hold the server's
        name = session.disk_name or uuid.uuid4().hex
        try:
            self._recreate()
            nbytes = write_session(
                self.path(name), self._capture(session), self.model, self.components
            )
        except (OSError, RuntimeError, ValueError) as exc:  # a full or read-only disk
            state = (session.conversation, len(tokens))
            if state not in self._unwritten:  # retried at every flush: one line a state
                self._unwritten.add(state)
                log.error("could not write session %s (%d tokens): %s", name, len(tokens), exc)
            return False
        self._unwritten.clear()  # the disk works again: a later failure is news
        session.disk_name = name
        self._index(name, tokens, [c.position for c in session.checkpoints], nbytes)
        return self.enforce_bound(keep=name)

    def load(self, entry: DiskEntry) -> Session | None:
        """The session in *entry*'s file, verified; None (the file moved aside,
        the reason logged) when it cannot be trusted."""
        try:
            meta, snapshot = read_session(self.path(entry.name), self.model)
        except SessionFileError as exc:
            self.reject(exc)
            return None
        except OSError as exc:
            log.error("could not read session file %s: %s", entry.name, exc)
            self.entries.pop(entry.name, None)
            return None
        if meta.tokens != entry.record.tokens or meta.checkpoints != entry.checkpoints:
            # Replaced since it was indexed (another copy, an older one): index what it
            # holds, so the caller matches the prompt against that, not the old record.
            log.warning(
                "session file %s changed since it was indexed (%d tokens then, %d now); "
                "re-indexed from its content", entry.name, len(entry.record), len(meta.tokens),
            )  # fmt: skip
            self.entries.pop(entry.name)
            nbytes = self.path(entry.name).stat().st_size
            self._index(entry.name, meta.tokens, meta.checkpoints, nbytes)
        try:
            session = self._materialize(snapshot)
            if session.position != len(meta.tokens):
                raise ValueError(f"its state holds {session.position} tokens, its record "
                                 f"{len(meta.tokens)}")  # fmt: skip
        except (KeyError, ValueError, TypeError, RuntimeError) as exc:
            # Verified, and ours, but not this family's state any more (a plugin changed it).
            self.reject(SessionFileError(self.path(entry.name), RejectReason.MALFORMED,
                                         f"does not fit this family's state ({exc!r})"))  # fmt: skip
            return None
        session.disk_name = entry.name
        self.touch(entry.name)
        return session

    def touch(self, name: str) -> None:
        """Mark a file most recently used (also across restarts: its mtime)."""
        self._clock += 1
        self.entries[name].tick = self._clock
        with contextlib.suppress(OSError):  # the order in memory is what matters now
            os.utime(self.path(name))

    def enforce_bound(self, keep: str | None) -> bool:
        """Delete files until the directory fits ``max_bytes`` (never *keep*, the
        file just written); False if *keep* alone does not fit.

        Files of sessions still in memory go first, least recently used first:
        deleting one loses nothing. A file that is its conversation's only copy
        goes only when those are gone, and each is counted in :attr:`evictions`."""
        if self.max_bytes is None:
            return True
        if keep is not None and self.entries[keep].nbytes > self.max_bytes:
            self._delete(keep, f"it alone is larger than the bound of {self.max_bytes} bytes")
            return False
        resident = self._resident()
        order = sorted(self.entries.values(), key=lambda e: (e.name not in resident, e.tick))
        for entry in order:
            if self.nbytes <= self.max_bytes:
                break
            if entry.name == keep:
                continue
            lost = entry.name not in resident
            self.evictions += lost
            where = "it was the conversation's only copy" if lost else "its session is in memory"
            self._delete(
                entry.name,
                f"the session directory is over its bound of {self.max_bytes} bytes; {where}",
            )
        return True

    def forget(self, name: str) -> None:
        """Delete file *name* because its conversation was dropped on purpose
        (nothing is lost that anyone asked to keep, so no eviction is counted)."""
        if self.entries.pop(name, None) is not None:
            self.path(name).unlink(missing_ok=True)
            fsync_dir(self.root)

    def _delete(self, name: str, why: str) -> None:
        entry = self.entries.pop(name)
        log.warning("evicted session file %s (%d tokens): %s", name, len(entry.record), why)
        self.path(name).unlink(missing_ok=True)
        fsync_dir(self.root)

    def reject(self, error: SessionFileError) -> None:
        """Move a file that cannot be trusted into ``rejected/`` with a note why
        (one log line: refused and moved, refused and left, or vanished)."""
        name = error.path.stem
        self.entries.pop(name, None)
        if not error.path.exists():
            log.warning("session file %s vanished; dropped from the index", error.path.name)
            return
        self.rejected.append((error.path.name, str(error.reason)))
        target = self.root / REJECTED / error.path.name
        try:
            target.parent.mkdir(exist_ok=True)
            while target.exists():
                target = target.with_name(f"{target.stem}-{uuid.uuid4().hex[:6]}{SUFFIX}")
            os.replace(error.path, target)
            target.with_suffix(".reason").write_text(f"{error.reason}: {error}\n")
            fsync_dir(self.root)
        except OSError as exc:
            log.error(
                "refused session file %s (%s): %s; it could not be moved aside (%s), so it is "
                "left in place and not indexed", error.path.name, error.reason, error, exc,
            )  # fmt: skip
            return
        log.warning(
            "refused session file %s (%s): %s; moved to %s", error.path.name, error.reason,
            error, target,
        )  # fmt: skip

    def _recreate(self) -> None:
        """Recreate the directory (and take its lock again) if it was deleted
        while serving; the files it held are gone from the index too."""
        if self.root.is_dir():
            return
        log.warning("session directory %s was removed; recreating it", self.root)
        resident = self._resident()
        self.evictions += sum(name not in resident for name in self.entries)
        self.entries.clear()
        self._lock.close()
        self._lock = _lock(self.root)

    def close(self) -> None:
        self._lock.close()


def _lock(root: Path):
    """Hold the directory for this process (two writers would evict each other's files)."""
    try:
        root.mkdir(parents=True, exist_ok=True)
        handle = (root / ".lock").open("a")
    except OSError as exc:
        raise InvalidInput(f"cannot use {root} as a session directory: {exc}") from exc
    try:
        fcntl.lockf(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.close()
        raise InvalidInput(
            f"another process is using {root} as its session directory; give each server "
            "its own --session-dir"
        ) from None
    return handle

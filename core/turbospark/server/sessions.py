"""The page for people (``GET /``) and the warm sessions as JSON (``GET /turbospark/sessions``).

The pool is what turbospark is for, and until now nobody could see it: an
operator could not tell which conversations are warm, what each one holds,
what was evicted, or why a turn re-read its history. The page
(``page/index.html``: one file, no build step, nothing fetched from the
network, which its Content-Security-Policy enforces) chats through
``/v1/chat/completions`` and polls the view below.

**Privacy.** Conversations are private, and whoever can see the page is not
necessarily whoever had the conversation. So the view holds counts, sizes,
positions and reasons, never a token id or a piece of text: a conversation is
named by a counter (:attr:`turbospark.sessions.session.Session.conversation`), not by a
hash of its content (a hash would confirm a guessed prompt), and no field is
a list of numbers. ``tests/test_page.py`` checks this against a real
conversation's ids and text.

**Threads.** Sessions belong to the runner thread. The view is built there,
between two engine steps (:meth:`turbospark.generation.engine.Engine.call`), and the
event loop only awaits the result, so a poll never races a request.
"""

from __future__ import annotations

import asyncio
import functools
from importlib import resources
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route

from turbospark.generation.engine import RowInfo
from turbospark.server.errors import APIError
from turbospark.sessions.session import Session
from turbospark.state.kv import describe_kv

if TYPE_CHECKING:
    from turbospark.server.service import Service

# The engine answers between two steps, so within milliseconds unless it is warming up.
VIEW_TIMEOUT_SECONDS = 10.0

# Only what the page itself holds: inline script and style, and requests back to
# this server. A page that fetched anything else would break offline, so the
# browser is told to refuse it.
PAGE_POLICY = (
    "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
    "connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; "
    "frame-ancestors 'none'"
)


class _View(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class RequestView(_View):
    """The request holding an active session."""

    phase: Literal["prefilling", "decoding", "batched"]
    prompt_tokens: int
    generated_tokens: int
    cached_tokens: int = Field(description="prompt tokens that were already in state")
    reuse_reason: str
    reuse_detail: str = Field(description="the reason in words, with counts and sizes")
    batch_size: int = Field(description="rows decoding in the same forward now")


class SessionView(_View):
    """One session in memory: checked out to a request (``active``), the runner's
    ``live`` one, or ``parked`` in the pool."""

    conversation: int = Field(
        description="a counter, kept while this is the same conversation (parked, promoted, "
        "extended, rewound) and never derived from its content; a number that disappears "
        "left memory"
    )
    where: Literal["active", "live", "parked"]
    tokens: int = Field(description="tokens in its state")
    bytes: int = Field(description="bytes its state and checkpoints hold")
    last_used: int | None = Field(
        description="recency among the idle sessions in memory, 0 the most recent; "
        "null while a request holds it"
    )
    tainted: bool = Field(description="its ids cannot prove a match (vision, a failed call)")
    steering: str = Field(
        description="the steering its state was built under ('off', or mode, scale, layers "
        "and the vector's sha256 prefix): only a request asking for the same reuses it"
    )
    checkpoints: int
    newest_checkpoint: int | None = Field(description="the position of its newest checkpoint")
    file: str | None = Field(description="its file in the session directory, if written")
    saved: bool = Field(description="that file holds exactly this session now")
    request: RequestView | None = None


class DiskEntryView(_View):
    """One file in the session directory's index."""

    file: str
    tokens: int
    bytes: int
    last_used: int = Field(description="recency among the files, 0 the most recent")
    checkpoints: int
    in_memory: bool = Field(description="its session is also warm in memory")


class DiskView(_View):
    directory: str
    files: int
    bytes: int
    max_bytes: int | None
    evictions: int = Field(description="files deleted for the bound while not in memory")
    rejected: int = Field(description="files refused since the server started")
    entries: list[DiskEntryView]


class PoolView(_View):
    slots: int = Field(description="--session-slots: the live session plus the parked ones")
    empty_slots: int
    live_bytes: int
    parked_bytes: int
    max_parked_bytes: int | None = Field(description="--max-parked-memory; null: no cap")
    evictions: int = Field(description="requests that discarded a parked session since start")


class EngineView(_View):
    warming: bool
    active_rows: int
    max_batch: int
    queue_depth: int
    batch_bytes: int = Field(description="bytes of the merged state batched rows decode in")


class SessionsView(_View):
    """``GET /turbospark/sessions``: every warm session, counts, sizes and reasons only."""

    model: str
    family: str
    context_length: int
    kv_cache: str = Field(
        description="how every session's attention K/V are stored: 'full precision', or "
        "bits and group size (--kv-bits, --kv-group-size); one setting for every session here"
    )
    engine: EngineView
    pool: PoolView
    sessions: list[SessionView] = Field(description="active first, then by last use")
    disk: DiskView | None = Field(description="the session directory, when serving with one")


def _session(
    session: Session,
    where: Literal["active", "live", "parked"],
    last_used: int | None,
    saved: bool,
    row: RowInfo | None = None,
) -> SessionView:
    position = session.position if row is None else row.position
    return SessionView(
        conversation=session.conversation,
        where=where,
        tokens=position,
        bytes=session.nbytes,
        last_used=last_used,
        tainted=session.record.tainted,
        steering=session.steering.describe(),
        checkpoints=len(session.checkpoints),
        newest_checkpoint=session.checkpoints[-1].position if session.checkpoints else None,
        file=session.disk_name,
        saved=saved,
        request=None
        if row is None
        else RequestView(
            phase=row.phase,
            prompt_tokens=row.prompt_tokens,
            generated_tokens=row.generated,
            cached_tokens=row.kept,
            reuse_reason=row.reuse_reason,
            reuse_detail=row.reuse_detail,
            batch_size=row.batch_size,
        ),
    )


def build_view(service: Service) -> SessionsView:
    """The view, read on the runner thread (call it through ``engine.call``)."""
    runner, engine = service.runner, service.engine
    disk = runner.session_disk
    live, *parked = runner.sessions()

    def saved(session: Session) -> bool:
        return disk is not None and disk.is_saved(session)

    rows = engine.in_flight()
    views = [_session(r.session, "active", None, saved(r.session), r) for r in rows]
    # The live session is the one used last; parked ones by their pool tick.
    idle = [(live, "live")] if live.has_content else []
    idle += [(s, "parked") for s in sorted(parked, key=lambda s: -s.tick) if s.has_content]
    views += [
        _session(session, where, rank, saved(session))  # type: ignore[arg-type]
        for rank, (session, where) in enumerate(idle)
    ]
    disk_view = None
    if disk is not None:
        resident = {s.disk_name for s in (*runner.sessions(), *(r.session for r in rows))}
        entries = sorted(disk.entries.values(), key=lambda e: -e.tick)
        disk_view = DiskView(
            directory=str(disk.root),
            files=len(entries),
            bytes=disk.nbytes,
            max_bytes=disk.max_bytes,
            evictions=disk.evictions,
            rejected=len(disk.rejected),
            entries=[
                DiskEntryView(
                    file=entry.name,
                    tokens=len(entry.record),
                    bytes=entry.nbytes,
                    last_used=rank,
                    checkpoints=len(entry.checkpoints),
                    in_memory=entry.name in resident,
                )
                for rank, entry in enumerate(entries)
            ],
        )
    return SessionsView(
        model=service.model_id,
        family=runner.manifest.family,
        context_length=runner.context_length,
        kv_cache=describe_kv(runner.kv_quantization),
        engine=EngineView(
            warming=engine.warming,
            active_rows=len(rows),
            max_batch=engine.max_batch,
            queue_depth=engine.queue_depth,
            batch_bytes=engine.batch_nbytes,
        ),
        pool=PoolView(
            slots=runner.session_pool_size,
            empty_slots=sum(not s.has_content for s in (live, *parked)),
            live_bytes=live.nbytes,
            parked_bytes=sum(s.nbytes for s in parked),
            max_parked_bytes=runner.max_parked_bytes,
            evictions=engine.evictions,
        ),
        sessions=views,
        disk=disk_view,
    )


async def sessions(request: Request) -> Response:
    service: Service = request.app.state.service
    future = service.engine.call(functools.partial(build_view, service))
    try:
        view = await asyncio.wait_for(asyncio.wrap_future(future), VIEW_TIMEOUT_SECONDS)
    except TimeoutError:
        raise APIError(
            503,
            f"the engine did not answer within {VIEW_TIMEOUT_SECONDS:g} s "
            "(it may be warming up); try again",
            code="engine_busy",
            headers={"Retry-After": "1"},
        ) from None
    return JSONResponse(view.model_dump(mode="json"), headers={"Cache-Control": "no-store"})


@functools.cache
def _page() -> str:
    return resources.files("turbospark.server").joinpath("page/index.html").read_text("utf-8")


async def page(request: Request) -> Response:
    return HTMLResponse(
        _page(),
        headers={
            "Content-Security-Policy": PAGE_POLICY,
            "Cache-Control": "no-cache",
            "X-Content-Type-Options": "nosniff",
        },
    )


ROUTES = [
    Route("/", page, methods=["GET"]),
    Route("/turbospark/sessions", sessions, methods=["GET"]),
]

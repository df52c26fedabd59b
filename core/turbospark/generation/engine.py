"""Continuous batching: every active request advances in one forward per step.

This is the one decode loop. The server runs every request through an
engine (:meth:`Engine.run`); the CLI and the library run each of theirs
through an engine of one row on the caller's thread (:meth:`Engine.stream`,
:func:`turbospark.generation.generate.stream_generate`), so the same request
gives the same tokens, stats and reuse reasons either way.

One :class:`Engine` runs on the runner's thread and owns the requests in
flight. Each :meth:`Engine.step`:

1. **admits** queued requests while fewer than ``max_batch`` rows are active
   (a moment later when the server has more requests on their way in, so
   that a burst prefills together: :meth:`Engine.expect`).
   The caller contract of SEMANTICS.md (:func:`turbospark.generation.request.acquire`)
   picks each request's session and explains the choice; the session is then
   checked out of the runner for the request's lifetime, so concurrent
   requests never share state. A job's ``forks`` (the other completions of a
   request with ``n > 1``) are admitted with it and become rows of their own
   when its prefill ends, each holding the prefilled state by reference, so
   the prompt is prefilled once; a fork's session is dropped when it ends;
2. **prefills** waiting prompts, at most ``prefill_budget`` tokens per step
   in all, so a long prompt never stalls the streams already decoding.
   Several prompts go together in one batched forward (each to its end,
   the shorter padded, where the batched state takes ragged rows; else the
   same number of tokens each, the shortest remainder:
   :meth:`Engine._prefill_together`); a
   prompt left alone goes on in :func:`~turbospark.generation.request.prompt_chunks`;
3. **decodes** one token for every decoding row. With two rows or more (and a
   family whose components are all ``batchable``) the sessions are merged
   into one batched state (:mod:`turbospark.state.kv`) and advance in one
   forward, and its rows sample together (:func:`turbospark.generation.sampling.sample_together`;
   logprobs in one :class:`turbospark.generation.sampling.LogprobTable`);
   a lone row, or a family without a batched forward, steps through
   the one-row forward, and may draft (:meth:`Engine._decode_drafted`);
4. **retires** rows that finished, failed or were cancelled (their client went
   away): a batched row is copied back out of the batch, and its session is
   checked back in as the runner's live session (the previous live one is
   parked by the pool's rules).

Decoding is pipelined: a step is built from the
still-lazy sampled ids and queued before those ids are read (a batch keeps
its rows' ids in one array and reads the ids of step *t* with one
``tolist()`` once step *t+1* is queued, as mlx-lm's ``BatchGenerator``
does), and a row whose
id turns out to be a stop goes back one token (rewindable components drop a
column; the others come back from references held before the step).

A row that fails (a plugin raising, an id the model cannot take) fails only
its own request: a failed batched step is undone from held references and
every row is retried alone, so only the culprit sees the error.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from functools import partial
from typing import Literal, TypeVar

import mlx.core as mx

from turbospark.generation.drafters import Drafter
from turbospark.generation.request import (
    Chunk,
    FinishReason,
    GenerationConfig,
    GenerationStats,
    acquire,
    check_prompt,
    prompt_chunks,
)
from turbospark.generation.runner import Runner
from turbospark.generation.sampling import LogprobTable, Sampler, sample_together
from turbospark.generation.speculation import Queued, Speculation, settle, speculation_for
from turbospark.layers.fused import STEP_TOKENS
from turbospark.policies.steering import Steer
from turbospark.sessions.replies import ReplyIndex
from turbospark.sessions.reuse import ReuseReason, ReuseReport
from turbospark.sessions.session import Session
from turbospark.state.components import State
from turbospark.text import StopStrings, StreamDecoder, TextCodec

log = logging.getLogger("turbospark.generation.engine")
# Engine.warm_up's rounds, as its log names them.
WARM_UP_ROUNDS = ("alone", "groups", "groups with history", "batch decode")

Emit = Callable[[Chunk | Exception], None]
# Told of every real request's end: its stats when it finished, None when it failed.
Observer = Callable[["Job", GenerationStats | None], None]
T = TypeVar("T")


@dataclass(eq=False)
class Arrival:
    """A request the server has taken and is still preparing (its prompt being
    rendered and tokenized): its job is on its way to :meth:`Engine.submit`.
    :meth:`done` once it is submitted or given up; one never told expires
    after the engine's ``gather_s``."""

    engine: Engine
    started: float = field(default_factory=time.perf_counter)

    def done(self) -> None:
        self.engine._arrived(self)


@dataclass(eq=False)
class Job:
    """One request as submitted: prompt ids, its knobs, and where its chunks go.

    ``emit`` is called on the engine's thread with each :class:`Chunk` (the last
    one carries ``finish_reason`` and stats) or with the exception that failed
    the request. Setting ``cancelled`` (a client that hung up) frees the row at
    the next step."""

    ids: list[int]
    config: GenerationConfig
    emit: Emit
    cancelled: threading.Event = field(default_factory=threading.Event)
    submitted: float = field(default_factory=time.perf_counter)
    warm_up: bool = False  # the engine's own start-up request, admitted first
    # Per-row sampling extras (turbospark.generation.logits_processors; fresh objects per job).
    processors: list[object] = field(default_factory=list)
    top_logprobs: int | None = None  # keep each sample's log-probabilities (Chunk.logprobs)
    # The other completions of the same prompt (a request's n > 1): they become
    # rows when this job's prefill ends, each starting from its state by reference.
    forks: list[Job] = field(default_factory=list)
    drafter: Drafter | None = None  # replaces the runner's draft policy (benchmarks' oracles)
    # Where the next turn's prompt leaves the generation prompt (the server's
    # rendering says): non-rewindable state is checkpointed there too, since a
    # template that re-renders the reply otherwise (thinking dropped) leaves the
    # session there.
    checkpoint_at: int | None = None
    # How the prompt was built, appended to the reuse detail (a re-sent reply's
    # generated ids spliced in, or why they were not).
    prompt_note: str = ""


@dataclass(eq=False)
class _Row:
    job: Job
    session: Session
    kept: int
    report: ReuseReport
    evicted: bool
    sampler: Sampler
    stop_ids: frozenset[int]
    decoder: StreamDecoder
    stops: StopStrings
    started: float
    next_prefill: int  # the next prompt index to feed
    context_length: int
    position: int = 0  # decode: where `pending` is fed
    pending: mx.array | None = None  # the sampled, maybe still lazy, next id
    following: mx.array | None = None  # the id sampled from `pending`'s logits
    generated: list[int] = field(default_factory=list)
    prefilled: float = 0.0
    batch_peak: int = 1  # the most rows this request decoded beside
    leaves_at: int = 0  # the session's position once the row leaves the batch
    finish: FinishReason = "stop"
    fork: bool = False  # one of a request's n copies: its session is never checked in
    spec: Speculation | None = None  # drafting, while the row decodes alone (solo)
    inflight: Queued | None = None  # a greedy round queued behind the last one, unread

    @property
    def final(self) -> bool:
        """Whether `pending` is the last token: it is emitted but never fed."""
        limit = self.job.config.max_tokens
        return (limit is not None and len(self.generated) + 1 >= limit) or (
            self.position >= self.context_length
        )


@dataclass(frozen=True)
class RowInfo:
    """One request in flight as the sessions view shows it: where it is, what its
    session holds, and why that session was chosen. Counts only, never ids."""

    phase: Literal["prefilling", "decoding", "batched"]  # batched: in the merged state
    session: Session
    prompt_tokens: int
    position: int  # tokens in the session's state now
    generated: int
    kept: int
    reuse_reason: str
    reuse_detail: str
    batch_size: int  # rows decoding in the same forward now (1 when alone)


class _Batch:
    """Decoding rows whose sessions are merged into one batched state.

    While rows decode here, their next ids live in one ``(B,)`` array,
    :attr:`tokens`, not one lazy scalar per row: a step feeds it as is,
    samples the next one in a few ops for all rows, and the host reads the
    ids it fed with one ``tolist()``. That array was queued a step earlier,
    so reading it waits only for that step's forward, never for the one just
    queued (step *t+1* runs while the host handles step *t*'s ids, as in
    mlx-lm's ``BatchGenerator``). A row's own ``pending`` is set again only
    when it leaves (or, for a row that samples alone, kept for its processors)."""

    def __init__(self, runner: Runner) -> None:
        self.runner = runner
        self.rows: list[_Row] = []
        self.state: State = {}
        self.held: dict[str, object] = {}
        self.steer: Steer | None = None  # each row's own steering, rebuilt as rows come and go
        self.tokens: mx.array | None = None  # (B,) the ids the next step feeds (decoding rows)
        self._held_tokens: mx.array | None = None
        self._kept: list[Sampler] = []  # samplers that kept a record in the last step
        self._keys: list[tuple[Sampler, mx.array]] = []  # their PRNG keys before it

    def join(self, rows: list[_Row]) -> None:
        merged = self.runner.merge_states([row.session for row in rows])
        if not self.rows:
            self.state = merged
        else:
            for name, component in self.state.items():
                component.extend(merged[name])
        if rows[0].pending is not None:  # decoding rows (a prefill group has none yet)
            ids = mx.concatenate([row.pending.reshape(1).astype(mx.uint32) for row in rows])
            self.tokens = ids if self.tokens is None else mx.concatenate([self.tokens, ids])
        self.rows.extend(rows)
        self.steer = self.runner.batch_steer([row.session for row in self.rows])
        # Each row's state now lives in the batch, and comes back to its session
        # copied when the row leaves: the session's own arrays would be a second
        # copy of every row's K/V for as long as it decodes here (and its undo
        # is stale). Its checkpoints stay: they are the session's, not the step's.
        for row in rows:
            row.session.undo = None
            for component in row.session.state.values():
                component.reset()

    @property
    def ragged(self) -> bool:
        """Whether rows may feed different numbers of tokens in one :meth:`feed`."""
        return self.runner.takes_ragged(self.state)

    def feed(self, chunks: list[list[int]], starts: list[int]) -> mx.array:
        """Prompt tokens for every row (row ``i`` at ``starts[i]``; as many for
        each unless :attr:`ragged`): logits ``(B, vocab)`` at each row's last
        token. A forward that raises is undone."""
        for component in self.state.values():
            component.prepare(max(len(chunk) for chunk in chunks))
        self.held = {name: component.hold() for name, component in self.state.items()}
        try:
            logits = self.runner.forward_ragged(chunks, starts, self.state, self.steer)
        except Exception:
            self.rollback()
            raise
        mx.async_eval(logits, [a for component in self.state.values() for a in component.arrays()])
        return logits

    def step(self) -> mx.array:
        """Feed :attr:`tokens` and queue the next ids in their place; return the
        ids fed (``(B,)``, queued by the step before, so reading them does not
        wait for this one)."""
        fed = self.tokens
        for component in self.state.values():
            component.prepare(1)
        self.held = {name: component.hold() for name, component in self.state.items()}
        self._held_tokens, self._kept = fed, []
        self._keys = [(row.sampler, row.sampler.key) for row in self.rows if isinstance(row.sampler, Sampler)]  # fmt: skip
        try:
            logits = self.runner.forward_batch(
                self.runner.clip_ids(fed)[:, None],
                [row.position for row in self.rows],
                self.state,
                self.steer,
            )
            following, tables = self._sample(logits)
        except Exception:
            self.rollback()
            raise
        self.tokens = following
        mx.async_eval(
            following,
            [a for table in tables for a in table.arrays()],
            [a for component in self.state.values() for a in component.arrays()],
        )
        return fed

    def _sample(self, logits: mx.array) -> tuple[mx.array, list[LogprobTable]]:
        """The next id of every row, ``(B,)``: greedy rows in one argmax, random
        rows in one :func:`sample_together`, rows that only keep logprobs in those
        too (their logprobs in one :class:`LogprobTable` per kind), and rows with
        logits processors (or a sampler that must see each id) one by one."""
        greedy: list[int] = []
        drawn: list[int] = []
        alone: list[int] = []
        for i, row in enumerate(self.rows):
            sampler = row.sampler
            if sampler.plain_greedy or (sampler.keeps_logprobs_only and not sampler.params.temperature):  # fmt: skip
                greedy.append(i)
            elif sampler.plain_random or sampler.keeps_logprobs_only:
                drawn.append(i)
            else:
                alone.append(i)
        following = mx.argmax(logits, axis=-1) if greedy else mx.zeros((len(self.rows),), mx.uint32)
        tables: list[LogprobTable] = []
        if drawn:
            index = mx.array(drawn)
            ids = sample_together([self.rows[i].sampler for i in drawn], logits[index])
            following[index] = ids
        for i in alone:  # such a row keeps its own lazy id (`pending`) for its processors
            row = self.rows[i]
            row.following = row.sampler(logits[i], fed=row.pending)
            following[i] = row.following
        for group in (greedy, drawn):
            keeping = [i for i in group if self.rows[i].sampler.keeps_logprobs_only]
            if keeping:
                index = mx.array(keeping)
                samplers = [self.rows[i].sampler for i in keeping]
                k = max(sampler.top_logprobs or 0 for sampler in samplers)
                table = LogprobTable(logits[index], following[index], k)
                tables.append(table)
                for j, sampler in enumerate(samplers):
                    sampler.keep(table, j)
                    self._kept.append(sampler)
        for i in greedy + drawn:
            self.rows[i].following = None  # its next id is in `tokens`
        return following, tables

    def rollback(self) -> None:
        for name, component in self.state.items():
            component.rollback(self.held[name])
        if self._held_tokens is not None:
            self.tokens = self._held_tokens
        for sampler in self._kept:
            sampler.unkeep()
        for sampler, key in self._keys:
            sampler.rewind(key)
        self._kept, self._keys = [], []

    def leave(self, going: dict[_Row, int]) -> None:
        """Copy each row in *going* back into its session, *back* tokens earlier."""
        if not going:
            return
        copies: list[mx.array] = []
        for i, row in enumerate(self.rows):
            if row in going:
                back = going[row]
                row.session.state = {
                    name: component.extract(i, row.leaves_at, back, self.held.get(name))
                    for name, component in self.state.items()
                }
                copies += [
                    a for component in row.session.state.values() for a in component.arrays()
                ]
                if self.tokens is not None and row.pending is None:
                    row.pending = self.tokens[i]
        # A row's copy, left lazy, would keep the whole batch buffer it is cut
        # from alive for as long as its session sits parked: every row that
        # left a shrinking batch held a buffer of all the rows still in it.
        mx.async_eval(copies)
        stay = [i for i, row in enumerate(self.rows) if row not in going]
        self.rows = [self.rows[i] for i in stay]
        if not self.rows:
            self.state, self.held, self.steer, self.tokens = {}, {}, None, None
            self._held_tokens, self._kept, self._keys = None, [], []
            return
        for component in self.state.values():
            component.filter(stay)
        if self.tokens is not None:
            self.tokens = self.tokens[mx.array(stay)]
        self._held_tokens, self._kept, self._keys = None, [], []
        self.steer = self.runner.batch_steer([row.session for row in self.rows])


def _ragged_width(wants: list[int], cap: int | None) -> int:
    """The tokens a ragged group's forward takes a row (the shorter rows
    padded to it): the longest reach whose padding is at most the real tokens
    fed beside it, within *cap*. Padding is nearly free where a forward is
    bound by the host (a GPU's short prompts), not where it is bound by its
    arithmetic (the CPU); so one long prompt among short ones is fed to their
    length first, and the short ones end without waiting for it."""
    best = min(wants)
    for width in sorted({min(w, cap) if cap else w for w in wants}):
        real = sum(min(w, width) for w in wants)
        if len(wants) * width - real <= real:
            best = width
    return best


def _split_at(chunks: Iterator[tuple[int, int]], at: int | None) -> Iterator[tuple[int, int]]:
    """*chunks*, the one spanning *at* cut there (a checkpoint is taken at *at*)."""
    for begin, end in chunks:
        if at is not None and begin < at < end:
            yield begin, at
            yield at, end
        else:
            yield begin, end


class Engine:
    """The scheduler loop over one runner (see the module docstring)."""

    def __init__(
        self,
        runner: Runner,
        codec: TextCodec,
        *,
        max_batch: int = 8,
        prefill_budget: int | None = None,
        observer: Observer | None = None,
        write_through: bool = True,
        gather_s: float = 0.0,
    ) -> None:
        """*write_through*: flush the disk tier whenever a request's session is
        checked in (the server's rule: a reply sent is a session kept); a library
        caller's runner writes sessions only when they leave memory.
        *gather_s*: the longest a queued prompt is held for requests still on
        their way in (:meth:`expect`; the server's ``--prefill-gather-ms``); 0
        admits at once."""
        if gather_s < 0:
            raise ValueError(f"gather_s must be at least 0, got {gather_s}")
        if max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, got {max_batch}")
        self.runner = runner
        self.codec = codec
        self.max_batch = max_batch
        self.prefill_budget = prefill_budget
        self.gather_s = gather_s
        self._queue: deque[Job] = deque()
        self._coming: set[Arrival] = set()  # requests on their way in (expect)
        self._wake = threading.Condition()
        self._prefilling: list[_Row] = []
        self._solo: list[_Row] = []
        self._batch = _Batch(runner)
        self._groups: list[_Batch] = []  # prompts prefilled together (Engine._prefill_together)
        self._regrouped: list[_Row] = []  # this step's rows of a failed group: they go alone
        self._ragged: bool | None = None  # whether groups take ragged rows, once one has formed
        self._calls: deque[tuple[Callable[[], object], Future]] = deque()
        self.warming = False
        # Whether the warm-up stops for a request that arrives during it (a
        # lockstep engine's never does: every rank must run the same steps).
        self.yields_warm_up = True
        # Requests that discarded a parked session with content (at admission or
        # at check-in): the sessions view shows it, so an eviction is seen when it happens.
        self.evictions = 0
        self.observer = observer  # called on the runner thread (metrics)
        self.write_through = write_through
        # Finished replies' text to their generated ids: the server feeds a re-sent
        # reply as those ids, so its session continues through it (replies.py);
        # kept in the session directory too, as the sessions it continues are.
        disk = runner.session_disk
        self.replies = ReplyIndex(
            path=None
            if disk is None
            else disk.root / f"replies-{disk.model.manifest_sha256[:16]}.jsonl"
        )

    # -- the outside: any thread ----------------------------------------------------

    def submit(self, job: Job) -> None:
        if any(fork.ids != job.ids or fork.forks for fork in job.forks):
            raise ValueError("a job's forks must have its prompt and no forks of their own")
        with self._wake:
            self._queue.append(job)
            self._wake.notify()

    def expect(self) -> Arrival:
        """Say a request is on its way in (its prompt still being rendered and
        tokenized), until its :meth:`Arrival.done`. While any is, a prompt
        already queued waits for it, at most ``gather_s``: requests that come in
        a burst (chat clients whose replies ended on one step) then prefill in
        one group, where admitting each at once prefills the first few alone
        and the rest wait behind their forward."""
        arrival = Arrival(self)
        with self._wake:
            self._coming.add(arrival)
        return arrival

    def _arrived(self, arrival: Arrival) -> None:
        with self._wake:
            if arrival in self._coming:
                self._coming.discard(arrival)
                self._wake.notify()

    def _gather_left(self) -> float:
        """Seconds the queued prompts wait yet for requests on their way in (0:
        admit now). Held only while the wait can put them in one prefill group:
        the family batches prefill, the batch has room for more, and the head
        of the queue has waited less than ``gather_s``. Call holding ``_wake``."""
        if not self._queue or not self._coming or self.gather_s <= 0 or self.warming:
            return 0.0
        now = time.perf_counter()
        self._coming = {a for a in self._coming if now - a.started < self.gather_s}
        queued = sum(1 + len(job.forks) for job in self._queue)
        if not self._coming or self.active_rows + queued >= self.max_batch or not self._batches:
            return 0.0
        left = self.gather_s - (now - self._queue[0].submitted)
        latest = max(self.gather_s - (now - a.started) for a in self._coming)
        return max(0.0, min(left, latest))

    def call(self, fn: Callable[[], T]) -> Future[T]:
        """Run *fn* on the runner thread between two steps (the loop owns that
        thread while it runs): inspection, a disk flush, a test's probe."""
        future: Future[T] = Future()
        with self._wake:
            self._calls.append((fn, future))
            self._wake.notify()
        return future

    def _run_calls(self) -> None:
        while self._calls:
            fn, future = self._calls.popleft()
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as exc:
                    future.set_exception(exc)

    @property
    def queue_depth(self) -> int:
        return len(self._queue)

    @property
    def active_rows(self) -> int:
        """Rows held now, a prefilling job's forks included (they start with it)."""
        forks = sum(len(row.job.forks) for row in self._prefilling)
        return len(self._prefilling) + forks + len(self._solo) + len(self._batch.rows)

    @property
    def batch_size(self) -> int:
        """Rows decoding in the merged batched state now (0 when none)."""
        return len(self._batch.rows)

    def in_flight(self) -> list[RowInfo]:
        """Every request holding a session now. Call on the runner thread
        (through :meth:`call`): the rows change at every step."""
        batched = len(self._batch.rows)
        rows = [(row, "prefilling", 1, row.next_prefill) for row in self._prefilling]
        rows += [(row, "decoding", 1, row.position) for row in self._solo]
        rows += [(row, "batched", batched, row.position) for row in self._batch.rows]
        return [
            RowInfo(
                phase=phase,
                session=row.session,
                prompt_tokens=len(row.job.ids),
                position=position,
                generated=len(row.generated),
                kept=row.kept,
                reuse_reason=str(row.report.reason),
                reuse_detail=row.report.detail,
                batch_size=size,
            )
            for row, phase, size, position in rows
            if not row.job.warm_up
        ]

    @property
    def batch_nbytes(self) -> int:
        """Bytes of the merged state the batched rows decode in (0 when none)."""
        return sum(c.nbytes for c in self._batch.state.values())

    def run(self, stop: threading.Event) -> None:
        """Step until *stop* is set, sleeping while there is nothing to do. A
        failure the rows could not contain fails every request in flight, and
        the loop goes on serving."""
        while not stop.is_set():
            self._run_calls()
            try:
                busy = self.step()
            except Exception as exc:
                log.exception("engine step failed; failing the requests in flight")
                self._fail_all(exc)
                continue
            if not busy:
                with self._wake:
                    if not self._calls:
                        held = self._gather_left()
                        if held:
                            self._wake.wait(timeout=held)
                        elif not self._queue:
                            self._wake.wait(timeout=0.05)
        self._run_calls()

    def stream(
        self, ids: list[int], config: GenerationConfig, drafter: Drafter | None = None
    ) -> Iterator[Chunk]:
        """Run one request on the caller's thread, stepping this engine until it
        ends, and yield its chunks as they come (the last one carries the finish
        reason and stats); its failure is raised here. This is how the CLI and
        the library generate: the same steps the server's loop runs, with one row.

        A consumer may stop iterating at any time (a client that hung up): the
        request is cancelled and its row leaves at a step run then, so its
        session is checked in with state and record agreeing and no unread
        round fed."""
        out: deque[Chunk | Exception] = deque()
        job = Job(ids=ids, config=config, emit=out.append, drafter=drafter)
        self.submit(job)
        over = False
        try:
            while True:
                while out:
                    item = out.popleft()
                    if isinstance(item, Exception):
                        over = True
                        raise item
                    over = item.finish_reason is not None
                    yield item
                    if over:
                        return
                try:
                    busy = self.step()
                except Exception as exc:  # not contained by a row: every row fails
                    self._fail_all(exc)
                    continue
                if not busy and not out:
                    with self._wake:
                        held = self._gather_left()
                        if held:  # queued behind a request on its way in (expect)
                            self._wake.wait(timeout=held)
                            continue
                    raise RuntimeError("the engine ran out of work before the request ended")
        finally:
            if not over:
                job.cancelled.set()
                while self.step():
                    pass

    def warm_up(self, ids: list[int], rows: int | None = None) -> None:
        """Run short requests to the end in four rounds, so the paths real
        traffic takes are built (and, on a GPU, their kernels compiled) before
        the first real request is admitted; the warm-up's sessions are
        forgotten afterwards. A real request that arrives meanwhile cuts it
        short (:meth:`_request_waits`): the rows under way are cancelled and
        leave at the next step, with no forward, and the request is admitted
        then. The rounds left are not run later: their throwaway sessions
        would take pool slots from real conversations by then.

        1. A short fresh prompt alone: a lone row's short forward and its
           decode, through the one-row forward (the compiled step functions).
        2. Two distinct fresh prompts prefill together (a batched group). Their
           lengths differ by a few tokens, as real prompts' do, so the longer
           row's last few run alone after the group's forward: a lone row with
           history through the compiled step functions.
        3. Each of those again with more tokens after it (uneven again), as a
           chat's next turn sends it: the sessions are reused, so the rows
           prefill together *with history* (held keys and recurrent state).
        4. A request prefills *ids*; *rows* - 1 more (default ``max_batch`` -
           1) take a few of its tokens, and they stop one step apart, so the
           batch decodes at each size from *rows* down to one (compiled pieces
           that are not shapeless trace once per batch size, e.g. the
           gated-DeltaNet step).

        The rounds of short prompts go first: they are what first requests
        and their next turns take, and their steps are the shortest, so a
        request that comes early waits least (on the CPU the long prompt's
        step alone held a first request 0.2 s, more than its own prefill).

        On a GPU the first use of an op graph compiles its kernels (NVRTC,
        seconds each), and a path left out here is paid by the first request
        that takes it while every row batched with it waits: a 16-client
        qwen_gdn server stalled 8-12 s in its first second turn when only the
        decode step had warmed the prefill's compiled pieces, and 14 s when
        its groups were warmed but only at even lengths (measured on the
        H200). ``tests/test_engine.py`` checks that chat
        traffic runs no kind of forward this has not."""
        count = min(rows or self.max_batch, self.max_batch)
        short = ids[: min(len(ids), 8)]
        first = [  # the long prompt joins the batch last, so it stops last
            (list(ids if k == 0 else short), 8 + (count + 2 if k == 0 else k)) for k in range(count)
        ]
        vocab = self.runner.vocab_size
        # A group's compiled pieces are shapeless and its other ops' kernels do
        # not depend on its shape, so two rows of a few tokens build what any
        # group runs (short enough that two turns and their replies fit any context).
        span = max(1, min(16, (self.runner.context_length - 8) // 3))
        uneven = min(3, span // 2)  # the longer row's tokens left after the group's forward
        fresh = [  # distinct from their first token: no row reuses another's prefix
            [(1 + k + 7 * j) % vocab for j in range(span - uneven * k)]
            for k in range(min(count, 2))
        ]
        more = [
            [(5 + 3 * j) % vocab for j in range(span - uneven * (1 - k))] for k in range(len(fresh))
        ]
        alone = [(3 + 11 * j) % vocab for j in range(min(span, STEP_TOKENS))]
        rounds = dict(
            zip(
                WARM_UP_ROUNDS,
                [
                    [(alone, 3)],
                    [(p, 2) for p in fresh],
                    [([*p, *extra], 2) for p, extra in zip(fresh, more, strict=True)],
                    first,
                ],
                strict=True,
            )
        )
        self.warming = True
        started = time.perf_counter()
        # Each round run to its end, and its time: a long first launch
        # (kernels compiled on a GPU) shows which paths cost it.
        spent: list[str] = []
        try:
            with self.runner.without_disk():  # its sessions are throwaway: never on disk
                for name, round_ in rounds.items():
                    round_started = time.perf_counter()
                    jobs = [
                        Job(
                            ids=prompt,
                            config=GenerationConfig(
                                max_tokens=tokens, temperature=0.0, stop_token_ids=[]
                            ),
                            emit=lambda item: None,
                            warm_up=True,
                        )
                        for prompt, tokens in round_
                    ]
                    with self._wake:
                        self._queue.extendleft(reversed(jobs))
                    while self.step():
                        if self._request_waits():  # its rows leave at the next step
                            for job in jobs:
                                job.cancelled.set()
                    if any(job.cancelled.is_set() for job in jobs):
                        break
                    spent.append(f"{name} {time.perf_counter() - round_started:.1f} s")
                self.runner.forget_sessions()
        finally:
            self.warming = False
        seconds = time.perf_counter() - started
        each = ", ".join(spent)
        if len(spent) == len(rounds):
            log.info("warmed up in %.1f s (%s)", seconds, each)
        else:
            log.info(
                "warm-up cut short after %.1f s (%d of %d rounds): a request came first; the "
                "paths left unbuilt are built by the first requests that take them%s",
                seconds,
                len(spent),
                len(rounds),
                f" (done: {each})" if each else "",
            )

    def _request_waits(self) -> bool:
        """Whether a real request waits behind the warm-up, which then gives way
        (:attr:`yields_warm_up`): a request that comes during it would
        otherwise wait for all of it, where alone it needs only its own paths
        built (on the CPU a first request's 0.05-0.1 s against a warm-up's 2 s)."""
        if not self.yields_warm_up:
            return False
        with self._wake:
            return any(not job.warm_up for job in self._queue)

    def _fail_all(self, exc: Exception) -> None:
        forks = [fork for row in self._prefilling for fork in row.job.forks]  # not rows yet
        rows = self._prefilling + self._solo + self._batch.rows
        self._prefilling, self._solo, self._batch = [], [], _Batch(self.runner)
        self._groups = []
        for row in rows:
            row.session.clear()  # its state may be half-written: never resume it
            self._fail(row, exc)
        for fork in forks:
            fork.emit(exc)

    def wake(self) -> None:
        with self._wake:
            self._wake.notify()

    # -- the loop: the runner's thread ---------------------------------------------

    def step(self) -> bool:
        """One scheduling round; False when there was nothing to do."""
        self._admit()
        if not self.active_rows:
            return False
        self._prefill()
        self._decode()
        return True

    def _admit(self) -> None:
        """A job and its forks are admitted together, when their rows fit (or,
        so that an n above ``max_batch`` still runs, when nothing else is active).
        Nothing is admitted while requests on their way in are awaited
        (:meth:`_gather_left`)."""
        with self._wake:
            if self._gather_left():
                return
        while self._queue:
            with self._wake:
                head = self._queue[0]
                if self.warming and not head.warm_up:
                    return  # real requests wait for the warm-up to finish
                rows = 1 + len(head.forks)
                if self.active_rows and self.active_rows + rows > self.max_batch:
                    return
                job = self._queue.popleft()
            group = [job, *job.forks]
            if all(j.cancelled.is_set() for j in group):  # given up while queued
                for j in group:
                    j.emit(Chunk(text="", finish_reason="stop"))
                continue
            try:
                row = self._start(job)
            except Exception as exc:  # refused before any session changed
                for j in group:
                    j.emit(exc)
                continue
            self._prefilling.append(row)

    def _start(self, job: Job) -> _Row:
        runner, config = self.runner, job.config
        check_prompt(runner, job.ids)
        sampler = self._new_sampler(job)
        started = time.perf_counter()
        kept, report, evicted = acquire(runner, job.ids, config.steering)
        if job.prompt_note:
            report = report.model_copy(update={"detail": f"{report.detail}; {job.prompt_note}"})
        self._evicted(job, evicted)
        session = runner.checkout()
        row = _Row(
            job=job,
            session=session,
            kept=kept,
            report=report,
            evicted=evicted,
            sampler=sampler,
            stop_ids=self._stop_ids(config),
            decoder=self.codec.stream_decoder(),
            stops=StopStrings(config.stop),
            started=started,
            next_prefill=kept,
            context_length=runner.context_length,
        )
        row.spec = speculation_for(
            runner,
            sampler,
            job.ids,
            row.generated,
            enabled=config.draft,
            drafter=job.drafter,
            session=session,
        )
        return row

    def _stop_ids(self, config: GenerationConfig) -> frozenset[int]:
        ids = self.codec.eos_token_ids if config.stop_token_ids is None else config.stop_token_ids
        return frozenset(ids)

    def _new_sampler(self, job: Job) -> Sampler:
        """The row's sampler (a distributed engine shares rank 0's samples instead)."""
        return Sampler(job.config, job.processors, job.top_logprobs)

    def _prefill(self) -> None:
        """Prompts, up to the budget: several together in batched forwards when
        the family batches (:meth:`_prefill_together`); a prompt with no other
        to go with, or whose session must first rewind, one chunk at a time
        (:meth:`_prefill_alone`). Prompts that could go together but found no
        budget left wait for the next step rather than go alone: alone, each
        costs a forward where together they cost one, and on a host-bound
        device a forward costs about what a decode step does, whatever its
        tokens."""
        if not self._prefilling:  # the common step: every row is decoding
            return
        for row in list(self._prefilling):
            if all(j.cancelled.is_set() for j in (row.job, *row.job.forks)):
                group = self._group_of(row)
                if group is not None:
                    row.leaves_at = row.next_prefill
                    group.leave({row: 0})
                    if not group.rows:
                        self._groups.remove(group)
                self._prefilling.remove(row)
                self._finish(row, "stop")
                for fork in row.job.forks:
                    fork.emit(Chunk(text="", finish_reason="stop"))
        budget = self.prefill_budget
        waiting = list(self._prefilling)
        if self._batches:
            self._regrouped = []
            budget = self._prefill_together(budget)
            waiting = self._ungrouped()
            if sum(1 for row in waiting if self._ready(row)) >= 2:
                waiting = [r for r in waiting if not self._ready(r) or r in self._regrouped]
        for row in waiting:
            if budget is not None and budget <= 0:
                break
            budget = self._prefill_alone(row, budget)

    @property
    def _batches(self) -> bool:
        """Whether rows may share a batched forward now: the family batches, and
        no vision map is installed (only the one-row forward takes one)."""
        return self.runner.batchable and not self.runner.vision_active

    @staticmethod
    def _ready(row: _Row) -> bool:
        """Whether the row's session holds exactly the prompt fed so far (one
        that must rewind first goes alone: the one-row forward rewinds)."""
        return row.session.position == row.next_prefill

    def _group_of(self, row: _Row) -> _Batch | None:
        return next((group for group in self._groups if row in group.rows), None)

    def _ungrouped(self) -> list[_Row]:
        grouped = {row for group in self._groups for row in group.rows}
        return [row for row in self._prefilling if row not in grouped]

    def _prefill_together(self, budget: int | None) -> int | None:
        """One batched forward for each prefill group (oldest first), then for
        each new group the budget left can take. Returns the budget left.

        A group forms from two or more waiting prompts (the first that fit in
        the budget: :meth:`_group_within`), as mlx-lm's ``BatchGenerator``
        prefills several prompts at once; their sessions are merged once and
        stay merged until each prompt ends. A new group forms only where the
        budget left lets its shortest prompt end in its first forward (or the
        step has spent nothing yet), so a sliver of budget never starts one.
        See :meth:`_feed_group` for each forward."""
        for group in list(self._groups):
            if budget is not None and budget <= 0:
                return budget
            budget = self._feed_group(group, budget)
        while (budget is None or budget > 0) and not self._regrouped:
            ready = [row for row in self._ungrouped() if self._ready(row)]
            if len(ready) < 2:
                break
            rows = self._group_within(ready, budget)
            need = min(self._need(row) for row in rows)
            if budget is not None and budget != self.prefill_budget and need * len(rows) > budget:
                break
            group = _Batch(self.runner)
            group.join(rows)
            self._ragged = group.ragged
            self._groups.append(group)
            budget = self._feed_group(group, budget)
        return budget

    @staticmethod
    def _need(row: _Row) -> int:
        """Prompt tokens the row's next forward can take: its remainder, within a chunk."""
        return min(len(row.job.ids) - row.next_prefill, row.job.config.chunk_size)

    def _feed_group(self, group: _Batch, budget: int | None) -> int | None:
        """One batched forward of *group*'s prompt tokens, each row up to its
        prompt's end or checkpoint (:meth:`_reach`) within the budget, at least
        one token a row; returns the budget left (padding counted).

        A row whose prompt ends samples its first id from the forward's logits
        at its last token, is copied out, and decodes from the next step. Where
        the batched state takes ragged rows (:meth:`Runner.forward_ragged`: K/V
        shifts them, gated DeltaNet lets padding pass), rows of different
        lengths go together, the shorter padded (:func:`_ragged_width`), so a
        burst of prompts ends in one forward; otherwise (a component that does
        neither) every row takes the shortest reach, and prompts of different
        lengths end over a few steps. If the forward fails, the
        group is undone from the references held before it and its rows go on
        alone."""
        rows = list(group.rows)
        wants = [self._reach(row) for row in rows]
        cap = None if budget is None else max(1, budget // len(rows))
        length = _ragged_width(wants, cap) if group.ragged else min(wants)
        if cap is not None:
            length = min(length, cap)
        starts = [row.next_prefill for row in rows]
        chunks = [
            row.job.ids[start : start + min(want, length)]
            for row, start, want in zip(rows, starts, wants, strict=True)
        ]
        try:
            logits = group.feed(chunks, starts)
        except Exception:
            log.warning("a batched prefill failed; its rows go on alone", exc_info=True)
            for row in rows:
                row.leaves_at = row.next_prefill
            group.leave({row: 0 for row in rows})
            self._groups.remove(group)
            self._regrouped.extend(rows)
            return budget
        done: dict[_Row, int] = {}
        marked: list[_Row] = []  # at their generation-prompt checkpoint, prompt not done
        for i, row in enumerate(rows):
            self.runner.fed(row.session, starts[i], chunks[i])
            row.next_prefill += len(chunks[i])
            if row.next_prefill == len(row.job.ids):
                row.leaves_at = row.next_prefill
                done[row] = i
            elif row.next_prefill == row.job.checkpoint_at:
                row.leaves_at = row.next_prefill
                marked.append(row)
        # A checkpoint holds the row's own state: it leaves the merged state first,
        # and goes on from there alone or in a later group.
        group.leave({row: 0 for row in [*done, *marked]})
        if not group.rows:
            self._groups.remove(group)
        for row in marked:
            self.runner.checkpoint(row.session)
        for row, i in done.items():
            self.runner.checkpoint(row.session)
            self._prefilled(row, logits[i])
        return None if budget is None else budget - length * len(rows)

    @staticmethod
    def _reach(row: _Row) -> int:
        """Prompt tokens the row's next batched forward may take: up to its
        prompt's end or its generation-prompt checkpoint, within its chunk."""
        reach = min(len(row.job.ids) - row.next_prefill, row.job.config.chunk_size)
        at = row.job.checkpoint_at
        if at is not None and at > row.next_prefill:
            reach = min(reach, at - row.next_prefill)
        return reach

    def _group_within(self, ready: list[_Row], budget: int | None) -> list[_Row]:
        """The first prompts (in arrival order, two at least) whose forward,
        fed to each, fits in the budget: as wide as :func:`_ragged_width` makes
        their reaches where a group takes ragged rows (unknown until a group
        has formed: assumed), else their shortest reach. A group spread over
        every waiting prompt would give each a sliver of the budget per step,
        and none would see its first token before all of them; a group that
        fits ends in one forward, and the next group follows, so first tokens
        come in arrival order as they did one prompt at a time. Counted by the
        shortest reach alone, a ragged group's longer rows would be cut to the
        budget's share and take a second forward for their last few tokens."""
        if budget is None:
            return ready
        group: list[_Row] = []
        for row in ready:
            reaches = [self._reach(r) for r in (*group, row)]
            width = _ragged_width(reaches, None) if self._ragged is not False else min(reaches)
            if len(group) >= 2 and len(reaches) * width > budget:
                break
            group.append(row)
        return group

    def _prefill_alone(self, row: _Row, budget: int | None) -> int | None:
        """Whole chunks (:func:`prompt_chunks`) of one row, up to
        the budget; the last one with its last token's logits."""
        ids, at = row.job.ids, row.job.checkpoint_at
        try:
            for begin, end in _split_at(
                prompt_chunks(len(ids), row.next_prefill, row.job.config.chunk_size), at
            ):
                if budget is not None and budget <= 0:
                    break
                logits = self.runner.feed(
                    row.session, ids[begin:end], begin, logits=end == len(ids)
                )
                budget = None if budget is None else budget - (end - begin)
                row.next_prefill = end
                if end == at:
                    self.runner.checkpoint(row.session)
                if end == len(ids):
                    self.runner.checkpoint(row.session)
                    self._prefilled(row, logits)
        except Exception as exc:
            self._prefilling.remove(row)
            self._fail(row, exc)
            for fork in row.job.forks:
                fork.emit(exc)
        return budget

    def _prefilled(self, row: _Row, logits: mx.array) -> None:
        """The prompt is in: the row, and its forks (each from its state by
        reference), sample their first ids from *logits* and decode from the next step."""
        rows = [row] + [self._fork(row, job) for job in row.job.forks]
        for each in rows:
            each.pending = each.sampler(logits)
        mx.async_eval([each.pending for each in rows])
        self._prefilling.remove(row)
        for each in rows:
            each.position = len(row.job.ids)
            each.prefilled = time.perf_counter()
            self._solo.append(each)

    def _fork(self, row: _Row, job: Job) -> _Row:
        """A row for *job*, another completion of *row*'s just-prefilled prompt: a
        session holding *row*'s state by reference (the prompt is prefilled once)."""
        session = self.runner.fork(row.session)
        report = ReuseReport(
            kept=len(job.ids),
            swapped=False,
            reason=ReuseReason.FORKED,
            detail=f"one of {1 + len(row.job.forks)} completions of one prompt: the first's "
            "prefilled state was taken by reference",
            prompt_tokens=len(job.ids),
        )
        return dataclasses.replace(
            row,
            job=job,
            session=session,
            kept=len(job.ids),
            report=report,
            evicted=False,
            sampler=self._new_sampler(job),
            stop_ids=self._stop_ids(job.config),
            decoder=self.codec.stream_decoder(),
            stops=StopStrings(job.config.stop),
            generated=[],
            fork=True,
            spec=None,  # a fork decodes in the batch, never drafting on another's session
        )

    def _decode(self) -> None:
        for row in self._solo + self._batch.rows:
            if row.job.cancelled.is_set():
                self._cancel(row)
        decoding = len(self._solo) + len(self._batch.rows)
        if decoding >= 2 and self._solo and self._batches:
            joining, self._solo = self._solo, []
            for row in joining:
                self._drop_inflight(row)  # a batched row drafts nothing
            self._batch.join(joining)
        if self._batch.rows:
            self._decode_batch()
        for row in list(self._solo):
            self._decode_solo(row)

    def _decode_solo(self, row: _Row) -> None:
        """One token for one row through the one-row forward, or a drafted round
        of several when the row drafts; a shadow probe is such a step beside
        which the drafter guesses the token it computes
        (see turbospark.generation.speculation)."""
        if row.job.config.max_tokens == 0:  # the prompt was all: nothing is emitted
            self._solo.remove(row)
            self._finish(row, "length")
            return
        depth = 0 if row.spec is None else self._decode_drafted(row)
        if depth is None:
            return
        fed = not row.final
        try:
            if fed:
                if depth:  # compared with row.following once read
                    row.spec.probe(row.pending, row.position)
                sample = partial(row.sampler, fed=row.pending)
                if row.sampler.reads_on_host:
                    # Queue the forward first so it runs while the host waits.
                    row.following = sample(self.runner.feed(row.session, [row.pending], row.position, logits=True))  # fmt: skip
                    mx.async_eval(row.following)
                else:  # the forward and its sample queued together (mlx-lm's order)
                    row.following = self.runner.feed(row.session, [row.pending], row.position, logits=True, then=sample)  # fmt: skip
            token = int(row.pending.item())
            if row.spec is not None:  # settle the probe that guessed this id; guess after it
                row.spec.observe(token, row.position, ends=token in row.stop_ids or not fed)
        except Exception as exc:
            self._solo.remove(row)
            self._fail(row, exc)
            return
        if token in row.stop_ids and fed:
            self.runner.take_back(row.session)
        self._advance(row, token, fed)

    def _decode_drafted(self, row: _Row) -> int | None:
        """A speculative round (see turbospark.generation.speculation): None when
        it ran; otherwise the row takes a plain step, with a shadow probe beside
        it when the depth returned is not 0 (0: paused, no draft, or the last
        probe's guess not compared yet).

        Greedy rounds are queued and read once (:meth:`Speculation.launch`);
        while they pass whole, the next round is queued behind each before it is
        read (:meth:`Speculation.launch_after`) and stays in flight to the next
        step (``row.inflight``). Every round is committed or cut before any of
        its tokens is emitted, so state and record agree whenever the row leaves."""
        spec = row.spec
        assert spec is not None
        limit = row.job.config.max_tokens
        remaining = None if limit is None else limit - len(row.generated)
        queued, row.inflight = row.inflight, None
        depth = 0
        if queued is None:
            if spec.probing:
                return 0  # comparing the probe's guess now would wait for the step
            depth = spec.plan(row.position, remaining)
            if not depth or spec.shadow:
                return depth
        try:
            ahead = verified = None
            if queued is None:
                token = int(row.pending.item())
                if token in row.stop_ids:
                    return 0  # the plain step ends the reply
                if spec.greedy:
                    queued = spec.launch(token, row.position, depth)
                else:
                    verified = spec.round(token, row.position, depth)
            if queued is not None:
                if spec.chains:
                    ahead = spec.launch_after(queued, remaining)
                verified = spec.resolve(queued)
            if verified is None:
                return 0  # the drafter had nothing: a plain step
            emit, keep = settle(verified.tokens, row.stop_ids, remaining)
            chunks = []
            for token in verified.tokens[:emit]:
                row.generated.append(token)
                chunks.append(Chunk(text=row.stops.feed(row.decoder.add(token)), token=token))
                if row.stops.stopped is not None:
                    break
            stopped = row.stops.stopped is not None or emit < len(verified.tokens)
            # The round behind this one was fed after all of it: it goes on when all
            # of this one passed, stays fed, and the reply continues.
            if (
                ahead is not None
                and len(verified.tokens) == ahead.position - row.position
                and keep == emit == len(verified.tokens)
                and not stopped
                and verified.following not in row.stop_ids
            ):
                row.inflight = ahead
            elif queued is not None:
                spec.cut(queued, keep)  # a round queued behind it leaves too
            else:
                spec.commit(row.position, keep)
        except Exception as exc:
            self._solo.remove(row)
            self._fail(row, exc)
            return None
        for chunk in chunks:
            row.job.emit(chunk)
        if stopped or keep < emit:  # keep < emit: the reply's last token, emitted unfed
            self._solo.remove(row)
            self._finish(row, "stop" if stopped else "length")
            return None
        row.position += keep
        row.pending = mx.array(verified.following)
        return None

    @staticmethod
    def _drop_inflight(row: _Row) -> None:
        """Cut a round still queued for *row* (its reply is over, or it joins
        the batch): the session keeps only the tokens its reply emitted."""
        if row.inflight is not None:
            assert row.spec is not None
            row.spec.cut(row.inflight, 0)
            row.inflight = None

    def _decode_batch(self) -> None:
        batch = self._batch
        # A row whose pending id is its last is never fed: it leaves first.
        last = {row: 0 for row in batch.rows if row.final}
        if last:
            for row in last:
                row.leaves_at = row.position
            batch.leave(last)
            for row in last:
                self._solo.append(row)  # emitted, unfed, by _decode_solo below
        if not batch.rows:
            return
        size = len(batch.rows)
        for row in batch.rows:
            if row.batch_peak < size:
                row.batch_peak = size
        try:
            tokens = batch.step().tolist()  # the ids fed: one read for every row
            self.runner.check_ids(tokens)
        except Exception:
            # Undo the step and retry every row alone: only the culprit fails.
            batch.rollback()
            going = {row: 0 for row in batch.rows}
            for row in going:
                row.leaves_at = row.position
            batch.leave(going)
            self._solo.extend(going)
            return
        going: dict[_Row, int] = {}
        for row, token in zip(list(batch.rows), tokens, strict=True):
            stop = token in row.stop_ids
            row.leaves_at = row.position + (0 if stop else 1)
            if not stop:
                self.runner.fed(row.session, row.position, [token])
            if not self._advance(row, token, fed=True, retire=False):
                going[row] = 1 if stop else 0
        batch.leave(going)
        for row in going:
            self._finish(row, row.finish)

    def _advance(self, row: _Row, token: int, fed: bool, retire: bool = True) -> bool:
        """Account for *token*; False (and, with *retire*, the row retired) when the
        request is over."""
        finish: FinishReason | None = None
        if token in row.stop_ids:
            finish = "stop"
        else:
            row.generated.append(token)
            text = row.stops.feed(row.decoder.add(token))
            if row.stops.stopped is not None:
                finish = "stop"
            elif not fed:
                finish = "length"
            logprobs = row.sampler.logprobs(len(row.generated) - 1)
            row.job.emit(Chunk(text=text, token=token, logprobs=logprobs))
            if finish is None:
                row.position += 1
                row.pending = row.following
                return True
        row.finish = finish
        if retire:
            self._solo.remove(row)
            self._finish(row, finish)
        return False

    def _cancel(self, row: _Row) -> None:
        """A client that went away: its row leaves and its session is checked in."""
        if row in self._solo:
            self._solo.remove(row)
            self._drop_inflight(row)
        else:
            row.leaves_at = row.position
            self._batch.leave({row: 0})
        self._finish(row, "stop")

    def _evicted(self, job: Job, evicted: bool) -> None:
        """Count a real request's eviction (the warm-up's sessions are forgotten anyway)."""
        if evicted and not job.warm_up:
            self.evictions += 1

    def _checkin(self, row: _Row) -> bool:
        """Check *row*'s session back in (True: a parked one was evicted). A fork's
        is dropped instead: n near-copies of one conversation would push the other
        conversations out of the pool, and the client continues the first choice."""
        if row.fork:
            return False
        losses = self.runner.disk_losses
        evicted = self.runner.checkin(row.session)
        if self.write_through:  # to the disk tier: a reply sent is a session kept
            self.runner.flush()
        return evicted or self.runner.disk_losses > losses

    def _fail(self, row: _Row, exc: Exception) -> None:
        log.warning("request failed: %s", exc, exc_info=exc)
        self._evicted(row.job, self._checkin(row))
        row.job.emit(exc)
        self._observe(row.job, None)

    def _observe(self, job: Job, stats: GenerationStats | None) -> None:
        if self.observer is None or job.warm_up:
            return
        try:
            self.observer(job, stats)
        except Exception:  # metrics never fail a request
            log.exception("the engine's observer failed")

    def _finish(self, row: _Row, finish: FinishReason) -> None:
        tail = ""
        if row.stops.stopped is None:
            tail = row.stops.feed(row.decoder.flush()) + row.stops.flush()
        evicted_at_checkin = self._checkin(row)
        self._evicted(row.job, evicted_at_checkin)
        if row.stops.stopped is None and not row.job.warm_up:
            # A stop string cut the text short of the ids: nothing to vouch for then.
            # Keyed by the text as streamed: what the client has to send back.
            self.replies.add(row.job.ids, row.decoder.text, row.generated)
        now = time.perf_counter()
        prefilled = row.prefilled or now
        stats = GenerationStats(
            prompt_tokens=len(row.job.ids),
            reused_tokens=row.kept,
            generated_tokens=len(row.generated),
            reuse_reason=str(row.report.reason),
            reuse_detail=row.report.detail,
            swapped=row.report.swapped,
            evicted=row.evicted or evicted_at_checkin,
            prefill_seconds=prefilled - row.started,
            decode_seconds=now - prefilled,
            queued_seconds=row.started - row.job.submitted,
            batch_size=row.batch_peak,
            draft_proposed=0 if row.spec is None else row.spec.proposed,
            draft_accepted=0 if row.spec is None else row.spec.accepted,
            draft_probed=0 if row.spec is None else row.spec.probed,
        )
        row.job.emit(Chunk(text=tail, finish_reason=finish, stats=stats))
        self._observe(row.job, stats)
        if row.job.warm_up:
            return
        log.info(
            "request done: reuse %s kept %d/%d, batch %d, ttft %.3fs, %.1f tok/s%s",
            stats.reuse_reason,
            stats.reused_tokens,
            stats.prompt_tokens,
            stats.batch_size,
            stats.queued_seconds + stats.prefill_seconds,
            stats.decode_tokens_per_second,
            ", a parked session was evicted at check-in" if evicted_at_checkin else "",
        )

"""Continuous batching: every active request advances in one forward per step.

One :class:`Engine` runs on the runner's thread and owns the requests in
flight. Each :meth:`Engine.step`:

1. **admits** queued requests while fewer than ``max_batch`` rows are active.
   The caller contract of SEMANTICS.md (:func:`turbospark.generate.acquire`)
   picks each request's session and explains the choice; the session is then
   checked out of the runner for the request's lifetime, so concurrent
   requests never share state;
2. **prefills** waiting prompts, one chunk at a time, at most
   ``prefill_budget`` tokens per step in all, so a long prompt never stalls
   the streams already decoding. Chunk boundaries are the one-request loop's,
   so a prompt's state is the same whether or not others ran beside it;
3. **decodes** one token for every decoding row. With two rows or more (and a
   family whose components are all ``batchable``) the sessions are merged
   into one batched state (:mod:`turbospark.batch`) and advance in one
   forward; a lone row, or a family without a batched forward, steps through
   the one-row forward exactly as :func:`turbospark.generate.stream_generate`
   does;
4. **retires** rows that finished, failed or were cancelled (their client went
   away): a batched row is copied back out of the batch, and its session is
   checked back in as the runner's live session (the previous live one is
   parked by the pool's rules).

Decoding is pipelined as in the one-request loop: a step is built from the
still-lazy sampled ids and queued before those ids are read, and a row whose
id turns out to be a stop goes back one token (rewindable components drop a
column; the others come back from references held before the step).

A row that fails (a plugin raising, an id the model cannot take) fails only
its own request: a failed batched step is undone from held references and
every row is retried alone, so only the culprit sees the error.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Literal, TypeVar

import mlx.core as mx

from turbospark.generate import (
    Chunk,
    FinishReason,
    GenerationConfig,
    GenerationStats,
    acquire,
    check_prompt,
)
from turbospark.pool import Session
from turbospark.reuse import ReuseReport
from turbospark.runner import Runner
from turbospark.sampling import Sampler
from turbospark.state import State
from turbospark.text import StopStrings, StreamDecoder, TextCodec

log = logging.getLogger("turbospark.engine")

Emit = Callable[[Chunk | Exception], None]
# Told of every real request's end: its stats when it finished, None when it failed.
Observer = Callable[["Job", GenerationStats | None], None]
T = TypeVar("T")


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
    # Per-row sampling extras (turbospark.logits_processors; fresh objects per job).
    processors: list[object] = field(default_factory=list)
    top_logprobs: int | None = None  # keep each sample's log-probabilities (Chunk.logprobs)


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
    """Decoding rows whose sessions are merged into one batched state."""

    def __init__(self, runner: Runner) -> None:
        self.runner = runner
        self.rows: list[_Row] = []
        self.state: State = {}
        self.held: dict[str, object] = {}

    def join(self, rows: list[_Row]) -> None:
        merged = self.runner.merge_states([row.session for row in rows])
        if not self.rows:
            self.state = merged
        else:
            for name, component in self.state.items():
                component.extend(merged[name])
        self.rows.extend(rows)

    def step(self) -> None:
        """Feed every row's pending id (still lazy) and queue the next ids."""
        tokens = mx.concatenate([row.pending.reshape(1) for row in self.rows])
        for component in self.state.values():
            component.prepare(1)
        self.held = {name: component.hold() for name, component in self.state.items()}
        try:
            logits = self.runner.forward_batch(
                self.runner.clip_ids(tokens)[:, None],
                [row.position for row in self.rows],
                self.state,
            )
        except Exception:
            self.rollback()
            raise
        # Plain greedy rows (most of a temperature-0 batch) take their ids in one
        # op; the others sample row by row with their own parameters.
        plain = [row.sampler.plain_greedy for row in self.rows]
        greedy = mx.argmax(logits, axis=-1) if any(plain) else None
        for i, row in enumerate(self.rows):
            if plain[i]:
                row.following = greedy[i]
            else:
                row.following = row.sampler(logits[i], fed=row.pending)
        mx.async_eval(
            [row.following for row in self.rows],
            [a for component in self.state.values() for a in component.arrays()],
        )

    def rollback(self) -> None:
        for name, component in self.state.items():
            component.rollback(self.held[name])

    def leave(self, going: dict[_Row, int]) -> None:
        """Copy each row in *going* back into its session, *back* tokens earlier."""
        if not going:
            return
        for i, row in enumerate(self.rows):
            if row in going:
                back = going[row]
                row.session.state = {
                    name: component.extract(i, row.leaves_at, back, self.held.get(name))
                    for name, component in self.state.items()
                }
        stay = [i for i, row in enumerate(self.rows) if row not in going]
        self.rows = [self.rows[i] for i in stay]
        if not self.rows:
            self.state, self.held = {}, {}
            return
        for component in self.state.values():
            component.filter(stay)


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
    ) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, got {max_batch}")
        self.runner = runner
        self.codec = codec
        self.max_batch = max_batch
        self.prefill_budget = prefill_budget
        self._queue: deque[Job] = deque()
        self._wake = threading.Condition()
        self._prefilling: list[_Row] = []
        self._solo: list[_Row] = []
        self._batch = _Batch(runner)
        self._calls: deque[tuple[Callable[[], object], Future]] = deque()
        self.warming = False
        # Requests that discarded a parked session with content (at admission or
        # at check-in): the sessions view shows it, so an eviction is seen when it happens.
        self.evictions = 0
        self.observer = observer  # called on the runner thread (metrics)

    # -- the outside: any thread ----------------------------------------------------

    def submit(self, job: Job) -> None:
        with self._wake:
            self._queue.append(job)
            self._wake.notify()

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
        return len(self._prefilling) + len(self._solo) + len(self._batch.rows)

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
                    if not self._queue and not self._calls:
                        self._wake.wait(timeout=0.05)
        self._run_calls()

    def warm_up(self, ids: list[int], rows: int = 2) -> None:
        """Run *rows* copies of a short request to the end, so the prefill, the
        one-row decode and the batched decode are built (and, on a GPU, their
        kernels compiled) before the first real request is admitted. Requests
        that arrive meanwhile wait in the queue; the warm-up's sessions are
        forgotten afterwards."""
        config = GenerationConfig(max_tokens=3, temperature=0.0, stop_token_ids=[])
        self.warming = True
        started = time.perf_counter()
        with self._wake:
            for _ in range(min(rows, self.max_batch)):
                self._queue.appendleft(
                    Job(ids=list(ids), config=config, emit=lambda item: None, warm_up=True)
                )
        try:
            while self.step():
                pass
            self.runner.forget_sessions()
        finally:
            self.warming = False
        log.info("warmed up in %.1f s", time.perf_counter() - started)

    def _fail_all(self, exc: Exception) -> None:
        rows = self._prefilling + self._solo + self._batch.rows
        self._prefilling, self._solo, self._batch = [], [], _Batch(self.runner)
        for row in rows:
            row.session.clear()  # its state may be half-written: never resume it
            self._fail(row, exc)

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
        while self._queue and self.active_rows < self.max_batch:
            with self._wake:
                if self.warming and not self._queue[0].warm_up:
                    return  # real requests wait for the warm-up to finish
                job = self._queue.popleft()
            if job.cancelled.is_set():  # given up while queued: it never starts
                job.emit(Chunk(text="", finish_reason="stop"))
                continue
            try:
                row = self._start(job)
            except Exception as exc:  # refused before any session changed
                job.emit(exc)
                continue
            self._prefilling.append(row)

    def _start(self, job: Job) -> _Row:
        runner, config = self.runner, job.config
        check_prompt(runner, job.ids)
        sampler = self._new_sampler(job)
        started = time.perf_counter()
        kept, report, evicted = acquire(runner, job.ids)
        self._evicted(job, evicted)
        session = runner.checkout()
        stop_ids = frozenset(
            self.codec.eos_token_ids if config.stop_token_ids is None else config.stop_token_ids
        )
        return _Row(
            job=job,
            session=session,
            kept=kept,
            report=report,
            evicted=evicted,
            sampler=sampler,
            stop_ids=stop_ids,
            decoder=self.codec.stream_decoder(),
            stops=StopStrings(config.stop),
            started=started,
            next_prefill=kept,
            context_length=runner.context_length,
        )

    def _new_sampler(self, job: Job) -> Sampler:
        """The row's sampler (a distributed engine shares rank 0's samples instead)."""
        return Sampler(job.config, job.processors, job.top_logprobs)

    def _prefill(self) -> None:
        """Whole chunks (the one-request loop's boundaries), up to the budget."""
        budget = self.prefill_budget
        for row in list(self._prefilling):
            if budget is not None and budget <= 0:
                break
            if row.job.cancelled.is_set():
                self._prefilling.remove(row)
                self._finish(row, "stop")
                continue
            ids, chunk = row.job.ids, row.job.config.chunk_size
            last = len(ids) - 1
            try:
                while row.next_prefill < last and (budget is None or budget > 0):
                    end = min(row.next_prefill + chunk, last)
                    self.runner.feed(row.session, ids[row.next_prefill : end], row.next_prefill)
                    budget = None if budget is None else budget - (end - row.next_prefill)
                    row.next_prefill = end
                if row.next_prefill < last:
                    continue
                logits = self.runner.feed(row.session, ids[last:], last, logits=True)
                self.runner.checkpoint(row.session)
                row.pending = row.sampler(logits)
                mx.async_eval(row.pending)
            except Exception as exc:
                self._prefilling.remove(row)
                self._fail(row, exc)
                continue
            budget = None if budget is None else budget - 1
            row.position = len(ids)
            row.prefilled = time.perf_counter()
            self._prefilling.remove(row)
            self._solo.append(row)

    def _decode(self) -> None:
        for row in self._solo + self._batch.rows:
            if row.job.cancelled.is_set():
                self._cancel(row)
        decoding = len(self._solo) + len(self._batch.rows)
        if self.runner.batchable and decoding >= 2 and self._solo:
            joining, self._solo = self._solo, []
            self._batch.join(joining)
        if self._batch.rows:
            self._decode_batch()
        for row in list(self._solo):
            self._decode_solo(row)

    def _decode_solo(self, row: _Row) -> None:
        """One token for one row through the one-row forward (stream_generate's step)."""
        fed = not row.final
        try:
            if fed:
                out = self.runner.feed(row.session, [row.pending], row.position, logits=True)
                row.following = row.sampler(out, fed=row.pending)
                mx.async_eval(row.following)
            token = int(row.pending.item())
        except Exception as exc:
            self._solo.remove(row)
            self._fail(row, exc)
            return
        if token in row.stop_ids and fed:
            self.runner.take_back_session(row.session)
        self._advance(row, token, fed)

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
        for row in batch.rows:
            row.batch_peak = max(row.batch_peak, len(batch.rows))
        try:
            batch.step()
            tokens = mx.concatenate([row.pending.reshape(1) for row in batch.rows]).tolist()
            for token in tokens:
                self.runner.check_ids([token])
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
                row.session.record.write(row.position, [token])
            if not self._advance(row, token, fed=True, retire=False):
                going[row] = 1 if stop else 0
        batch.leave(going)
        for row in going:
            self._finish(row, row.finish)

    def _advance(self, row: _Row, token: int, fed: bool, retire: bool = True) -> bool:
        """Account for *token*; False (and, with *retire*, the row retired) when the
        request is over. Mirrors stream_generate's loop body."""
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
        else:
            row.leaves_at = row.position
            self._batch.leave({row: 0})
        self._finish(row, "stop")

    def _evicted(self, job: Job, evicted: bool) -> None:
        """Count a real request's eviction (the warm-up's sessions are forgotten anyway)."""
        if evicted and not job.warm_up:
            self.evictions += 1

    def _fail(self, row: _Row, exc: Exception) -> None:
        log.warning("request failed: %s", exc, exc_info=exc)
        self._evicted(row.job, self.runner.checkin(row.session))
        self.runner.flush()
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
        evicted_at_checkin = self.runner.checkin(row.session)
        self._evicted(row.job, evicted_at_checkin)
        self.runner.flush()  # write-through to the disk tier: a reply sent is a session kept
        now = time.perf_counter()
        prefilled = row.prefilled or now
        stats = GenerationStats(
            prompt_tokens=len(row.job.ids),
            reused_tokens=row.kept,
            generated_tokens=len(row.generated),
            reuse_reason=str(row.report.reason),
            reuse_detail=row.report.detail,
            swapped=row.report.swapped,
            evicted=row.evicted,
            prefill_seconds=prefilled - row.started,
            decode_seconds=now - prefilled,
            queued_seconds=row.started - row.job.submitted,
            batch_size=row.batch_peak,
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

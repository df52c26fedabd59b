"""Serving one sharded model from a group of processes, in lockstep.

Under ``mlx.launch -n N``, every rank holds a shard of the model
(:mod:`turbospark.layers.sharding`) and must run exactly the same forward calls in the
same order, or their collectives pair up wrongly and the ranks hang or diverge.
So every decision is made once, on rank 0, and broadcast (mlx-lm's server does
the same with ``all_sum`` of an array that only rank 0 fills):

- **what happens at each step**: before every engine step, rank 0 broadcasts
  the requests that arrived and the ones cancelled since the last step (a
  client that hung up, a deadline) — :class:`Lockstep`. Every rank applies
  them and runs the same :meth:`Engine.step`, so admission, reuse, park and
  evict decisions (pure functions of the sessions' token records) come out the
  same on every rank;
- **every sampled token**: rank 0 samples (with the request's seed, penalties
  and grammar) and broadcasts the id (:class:`SharedSampler`), so the others
  feed the same token without running the sampler at all.

Rank 0's engine only ever sees cancellations at those broadcast points (the
HTTP side's flag is copied over there), never in the middle of a step.

A rank that dies makes the ring's next collective raise on the others; a rank
that hangs trips the watchdog (no broadcast for ``timeout`` seconds). Either
way every rank exits with one line naming what happened, never a hang.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from typing import Any

import mlx.core as mx
import numpy as np

from turbospark.generation.engine import Engine, Job
from turbospark.generation.request import GenerationConfig
from turbospark.generation.runner import Runner
from turbospark.generation.sampling import Sampler
from turbospark.text import TextCodec

log = logging.getLogger("turbospark.generation.distributed")

IDLE_BEAT = 0.05  # seconds rank 0 waits for work before broadcasting an empty step


def launcher_backend() -> str:
    """The backend ``mlx.launch`` set this process up for, read from what it
    exports (``NCCL_PORT`` for ``--backend nccl``, ``MLX_HOSTFILE`` for ring):
    ``mx.distributed.init()`` is then told, not left to guess."""
    if "NCCL_PORT" in os.environ:
        return "nccl"
    if "MLX_HOSTFILE" in os.environ:
        return "ring"
    return "any"


def fatal(group: mx.distributed.Group, what: str) -> None:
    """One line, then exit at once: a rank must never go on alone.

    The line goes out in one ``write`` (atomic on a pipe): MLX's ring threads
    print their own errors to the same stderr at that moment, and a ``print``'s
    text and newline are separate writes they could land between."""
    sys.stderr.flush()
    line = f"turbospark: rank {group.rank()} of {group.size()}: {what}\n"
    os.write(2, line.encode(errors="replace"))
    os._exit(1)


class Lockstep:
    """Rank 0's messages to every rank, over the group's ``all_sum``; and a
    watchdog that ends the process when no message got through in ``timeout``
    seconds (a peer that hangs)."""

    def __init__(self, group: mx.distributed.Group, timeout: float) -> None:
        self.group = group
        self.rank = group.rank()
        self.timeout = timeout
        self._last = time.monotonic()
        self._watching = threading.Event()

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def _sum(self, values: mx.array) -> mx.array:
        try:
            out = mx.distributed.all_sum(values, group=self.group)
            mx.eval(out)
        except RuntimeError as exc:
            fatal(self.group, f"lost a peer ({exc}); every rank stops")
        return out

    def broadcast(self, message: dict[str, Any] | None) -> dict[str, Any]:
        """Rank 0 passes *message*, the others None; every rank returns rank 0's."""
        payload = json.dumps(message).encode() if self.leader else b""
        length = int(self._sum(mx.array([len(payload)], dtype=mx.int32)).item())
        if self.leader:
            data = np.frombuffer(payload, dtype=np.uint8)
        else:
            data = np.zeros(length, dtype=np.uint8)
        received = np.asarray(self._sum(mx.array(data))).tobytes()
        self._last = time.monotonic()
        return json.loads(received)

    def share_token(self, token: mx.array) -> mx.array:
        """Rank 0's *token* (a scalar id, -1 for "sampling failed") on every rank, lazily."""
        mine = token.astype(mx.int32) if self.leader else mx.zeros((), dtype=mx.int32)
        return mx.distributed.all_sum(mine, group=self.group)

    def watch(self) -> None:
        """Start the watchdog thread (once)."""
        if self._watching.is_set():
            return
        self._watching.set()

        def loop() -> None:
            while True:
                time.sleep(min(1.0, self.timeout / 4))
                silent = time.monotonic() - self._last
                if silent > self.timeout:
                    fatal(
                        self.group,
                        f"no step from the group for {silent:.0f} s (a peer hung or was "
                        f"stopped; --distributed-timeout is {self.timeout:g} s); every rank stops",
                    )

        threading.Thread(target=loop, name="turbospark-watchdog", daemon=True).start()


class SharedSampler:
    """A row's sampler under lockstep: rank 0 samples, every rank gets its id."""

    plain_greedy = False  # every id goes through the broadcast, batched or not
    plain_random = False
    keeps_logprobs_only = False  # its draws are broadcast one by one
    stepwise = True  # one broadcast per id
    # The broadcast must follow the forward's collectives: sampled after it, on the host.
    reads_on_host = True

    def __init__(self, lockstep: Lockstep, inner: Sampler | None) -> None:
        self.lockstep = lockstep
        self.inner = inner  # rank 0's real sampler; None elsewhere

    def __call__(self, logits: mx.array, fed: mx.array | None = None) -> mx.array:
        # Both evaluations are explicit, so every rank runs its collectives in one
        # order: the forward's (inside the logits) first, then the token's. Left
        # lazy, a rank whose token graph does not depend on the logits (all but
        # rank 0) could run the token's all_sum first and pair it with the wrong one.
        mx.eval(logits)
        if self.inner is not None:
            try:
                token = self.inner(logits, fed=fed)
            except Exception:
                mx.eval(self.lockstep.share_token(mx.array(-1)))  # the others fail it too
                raise
            shared = self.lockstep.share_token(token)
            mx.eval(shared)
            return shared.astype(mx.uint32)
        shared = self.lockstep.share_token(mx.zeros((), dtype=mx.int32))
        if shared.item() < 0:
            raise RuntimeError("rank 0 failed to sample this row")
        return shared.astype(mx.uint32)

    def logprobs(self, index: int) -> Any:
        return None if self.inner is None else self.inner.logprobs(index)


class LockstepEngine(Engine):
    """The engine, stepped in lockstep across the group (see the module docstring).

    On rank 0 :meth:`submit` queues a request for the next broadcast; on the
    others requests arrive only through the broadcast. :meth:`run` ends on
    every rank when rank 0's *stop* is set.
    """

    def __init__(self, runner: Runner, codec: TextCodec, lockstep: Lockstep, **kwargs: Any):
        super().__init__(runner, codec, **kwargs)
        self.lockstep = lockstep
        self.yields_warm_up = False  # every rank runs the same warm-up steps, whole
        # Admission waits on rank 0's requests in flight, which no other rank sees:
        # every rank admits what the broadcast brings, at once.
        self.gather_s = 0.0
        self._inbox: list[Job] = []
        self._next_id = 0
        # id -> (the request's own job, the engine's copy); cancelled flags cross
        # over only at broadcasts.
        self._jobs: dict[int, tuple[Job, Job]] = {}

    def submit(self, job: Job) -> None:
        with self._wake:
            self._inbox.append(job)
            self._wake.notify()

    def _new_sampler(self, job: Job) -> Sampler:
        inner = super()._new_sampler(job) if self.lockstep.leader else None
        return SharedSampler(self.lockstep, inner)  # type: ignore[return-value]

    def _message(self, stop: threading.Event) -> dict[str, Any]:
        """Rank 0: what changed since the last step."""
        with self._wake:
            if not (self._inbox or self.active_rows or self._queue or stop.is_set()):
                self._wake.wait(timeout=IDLE_BEAT)
            arrived, self._inbox = self._inbox, []
        jobs = []
        for job in arrived:
            self._next_id += 1
            jobs.append(
                {
                    "id": self._next_id,
                    "ids": job.ids,
                    "checkpoint_at": job.checkpoint_at,  # every rank cuts its prefill there
                    "config": job.config.model_dump(mode="json"),
                    "forks": [fork.config.model_dump(mode="json") for fork in job.forks],
                }
            )
            self._jobs[self._next_id] = (job, self._copy(job, self._next_id))
        cancelled = [
            key for key, (job, copy) in self._jobs.items()
            if job.cancelled.is_set() and not copy.cancelled.is_set()
        ]  # fmt: skip
        return {"jobs": jobs, "cancelled": cancelled, "stop": stop.is_set()}

    def _copy(self, job: Job, key: int) -> Job:
        """The engine's copy of a request: the same ids, knobs and output, its own
        cancelled flag; forgotten once it emitted its last chunk."""

        def emit(item: Any) -> None:
            if isinstance(item, Exception) or item.finish_reason is not None:
                self._jobs.pop(key, None)
            job.emit(item)

        return Job(
            ids=job.ids,
            config=job.config,
            emit=emit,
            submitted=job.submitted,
            processors=job.processors,
            top_logprobs=job.top_logprobs,
            checkpoint_at=job.checkpoint_at,
            prompt_note=job.prompt_note,
            # The choices' own copies: their flags, too, change only between steps.
            forks=[
                Job(
                    ids=f.ids,
                    config=f.config,
                    emit=f.emit,
                    submitted=f.submitted,
                    processors=f.processors,
                    top_logprobs=f.top_logprobs,
                )
                for f in job.forks
            ],
        )

    def _apply(self, message: dict[str, Any]) -> None:
        for entry in message["jobs"]:
            if self.lockstep.leader:
                job = self._jobs[entry["id"]][1]
            else:
                config = GenerationConfig.model_validate(entry["config"])
                forks = [
                    Job(ids=entry["ids"], config=GenerationConfig.model_validate(c), emit=_drop)
                    for c in entry["forks"]
                ]
                job = Job(
                    ids=entry["ids"],
                    config=config,
                    emit=self._forget(entry["id"]),
                    forks=forks,
                    checkpoint_at=entry["checkpoint_at"],
                )
                self._jobs[entry["id"]] = (job, job)
            self._queue.append(job)
        for key in message["cancelled"]:
            if key in self._jobs:
                copy = self._jobs[key][1]
                for job in (copy, *copy.forks):
                    job.cancelled.set()

    def _forget(self, key: int) -> Any:
        def emit(item: Any) -> None:
            if isinstance(item, Exception) or item.finish_reason is not None:
                self._jobs.pop(key, None)

        return emit

    def run(self, stop: threading.Event) -> None:
        """Broadcast, apply, step — until rank 0 says stop. A step that fails
        outside a row ends every rank: going on could diverge."""
        self.lockstep.watch()
        while True:
            message = self.lockstep.broadcast(self._message(stop) if self.lockstep.leader else None)
            self._apply(message)
            if message["stop"]:
                break
            if self.lockstep.leader:
                self._run_calls()
            try:
                self.step()
            except Exception as exc:
                log.exception("engine step failed")
                fatal(self.lockstep.group, f"an engine step failed ({exc}); every rank stops")
        self._run_calls()

    @property
    def queue_depth(self) -> int:
        return len(self._queue) + len(self._inbox)


def _drop(item: Any) -> None:
    """A follower's fork rows: their output is rank 0's to send."""

"""The runner: one loaded model and the sessions it serves, behind one public façade.

The runner opens an install, validates every input before any state changes,
feeds tokens through the family's forward hook and keeps the prefix record
honest. The sessions themselves (the live one, the parked pool, the disk tier,
checkout and checkin, reuse) belong to its :class:`SessionStore
<turbospark.sessions.store.SessionStore>`; the runner's session methods are
that store's, under the names the public API gives them. See SEMANTICS.md
for the rules.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from functools import partial
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import pluggy

from turbospark.contract.hookspecs import (
    DEFAULT_TOOL_SYNTAX,
    TOOL_SYNTAXES,
    ArchConfig,
    FamilySpec,
    LogitsWanted,
    MoESpec,
)
from turbospark.contract.protocols import MultiTokenHead
from turbospark.contract.vision import MropePositions, VisionInjection, VisionMap
from turbospark.errors import (
    ContextOverflow,
    InstallError,
    InvalidInput,
)
from turbospark.generation.opening import (
    check_disk_options,
    check_kv_quantization,
    check_mtp,
    check_pool_capability,
    check_rollback,
    check_shardable,
    check_steering,
    to_dtype,
)
from turbospark.layers.cuda import qmv as qmv_cuda
from turbospark.layers.fused import STEP_TOKENS
from turbospark.layers.layer_step import kernels_available
from turbospark.layers.sharding import check_same_install
from turbospark.loading.install import (
    Manifest,
    load_weights,
    manifest_digest,
    validate_arch,
)
from turbospark.loading.plugins import FamilyRegistry, default_registry
from turbospark.loading.sources import ModelSource, resolve_source, verify_install
from turbospark.policies import DraftPolicies, ExpertCacheSlots, SteeringPolicy
from turbospark.policies.expert_cache import (
    ExpertCacheStats,
    StreamedExperts,
    check_policy,
    plan_streams,
    resident_stats,
)
from turbospark.policies.steering import LastTokenRecorder, Steer, cannot_steer
from turbospark.sessions.disk_tier import DiskTier
from turbospark.sessions.mtp_track import MtpTrack
from turbospark.sessions.reuse import ReuseReport
from turbospark.sessions.session import Checkpoint, Session, SessionSnapshot
from turbospark.sessions.session_file import ModelIdentity
from turbospark.sessions.store import DiskOptions, SessionStore, StateHooks
from turbospark.state.components import PadsRows, ShiftsRows, State
from turbospark.state.kv import STEP, KVComponent, KVQuantization, ladder, quantize_kv


class Runner:
    """Serve one model to many conversations. Build with :meth:`open`."""

    def __init__(
        self,
        *,
        path: Path,
        source: ModelSource,
        manifest: Manifest,
        arch: ArchConfig,
        spec: FamilySpec,
        pm: pluggy.PluginManager,
        model: object,
        context_length: int,
        session_slots: int,
        max_parked_bytes: int | None,
        expert_cache: ExpertCacheSlots,
        draft: DraftPolicies,
        steering: SteeringPolicy,
        dtype: mx.Dtype | None = None,
        session_dir: Path | None = None,
        max_session_disk_bytes: int | None = None,
        group: mx.distributed.Group | None = None,
        kv_quantization: KVQuantization | None = None,
    ) -> None:
        self.path = path
        self.source = source  # what was opened: an install, a checkpoint or a hub id
        # The processes this model is sharded across (None: not sharded).
        self.group = group if group is not None and group.size() > 1 else None
        self.manifest = manifest
        self.arch = arch
        self.family = spec
        self.model = model
        self.context_length = context_length
        self.expert_cache = expert_cache
        self.draft = draft
        self.steering = steering  # the default; a request may ask for its own (use_steering)
        self._steers: dict[str | None, Steer | None] = {}  # compiled, by identity
        self.dtype = dtype or to_dtype(manifest.dtype)
        # How every session's attention K/V are stored (None: in the compute dtype).
        self.kv_quantization = kv_quantization
        self._hook = pm.hook
        disk = (
            None
            if session_dir is None
            else DiskOptions(
                session_dir,
                ModelIdentity.of(manifest, self.dtype, steering.identity, kv_quantization),
                context_length,
                max_session_disk_bytes,
            )
        )
        # Every session the runner serves, and every move of one between tiers.
        self.store = SessionStore(
            StateHooks(
                new_state=self._new_state,
                snapshot=lambda state: self._hook.turbospark_snapshot_state(state=state),
                restore=lambda state, arrays: self._hook.turbospark_restore_state(
                    state=state, snapshot=arrays
                ),
            ),
            spec,
            slots=session_slots,
            max_parked_bytes=max_parked_bytes,
            steering=steering,
            disk=disk,
        )
        self._vision: VisionMap | None = None
        self._experts: StreamedExperts | None = None  # set by open when experts stream
        # The checkpoint's MTP head, set by open for DraftPolicies.mtp: every feed
        # then keeps the hidden states it reads (Session.mtp, turbospark.generation.mtp).
        self.mtp_head: MultiTokenHead | None = None
        self._moe: MoESpec | None = None

    # -- opening ---------------------------------------------------------------

    @classmethod
    def open(
        cls,
        path: str | Path | ModelSource,
        arch: ArchConfig | None = None,
        context_length: int = 4096,
        expert_cache: ExpertCacheSlots | None = None,
        draft: DraftPolicies | None = None,
        steering: SteeringPolicy | None = None,
        session_slots: int = 1,
        *,
        max_parked_bytes: int | None = None,
        session_dir: str | Path | None = None,
        max_session_disk_bytes: int | None = None,
        dtype: str | mx.Dtype | None = None,
        registry: FamilyRegistry | None = None,
        group: mx.distributed.Group | None = None,
        kv_bits: int | None = None,
        kv_group_size: int = 64,
    ) -> Runner:
        """Open a model: an install, a checkpoint directory or a hub id
        (:func:`~turbospark.loading.sources.resolve_source`; a checkpoint's files
        are verified there, once, and remembered). Cheap checks (manifest, arch,
        pool capability, policies) run before any weight is read, so refusals
        are instant.

        ``max_parked_bytes`` caps the memory of parked sessions: whenever a
        session is parked, the least recently used ones are cleared until the
        rest fit (reported like any eviction).

        ``session_dir`` adds the disk tier (SEMANTICS.md): sessions leaving
        memory are written there instead of dropped, the directory's sessions
        are indexed now and scored like parked ones, and :meth:`flush` /
        :meth:`close` write the warm ones. ``max_session_disk_bytes`` bounds it.

        ``expert_cache`` (default ``ExpertCacheSlots.all()``) bounds the routed
        experts resident per MoE layer; the rest stream from the install
        (:mod:`turbospark.policies.expert_cache`), with identical logits.

        ``group`` (``mx.distributed.init()`` under ``mlx.launch``) shards the
        model across its processes (tensor parallelism, the family's
        ``turbospark_shard_model``); every process opens the same install and
        runs the same calls (``docs/SCALING.md``). A group of one changes nothing.

        ``kv_bits`` (4 or 8; None: full precision) stores every session's
        attention K/V quantized in groups of ``kv_group_size`` along the head
        dim (mlx-lm's ``QuantizedKVCache``, from the first token): sessions
        take a quarter (8-bit) to an eighth (4-bit) of the bytes in float32,
        so the pool, ``max_parked_bytes`` and the disk tier hold more of them
        (docs/SESSIONS.md)."""
        source = resolve_source(path, registry=registry)
        path, manifest = source.path, source.manifest
        distributed = group is not None and group.size() > 1
        if distributed:  # first, so every rank refuses a mismatch at the same point
            check_same_install(group, manifest_digest(manifest), source.describe())
        family = (registry or default_registry()).get(manifest.family)
        spec = family.spec
        installed = validate_arch(path, manifest, spec.arch_config)
        if arch is not None and arch != installed:
            raise InstallError(
                f"the arch passed to Runner.open does not match {path}'s config.json; "
                "pass arch=None or peek_manifest_arch(path)"
            )
        if context_length <= 0:
            raise InvalidInput(f"context_length must be positive, got {context_length}")
        if session_slots < 0:
            raise InvalidInput(f"session_slots must be 0 or more, got {session_slots}")
        if max_parked_bytes is not None and max_parked_bytes < 0:
            raise InvalidInput(f"max_parked_bytes must be 0 or more, got {max_parked_bytes}")
        check_disk_options(spec, session_slots, session_dir, max_session_disk_bytes)
        kv_quantization = check_kv_quantization(spec, installed, kv_bits, kv_group_size)
        pm = family.manager()
        draft = draft or DraftPolicies.off()
        if draft.enabled:
            check_rollback(spec, draft.mode)
        if draft.mode == "mtp":
            check_mtp(spec, pm, path, manifest)
        expert_cache = expert_cache or ExpertCacheSlots.all()
        steering = steering or SteeringPolicy.off()
        check_steering(spec, installed, steering)
        moe = pm.hook.turbospark_moe(arch=installed)
        check_policy(expert_cache, moe, spec.name)
        if distributed:
            check_shardable(pm, spec, group, session_dir)
            if moe is not None and expert_cache.mode != "all":
                raise InvalidInput(
                    f"--expert-cache-slots {expert_cache} streams experts into one process's "
                    "slots and cannot be sharded across a group; use --expert-cache-slots all "
                    "with --distributed"
                )
        if session_slots > 1:
            check_pool_capability(
                spec, pm.hook.turbospark_pool_capability(arch=installed), session_slots
            )
        compute_dtype = to_dtype(dtype or manifest.dtype)
        streams = plan_streams(path, manifest.weight_files, moe, expert_cache, compute_dtype)
        if source.kind == "install":  # a checkpoint's files were verified by resolve_source
            verify_install(path, manifest)
        model = _loaded_model(
            pm, installed, path, manifest, compute_dtype, streams, group if distributed else None
        )
        # Its packed products' kernels compile meanwhile, on a machine's first launch (the
        # weights are read lazily, by the warm-up below).
        qmv_cuda.prebuild(model)
        runner = cls(
            path=path,
            source=source,
            manifest=manifest,
            arch=installed,
            spec=spec,
            pm=pm,
            model=model,
            context_length=context_length,
            session_slots=session_slots,
            max_parked_bytes=max_parked_bytes,
            expert_cache=expert_cache,
            draft=draft,
            steering=steering,
            dtype=compute_dtype,
            session_dir=None if session_dir is None else Path(session_dir),
            max_session_disk_bytes=max_session_disk_bytes,
            group=group,
            kv_quantization=kv_quantization,
        )
        runner._experts = streams
        runner._moe = moe
        if draft.mode == "mtp":
            runner.mtp_head = pm.hook.turbospark_mtp_head(model=model)
            if runner.mtp_head is None:
                raise InstallError(
                    f"DraftPolicies.mtp: the install at {path} names mtp.* tensors but "
                    f"family '{spec.name}' built no MTP head from them; re-import the checkpoint"
                )
        runner.warm_up()
        return runner

    def _new_state(self) -> State:
        """A fresh state, its K/V stored under the runner's setting (every
        state the runner makes comes from here, so none is ever mixed)."""
        state = self._hook.turbospark_new_state(
            arch=self.arch, model=self.model, context_length=self.context_length
        )
        return quantize_kv(state, self.kv_quantization)

    def warm_up(self) -> int:
        """Trace a lone row's decode step at every capacity a session's K/V
        can take up to the context length (the growth ladder,
        :func:`~turbospark.state.kv.ladder`), once, at load: where the
        attention kernels run (:func:`~turbospark.layers.layer_step.kernels_available`)
        a decode step is traced with the cache's whole buffers, so each new
        capacity would otherwise trace it on some request's step (a step
        after each growth cost 1.4-2.8x a steady one on the CPU, with the
        kernels' contract in ops). Returns the rungs traced (0: nothing to
        warm, a step here never traces per capacity).

        On a scratch state: a short prompt (fed as :meth:`feed` feeds one)
        and one decode step, evaluated (every kernel built once, and the
        first prompt's forms traced), then for each rung the step built over
        zero buffers of that capacity and never evaluated, so the rungs cost
        host time alone (about one step's graph each) and no memory. A
        quantized cache and a sharded model take the modules' path, which
        traces no capacity; streamed experts are left alone (a step's
        routing would load experts and count in their cache's statistics)."""
        if (
            not kernels_available()
            or self.kv_quantization is not None
            or self.group is not None
            or self._experts is not None
            or self.context_length < 3
        ):
            return 0
        state = self._new_state()

        def step(start: int, length: int = 1, logits: LogitsWanted = "last") -> mx.array | None:
            return self._hook.turbospark_forward(
                model=self.model, state=state, vision=None, steer=None, logits=logits,
                tokens=mx.zeros((length,), dtype=mx.int32), start=start,
            )  # fmt: skip

        # A prompt past the compiled lengths, fed as _feed feeds one (the last
        # token alone): the prefill's uncompiled and one-token forms.
        prompt = min(STEP_TOKENS + 2, self.context_length - 2)
        for begin, end, wanted in _forwards(prompt, "last"):
            step(begin, end - begin, wanted)
        mx.eval(step(prompt), *_state_arrays(state))  # a decode step: its kernels
        position = prompt + 1  # every rung's step writes here (a family may check it)
        kv = [component for component in state.values() if isinstance(component, KVComponent)]
        others = {
            name: component.snapshot()
            for name, component in state.items()
            if not isinstance(component, KVComponent)
        }
        # A buffer full at the last rung below the limit grows by at least a step.
        rungs = ladder(self.context_length + STEP)
        for capacity in rungs:
            for component in kv:
                component.at(position, capacity)
            for name, snapshot in others.items():
                state[name].restore(snapshot)
            step(position)  # traced, never evaluated
        return len(rungs)

    # -- introspection -----------------------------------------------------------

    def expert_cache_stats(self) -> ExpertCacheStats | None:
        """Hits, misses, bytes read, resident bytes and slots per layer of the
        routed-expert cache; ``None`` for a model without MoE experts."""
        if self._experts is not None:
            return self._experts.stats()
        return (
            None if self._moe is None else resident_stats(self._moe, self.model, self.expert_cache)
        )

    @property
    def vocab_size(self) -> int:
        return self.arch.vocab_size

    @property
    def position(self) -> int:
        """The live session's next write position."""
        return self.store.live.position

    @property
    def session_pool_size(self) -> int:
        """Slots including the live one (1 when there is no pool)."""
        return self.store.pool_size

    def session_states(self) -> list[State]:
        """Every session's state, live first, then parked slots: for inspection
        (the conformance kit names leaks with it), never to feed directly."""
        return [s.state for s in self.store.sessions()]

    def session_nbytes(self) -> list[int]:
        """Bytes held by each session, live first, then parked slots."""
        return [s.nbytes for s in self.store.sessions()]

    def sessions(self) -> list[Session]:
        """The live session, then the parked slots, as objects: for inspection
        on the runner thread (the server's sessions view), never to feed."""
        return self.store.sessions()

    @property
    def max_parked_bytes(self) -> int | None:
        """The parked-memory cap (``--max-parked-memory``); None: slots alone bound it."""
        return self.store.max_parked_bytes

    def session_slot_evicted(self) -> bool:
        """Whether the last :meth:`reset` (or a swap in :meth:`try_reuse_prefix`
        that pushed the pool past ``max_parked_bytes``) discarded a parked
        session with real content."""
        return self.store.evicted

    @property
    def last_reuse(self) -> ReuseReport:
        """What the last :meth:`try_reuse_prefix` (or a sharing :meth:`share_prefix`) decided."""
        return self.store.last_reuse

    # -- feeding -----------------------------------------------------------------

    def feed(
        self,
        session: Session,
        tokens: Sequence[int | mx.array],
        start: int,
        logits: bool = False,
        then: Callable[[mx.array], mx.array] | None = None,
    ) -> mx.array | None:
        """Feed *tokens* to *session* at ``start..``; with *logits*, float32
        logits ``(vocab,)`` after the last one (else None), the last token then
        fed in a forward of its own, so the others get only the state's work
        (:func:`_forwards`). Every forward
        of the one-row path comes through here: the engine's on the sessions
        its requests checked out (:meth:`checkout`), the live-session calls
        (:meth:`produce`, :meth:`prefill_chunk`) on the live one.

        The first token may be a still-lazy scalar ``mx.array`` (a sampler's
        output): the forward is then queued before its id is read, so building
        the graph overlaps the previous step's compute. Its id is checked once
        read, and :meth:`take_back` can undo the step (the id may turn
        out a stop).

        *then* (a sampler) maps the logits to what is returned, and is queued
        with the forward, before the wait for a lazy token: the device then
        never waits for the host between a forward and its sample (mlx-lm's
        ``generate_step`` order)."""
        return self._feed(list(tokens), start, "last" if logits else "none", session, then)

    def produce(
        self,
        token: int | mx.array,
        position: int,
        then: Callable[[mx.array], mx.array] | None = None,
    ) -> mx.array:
        """:meth:`feed` one token (maybe lazy) to the live session at *position*:
        the logits for the next, or what *then* makes of them; :meth:`take_back`
        undoes it."""
        return self.feed(self.store.live, [token], position, logits=True, then=then)

    def produce_prefill(self, token: int, position: int) -> None:
        """Feed one prompt token whose logits nobody reads (the head is skipped)."""
        self.feed(self.store.live, [token], position)

    def prefill_chunk(
        self, tokens: Sequence[int], start: int, logits: bool = True
    ) -> mx.array | None:
        """Feed *tokens* to the live session at ``start..`` (:meth:`feed`); logits
        after the last one."""
        return self.feed(self.store.live, tokens, start, logits=logits)

    def _feed(
        self,
        tokens: list[int | mx.array],
        start: int,
        want: LogitsWanted,
        session: Session | None = None,
        then: Callable[[mx.array], mx.array] | None = None,
    ) -> mx.array | None:
        """Feed *session* (None: the live one) through the family's one-row
        forward; *then* (logits only) is applied before anything is queued (see :meth:`feed`).
        The first token may be a lazy id (:meth:`produce`, :meth:`verify`): it is
        read after the forward is queued."""
        live = session or self.store.live
        lazy, known = _split_lazy(tokens)
        ids = self._validate_write(known if lazy is None else [0, *known], start, live)
        if lazy is None:
            fed = mx.array(ids, dtype=mx.int32)
        elif not known:
            fed = self.clip_ids(lazy.reshape(1))
        else:  # a chained round's verify pass: the unread bonus, then drafts
            fed = mx.concatenate([self.clip_ids(lazy.reshape(1)), mx.array(ids[1:], mx.int32)])
        if start < live.position:
            live.rewind(live.position - start)
        # The components that cannot rewind, by reference: a failed forward puts them back.
        before = Checkpoint(start, live.parts(self.rigid_components))
        live.undo = before if lazy is not None and not known else None
        tracked: list[mx.array] = []  # the hidden states the MTP track keeps
        try:
            forward = dict(
                model=self.model,
                state=live.state,
                vision=self._vision,
                steer=self._compiled(live.steering),
            )
            if self.mtp_head is None:
                for begin, end, wanted in _forwards(fed.size, want):
                    out = self._hook.turbospark_forward(
                        **forward,
                        tokens=_tokens(fed, begin, end),
                        start=start + begin,
                        logits=wanted,
                    )
            else:  # the MTP track reads every token's hidden state: nothing to skip
                out, hidden = self._hook.turbospark_forward_with_hidden(
                    **forward, tokens=fed, start=start, logits=want
                )
                self.mtp_track(live).write(start, hidden)
                # Queued with the step: left lazy (a chunk with no logits read),
                # it would keep the last layer's whole graph alive until drafted.
                tracked.append(hidden)
            if then is not None and out is not None:
                out = then(out)
            mx.async_eval(*([] if out is None else [out]), *_state_arrays(live.state), *tracked)
            if lazy is not None:
                # The id itself, queued by the step before: a node made from it
                # (a reshape) would queue behind this step and wait for its end.
                ids = self._validate_write([lazy.item(), *known], start, live)  # waits
        except Exception:
            live.recover(before)
            raise
        self.fed(live, start, ids)
        return out

    def fed(self, session: Session, start: int, ids: Sequence[int]) -> None:
        """Record that *ids* were fed to *session* at *start* by a forward that
        succeeded (this one's, or a batched one's): the one writer of a session's
        prefix record, so what it vouches for is only ever what a forward took.
        Under a vision map the ids prove nothing about content: tainted."""
        session.record.write(start, ids, taint=self._vision is not None)

    def clip_ids(self, lazy: mx.array) -> mx.array:
        """Lazy sampled ids, clipped so an impossible one cannot index past the
        embedding table before it is read and refused (MLX's gather does not
        bounds-check)."""
        return _clip_ids(lazy, self.vocab_size - 1)

    def take_back(self, session: Session | None = None) -> None:
        """Undo the last :meth:`produce` (or :meth:`feed`) of a lazy token to
        *session* (None: the live one): non-rewindable state goes back to its
        held references, the rest rewinds one token, and the record forgets the
        id. The decode loop calls it when that id is a stop."""
        (session or self.store.live).take_back()

    # -- speculative decoding: one verify forward, then a cut (turbospark.generation.speculation) ----

    def verify(
        self,
        session: Session | None,
        tokens: Sequence[int | mx.array],
        start: int,
        then: Callable[[mx.array], Any] | None = None,
    ) -> Any:
        """Feed *tokens* (a confirmed token, then drafts) at ``start..`` in one
        forward; float32 logits ``(L, vocab)``, row ``j`` for the token after
        ``tokens[j]``. Traceable components can give their state after any token, so
        :meth:`accept` cuts back to any prefix without a second forward.

        The confirmed token may be a still-lazy id (a chained round's bonus,
        :meth:`Speculation.launch_after
        <turbospark.generation.speculation.Speculation.launch_after>`): the pass is queued
        before it is read, as :meth:`produce` does; *then* maps the logits to
        what is returned (arrays) and is queued with them."""
        live = session or self.store.live
        _, known = _split_lazy(tokens)
        if known:
            self.check_ids(known)  # before any component traces
        for name in self.traced_components:
            live.state[name].trace()  # type: ignore[attr-defined]
        return self._feed(list(tokens), start, "all", session, then)

    def accept(
        self,
        session: Session | None,
        start: int,
        keep: int,
        held: dict[str, object] | None = None,
    ) -> None:
        """After :meth:`verify` at *start*: keep its first *keep* tokens. The rest
        leave every component (rewound, or the traced state at ``start + keep``)
        and the record, so the session never holds a rejected token. *held*
        (:meth:`hold`, taken after that verify): a later verify was queued since,
        and it leaves too."""
        live = session or self.store.live
        kept: list[mx.array] = []
        for name in self.traced_components:
            trace = None if held is None else held[name]
            live.state[name].keep_traced(keep, trace)  # type: ignore[attr-defined]
            kept += live.state[name].arrays()
        # A state rebuilt from the trace, left lazy, keeps the whole trace alive
        # (every token's state, or the pass's deltas and decays): a reply that
        # ends on this round would park with it. Queued, it is the few arrays
        # the next step reads anyway, and no host sync.
        mx.async_eval(kept)
        live.cut_to(start + keep)  # the others rewind; the record and checkpoints follow

    def hold(self, session: Session | None) -> dict[str, object]:
        """The last :meth:`verify`'s traces, so :meth:`accept` can cut inside it
        after another verify was queued behind it (a chained round)."""
        live = session or self.store.live
        return {name: live.state[name].held_trace() for name in self.traced_components}  # type: ignore[attr-defined]

    def mtp_track(self, session: Session | None) -> MtpTrack:
        """*session*'s (None: the live one's) MTP K/V and hidden-state record."""
        live = session or self.store.live
        if live.mtp is None:
            live.mtp = MtpTrack()
        return live.mtp

    @property
    def traced_components(self) -> list[str]:
        """The components a verify forward traces (non-rewindable, declared traceable)."""
        return [c.name for c in self.family.components if c.traceable]

    @property
    def rigid_components(self) -> list[str]:
        """The components that cannot rewind (restored from held references instead)."""
        return [c.name for c in self.family.components if c.rewindable is False]

    def check_ids(self, tokens: Sequence[int]) -> list[int]:
        """*tokens* as plain ints, refused (changing nothing) if empty or outside
        the vocabulary; the generation loop checks whole prompts with it up front."""
        if not tokens:
            raise InvalidInput("no tokens to feed: pass at least one token id")
        ids = []
        for token in tokens:
            try:
                value = operator.index(token)  # ints and numpy integers, not floats or bools
            except TypeError:
                value = None
            if value is None or isinstance(token, bool) or not 0 <= value < self.vocab_size:
                raise InvalidInput(
                    f"token id {token!r} is outside this model's vocabulary (0..{self.vocab_size - 1}); "
                    "check the tokenizer matches the install"
                )
            ids.append(value)
        return ids

    def _validate_write(self, tokens: Sequence[int], start: int, live: Session) -> list[int]:
        """The token ids as plain ints, once every check passed (nothing fed yet)."""
        ids = self.check_ids(tokens)
        position = live.position
        if start < 0 or start > position:
            raise InvalidInput(
                f"position gap: a write at {start} but the live session is at {position}; "
                f"feed from position {position} (or an earlier one), or call reset() first"
            )
        if start + len(tokens) > self.context_length:
            raise ContextOverflow(
                f"writing {len(tokens)} token(s) at {start} would reach {start + len(tokens)}, past the "
                f"context length {self.context_length}; shorten the prompt or open the runner with "
                "a larger context_length"
            )
        return ids

    # -- sessions: the store's, under the public API's names -------------------------

    def set_prefix_reuse(self, enabled: bool) -> None:
        self.store.reuse_enabled = bool(enabled)

    def try_reuse_prefix(self, tokens: Sequence[int]) -> int:
        """How many leading *tokens* are already in the (possibly swapped-in) live
        session; commits the swap/rewind. See ``last_reuse`` for why."""
        return self.store.try_reuse(tokens, self._vision is not None)

    def share_prefix(self, tokens: Sequence[int]) -> int:
        """After :meth:`reset`, start the fresh live session from the longest
        prefix of *tokens* a parked conversation holds (say, a shared system
        prompt), leaving that conversation parked. Returns the tokens now in
        state (0: nothing shared; ``last_reuse`` is then unchanged)."""
        return self.store.share(tokens, self._vision is not None)

    def reset(self) -> None:
        """Start a new conversation: park the live one (evicting the LRU slot
        when full) if there is a pool, then clear the live session."""
        self.store.reset()

    def checkpoint(self, session: Session | None = None) -> None:
        """Remember the non-rewindable components at the current position (the
        generation loop calls this where the prompt ends). Held references only."""
        self.store.checkpoint(session)

    def snapshot(self, session: Session | None = None) -> SessionSnapshot:
        """*session* (None: the live one) as arrays plus its record (speculative
        rollback, disk spill)."""
        return self.store.snapshot(session)

    def restore(self, snapshot: SessionSnapshot, session: Session | None = None) -> None:
        """Make *session* (None: the live one) exactly what :meth:`snapshot`
        captured, its checkpoints included (the previous conversation's are dropped)."""
        self.store.restore(snapshot, session)

    @property
    def session_disk(self) -> DiskTier | None:
        """The disk tier (``session_dir``), for inspection: its index, evictions, refusals."""
        return self.store.disk

    @property
    def disk_losses(self) -> int:
        """Session files deleted for the disk bound that were their conversation's
        only copy, since opening (0 without a session directory)."""
        return self.store.disk_losses

    def without_disk(self) -> AbstractContextManager[None]:
        """The session directory detached for a while (the engine's warm-up):
        nothing is read from it or written to it, and a session that leaves
        memory meanwhile is dropped. A warm-up's throwaway sessions would
        otherwise be written at every start, and a later start's warm-up would
        restore them instead of running the paths it is there to build."""
        return self.store.without_disk()

    def flush(self) -> int:
        """Write every warm session (live and parked) that changed since its last
        write to the session directory; the number written. The server calls it
        after each request (write-through), so a killed process loses nothing.
        A failed write is logged and changes nothing in memory."""
        return self.store.flush()

    def close(self) -> None:
        """At shutdown: write every warm session, then let go of the session directory."""
        self.store.close()

    def checkout(self) -> Session:
        """Hand the live session (just chosen for a request by the caller
        contract) to that request; a fresh, empty live session takes its place.
        Batched requests each hold their own session while they run."""
        return self.store.checkout()

    def fork(self, session: Session) -> Session:
        """A new session holding *session*'s state by reference (MLX arrays are
        never written in place, so neither sees the other's later tokens): the
        other completions of one prompt start from its single prefill. It is not
        the live session nor parked; the engine drops it when its request ends."""
        return self.store.fork(session)

    def checkin(self, session: Session) -> bool:
        """A request is done with *session*: it becomes the live session again,
        and the one live before it is parked (the LRU rule, then the memory cap,
        decide what goes). True if a parked session with content was discarded."""
        return self.store.checkin(session)

    def forget_sessions(self) -> None:
        """Clear the live session and every parked one (after a warm-up)."""
        self.store.forget()

    @property
    def batchable(self) -> bool:
        """Whether sessions decode together in one forward: every component is
        ``batchable`` and the family implements ``turbospark_forward_batch``."""
        return all(c.batchable for c in self.family.components) and bool(
            self._hook.turbospark_forward_batch.get_hookimpls()
        )

    def merge_states(self, sessions: Sequence[Session]) -> State:
        """The sessions' states stacked along the batch axis (one copy each)."""
        return {
            name: type(component).merge([s.state[name] for s in sessions])
            for name, component in sessions[0].state.items()
        }

    def forward_batch(
        self, tokens: mx.array, positions: list[int], state: State, steer: Steer | None = None
    ) -> mx.array:
        """Last-token logits ``(B, vocab)`` for ``tokens`` ``(B, L)``, row ``i`` at
        ``positions[i]..``; *steer* from :meth:`batch_steer` over the same rows.
        Only the state's work for all tokens but the last (:func:`_forwards`)."""
        logits = None
        for begin, end, wanted in _forwards(tokens.shape[1], "last"):
            logits = self._hook.turbospark_forward_batch(
                model=self.model,
                tokens=_tokens(tokens, begin, end),
                positions=[p + begin for p in positions],
                state=state,
                logits=wanted,
                steer=steer,
            )
        assert logits is not None
        return logits

    @staticmethod
    def takes_ragged(state: State) -> bool:
        """Whether *state* (batched) can take rows of different lengths in one
        forward (:meth:`forward_ragged`): every component shifts its rows or
        lets padding pass."""
        return all(isinstance(c, ShiftsRows | PadsRows) for c in state.values())

    def forward_ragged(
        self,
        chunks: Sequence[Sequence[int]],
        positions: list[int],
        state: State,
        steer: Steer | None = None,
    ) -> mx.array:
        """Logits ``(B, vocab)`` at each row's last token for *chunks* of
        different lengths (row ``i`` at ``positions[i]..``), in two forwards
        whatever the lengths: every row's tokens but its last, the shorter rows
        padded at the end (a recurrent component lets the padding pass:
        :class:`~turbospark.state.components.PadsRows`), then the rows shifted
        right past their padding (K/V:
        :class:`~turbospark.state.components.ShiftsRows`) and each row's last
        token. Fed in equal lengths, the shortest row ends in each forward and
        a group of n lengths takes n forwards; on a device bound by the host
        each costs about what a decode step does.

        The state must :meth:`takes_ragged`. If the second forward fails, the
        shift is undone before the error propagates, so the caller's rollback
        (indices held before the first) restores the rows."""
        width = max(len(chunk) for chunk in chunks)
        if all(len(chunk) == width for chunk in chunks):
            return self.forward_batch(mx.array(chunks, dtype=mx.int32), positions, state, steer)
        pads = [width - len(chunk) for chunk in chunks]
        heads = [[*chunk[:-1], *[chunk[-1]] * pad] for chunk, pad in zip(chunks, pads, strict=True)]
        padded = [c for c in state.values() if isinstance(c, PadsRows)]
        for component in padded:
            component.pad([len(chunk) - 1 for chunk in chunks])
        try:
            self._hook.turbospark_forward_batch(
                model=self.model, tokens=mx.array(heads, dtype=mx.int32), positions=positions,
                state=state, logits="none", steer=steer,
            )  # fmt: skip
        finally:
            for component in padded:
                component.pad(None)
        shifted = [c for c in state.values() if isinstance(c, ShiftsRows)]
        for component in shifted:
            component.shift(pads)
        try:
            logits = self._hook.turbospark_forward_batch(
                model=self.model,
                tokens=mx.array([[chunk[-1]] for chunk in chunks], dtype=mx.int32),
                positions=[p + len(chunk) - 1 for p, chunk in zip(positions, chunks, strict=True)],
                state=state,
                logits="last",
                steer=steer,
            )
        except Exception:
            for component in shifted:
                component.shift([-pad for pad in pads])
            raise
        assert logits is not None
        return logits

    # -- tools -------------------------------------------------------------------

    def tool_syntax(self, chat_template: str | None) -> str:
        """The name of the syntax this family's models call tools in, for the
        install's *chat_template* (``turbospark_tool_syntax``; without one, the
        Hermes JSON form). One core does not implement is refused by name."""
        name = self._hook.turbospark_tool_syntax(chat_template=chat_template)
        if name is None:
            return DEFAULT_TOOL_SYNTAX
        if name not in TOOL_SYNTAXES:
            raise InstallError(
                f"family '{self.family.name}' names tool syntax {name!r}; "
                f"turbospark reads {', '.join(TOOL_SYNTAXES)}"
            )
        return name

    # -- embeddings --------------------------------------------------------------

    @property
    def embeds(self) -> bool:
        """Whether the family gives final hidden states (``turbospark_forward_hidden``)."""
        return bool(self._hook.turbospark_forward_hidden.get_hookimpls())

    def embed(self, tokens: Sequence[int], chunk_size: int = 512) -> mx.array:
        """The mean of *tokens*' final-normed hidden states, L2-normalized (float32,
        ``(hidden,)``), computed in a throwaway state in chunks: no session, live
        or parked, is read or changed."""
        if not self.embeds:
            raise InvalidInput(
                f"the {self.family.name} family gives no hidden states (it implements no "
                "turbospark_forward_hidden hook), so it cannot serve embeddings"
            )
        ids = self.check_ids(tokens)
        if len(ids) > self.context_length:
            raise ContextOverflow(
                f"an embedding input is {len(ids)} tokens but the context length is "
                f"{self.context_length}; shorten it or serve with a larger --context-length"
            )
        state = self._new_state()
        total = mx.zeros((self.arch.hidden_size,), dtype=mx.float32)
        for start in range(0, len(ids), chunk_size):
            chunk = mx.array(ids[start : start + chunk_size], dtype=mx.int32)
            hidden = self._hook.turbospark_forward_hidden(
                model=self.model, tokens=chunk, start=start, state=state
            )  # (L, hidden)
            total = total + hidden.astype(mx.float32).sum(axis=0)
            mx.eval(total, *_state_arrays(state))  # one chunk's graph at a time
        mean = total / len(ids)
        return mean / mx.maximum(mx.linalg.norm(mean), 1e-12)

    def batch_steer(self, sessions: Sequence[Session]) -> Steer | None:
        """Each session's own steering, row by row (None when no row steers)."""
        return Steer.of([s.steering for s in sessions], self.dtype)

    # -- steering ------------------------------------------------------------------

    def use_steering(self, steering: SteeringPolicy | None) -> None:
        """The steering of the next prompt (None: the runner's default). Checked
        first, so a refusal changes nothing; a session built under another
        setting is then never reused for it (reason ``steering_changed``)."""
        steering = steering or self.steering
        check_steering(self.family, self.arch, steering)
        self.store.request(steering)

    def _compiled(self, steering: SteeringPolicy) -> Steer | None:
        key = steering.identity
        if key not in self._steers:
            if len(self._steers) >= 16:
                self._steers.clear()
            self._steers[key] = Steer.of([steering], self.dtype)
        return self._steers[key]

    def layer_outputs(self, tokens: Sequence[int]) -> dict[int, mx.array]:
        """The last token's hidden state at every layer's output ``{layer: (hidden,)}``
        for *tokens* run from position 0 on a scratch state, unsteered; no session
        is touched (``turbospark steer extract`` reads these)."""
        if not self.family.steerable:
            raise InvalidInput(cannot_steer(self.family.name))
        ids = self.check_ids(tokens)
        recorder = LastTokenRecorder()
        self._hook.turbospark_forward(
            model=self.model,
            tokens=mx.array(ids, dtype=mx.int32),
            start=0,
            state=self._new_state(),
            vision=None,
            logits="none",
            steer=recorder,
        )
        mx.eval(list(recorder.states.values()))
        return recorder.states

    # -- vision ------------------------------------------------------------------

    def set_prompt_vision(
        self, injections: Sequence[VisionInjection], positions: MropePositions, prompt_len: int
    ) -> None:
        """Install a vision map for the next prompt; validated first, so a bad
        map changes nothing. Taints the live record (ids cannot prove a match)."""
        self._vision = VisionMap.validated(
            list(injections), positions, prompt_len, self.arch.hidden_size
        )
        self.store.live.record.taint()

    def clear_prompt_vision(self) -> None:
        self._vision = None

    @property
    def vision_active(self) -> bool:
        """Whether a vision map is installed: every forward of the one-row path
        takes it (batched forwards take none, so the engine does not batch then)."""
        return self._vision is not None


def _loaded_model(
    pm: pluggy.PluginManager,
    arch: ArchConfig,
    path: Path,
    manifest: Manifest,
    dtype: mx.Dtype,
    streams: StreamedExperts | None,
    group: mx.distributed.Group | None,
) -> nn.Module:
    """The family's model over the install's weights, sharded across *group*
    when given. The dict of loaded tensors lives in this frame alone, so it is
    gone when the model comes back: held any longer (through the warm-up at
    load), every array the model replaces would stay resident beside its
    replacement. The warm-up builds the stacks
    (:func:`~turbospark.layers.stacked.stacked`), which re-point each
    projection at its rows of one concatenated array: the dict's originals
    would be a second copy of every stacked weight (q/k/v, gate and up) at
    the load's peak, as a shard's unsharded tensor would be beside it."""
    weights = load_weights(path, manifest)
    for name in set() if streams is None else streams.tensor_names:
        weights.pop(name, None)  # MLX loads lazily: a tensor dropped here is never read
    model = pm.hook.turbospark_load_model(arch=arch, weights=weights, dtype=dtype, experts=streams)
    if group is not None:
        pm.hook.turbospark_shard_model(model=model, group=group)
        del weights  # before the shards are evaluated: the unsharded tensors go as they are read
        mx.eval(model.parameters())
    return model


@partial(mx.compile, shapeless=True)
def _clip_ids(ids: mx.array, top: int) -> mx.array:
    """Clip and cast as one kernel: the decode step's first launch."""
    return mx.clip(ids, 0, top).astype(mx.int32)


def _state_arrays(state: State) -> list[mx.array]:
    return [a for component in state.values() for a in component.arrays()]


def _forwards(length: int, want: LogitsWanted) -> list[tuple[int, int, LogitsWanted]]:
    """The forwards that feed *length* tokens, as ``(begin, end, logits
    wanted)``: one, or, where only the last token's logits are wanted, the
    others first with none wanted, then the last token alone. Tokens whose
    logits nobody reads then get only the work the state needs: MLX computes
    lazily only what the evaluated arrays (logits and state) depend on, so
    the last state-writing layer's attention and MLP, and every layer after
    it, run for the last token alone, as in mlx-lm's ``generate_step``.
    One forward of them all would run every layer for every token, to read
    one token's logits."""
    if want != "last" or length < 2:
        return [(0, length, want)]
    return [(0, length - 1, "none"), (length - 1, length, "last")]


def _tokens(tokens: mx.array, begin: int, end: int) -> mx.array:
    """Tokens ``[begin, end)`` along the last axis (all of them: the array itself)."""
    if begin == 0 and end == tokens.shape[-1]:
        return tokens
    return tokens[..., begin:end]


def _split_lazy(tokens: Sequence[int | mx.array]) -> tuple[mx.array | None, list[int]]:
    """``(lazy first id or None, the read ids after it)``; a lazy id anywhere
    but first is refused before anything is fed (only the confirmed token can
    still be computing when a forward is queued)."""
    lazy = tokens[0] if tokens and isinstance(tokens[0], mx.array) else None
    known = list(tokens if lazy is None else tokens[1:])
    if any(isinstance(t, mx.array) for t in known):
        raise InvalidInput(
            "only the first token fed may be a lazy (unread) id; read the others first"
        )
    return lazy, known  # type: ignore[return-value]

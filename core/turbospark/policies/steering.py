"""Activation steering: a control vector applied to each layer's output.

The original runtime (and llama.cpp's ``--control-vector``) steers the residual
stream after every layer's feed-forward join. Families call one hook there,
``h = steer(layer, h)``, only when a :class:`Steer` is passed, so a forward
without steering runs no extra op at all.

Layer numbering is llama.cpp's: ``direction.{k}`` of a control-vector file is
applied to the output of block ``k`` (0-based), so block 0 is never steered and
the valid layers of an ``n``-layer model are ``1 .. n-1``
(``llama_adapter_cvec::apply`` stores no data for layer 0).

Modes, for a layer's output ``h`` and direction ``v`` (``u = v / |v|``), scale ``s``:

- ``add``: ``h + s v`` (llama.cpp's behaviour; ``v`` is not normalised);
- ``ablate``: ``h - (h . u) u``, the component along ``v`` removed (``s`` unused);
- ``clamp``: ``h - ((h . u) - s) u``, the component along ``v`` set to ``s``;
- ``renorm``: ``h' = h + s v``, then ``h' |h| / |h'|``, so the norm is kept.

One :class:`Steer` steers every row of a batch with that row's own setting
(or none), and a lone session is a batch of one, so a row computes the same
ops whether it runs alone or beside others.

Cost. A decode step on a GPU is bound by building and launching its kernels,
so steering is built to add as few of either as it can: a family may hand a
layer's last residual join to :func:`joiner`, and in a compiled step
(:func:`~turbospark.layers.fused.runs_compiled`) :meth:`Join.fold` traces the
family's tail and the steering as one compiled function, so a steered layer
makes one compiled call, as an unsteered one does, and ``add`` runs inside the
join's own kernel. On MLX's CUDA backend a one-token step's
``ablate``/``clamp``/``renorm`` is one custom kernel that takes the join
(:mod:`turbospark.layers.cuda.steer`).
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Literal, get_args

import mlx.core as mx
import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from turbospark.contract.protocols import Join, LayerHook, Parts
from turbospark.errors import InvalidInput
from turbospark.layers.cuda import steer as steer_cuda
from turbospark.layers.fused import residual_scale

Mode = Literal["add", "ablate", "clamp", "renorm"]
MODES: tuple[str, ...] = get_args(Mode)


class _HookJoin:
    """:class:`Join` for any hook but a :class:`Steer` (a recorder): the
    family's join, then the hook on its output."""

    __slots__ = ("hook", "layer")

    def __init__(self, hook: LayerHook, layer: int) -> None:
        self.hook, self.layer = hook, layer

    def __call__(self, h: mx.array, update: mx.array, scale: mx.array | None) -> mx.array:
        return self.hook(self.layer, _join(h, update, scale))

    def fold(
        self, parts: Parts, args: tuple[Any, ...], scale: mx.array | None, compiled: bool
    ) -> mx.array:
        return self(*(_compiled(parts) if compiled else parts)(*args), scale)


class _SteerJoin:
    """:class:`Join` for one layer of a :class:`Steer` (made once per layer)."""

    __slots__ = ("entry",)

    def __init__(self, entry: _LayerSteer) -> None:
        self.entry = entry

    def __call__(self, h: mx.array, update: mx.array, scale: mx.array | None) -> mx.array:
        return self.entry.join(h, update, scale)

    def fold(
        self, parts: Parts, args: tuple[Any, ...], scale: mx.array | None, compiled: bool
    ) -> mx.array:
        if not compiled:
            return self.entry.join(*parts(*args), scale)
        return self.entry.fold(parts, args, scale)


def joiner(steer: LayerHook | None, layer: int) -> Join | None:
    """*layer*'s last residual join and its steering as one call; None when
    *steer* is None (the family runs its own join, nothing extra).

    A family that ends its layer with the join ``(h + update) * scale`` (or
    ``h + update``) hands it over instead of calling ``steer(layer, h)``
    after it: ``join.fold(parts, args, scale, compiled)`` from the function
    that computes the two halves, or ``join(h, update, scale)`` from the
    halves. A :class:`Steer` then runs ``add`` inside the join's own kernel
    and, in a compiled step, every mode inside the family's compiled tail;
    any other hook (a recorder) is called on the joined output, as if the
    family had called it."""
    if steer is None:
        return None
    return steer.joiner(layer) if isinstance(steer, Steer) else _HookJoin(steer, layer)


class SteeringPolicy(BaseModel):
    """A validated steering setting: a control vector (per-layer directions),
    its mode, scale and layer range. ``off()`` steers nothing.

    Part of a session's identity (:attr:`identity`): state built under one
    setting is never reused under another (SEMANTICS.md)."""

    model_config = ConfigDict(frozen=True, arbitrary_types_allowed=True)

    mode: Literal["off", "add", "ablate", "clamp", "renorm"] = "off"
    scale: float = 1.0
    layers: tuple[int, int] | None = Field(
        default=None, description="inclusive S:E in llama.cpp's numbering; None = every layer"
    )
    sources: tuple[str, ...] = Field(default=(), description="the files the directions came from")
    # llama.cpp layer index -> float32 (hidden,) direction (several files summed).
    directions: dict[int, np.ndarray] = Field(default_factory=dict, exclude=True, repr=False)
    digest: str = Field(default="", description="sha256 of the directions")

    @classmethod
    def off(cls) -> SteeringPolicy:
        return cls()

    @classmethod
    def from_gguf(
        cls,
        path: str | Path | Sequence[str | Path],
        scale: float = 1.0,
        mode: str = "add",
        layers: tuple[int, int] | str | None = None,
    ) -> SteeringPolicy:
        """Read llama.cpp control-vector file(s); several are summed, as llama.cpp does."""
        from turbospark.policies.control_vectors import read_control_vector

        paths = [path] if isinstance(path, str | Path) else list(path)
        if not paths:
            raise InvalidInput("no control-vector file given; pass --steering FILE")
        _check_settings(scale, mode)
        span = parse_layers(layers)
        summed: dict[int, np.ndarray] = {}
        for one in paths:
            for layer, vector in read_control_vector(Path(one)).items():
                if summed and len(vector) != len(next(iter(summed.values()))):
                    raise InvalidInput(
                        f"{one}: its directions have {len(vector)} values, the other files' "
                        f"{len(next(iter(summed.values())))}; combine vectors made for one model"
                    )
                summed[layer] = summed.get(layer, 0) + vector
        return cls.from_directions(summed, scale, mode, span, tuple(str(p) for p in paths))

    @classmethod
    def from_directions(
        cls,
        directions: Mapping[int, np.ndarray],
        scale: float = 1.0,
        mode: str = "add",
        layers: tuple[int, int] | str | None = None,
        sources: tuple[str, ...] = (),
    ) -> SteeringPolicy:
        """A policy from in-memory directions keyed by llama.cpp layer index."""
        _check_settings(scale, mode)
        span = parse_layers(layers)
        clean = {}
        for layer, vector in sorted(directions.items()):
            array = np.asarray(vector, dtype=np.float32).reshape(-1)
            if layer < 1:
                raise InvalidInput(
                    f"direction.{layer}: control-vector layers are numbered from 1 (llama.cpp); "
                    "rename the tensor"
                )
            if not np.isfinite(array).all():
                raise InvalidInput(
                    f"direction.{layer} holds a non-finite value (nan or inf); rebuild the vector"
                )
            clean[layer] = array
        if not clean:
            raise InvalidInput("the control vector has no direction.N tensor; rebuild the vector")
        digest = hashlib.sha256()
        for layer, array in clean.items():
            digest.update(f"{layer}:".encode() + array.tobytes())
        return cls(
            mode=mode,
            scale=float(scale),
            layers=span,
            sources=sources,
            directions=clean,
            digest=digest.hexdigest(),
        )

    def with_settings(
        self,
        scale: float | None = None,
        mode: str | None = None,
        layers: tuple[int, int] | str | None = None,
    ) -> SteeringPolicy:
        """The same vector under other settings (a request's override); validated."""
        if self.mode == "off":
            raise InvalidInput(
                "a steering override needs a control vector; serve with --steering FILE"
            )
        return SteeringPolicy.from_directions(
            self.directions,
            self.scale if scale is None else scale,
            self.mode if mode is None else mode,
            self.layers if layers is None else layers,
            self.sources,
        )

    @property
    def identity(self) -> str | None:
        """What makes two settings steer alike; None while off."""
        if self.mode == "off":
            return None
        return json.dumps(
            {"mode": self.mode, "scale": self.scale, "layers": self.layers, "sha256": self.digest}
        )

    def describe(self) -> str:
        """One line for people (the sessions view, refusals)."""
        if self.mode == "off":
            return "off"
        span = "all layers" if self.layers is None else f"layers {self.layers[0]}:{self.layers[1]}"
        return f"{self.mode} x{self.scale:g} ({span}, vector {self.digest[:12]})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SteeringPolicy) and self.identity == other.identity

    def __hash__(self) -> int:
        return hash(self.identity)

    def check_model(self, family: str, steerable: bool, hidden_size: int, num_layers: int) -> None:
        """Refuse a setting this model cannot take, by name; nothing changes on refusal."""
        if self.mode == "off":
            return
        if not steerable:
            raise InvalidInput(cannot_steer(family))
        width = len(next(iter(self.directions.values())))
        if width != hidden_size:
            raise InvalidInput(
                f"the control vector has {width} values per layer but the model's hidden size "
                f"is {hidden_size}; use a vector made for this model"
            )
        top = num_layers - 1
        beyond = [k for k in self.directions if k > top]
        if beyond:
            raise InvalidInput(
                f"the control vector has direction.{max(beyond)} but this model's steerable "
                f"layers are 1..{top}; use a vector made for this model"
            )
        if self.layers is not None and self.layers[1] > top:
            raise InvalidInput(
                f"--steering-layers {self.layers[0]}:{self.layers[1]} is outside the model; "
                f"its steerable layers are 1..{top}"
            )

    def covered(self) -> dict[int, np.ndarray]:
        """The directions this setting applies: inside the layer range and non-zero
        (a zero direction has no axis to ablate, clamp or renormalise along)."""
        low, high = self.layers or (1, max(self.directions, default=0))
        return {k: v for k, v in self.directions.items() if low <= k <= high and np.any(v != 0)}


def cannot_steer(family: str) -> str:
    return (
        f"family '{family}' cannot steer: its forward does not apply steering at each "
        "layer's output (its FamilySpec is not steerable); run without --steering"
    )


def parse_layers(layers: tuple[int, int] | str | None) -> tuple[int, int] | None:
    """``"S:E"`` or ``(S, E)`` (inclusive, llama.cpp numbering from 1) -> a checked pair."""
    if layers is None:
        return None
    if isinstance(layers, str):
        text = layers
        start, sep, end = text.partition(":")
        if not sep or not start.strip().isdigit() or not end.strip().isdigit():
            raise InvalidInput(
                f"steering layers {text!r} must be S:E (two integers, inclusive), e.g. 10:20"
            )
        layers = (int(start), int(end))
    start, end = (int(x) for x in layers)
    if not 1 <= start <= end:
        raise InvalidInput(
            f"steering layers {start}:{end} are outside any model: they are numbered from 1 "
            "(llama.cpp) and S must not exceed E"
        )
    return start, end


def _check_settings(scale: float, mode: str) -> None:
    if mode not in MODES:
        raise InvalidInput(f"unknown steering mode {mode!r}; use one of {', '.join(MODES)}")
    if isinstance(scale, bool) or not isinstance(scale, int | float) or not math.isfinite(scale):
        raise InvalidInput(f"steering scale {scale!r} must be a finite number, e.g. 0.5")


@dataclass(frozen=True)
class _LayerSteer:
    """One layer's per-row arrays (``B`` rows, broadcast over ``(B, L, hidden)``):
    ``u`` unit directions, ``a`` 1 where the component along ``u`` is replaced,
    ``t`` what it is replaced by, ``w`` the added vector, ``r`` renormalising
    rows. A row without steering has zeros everywhere, which is exact identity.
    An array is None when no row needs it, so its ops are never built."""

    u: mx.array | None  # (B, 1, hidden)
    a: mx.array | None  # (B, 1, 1)
    t: mx.array | None  # (B, 1, 1)
    w: mx.array | None  # (B, 1, hidden)
    r: mx.array | None  # (B, 1, 1) bool; None when every row renormalises or none does
    renorm: bool
    # (u, w, coef) for the one-launch CUDA kernel (one-token steps; None elsewhere).
    one_launch: tuple[mx.array, mx.array, mx.array] | None = None

    # parts -> its compiled fold for this layer (a dict lookup per step, not
    # functools.cache's hash of every flag).
    folds: dict[Parts, Callable[..., mx.array]] = field(
        default_factory=dict, repr=False, compare=False
    )

    def fold(self, parts: Parts, args: tuple[Any, ...], scale: mx.array | None) -> mx.array:
        """``self.join(*parts(*args), scale)`` as one compiled call (the family's
        tail, its join and this steering traced together); on CUDA a layer
        with the one-launch kernel keeps it (:meth:`join` takes the halves)."""
        if self.one_launch is not None:
            return self.join(*_compiled(parts)(*args), scale)
        flags, arrays = self.held
        run = self.folds.get(parts)
        if run is None:
            run = self.folds[parts] = _folded(parts, flags, self.renorm)
        return run(args, scale, arrays)

    def join(self, h: mx.array, update: mx.array, scale: mx.array | None) -> mx.array:
        """``self((h + update) * scale)``; ``add`` in the join's one fused kernel,
        and on CUDA a one-token step of any mode in the one-launch kernel."""
        if self.u is None and not self.renorm:
            return (
                _join(h, update, scale) if self.w is None else _join_add(h, update, scale, self.w)
            )
        if self.one_launch is not None and h.shape[1] == 1 and _one_element(scale):
            return steer_cuda.steer_rows(h, *self.one_launch, update=update, scale=scale)
        return self._steered_join(h, update, scale)

    def __call__(self, h: mx.array) -> mx.array:
        if self.u is None and not self.renorm:
            return h if self.w is None else h + self.w  # add: one op, nothing to fuse
        if self.one_launch is not None and h.shape[1] == 1:
            return steer_cuda.steer_rows(h, *self.one_launch)
        flags, arrays = self.held
        return _kernel(flags, self.renorm)(h, *arrays)

    def _steered_join(self, h: mx.array, update: mx.array, scale: mx.array | None) -> mx.array:
        flags, arrays = self.held
        if scale is None:
            return _kernel(flags, self.renorm, "unscaled")(h, update, *arrays)
        return _kernel(flags, self.renorm, "scaled")(h, update, scale, *arrays)

    @cached_property
    def held(self) -> tuple[tuple[bool, ...], list[mx.array]]:
        """Which of ``u, t, a, w, r`` this layer holds (the compiled function's
        key) and those arrays, in that order (its arguments); once per layer."""
        every = (self.u, self.t, self.a, self.w, self.r)
        return tuple(a is not None for a in every), [a for a in every if a is not None]


# A layer no row steers: its join alone (in a compiled step, traced with the tail).
_UNSTEERED = _LayerSteer(u=None, a=None, t=None, w=None, r=None, renorm=False)


def _one_element(scale: mx.array | None) -> bool:
    """The one-launch kernel reads a join's scale as one number (a layer scalar)."""
    return scale is None or scale.size == 1


def _join(h: mx.array, update: mx.array, scale: mx.array | None) -> mx.array:
    """A family's last residual join, exactly as the families compute it."""
    return h + update if scale is None else residual_scale(h, update, scale)


@functools.partial(mx.compile, shapeless=True)
def _join_scaled_add(h: mx.array, update: mx.array, scale: mx.array, w: mx.array) -> mx.array:
    return (h + update) * scale + w


@functools.partial(mx.compile, shapeless=True)
def _join_unscaled_add(h: mx.array, update: mx.array, w: mx.array) -> mx.array:
    return h + update + w


def _join_add(h: mx.array, update: mx.array, scale: mx.array | None, w: mx.array) -> mx.array:
    """The join then ``+ w``, op for op, in one fused kernel."""
    if scale is None:
        return _join_unscaled_add(h, update, w)
    return _join_scaled_add(h, update, scale, w)


def steered(
    h: mx.array, held: Sequence[bool], renorm: bool, arrays: Sequence[mx.array]
) -> mx.array:
    """The steering math on a layer's output ``h``, over arrays only, so it
    traces into a compiled function: *held* says which of ``u, t, a, w, r``
    (see :class:`_LayerSteer`) *arrays* holds, in that order."""
    given = iter(arrays)
    u, t, a, w, r = (next(given) if f else None for f in held)
    out = h
    if u is not None:
        along = (h * u).sum(axis=-1, keepdims=True)  # (B, L, 1)
        if t is not None:
            along = along - t
        if a is not None:
            along = a * along
        out = out - along * u
    if w is not None:
        out = out + w
    if renorm:
        ratio = (h * h).sum(axis=-1, keepdims=True) / (out * out).sum(axis=-1, keepdims=True)
        kept = out * mx.sqrt(ratio)
        out = kept if r is None else mx.where(r, kept, out)
    return out


@functools.cache
def _kernel(
    held: tuple[bool, ...], renorm: bool, joined: Literal["no", "unscaled", "scaled"] = "no"
) -> Callable[..., mx.array]:
    """One layer's steering as a single compiled function (its elementwise ops
    fused, so ``ablate``/``clamp``/``renorm`` cost about what ``add`` does); one
    per combination of the arrays a :class:`_LayerSteer` holds (*held*: which
    of ``u, t, a, w, r``, :attr:`_LayerSteer.held`). *joined*: the
    function takes the family's last join first (``h``, ``update`` and, when
    scaled, ``scale``), so the join fuses with the steering's first ops."""

    def apply(*arrays: mx.array) -> mx.array:
        if joined == "no":
            return steered(arrays[0], held, renorm, arrays[1:])
        if joined == "unscaled":
            return steered(arrays[0] + arrays[1], held, renorm, arrays[2:])
        return steered(residual_scale(*arrays[:3]), held, renorm, arrays[3:])

    return mx.compile(apply)


@functools.cache
def _folded(parts: Parts, held: tuple[bool, ...], renorm: bool) -> Callable[..., mx.array]:
    """A family's tail *parts*, its last join and one layer's steering as one
    compiled function, ``(args, scale, arrays) -> out``: a steered layer's
    step makes one compiled call where the tail, then :func:`_kernel`, made
    two (each call costs host time to build, which bounds a GPU's decode).
    One per tail and combination of held arrays, as :func:`_kernel`; *held* all
    False is the join alone (a layer the :class:`Steer` does not cover)."""

    def apply(
        args: tuple[Any, ...], scale: mx.array | None, arrays: Sequence[mx.array]
    ) -> mx.array:
        return steered(_join(*parts(*args), scale), held, renorm, arrays)

    return mx.compile(apply)


@functools.cache
def _compiled(parts: Parts) -> Callable[..., tuple[mx.array, mx.array]]:
    """*parts* compiled alone (its halves for a CUDA kernel or another hook)."""
    return mx.compile(parts)


class Steer:
    """Compiled steering for ``B`` rows: ``steer(layer, h)`` is the hook families call.

    Build with :meth:`of` from each row's :class:`SteeringPolicy` (``None`` or
    ``off`` for a row that is not steered); it returns None when no row steers,
    and then the families' forwards run exactly as without steering."""

    def __init__(self, layers: dict[int, _LayerSteer]) -> None:
        self.layers = layers
        self.joins: dict[int, Join] = {}

    def __call__(self, layer: int, h: mx.array) -> mx.array:
        entry = self.layers.get(layer)
        return h if entry is None else entry(h)

    def joiner(self, layer: int) -> Join:
        """*layer*'s :class:`Join` (see :func:`joiner`), made once."""
        join = self.joins.get(layer)
        if join is None:
            join = self.joins[layer] = _SteerJoin(self.layers.get(layer, _UNSTEERED))
        return join

    @classmethod
    def of(cls, rows: Sequence[SteeringPolicy | None], dtype: mx.Dtype) -> Steer | None:
        covered = [{} if p is None or p.mode == "off" else p.covered() for p in rows]
        modes = [None if p is None else p.mode for p in rows]
        every = sorted({k for c in covered for k in c})
        if not every:
            return None
        width = len(next(v for c in covered for v in c.values()))
        layers = {}
        for k in every:
            u = np.zeros((len(rows), 1, width), np.float32)
            w = np.zeros_like(u)
            a = np.zeros((len(rows), 1, 1), np.float32)
            t = np.zeros_like(a)
            r = np.zeros((len(rows), 1, 1), bool)
            for i, policy in enumerate(rows):
                v = covered[i].get(k)
                if v is None:
                    continue
                s, mode = policy.scale, modes[i]
                if mode in ("add", "renorm"):
                    w[i, 0] = s * v
                    r[i] = mode == "renorm"
                else:
                    u[i, 0] = v / np.linalg.norm(v)
                    a[i] = 1.0
                    t[i] = s if mode == "clamp" else 0.0
            projects = bool(a.any())
            one_launch = None
            if (projects or r.any()) and steer_cuda.available():
                coef = np.concatenate([a, t, r.astype(np.float32)], axis=-1)  # (B, 1, 3)
                one_launch = (mx.array(u, dtype=dtype), mx.array(w, dtype=dtype), mx.array(coef))
            layers[k] = _LayerSteer(
                u=mx.array(u, dtype=dtype) if projects else None,
                a=None if not projects or a.all() else mx.array(a, dtype=dtype),
                t=mx.array(t, dtype=dtype) if t.any() else None,
                w=mx.array(w, dtype=dtype) if w.any() else None,
                r=None if r.all() or not r.any() else mx.array(r),
                renorm=bool(r.any()),
                one_launch=one_launch,
            )
        return cls(layers)


class LastTokenRecorder:
    """A :class:`LayerHook` that changes nothing and keeps the last token's
    hidden state at every layer's output (what ``steer extract`` reads)."""

    def __init__(self) -> None:
        self.states: dict[int, mx.array] = {}

    def __call__(self, layer: int, h: mx.array) -> mx.array:
        self.states[layer] = h[0, -1]  # (hidden,)
        return h

"""What :meth:`Runner.open <turbospark.generation.runner.Runner.open>` refuses
before any weight is read: options a family or an install cannot serve, each
named with what to run instead, so a refusal is instant and changes nothing.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pluggy

from turbospark.contract.hookspecs import ArchConfig, FamilySpec
from turbospark.errors import InvalidInput, SessionPoolUnsupported
from turbospark.loading.install import Manifest, tensor_names
from turbospark.policies import SteeringPolicy
from turbospark.state.kv import KVQuantization


def to_dtype(value: str | mx.Dtype) -> mx.Dtype:
    if isinstance(value, mx.Dtype):
        return value
    dtype = getattr(mx, str(value).removeprefix("mlx.core."), None)
    if not isinstance(dtype, mx.Dtype):
        raise InvalidInput(f"unknown dtype {value!r}; use bfloat16, float16 or float32")
    return dtype


def check_kv_quantization(
    spec: FamilySpec, arch: ArchConfig, bits: int | None, group_size: int
) -> KVQuantization | None:
    """The K/V setting ``--kv-bits``/``--kv-group-size`` ask for, refused
    where MLX cannot quantize to it, where the group size does not divide an
    attention head dim, or where the family attends over its K/V itself."""
    quant = KVQuantization.of(bits, group_size)
    if quant is None:
        return None
    if not spec.kv_quantizable:
        raise InvalidInput(
            f"--kv-bits {bits}: family '{spec.name}' attends over its K/V itself (not through "
            "turbospark.layers.attention), so it cannot read a quantized K/V cache; drop "
            "--kv-bits to serve it"
        )
    quant.check_head_dims(arch.attention_head_dims(), spec.name)
    return quant


def check_steering(spec: FamilySpec, arch: ArchConfig, steering: SteeringPolicy) -> None:
    steering.check_model(spec.name, spec.steerable, arch.hidden_size, arch.num_hidden_layers)


def check_shardable(
    pm: pluggy.PluginManager,
    spec: FamilySpec,
    group: mx.distributed.Group,
    session_dir: str | Path | None,
) -> None:
    """Refuse tensor parallelism a family or these options cannot do, before
    any weight is read."""
    if not pm.hook.turbospark_shard_model.get_hookimpls():
        raise InvalidInput(
            f"family '{spec.name}' cannot be sharded across {group.size()} processes: it does "
            "not implement turbospark_shard_model; run it in one process (no mlx.launch -n N)"
        )
    if session_dir is not None:
        raise InvalidInput(
            "session_dir with a group of processes: each process holds only its shard of a "
            "session, and the disk tier's files hold whole ones; drop --session-dir, or run "
            "replicas instead (docs/SCALING.md)"
        )


def check_disk_options(
    spec: FamilySpec, slots: int, session_dir: str | Path | None, max_bytes: int | None
) -> None:
    if session_dir is None:
        if max_bytes is not None:
            raise InvalidInput(
                "max_session_disk_bytes bounds the session_dir; pass session_dir too"
            )
        return
    if slots < 2:
        raise InvalidInput(
            f"session_dir extends the session pool, but session_slots is {slots}; "
            "use session_slots 2 or more"
        )
    if max_bytes is not None and max_bytes < 0:
        raise InvalidInput(f"max_session_disk_bytes must be 0 or more, got {max_bytes}")
    unsaved = [c.name for c in spec.components if not c.persistable]
    if unsaved:
        raise SessionPoolUnsupported(
            f"session_dir needs every state component of family '{spec.name}' to be "
            f"persistable, but {', '.join(unsaved)} cannot be written (see {spec.state_source})"
        )


def check_mtp(spec: FamilySpec, pm: pluggy.PluginManager, path: Path, manifest: Manifest) -> None:
    """``DraftPolicies.mtp`` needs a family with an MTP head (both optional hooks)
    and a checkpoint that carries its weights; checked before any weight is read."""
    if not has_mtp_hooks(pm):
        raise InvalidInput(
            f"DraftPolicies.mtp: family '{spec.name}' has no multi-token-prediction head "
            "(hooks turbospark_mtp_head and turbospark_forward_with_hidden); use "
            "DraftPolicies.ngram() or off()"
        )
    if not any(name.startswith("mtp.") for name in tensor_names(path, manifest)):
        raise InvalidInput(
            f"DraftPolicies.mtp: the install at {path} carries no mtp.* weights (the "
            "checkpoint's multi-token-prediction head); use DraftPolicies.ngram() or off()"
        )


def has_mtp_hooks(pm: pluggy.PluginManager) -> bool:
    """Whether the family implements both hooks ``DraftPolicies.mtp`` drafts through."""
    hook = pm.hook
    return bool(
        hook.turbospark_mtp_head.get_hookimpls()
        and hook.turbospark_forward_with_hidden.get_hookimpls()
    )


def check_rollback(spec: FamilySpec, mode: str) -> None:
    """Drafting needs every component to drop rejected tokens: rewind, or trace."""
    stuck = [c.name for c in spec.components if c.rewindable is False and not c.traceable]
    if stuck:
        raise InvalidInput(
            f"the {mode!r} draft policy needs every state component of family "
            f"'{spec.name}' to roll back a rejected draft, but {', '.join(stuck)} can neither "
            f"rewind nor trace (see {spec.state_source}); use DraftPolicies.off()"
        )


def check_pool_capability(spec: FamilySpec, swappable: list[str], slots: int) -> None:
    missing = [c.name for c in spec.components if c.name not in swappable]
    if missing:
        raise SessionPoolUnsupported(
            f"--session-slots {slots} needs every state component of family '{spec.name}' to be "
            f"swappable, but {', '.join(missing)} cannot be parked (see {spec.state_source}); "
            "run with --session-slots 1"
        )

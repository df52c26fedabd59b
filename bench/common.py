"""What every benchmark shares: the machine record, model sizes, cached installs, timing.

Benchmarks compare two engines on the *same* install directory and the same
process settings, so the only thing that differs between two timed runs is the
engine. The machine record (cores, CPU model, device, BLAS) travels with every
result, because a number without it cannot be compared with anything.
"""

from __future__ import annotations

import os
import platform
import shutil
import statistics
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx

from turbospark.loading.install import MANIFEST, build_synthetic_install
from turbospark.loading.synthetic import SYNTHETIC_FORMAT

FAMILIES = ("gemma4", "qwen_gdn")
DEFAULT_CACHE = Path.home() / ".cache" / "turbospark" / "bench"

# Model sizes per family. "tiny" is the smoke test's; "small" and "medium" are
# the forward benchmark's; "chat" serves the interleaved and HTTP workloads:
# its vocabulary is the synthetic tokenizer's special tokens, its 96 characters
# and (byte-level) a merge, with no reserved ids, so every generated id decodes
# to text (or stops) and a streamed first token is never an invisible reserved
# token on one server and not the other.
SIZES: dict[str, dict[str, dict[str, Any]]] = {
    "gemma4": {
        "tiny": {"vocab_size": 128, "num_layers": 2, "sliding_window": 16},
        "small": {
            "vocab_size": 1024,
            "num_layers": 4,
            "hidden_size": 256,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 64,
            "global_head_dim": 128,
            "intermediate_size": 1024,
            "hidden_size_per_layer_input": 32,
            "sliding_window": 128,
        },
        "medium": {
            "vocab_size": 8192,
            "num_layers": 8,
            "hidden_size": 1024,
            "num_attention_heads": 8,
            "num_key_value_heads": 2,
            "head_dim": 128,
            "global_head_dim": 256,
            "intermediate_size": 4096,
            "hidden_size_per_layer_input": 64,
            "sliding_window": 512,
        },
        "chat": {
            "vocab_size": 102,
            "num_layers": 4,
            "hidden_size": 256,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 64,
            "global_head_dim": 128,
            "intermediate_size": 1024,
            "hidden_size_per_layer_input": 32,
            "sliding_window": 128,
        },
    },
    "qwen_gdn": {
        "tiny": {"vocab_size": 128, "num_layers": 4},
        "small": {
            "vocab_size": 1024,
            "num_layers": 4,
            "hidden_size": 256,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 64,
            "intermediate_size": 768,
            "linear_num_value_heads": 8,
            "linear_num_key_heads": 4,
            "linear_key_head_dim": 32,
            "linear_value_head_dim": 32,
        },
        "medium": {
            "vocab_size": 8192,
            "num_layers": 8,
            "hidden_size": 1024,
            "num_attention_heads": 8,
            "num_key_value_heads": 2,
            "head_dim": 128,
            "intermediate_size": 3072,
            "linear_num_value_heads": 16,
            "linear_num_key_heads": 8,
            "linear_key_head_dim": 64,
            "linear_value_head_dim": 64,
        },
        "chat": {
            "vocab_size": 102,
            "num_layers": 4,
            "hidden_size": 256,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 64,
            "intermediate_size": 768,
            "linear_num_value_heads": 8,
            "linear_num_key_heads": 4,
            "linear_key_head_dim": 32,
            "linear_value_head_dim": 32,
        },
    },
}


# GPU runs: shapes of real ~1B checkpoints (random bf16 weights). "chat_large"
# is the chat workload's exact-tokenizer vocabulary at that shape.
_LARGE: dict[str, dict[str, Any]] = {
    "gemma4": {
        "vocab_size": 32768,
        "num_layers": 16,
        "hidden_size": 2048,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "global_head_dim": 512,
        "intermediate_size": 8192,
        "hidden_size_per_layer_input": 128,
        "sliding_window": 512,
    },
    "qwen_gdn": {
        "vocab_size": 32768,
        "num_layers": 16,
        "hidden_size": 2048,
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "intermediate_size": 6144,
        "linear_num_value_heads": 32,
        "linear_num_key_heads": 16,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
    },
}
# The host cost of a decode step (bench/host_cost.py): the large sizes' layer
# layout (16 layers, the same kinds, KV sharing and head counts) at tiny widths,
# so on a CPU the step is all host work: graph building and per-kernel dispatch.
_HOST: dict[str, dict[str, Any]] = {
    "gemma4": {
        **_LARGE["gemma4"],
        "vocab_size": 256,
        "hidden_size": 64,
        "head_dim": 16,
        "global_head_dim": 32,
        "intermediate_size": 128,
        "hidden_size_per_layer_input": 8,
    },
    "qwen_gdn": {
        **_LARGE["qwen_gdn"],
        "vocab_size": 256,
        "hidden_size": 64,
        "head_dim": 16,
        "intermediate_size": 128,
        "linear_key_head_dim": 8,
        "linear_value_head_dim": 8,
    },
}
# Tensor parallelism (bench/tp.py): about 8B parameters, every head count even.
_TP8B: dict[str, dict[str, Any]] = {
    "gemma4": {
        "vocab_size": 32768,
        "num_layers": 32,
        "hidden_size": 4096,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "global_head_dim": 256,
        "intermediate_size": 14336,
        "hidden_size_per_layer_input": 0,
        "sliding_window": 1024,
    },
    "qwen_gdn": {
        "vocab_size": 32768,
        "num_layers": 32,
        "hidden_size": 4096,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "intermediate_size": 14336,
        "linear_num_value_heads": 32,
        "linear_num_key_heads": 16,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
    },
}
_HOST_WIDTHS = (
    "vocab_size", "hidden_size", "head_dim", "global_head_dim", "intermediate_size",
    "linear_key_head_dim", "linear_value_head_dim",
)  # fmt: skip
for _family, _dims in _TP8B.items():
    SIZES[_family]["tp8b"] = _dims
    # tp8b's layer layout at the host sizes' widths: on a GPU its decode step
    # is what the host alone allows at that depth (its kernels are tiny).
    SIZES[_family]["tp8b_host"] = {
        **_dims,
        **{k: v for k, v in _HOST[_family].items() if k in _HOST_WIDTHS},
    }
for _family, _dims in _HOST.items():
    SIZES[_family]["host"] = _dims
for _family, _dims in _LARGE.items():
    SIZES[_family]["large"] = _dims
    SIZES[_family]["chat_large"] = {**_dims, "vocab_size": SIZES[_family]["chat"]["vocab_size"]}

# The server's host-bound proxy (bench/server_step.py): chat_large's depth
# (16 layers, so the step builds as many ops as on the H200) at widths so small
# that the CPU computes a step in about the time the H200 does, and the step is
# bound by the host's Python and graph work, as it is there.
SIZES["gemma4"]["chat_host"] = {
    "vocab_size": SIZES["gemma4"]["chat"]["vocab_size"],
    "num_layers": 16,
    "hidden_size": 64,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "global_head_dim": 64,
    "intermediate_size": 128,
    "hidden_size_per_layer_input": 8,
    "sliding_window": 512,
}
SIZES["qwen_gdn"]["chat_host"] = {
    "vocab_size": SIZES["qwen_gdn"]["chat"]["vocab_size"],
    "num_layers": 16,
    "hidden_size": 64,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "intermediate_size": 128,
    "linear_num_value_heads": 4,
    "linear_num_key_heads": 2,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
}

# The expert cache's benchmark (bench/experts.py): MoE installs whose routed
# experts are most of the weights (no PLE, as in the MoE releases). "moe":
# ~200 MB of float32 experts against ~10 MB of the rest, for the CPU;
# "moe_large": ~3.6 GB of bfloat16 experts against ~0.85 GB, for a GPU.
SIZES["gemma4"]["tiny_moe"] = {
    **SIZES["gemma4"]["tiny"],
    "num_experts": 8,
    "top_k_experts": 2,
    "hidden_size_per_layer_input": 0,
}
SIZES["gemma4"]["moe"] = {
    "vocab_size": 1024,
    "num_layers": 4,
    "hidden_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "global_head_dim": 128,
    "intermediate_size": 256,
    "hidden_size_per_layer_input": 0,
    "sliding_window": 128,
    "num_experts": 32,
    "top_k_experts": 4,
    "moe_intermediate_size": 512,
}
SIZES["gemma4"]["moe_large"] = {
    **_LARGE["gemma4"],
    "num_layers": 12,
    "intermediate_size": 2048,
    "hidden_size_per_layer_input": 0,
    "num_experts": 32,
    "top_k_experts": 4,
    "moe_intermediate_size": 768,
}


# qwen4_exp has no upstream (no mlx-lm to compare with), so it is not in
# FAMILIES; bench/batch_decode.py measures it against itself. QSA budgets are
# small enough that a few hundred tokens reach the sparse regime: "small" is
# dense while a query's position + 1 <= 4 * 16 + 64 = 128, "large" while
# <= 4 * 64 + 256 = 512.
SIZES["qwen4_exp"] = {
    "tiny": {"vocab_size": 128},
    "small": {
        **SIZES["qwen_gdn"]["small"],
        "full_attention_interval": 2,
        "index_head_dim": 32,
        "qsa_block_size": 16,
        "qsa_top_blocks": 4,
        "qsa_local_window": 64,
        "ngram_buckets": 4096,
        "hidden_size_per_layer_input": 32,
    },
    "large": {
        **_LARGE["qwen_gdn"],
        "full_attention_interval": 4,
        "index_head_dim": 64,
        "qsa_block_size": 64,
        "qsa_top_blocks": 4,
        "qsa_local_window": 256,
        "ngram_buckets": 65536,
        "hidden_size_per_layer_input": 128,
        "ple_layer": 3,
    },
}


def default_dtype() -> str:
    """bfloat16 where a GPU runs the model; float32 on the CPU, where MLX's
    bfloat16 matmul has no BLAS path (~10x slower) and ``gather_mm`` (MoE)
    only supports float32."""
    return "bfloat16" if mx.default_device() == mx.gpu else "float32"


def install(family: str, size: str, dtype: str, cache_dir: Path, mtp: bool = False) -> Path:
    """The cached random-weight install of *family* at *size* (built on first use);
    *mtp*: with a multi-token-prediction head (qwen_gdn's ``mtp=True``), a separate
    install, so every other benchmark's weights stay as they were."""
    dims = {**SIZES[family][size], **({"mtp": True} if mtp else {})}
    tag = "-mtp" if mtp else ""
    path = cache_dir / f"{family}-{size}{tag}-{dtype}-v{SYNTHETIC_FORMAT}"
    if not (path / MANIFEST).is_file():
        build_synthetic_install(
            family, path, model_id=f"bench-{family}-{size}{tag}", dtype=dtype, seed=0, **dims
        )
    return path


def blas_setting() -> str:
    """Which BLAS MLX's CPU matmuls use: an ``LD_PRELOAD``-ed one, or the wheel's own.

    The Linux ``mlx[cpu]`` wheel bundles the reference BLAS; preloading an
    optimised one (OpenBLAS) replaces its symbols for every engine in the
    process and in the server subprocesses, which inherit the environment.
    """
    preload = os.environ.get("LD_PRELOAD", "")
    libs = [p for p in preload.split(":") if "blas" in p.lower()]
    return f"LD_PRELOAD={','.join(libs)}" if libs else "bundled reference BLAS (no LD_PRELOAD)"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# What nvidia-smi says of GPU 0 (its clocks, power, temperature and the
# reasons it holds its clocks down: a driver before 535 names that field
# ``clocks_throttle_reasons.active``), in this order.
GPU_FIELDS = (
    "clocks.sm",
    "clocks.mem",
    "power.draw",
    "temperature.gpu",
    "clocks_event_reasons.active",
)
_OLDER_REASONS = "clocks_throttle_reasons.active"


def gpu_state() -> dict[str, str] | None:
    """GPU 0's clocks, power and temperature now, as nvidia-smi reports them,
    so a slow repetition can be told from a clock held down; None without
    nvidia-smi (or where it fails)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    for reasons in (GPU_FIELDS[-1], _OLDER_REASONS):
        query = ",".join((*GPU_FIELDS[:-1], reasons))
        try:
            out = subprocess.run(
                [smi, "--id=0", f"--query-gpu={query}", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=10, check=True,
            )  # fmt: skip
        except (OSError, subprocess.SubprocessError):
            continue
        values = [v.strip() for v in out.stdout.strip().split(",")]
        if len(values) == len(GPU_FIELDS):
            return dict(zip(GPU_FIELDS, values, strict=True))
    return None


def machine() -> dict[str, Any]:
    """The record that makes a result comparable: where and how it ran."""
    load = os.getloadavg() if hasattr(os, "getloadavg") else (0.0, 0.0, 0.0)
    return {
        "cpu_model": _cpu_model(),
        "cores": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "mlx": mx.__version__,
        "mlx_lm": _version("mlx-lm"),
        "device": str(mx.default_device()),
        "device_name": str(mx.device_info().get("device_name", "")),  # the GPU's model there
        "blas": blas_setting(),
        "load_average_at_start": [round(x, 2) for x in load],
        "gpu_at_start": gpu_state(),
    }


def _version(dist: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return "not installed"


def interleaved(
    engines: dict[str, Callable[[], dict[str, float]]], reps: int
) -> dict[str, list[dict[str, float]]]:
    """Run each engine once as warm-up, then *reps* rounds alternating which
    engine goes first, so slow drift (other load, thermal) hits both equally."""
    names = list(engines)
    for name in names:
        engines[name]()
    results: dict[str, list[dict[str, float]]] = {name: [] for name in names}
    for rep in range(reps):
        order = names if rep % 2 == 0 else names[::-1]
        for name in order:
            results[name].append(engines[name]())
    return results


def median_of(rows: list[dict[str, float]], key: str) -> float:
    return statistics.median(row[key] for row in rows)


def random_tokens(n: int, vocab: int, seed: int, low: int = 6) -> list[int]:
    """*n* reproducible token ids above the specials."""
    import random

    rng = random.Random(seed)
    return [rng.randrange(low, vocab) for _ in range(n)]

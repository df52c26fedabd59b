"""Quantized routed experts: a Gemma 4 MoE checkpoint quantized by mlx-lm's own
convert gives mlx-lm's logits on the same directory, resident or streamed
through any number of slots, batched or alone; the slots hold packed experts
and count their bytes as such; bad packings are refused by name."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm import convert
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load_model

from turbospark import ExpertCacheSlots, Runner, build_synthetic_install
from turbospark.errors import InstallError, InvalidInput
from turbospark.layers.experts import PackedExperts
from turbospark.layers.packing import QuantSpec
from turbospark.layers.sharding import require_whole_groups, shard_experts
from turbospark.loading.importer import import_checkpoint
from turbospark.loading.install import load_weights, read_manifest, write_install
from turbospark.loading.quantization import quantization_of
from turbospark.sessions.session import Session
from turbospark_gemma4.model import sanitize

EXPERTS, TOP_K, INNER, HIDDEN = 8, 2, 64, 128
PROMPT = [3, 17, 42, 9, 88, 5, 61, 23, 100, 7, 12, 77, 31, 54]
REPLY = [5, 9, 17]
# float32 activations: the same packed numbers in another summation order.
ATOL = 1e-4


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A floating-point MoE checkpoint (no per-layer embeddings: the MoE releases have none)."""
    path = tmp_path_factory.mktemp("moe") / "src"
    build_synthetic_install(
        "gemma4", path, vocab_size=128, num_layers=2, hidden_size=HIDDEN, num_experts=EXPERTS,
        top_k_experts=TOP_K, moe_intermediate_size=INNER, intermediate_size=128,
        hidden_size_per_layer_input=0, seed=3,
    )  # fmt: skip
    return path


def quantized(source: Path, root: Path, bits: int, group: int = 32) -> tuple[Path, Path]:
    """``mlx_lm.convert -q --q-bits B --q-group-size G`` of *source*, and its import."""
    mlx_dir, install = root / f"mlx{bits}", root / f"install{bits}"
    convert(str(source), str(mlx_dir), quantize=True, q_bits=bits, q_group_size=group)
    import_checkpoint(mlx_dir, install, progress=False)
    return mlx_dir, install


@pytest.fixture(scope="module", params=[4, 8])
def checkpoint(request, source, tmp_path_factory) -> tuple[Path, Path]:
    return quantized(source, tmp_path_factory.mktemp("q"), request.param)


def mlx_lm_logits(mlx_dir: Path) -> list[np.ndarray]:
    """mlx-lm's last-position logits: the prompt, then each reply token."""
    model, _ = load_model(mlx_dir)
    cache = make_prompt_cache(model)
    out = [model(mx.array([PROMPT]), cache=cache)[0, -1]]
    out += [model(mx.array([[t]]), cache=cache)[0, -1] for t in REPLY]
    return [np.array(x.astype(mx.float32)) for x in out]


def ours(install: Path, policy: ExpertCacheSlots) -> list[np.ndarray]:
    """The same through the runner: a chunked prefill, then decode steps."""
    runner = Runner.open(install, expert_cache=policy, dtype="float32")
    runner.prefill_chunk(PROMPT[:6], 0)
    out = [runner.prefill_chunk(PROMPT[6:], 6)]
    out += [runner.produce(t, len(PROMPT) + i) for i, t in enumerate(REPLY)]
    return [np.array(x) for x in out]


def test_logits_equal_mlx_lm_and_every_slot_count(checkpoint):
    mlx_dir, install = checkpoint
    want = mlx_lm_logits(mlx_dir)
    resident = ours(install, ExpertCacheSlots.all())
    for step, (got, ref) in enumerate(zip(resident, want, strict=True)):
        assert np.abs(got - ref).max() <= ATOL, f"step {step} differs from mlx-lm"
    for slots in (TOP_K, 5):
        streamed = ours(install, ExpertCacheSlots.fixed(slots))
        for step, (got, ref) in enumerate(zip(streamed, resident, strict=True)):
            assert np.array_equal(got, ref), f"step {step} differs under fixed({slots})"


def test_batched_rows_equal_each_row_alone(checkpoint):
    """Three rows decode together over two slots (more experts than fit)."""
    _, install = checkpoint
    runner = Runner.open(install, expert_cache=ExpertCacheSlots.fixed(TOP_K))
    histories = [PROMPT[:5], PROMPT[3:12], PROMPT[1:4]]
    sessions = []
    for history in histories:
        session = Session(runner._new_state())
        runner.feed(session, history, 0)
        sessions.append(session)
    tokens = mx.array([[11], [22], [33]], dtype=mx.int32)
    batched = runner.forward_batch(tokens, [len(h) for h in histories], runner.merge_states(sessions))  # fmt: skip
    alone = Runner.open(install)
    for i, history in enumerate(histories):
        want = alone.prefill_chunk([*history, int(tokens[i, 0])], 0)
        assert np.array_equal(np.array(batched[i]), np.array(want)), f"row {i}"


def expert_bytes(bits: int, group: int) -> int:
    """One expert of one layer, packed: words, then float32 scales and biases."""
    shapes = [(INNER, HIDDEN), (INNER, HIDDEN), (HIDDEN, INNER)]
    return sum(out * (inputs * bits // 8 + 2 * 4 * inputs // group) for out, inputs in shapes)


def test_slots_hold_packed_experts_and_count_their_bytes(checkpoint):
    _, install = checkpoint
    bits = 4 if install.name.endswith("4") else 8
    one = expert_bytes(bits, 32)
    resident = Runner.open(install)
    assert resident.expert_cache_stats().resident_bytes == 2 * EXPERTS * one
    runner = Runner.open(install, expert_cache=ExpertCacheSlots.fixed(3))
    assert runner.expert_cache_stats().resident_bytes == 2 * 3 * one
    runner.prefill_chunk(PROMPT, 0)
    stats = runner.expert_cache_stats()
    assert stats.misses > 0 and stats.bytes_read == stats.misses * one
    cache = next(iter(runner._experts.caches.values()))
    assert cache.tables["gate_proj"].dtype == mx.uint32
    assert set(cache.tables) == {
        f"{p}{part}" for p in ("gate_proj", "up_proj", "down_proj") for part in ("", "_scales", "_biases")
    }  # fmt: skip
    # Each resident slot holds its expert's packed rows exactly as the install stores them.
    weights = load_weights(install, read_manifest(install))
    for expert, slot in cache.resident.items():
        for part in ("weight", "scales", "biases"):
            stored = weights[f"{cache.path}.switch_glu.down_proj.{part}"][expert]
            table = cache.tables["down_proj" + ("" if part == "weight" else f"_{part}")]
            assert np.array_equal(np.array(table[slot]), np.array(stored))


def test_auto_sizes_slots_by_packed_bytes(checkpoint, monkeypatch):
    _, install = checkpoint
    bits = 4 if install.name.endswith("4") else 8
    seen = []

    def auto_slots(spec, expert_bytes, other_bytes, available):
        seen.append(expert_bytes)
        return TOP_K

    monkeypatch.setattr("turbospark.policies.expert_cache.auto_slots", auto_slots)
    runner = Runner.open(install, expert_cache=ExpertCacheSlots.auto(), dtype="float32")
    assert seen == [expert_bytes(bits, 32)]
    assert runner.expert_cache_stats().resident_bytes == 2 * TOP_K * seen[0]


def test_the_quantization_is_described_resident_and_streamed(checkpoint):
    _, install = checkpoint
    bits = 4 if install.name.endswith("4") else 8
    for policy in (ExpertCacheSlots.all(), ExpertCacheSlots.fixed(TOP_K)):
        specs = quantization_of(Runner.open(install, expert_cache=policy).model)
        assert specs["model.layers.1.experts.down_proj"] == QuantSpec(group_size=32, bits=bits)
        # mlx-lm keeps the router at 8 bits, group 64: a per-module override.
        assert specs["model.layers.0.router.proj"] == QuantSpec(group_size=64, bits=8)


def test_an_experts_only_quantization_streams_too(source, tmp_path):
    """Dense layers in floating point, experts packed (mlx-lm's quant_predicate)."""
    mlx_dir, install = tmp_path / "mlx", tmp_path / "install"
    convert(
        str(source), str(mlx_dir), quantize=True, q_bits=4, q_group_size=64,
        quant_predicate=lambda path, module: "experts" in path,
    )  # fmt: skip
    import_checkpoint(mlx_dir, install, progress=False)
    want = mlx_lm_logits(mlx_dir)
    for policy in (ExpertCacheSlots.all(), ExpertCacheSlots.fixed(TOP_K)):
        for got, ref in zip(ours(install, policy), want, strict=True):
            assert np.abs(got - ref).max() <= ATOL


def test_microscaling_experts_stream_packed_with_uint8_scales(source, tmp_path):
    """mxfp4 (no biases, uint8 scales) resident and streamed, against mlx-lm."""
    mlx_dir, install = tmp_path / "mlx", tmp_path / "install"
    convert(str(source), str(mlx_dir), quantize=True, q_mode="mxfp4")
    import_checkpoint(mlx_dir, install, progress=False)
    want = mlx_lm_logits(mlx_dir)
    resident = ours(install, ExpertCacheSlots.all())
    for got, ref in zip(resident, want, strict=True):
        assert np.abs(got - ref).max() <= ATOL
    runner = Runner.open(install, expert_cache=ExpertCacheSlots.fixed(TOP_K))
    cache = next(iter(runner._experts.caches.values()))
    assert cache.tables["up_proj_scales"].dtype == mx.uint8 and "up_proj_biases" not in cache.tables
    for got, ref in zip(ours(install, ExpertCacheSlots.fixed(TOP_K)), resident, strict=True):
        assert np.array_equal(got, ref)


def test_sanitize_reads_mlx_lm_names_and_splits_packed_fused_tables(source):
    """A fused gate_up table packed as a whole splits into the two tables packed
    alone: quantization runs along the inputs, so rows split alike."""
    arch = Runner.open(source).arch
    fused = mx.random.normal((EXPERTS, 2 * INNER, HIDDEN), key=mx.random.key(0))
    words, scales, biases = mx.quantize(fused, group_size=32, bits=4)
    out = sanitize(
        {
            "model.layers.0.experts.gate_up_proj": words,
            "model.layers.0.experts.gate_up_proj.scales": scales,
            "model.layers.0.experts.gate_up_proj.biases": biases,
            "model.layers.1.experts.switch_glu.down_proj.weight": words,
            "model.layers.1.experts.switch_glu.down_proj.scales": scales,
        },
        arch,
    )
    up = mx.quantize(fused[:, INNER:], group_size=32, bits=4)
    for part, want in zip(("", "_scales", "_biases"), up, strict=True):
        assert mx.array_equal(out[f"model.layers.0.experts.up_proj{part}"], want)
    assert set(out) >= {
        "model.layers.1.experts.down_proj",
        "model.layers.1.experts.down_proj_scales",
    }


def test_a_packed_expert_table_with_mismatched_scales_is_refused_by_name(checkpoint, tmp_path):
    _, install = checkpoint
    weights = load_weights(install, read_manifest(install))
    name = "model.layers.0.experts.switch_glu.up_proj.scales"
    weights[name] = weights[name][:, :, :3]  # 3 groups: no group size gives 128 inputs
    arch = Runner.open(install).arch
    write_install(tmp_path / "broken", arch=arch, model_id="broken", weights=weights)
    for policy in (ExpertCacheSlots.fixed(TOP_K), ExpertCacheSlots.all()):
        with pytest.raises(
            InstallError, match=r"up_proj.weight is stored quantized .* no packing of 128"
        ):
            Runner.open(tmp_path / "broken", expert_cache=policy)


class TwoRanks:
    """What the sharding helpers read of a group, for refusals that come before any exchange."""

    def size(self) -> int:
        return 2

    def rank(self) -> int:
        return 0


def test_sharding_refuses_a_group_that_splits_a_quantization_group(source, tmp_path):
    """Group 64 over 64 inner features: each of 2 ranks would hold half a group."""
    _, install = quantized(source, tmp_path, 4, group=64)
    model = Runner.open(install).model
    layer = model.model.layers[0]
    before = layer.experts.tables()["down_proj"]
    assert isinstance(before, PackedExperts)
    with pytest.raises(InvalidInput, match=r"experts.down_proj's 64 inputs into 32-wide shards.*groups of 64"):  # fmt: skip
        shard_experts(layer.experts, TwoRanks(), into=("gate_proj", "up_proj"), out_of=("down_proj",))  # fmt: skip
    assert layer.experts.tables()["down_proj"].weight.shape == before.weight.shape
    # The family checks every layer before any weight moves.
    shapes = [(k, v.shape) for k, v in tree_flatten(model.parameters())]
    with pytest.raises(InvalidInput, match=r"model.layers.0.self_attn.o_proj's 64 inputs"):
        model.shard(TwoRanks())
    assert [(k, v.shape) for k, v in tree_flatten(model.parameters())] == shapes
    # A dense projection out of heads is checked the same way.
    down = nn.QuantizedLinear(64, HIDDEN, bias=False, group_size=64, bits=4)
    with pytest.raises(InvalidInput, match=r"down_proj's 64 inputs into 32-wide shards"):
        require_whole_groups(TwoRanks(), down_proj=down)
    require_whole_groups(TwoRanks(), down_proj=nn.QuantizedLinear(128, HIDDEN, group_size=64))


def test_packed_tables_for_the_wrong_expert_count_are_refused_by_name(source):
    experts = Runner.open(source).model.model.layers[0].experts
    words, scales, biases = mx.quantize(mx.zeros((EXPERTS - 1, INNER, HIDDEN)), 32, 4)
    weights = {"e.up_proj": words, "e.up_proj_scales": scales, "e.up_proj_biases": biases}
    with pytest.raises(
        InstallError, match=r"e.up_proj is stored packed as \(7, 64, 16\).*8 experts"
    ):
        experts.quantize_from("e", weights)

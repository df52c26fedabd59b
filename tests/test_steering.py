"""Activation steering: the modes against NumPy, llama.cpp's file format both ways,
rows of a batch against themselves alone, and every bad input refused by name
before anything changes. The per-family checks (scale 0, one layer, chunked,
batched, the pool) are the conformance kit's ``SteeringChecks``."""

from __future__ import annotations

from pathlib import Path

import gguf
import mlx.core as mx
import numpy as np
import pytest
from mutant_families import MutantGemma4

from turbospark import Runner, build_synthetic_install
from turbospark.contract.hookspecs import FamilySpec, hookimpl
from turbospark.errors import InvalidInput
from turbospark.loading.plugins import FamilyRegistry, default_registry
from turbospark.policies.control_vectors import directions_from_states, read_control_vector
from turbospark.policies.steering import Steer, SteeringPolicy
from turbospark.sessions.reuse import ReuseReason

WIDTH = 16


def numpy_reference(h: np.ndarray, v: np.ndarray, s: float, mode: str) -> np.ndarray:
    """The modes as the issue states them, in float64."""
    h, v = h.astype(np.float64), v.astype(np.float64)
    u = v / np.linalg.norm(v)
    along = (h @ u)[..., None]
    if mode == "add":
        return h + s * v
    if mode == "ablate":
        return h - along * u
    if mode == "clamp":
        return h - along * u + s * u
    added = h + s * v
    return added * (
        np.linalg.norm(h, axis=-1, keepdims=True) / np.linalg.norm(added, axis=-1, keepdims=True)
    )


def write_gguf(path: Path, directions: dict[int, np.ndarray], arch: str = "controlvector") -> Path:
    """A control vector written with gguf's writer directly, as repeng's export does."""
    writer = gguf.GGUFWriter(path, arch)
    writer.add_string(f"{arch}.model_hint", "llama")
    writer.add_uint32(f"{arch}.layer_count", len(directions))
    for layer, vector in directions.items():
        writer.add_tensor(f"direction.{layer}", np.asarray(vector, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def random_directions(layers, seed: int = 0, width: int = WIDTH) -> dict[int, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {k: rng.standard_normal(width).astype(np.float32) for k in layers}


@pytest.mark.parametrize("mode", ["add", "ablate", "clamp", "renorm"])
@pytest.mark.parametrize("scale", [0.7, -2.5])
def test_each_mode_matches_numpy(mode: str, scale: float) -> None:
    rng = np.random.default_rng(1)
    h = rng.standard_normal((2, 5, WIDTH)).astype(np.float32)
    v = rng.standard_normal(WIDTH).astype(np.float32) * 3
    steer = Steer.of([SteeringPolicy.from_directions({1: v}, scale, mode)], mx.float32)
    got = np.array(steer(1, mx.array(h)))
    np.testing.assert_allclose(got, numpy_reference(h, v, scale, mode), rtol=1e-5, atol=1e-5)
    assert np.array_equal(np.array(steer(2, mx.array(h))), h)  # an uncovered layer is untouched


def test_rows_of_a_batch_equal_themselves_alone() -> None:
    """Every mode and an unsteered row in one Steer: each row bit-identical alone."""
    rng = np.random.default_rng(2)
    h = rng.standard_normal((5, 3, WIDTH)).astype(np.float32)
    rows = [
        SteeringPolicy.from_directions(random_directions([1, 2], seed), 1.5, mode)
        for seed, mode in enumerate(["add", "ablate", "clamp", "renorm"])
    ]
    rows.insert(2, None)
    batched = Steer.of(rows, mx.float32)
    for layer in (1, 2, 3):
        out = np.array(batched(layer, mx.array(h)))
        for i, row in enumerate(rows):
            alone = Steer.of([row], mx.float32)
            expected = (
                h[i : i + 1] if alone is None else np.array(alone(layer, mx.array(h[i : i + 1])))
            )
            assert np.array_equal(out[i : i + 1], expected), (layer, i)


def test_several_files_sum_and_layers_select(tmp_path: Path) -> None:
    """Files are summed per layer (llama.cpp), the layer range is inclusive."""
    a, b = random_directions([1, 2, 3], 3), random_directions([2, 4], 4)
    policy = SteeringPolicy.from_gguf(
        [write_gguf(tmp_path / "a.gguf", a), write_gguf(tmp_path / "b.gguf", b)], layers="2:3"
    )
    assert sorted(policy.directions) == [1, 2, 3, 4]
    np.testing.assert_array_equal(policy.directions[2], a[2] + b[2])
    assert sorted(policy.covered()) == [2, 3]
    assert policy.identity != SteeringPolicy.from_gguf(tmp_path / "a.gguf").identity
    assert SteeringPolicy.off().identity is None


def test_extracted_vector_round_trips_with_gguf_writer(tmp_path: Path) -> None:
    """`steer extract` math written by our writer reads back exactly as a file gguf's
    writer wrote independently, and both load as the same policy."""
    from turbospark.policies.control_vectors import write_control_vector

    rng = np.random.default_rng(5)
    pos = [random_directions([1, 2, 3], int(s)) for s in rng.integers(0, 99, 4)]
    neg = [random_directions([1, 2, 3], int(s)) for s in rng.integers(100, 199, 4)]
    for method in ("mean", "pca"):
        directions = directions_from_states(pos, neg, method)
        ours = tmp_path / f"ours-{method}.gguf"
        write_control_vector(ours, directions, "llama")
        theirs = write_gguf(tmp_path / f"theirs-{method}.gguf", directions)
        reader = gguf.GGUFReader(ours)
        assert reader.get_field("general.architecture").contents() == "controlvector"
        assert [t.name for t in reader.tensors] == ["direction.1", "direction.2", "direction.3"]
        a, b = read_control_vector(ours), read_control_vector(theirs)
        assert all(np.array_equal(a[k], b[k]) for k in (1, 2, 3))
        assert SteeringPolicy.from_gguf(ours) == SteeringPolicy.from_gguf(theirs)
        if method == "pca":  # unit length, positives project higher
            for k, v in directions.items():
                assert abs(np.linalg.norm(v) - 1) < 1e-5
                assert np.mean([p[k] @ v for p in pos]) > np.mean([n[k] @ v for n in neg])
        else:
            expected = np.mean([p[1] for p in pos], 0) - np.mean([n[1] for n in neg], 0)
            np.testing.assert_allclose(directions[1], expected, rtol=1e-5, atol=1e-6)


# -- bad input ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def qwen(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("steer-qwen")
    build_synthetic_install("qwen_gdn", path, vocab_size=64, num_layers=3, model_id="steer")
    return path


def _good(path: Path, width: int) -> Path:
    return write_gguf(path / "good.gguf", random_directions([1, 2], 9, width))


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda d, w: SteeringPolicy.from_gguf(d / "missing.gguf"), "does not exist"),
        (lambda d, w: SteeringPolicy.from_gguf(_text(d)), "not a GGUF file"),
        (lambda d, w: SteeringPolicy.from_gguf(write_gguf(d / "m.gguf", {1: np.ones(w)}, "llama")), "not a control vector"),
        (lambda d, w: SteeringPolicy.from_gguf(_good(d, w + 1)), "hidden size"),
        (lambda d, w: SteeringPolicy.from_gguf(_good(d, w), layers="1:3"), "outside the model"),
        (lambda d, w: SteeringPolicy.from_gguf(_good(d, w), layers="0:1"), "numbered from 1"),
        (lambda d, w: SteeringPolicy.from_gguf(_good(d, w), layers="2"), "must be S:E"),
        (lambda d, w: SteeringPolicy.from_gguf(write_gguf(d / "deep.gguf", random_directions([5], 1, w))), "direction.5"),
        (lambda d, w: SteeringPolicy.from_gguf(_good(d, w), scale=float("nan")), "finite"),
        (lambda d, w: SteeringPolicy.from_gguf(_good(d, w), scale=float("inf")), "finite"),
        (lambda d, w: SteeringPolicy.from_gguf(write_gguf(d / "nan.gguf", {1: np.full(w, np.nan)})), "non-finite"),
        (lambda d, w: SteeringPolicy.from_gguf(_good(d, w), mode="subtract"), "unknown steering mode"),
        (lambda d, w: SteeringPolicy.off().with_settings(scale=0.5), "needs a control vector"),
    ],
)  # fmt: skip
def test_bad_input_is_refused_before_any_state_changes(qwen: Path, tmp_path: Path, make, message):
    """Each refused in one line naming the problem; a runner that was serving
    keeps its live session and its steering exactly as they were."""
    runner = Runner.open(qwen, session_slots=2, dtype="float32")
    runner.set_prefix_reuse(True)
    runner.prefill_chunk([1, 2, 3, 4], 0)
    before = (runner.position, list(runner.sessions()[0].record.tokens), runner.sessions())
    with pytest.raises(InvalidInput, match=message) as refused:
        runner.use_steering(make(tmp_path, runner.arch.hidden_size))
    assert "\n" not in str(refused.value)
    assert (runner.position, list(runner.sessions()[0].record.tokens)) == before[:2]
    assert runner.sessions() == before[2]
    assert runner.try_reuse_prefix([1, 2, 3, 4, 5]) == 4  # still unsteered, still reused


def _text(directory: Path) -> Path:
    path = directory / "notes.gguf"
    path.write_text("not a gguf")
    return path


def test_runner_open_refuses_a_mismatched_vector_before_loading(qwen: Path, tmp_path: Path):
    wrong = SteeringPolicy.from_gguf(write_gguf(tmp_path / "w.gguf", random_directions([1], 0, 7)))
    with pytest.raises(InvalidInput, match="7 values per layer but the model's hidden size"):
        Runner.open(qwen, steering=wrong)


class Unsteerable(MutantGemma4):
    """gemma4 under another name whose spec does not declare steering."""

    @hookimpl
    def turbospark_family(self) -> FamilySpec:
        return super().turbospark_family().model_copy(update={"steerable": False})


def test_a_family_that_cannot_steer_is_refused_by_name(tmp_path: Path) -> None:
    registry = FamilyRegistry()
    registry.register(
        Unsteerable("unsteerable", None, default_registry().get("gemma4").plugin),
        name="unsteerable",
    )
    build_synthetic_install("unsteerable", tmp_path, registry=registry, num_layers=2, vocab_size=64)
    policy = SteeringPolicy.from_directions(random_directions([1], 0, 64), 1.0)
    with pytest.raises(InvalidInput, match="family 'unsteerable' cannot steer"):
        Runner.open(tmp_path, steering=policy, registry=registry)
    runner = Runner.open(tmp_path, registry=registry)
    with pytest.raises(InvalidInput, match="family 'unsteerable' cannot steer"):
        runner.use_steering(policy)
    with pytest.raises(InvalidInput, match="family 'unsteerable' cannot steer"):
        runner.layer_outputs([1, 2])


def test_steering_changed_reason_names_both_settings(qwen: Path) -> None:
    runner = Runner.open(qwen, session_slots=2, dtype="float32")
    runner.set_prefix_reuse(True)
    runner.prefill_chunk([5, 6, 7, 8], 0)
    steered = SteeringPolicy.from_directions(random_directions([1, 2], 3, runner.arch.hidden_size))
    runner.use_steering(steered)
    assert runner.try_reuse_prefix([5, 6, 7, 8, 9]) == 0
    report = runner.last_reuse
    assert report.reason == ReuseReason.STEERING_CHANGED
    assert "steering off" in report.detail and "add x1" in report.detail

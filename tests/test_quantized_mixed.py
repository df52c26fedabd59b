"""mlx-lm's mixed-precision recipes, loaded as written and held to mlx-lm on every path.

``mlx_lm.convert -q --quant-predicate mixed_2_6|mixed_3_4|mixed_3_6|mixed_4_6``
(every recipe the locked mlx-lm has, ``mlx_lm.convert.QUANT_RECIPES``) packs
most modules at the low width and, in the first and last eighth of the layers
and every third between, ``v_proj`` and ``down_proj`` at the high one, and
``lm_head`` always; each module's setting is an override in ``config.json``.
So one layer's q/k/v projections differ in packing (qwen_gdn's full-attention
layer 3, gemma4's K/V-owning layer 2): :func:`stacked` reads them as
:class:`PerModule`, one product per module, and the layer keeps its one-trace
step. A predicate of our own (``uneven``, through the Python API's
``quant_predicate=``) also splits the packings of gate/up (one of them left in
floating point) and of a gated DeltaNet's input projections, which the recipes
never do.

On a tiny synthetic gemma4 and qwen_gdn, each recipe's checkpoint (groups of
32, float32) is imported as it is and must load every module at the packing
mlx-lm loads it with, and give mlx-lm's logits on the same directory (within
1e-4): token by token (the compiled decode step), in uneven prefill chunks,
on the CUDA kernels' path (their ops, as ``tests/test_quantized_paths.py``
runs them: the qmv kernel takes only the 4- and 8-bit products, part by
part), and as rows of batched decode steps; greedy replies, drafted or not,
are mlx-lm's tokens. ``turbospark families`` and the serve banner name the
checkpoint as mixed, with the modules at each width; ``turbospark serve`` on
the directory as it lies answers the openai client.
"""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path
from typing import Any, NamedTuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import openai
import pytest
from mlx_lm.convert import QUANT_RECIPES
from mlx_lm.generate import generate_step
from mlx_lm.utils import load_model
from quantized_checkpoints import Predicate, mlx_lm_convert
from serving import serve_process
from test_quantized_paths import _kernels, greedy_three_ways

from helpers import batched_greedy, chunks_and_steps
from turbospark import build_synthetic_install
from turbospark.cli import main
from turbospark.generation.runner import Runner
from turbospark.layers.gated_delta.layer import IN_PROJECTIONS
from turbospark.layers.stacked import PerModule, stacked
from turbospark.loading.importer import import_checkpoint
from turbospark.loading.quantization import QuantSpec, quantization_of, summary

ATOL = 1e-4
GROUP = QuantSpec(bits=4, group_size=32)  # the recipes take the groups; bits are theirs
PROMPT = [3 + (7 * i) % 90 for i in range(30)]
DECODE = [5, 6, 7]  # chunks_and_steps' decode tokens
READ = [12, 25, len(PROMPT) - 1, *range(len(PROMPT), len(PROMPT) + len(DECODE))]
KINDS: dict[str, dict[str, Any]] = {
    # One K/V-shared layer (3), so layer 2 owns a 6-bit v_proj beside its q/k
    # (the recipes' high layers of four are 2 and 3); a per-layer input.
    "gemma4": {
        "num_layers": 4,
        "sliding_window": 8,
        "hidden_size": 128,
        "hidden_size_per_layer_input": 32,
        "num_kv_shared_layers": 1,
    },
    # Gated-DeltaNet layers 0-2, full attention at 3; an untied (high-width) head.
    "qwen_gdn": {"num_layers": 4},
}
# The groups the projections stack in, each read as one product or as PerModule.
GROUPS = [("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), IN_PROJECTIONS]


def _uneven(path: str, module: nn.Module) -> bool | dict[str, Any]:
    """6 bits for every k_proj, up_proj and in_proj_z, floating point for the
    third layer's gate_proj and every in_proj_b, 4 bits elsewhere."""
    if path.endswith("layers.2.mlp.gate_proj") or path.endswith("in_proj_b"):
        return False
    high = any(path.endswith(name) for name in ("k_proj", "up_proj", "in_proj_z"))
    return {"group_size": GROUP.group_size, "bits": 6 if high else 4, "mode": "affine"}


PREDICATES: dict[str, str | Predicate] = {r: r for r in QUANT_RECIPES} | {"uneven": _uneven}
# The fast loop keeps one recipe per family and the uneven split; the rest is slow.
FAST = {("gemma4", "mixed_3_6"), ("qwen_gdn", "mixed_2_6"), ("gemma4", "uneven"), ("qwen_gdn", "uneven")}  # fmt: skip


class Mixed(NamedTuple):
    kind: str  # a key of KINDS
    written: Path  # mlx_lm.convert's directory
    install: Path  # the same, imported
    model: Any  # mlx-lm's model of it


def test_the_locked_mlx_lm_has_every_recipe() -> None:
    assert set(QUANT_RECIPES) == {"mixed_2_6", "mixed_3_4", "mixed_3_6", "mixed_4_6"}


@pytest.fixture(
    scope="module",
    params=[
        pytest.param(
            (kind, recipe),
            id=f"{kind}-{recipe}",
            marks=() if (kind, recipe) in FAST else pytest.mark.slow,
        )
        for kind in KINDS
        for recipe in PREDICATES
    ],
)
def mixed(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Mixed:
    kind, recipe = request.param
    root = tmp_path_factory.mktemp(f"{kind}-{recipe}")
    build_synthetic_install(kind, root / "src", vocab_size=128, model_id=kind, **KINDS[kind])
    written = mlx_lm_convert(root / "src", root / recipe, GROUP, PREDICATES[recipe])
    import_checkpoint(written, root / "install", progress=False)
    model, _ = load_model(written)
    return Mixed(kind, written, root / "install", model)


def _open(path: Path, **kwargs: Any) -> Runner:
    return Runner.open(path, context_length=256, dtype="float32", **kwargs)


def _close(got: Any, want: Any, what: str) -> None:
    np.testing.assert_allclose(np.array(got), np.array(want), atol=ATOL, rtol=ATOL, err_msg=what)


def _reference(model: Any, tokens: list[int]) -> np.ndarray:
    """mlx-lm's logits at every position of *tokens*, one forward from scratch."""
    return np.array(model(mx.array(tokens)[None])[0].astype(mx.float32))


def _theirs(model: Any) -> dict[str, QuantSpec]:
    """Each quantized module of mlx-lm's model, by our path for it (qwen_gdn's
    text model sits under ``language_model.`` in mlx-lm's)."""
    return {
        path.removeprefix("language_model."): QuantSpec(
            group_size=m.group_size, bits=m.bits, mode=m.mode
        )
        for path, m in model.named_modules()
        if isinstance(m, nn.QuantizedLinear | nn.QuantizedEmbedding)
    }


def test_every_module_loads_as_written(mixed: Mixed) -> None:
    """Each module at mlx-lm's packing (or in floating point where mlx-lm's
    is), two widths among them; every group of projections stacks, as one
    product where they share a packing and as :class:`PerModule` where not (some
    layer's, at least), never refused."""
    runner = _open(mixed.install)
    ours = quantization_of(runner.model)
    assert ours == _theirs(mixed.model)
    assert len({spec.bits for spec in ours.values()}) == 2
    split = 0
    for path, module in runner.model.named_modules():
        for names in GROUPS:
            if not all(name in module for name in names):
                continue
            packings = {ours.get(f"{path}.{name}") for name in names}
            stack = stacked(module, names)
            assert stack is not None, f"{path}: {names} not stacked"
            assert isinstance(stack.weight_t, PerModule) == (len(packings) > 1), path
            split += len(packings) > 1
    assert split > 0


def test_steps_and_chunks_match_mlx_lm(mixed: Mixed) -> None:
    """Token by token (each forward a compiled decode step), then uneven
    prefill chunks and steps."""
    expected = _reference(mixed.model, [*PROMPT, *DECODE])
    runner = _open(mixed.install)
    for position, token in enumerate([*PROMPT, *DECODE]):
        _close(runner.produce(token, position), expected[position], f"token {position}")
    logits, _ = chunks_and_steps(_open(mixed.install), PROMPT)
    for got, row in zip(logits, READ, strict=True):
        _close(got, expected[row], f"position {row}")


def test_the_kernels_path_matches_mlx_lm(mixed: Mixed, monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA kernels' forms: the one-trace attention and gated-DeltaNet
    steps run (the layers of :class:`PerModule` too), the qmv kernel takes the 4-
    and 8-bit products only, and the logits are mlx-lm's."""
    expected = _reference(mixed.model, [*PROMPT, *DECODE])
    with ExitStack() as stack:
        taken = _kernels(stack, monkeypatch)
        logits, _ = chunks_and_steps(_open(mixed.install), PROMPT)
    for got, row in zip(logits, READ, strict=True):
        _close(got, expected[row], f"position {row}")
    assert taken["attention"] > 0
    assert taken["gated_delta"] > 0 or mixed.kind == "gemma4"
    widths = {spec.bits for spec in _theirs(mixed.model).values()}
    assert (taken["qmv"] > 0) == bool(widths & {4, 8})


def test_batched_decode_matches_mlx_lm(mixed: Mixed) -> None:
    """Three sessions decoded together: each row's logits at each step are
    mlx-lm's on that row's tokens (its prompt, its last token again, then its
    own argmaxes, as batched_greedy feeds them)."""
    prompts = [PROMPT[:9], PROMPT[:20], PROMPT]
    steps = batched_greedy(_open(mixed.install, session_slots=3), prompts, 4)
    for row, prompt in enumerate(prompts):
        fed = [*prompt, prompt[-1], *(int(mx.argmax(s[row]).item()) for s in steps[:-1])]
        expected = _reference(mixed.model, fed)
        for step, got in enumerate(steps):
            _close(got[row], expected[len(prompt) + step], f"row {row}, step {step}")


def test_greedy_plain_kernels_and_drafted_are_mlx_lm_s(
    mixed: Mixed, monkeypatch: pytest.MonkeyPatch
) -> None:
    """20 greedy tokens on the plain path, the kernels' path, and drafted there
    (verify passes of several tokens, rejected drafts rewound): mlx-lm's."""
    plain, kernels, drafted = greedy_three_ways(mixed.install, monkeypatch)
    steps = generate_step(mx.array(PROMPT), mixed.model, max_tokens=len(plain))
    expected = [int(token) for token, _ in steps]
    assert plain == kernels == drafted == expected


def test_families_names_the_widths_the_model_loads(
    mixed: Mixed, capsys: pytest.CaptureFixture[str]
) -> None:
    """From the config and the safetensors headers, the checkpoint as it lies
    and imported: the phrase the loaded model gives, each width counted."""
    loaded = summary(quantization_of(_open(mixed.install).model))
    assert loaded is not None and loaded.startswith("mixed ")
    for path in (mixed.written, mixed.install):
        assert main(["families", str(path)]) == 0
        assert capsys.readouterr().out.splitlines()[-1].endswith(f", {loaded})")


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(KINDS))
def test_serve_answers_on_a_mixed_checkpoint_as_it_lies(kind: str, tmp_path: Path) -> None:
    """``turbospark serve DIR`` on mlx_lm.convert's directory: the banner names
    the mixed packing it loaded, and the openai client gets a completion."""
    build_synthetic_install(kind, tmp_path / "src", vocab_size=128, model_id=kind, **KINDS[kind])
    written = mlx_lm_convert(tmp_path / "src", tmp_path / "mixed_4_6", GROUP, "mixed_4_6")
    with serve_process(written, "--no-warm-up", family=kind) as (process, base):
        api = openai.OpenAI(base_url=f"{base}/v1", api_key="none")
        model = api.models.list().data[0].id
        reply = api.completions.create(model=model, prompt="hello", max_tokens=4, temperature=0)
        assert reply.usage is not None and reply.usage.completion_tokens == 4
        process.kill()
        printed = process.communicate()[0]
    assert f"({kind}, float32, mixed 4/6-bit: " in printed

"""The synthetic tokenizers, loading an install's text files, streaming detokenisation,
stops, and prompt-token parity with mlx-lm on every family's synthetic install."""

from __future__ import annotations

import functools
import itertools
import json
import string
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models

from turbospark.errors import InvalidInput
from turbospark.loading.synthetic import GEMMA_TEXT, QWEN_TEXT, SyntheticText
from turbospark.text import StopStrings, TextCodec, load_text

BOS_ID, EOS_ID = GEMMA_TEXT.id("<bos>"), GEMMA_TEXT.id("<eos>")
START_OF_TURN_ID, END_OF_TURN_ID = GEMMA_TEXT.id("<|turn>"), GEMMA_TEXT.id("<turn|>")
KINDS = {"sentencepiece": GEMMA_TEXT, "byte_level": QWEN_TEXT}

CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hello there, how are you?\nI'm fine: thanks! 42 + 7 = 49."},
    {"role": "assistant", "content": "Good to hear it, friend."},
    {"role": "user", "content": "And the weather in Zürich, <b>today</b>?"},
]


def write(path: Path, files: dict[str, str]) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    for name, content in files.items():
        (path / name).write_text(content)
    return path


@pytest.fixture
def codec(tmp_path: Path) -> TextCodec:
    return load_text(write(tmp_path, GEMMA_TEXT.files(128)))


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("vocab_size", [40, 128, 300])
def test_every_id_of_the_vocabulary_exists_and_decodes(
    tmp_path: Path, vocab_size: int, kind: str
) -> None:
    text = KINDS[kind]
    codec = load_text(write(tmp_path, text.files(vocab_size)))
    assert codec.vocab_size == vocab_size
    pieces = [codec.decode([i], skip_special_tokens=False) for i in range(vocab_size)]
    assert all(pieces) and len(set(pieces)) == vocab_size
    assert pieces[: len(text.specials)] == list(text.specials)


@pytest.mark.parametrize("text", [GEMMA_TEXT, QWEN_TEXT], ids=["gemma", "qwen"])
def test_too_small_a_vocabulary_is_refused(text: SyntheticText) -> None:
    with pytest.raises(InvalidInput, match="vocab_size >= 128"):
        text.files(12)


def test_printable_ascii_round_trips_one_token_per_character(codec: TextCodec) -> None:
    text = string.printable.replace("\t", "").replace("\r", "").replace("\x0b", "")
    text = text.replace("\x0c", "")
    ids = codec.encode(text)
    assert len(ids) == len(text)
    assert codec.decode(ids) == text
    assert codec.encode("hi", add_special_tokens=True) == [BOS_ID, *codec.encode("hi")]
    # SentencePiece's shape: spaces are the "▁" piece, unknown characters <unk>.
    assert codec.tokenizer.encode("a b", add_special_tokens=False).tokens == ["a", "▁", "b"]
    assert codec.encode("é") == [GEMMA_TEXT.id("<unk>")]


def test_byte_level_kind_is_a_bpe_with_merges_and_no_bos(tmp_path: Path) -> None:
    """Qwen's shape: GPT-2 bytes (space is Ġ), real merges, no BOS, ChatML turns."""
    codec = load_text(write(tmp_path, QWEN_TEXT.files(128)))
    assert codec.tokenizer.encode("in the end", add_special_tokens=False).tokens == [
        "in",
        "Ġthe",
        "Ġ",
        "en",
        "d",
    ]
    assert codec.encode("hi", add_special_tokens=True) == codec.encode("hi")
    text = "Hello, World! 42\n  done."
    assert codec.decode(codec.encode(text)) == text
    # Qwen3.5's thinking, once asked: on opens the block, off pre-fills it empty;
    # not asked, the synthetic template opens none (its turns extend each other).
    assert codec.apply_chat_template([{"role": "user", "content": "Hi"}]) == (
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    on = codec.apply_chat_template([{"role": "user", "content": "Hi"}], enable_thinking=True)
    assert on.endswith("<|im_start|>assistant\n<think>\n")
    think = codec.apply_chat_template([{"role": "user", "content": "Hi"}], enable_thinking=False)
    assert think.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert codec.eos_token_ids == {QWEN_TEXT.id("<|im_end|>"), QWEN_TEXT.id("<|endoftext|>")}
    # <think> is whole but not special: it survives skip_special_tokens, <|im_end|> does not.
    ids = codec.encode("<think>x<|im_end|>")
    assert ids[0] == QWEN_TEXT.id("<think>") and codec.decode(ids) == "<think>x"


@pytest.mark.parametrize("family", ["gemma4", "qwen_gdn", "qwen4_exp"])
def test_mlx_lm_tokenizes_a_chat_exactly_as_we_do(
    family: str, request: pytest.FixtureRequest
) -> None:
    """mlx-lm's tokenizer (``transformers``, which picks its class by ``model_type``) and
    ours give the same prompt tokens, so benchmarks against mlx-lm compare like with like."""
    tokenizer_utils = pytest.importorskip("mlx_lm.tokenizer_utils")
    install = request.getfixturevalue(f"{family}_install")
    theirs = tokenizer_utils.load(install)
    ours = load_text(install)
    # mlx-lm passes enable_thinking (True where the vocabulary has <think>); so do we here.
    for thinking in (True, False):
        expected = theirs.apply_chat_template(
            CHAT, add_generation_prompt=True, enable_thinking=thinking
        )
        ours_ids = ours.encode(ours.apply_chat_template(CHAT, enable_thinking=thinking))
        assert ours_ids == list(expected)
    assert ours.encode("raw text", add_special_tokens=True) == theirs.encode("raw text")


def test_chat_template_renders_gemma_turns(codec: TextCodec) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": " Hello! "},
        {"role": "user", "content": "Bye"},
    ]
    assert codec.apply_chat_template(messages) == (
        "<bos><|turn>system\nBe brief.<turn|>\n<|turn>user\nHi<turn|>\n"
        "<|turn>model\nHello!<turn|>\n"
        "<|turn>user\nBye<turn|>\n<|turn>model\n"
    )
    ids = codec.encode_chat(messages[1:2])
    assert ids[:2] == [BOS_ID, START_OF_TURN_ID] and END_OF_TURN_ID in ids
    assert codec.eos_token_ids == {EOS_ID, END_OF_TURN_ID}


def test_template_refusals_are_invalid_input(codec: TextCodec) -> None:
    with pytest.raises(InvalidInput, match="alternate"):
        codec.apply_chat_template([{"role": "user", "content": "a"}] * 2)
    with pytest.raises(InvalidInput, match="empty"):
        codec.apply_chat_template([])


def test_hugging_face_variants_of_the_text_files(tmp_path: Path) -> None:
    """AddedToken dicts, a named template list, chat_template.jinja, a nested text_config."""
    files = GEMMA_TEXT.files(128)
    config = json.loads(files["tokenizer_config.json"])
    template = config.pop("chat_template")
    config["eos_token"] = {"content": "<eos>", "special": True}
    write(tmp_path / "a", {**files, "tokenizer_config.json": json.dumps(config)})
    (tmp_path / "a" / "generation_config.json").unlink()
    (tmp_path / "a" / "chat_template.jinja").write_text(template)
    (tmp_path / "a" / "config.json").write_text(json.dumps({"text_config": {"eos_token_id": [7]}}))
    codec = load_text(tmp_path / "a")
    assert codec.eos_token_ids == {EOS_ID, 7}
    assert codec.apply_chat_template([{"role": "user", "content": "x"}]).startswith("<bos>")

    config["chat_template"] = [
        {"name": "tool_use", "template": "T"},
        {"name": "default", "template": "D"},
    ]
    write(tmp_path / "b", {**files, "tokenizer_config.json": json.dumps(config)})
    assert load_text(tmp_path / "b").apply_chat_template([{"role": "user", "content": "x"}]) == "D"


def test_stream_decoder_holds_back_an_incomplete_character() -> None:
    """A byte-fallback tokenizer splits 'é' over two tokens: nothing until both arrive."""
    vocab = {"<unk>": 0, "a": 1, "<0xC3>": 2, "<0xA9>": 3}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tokenizer.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    codec = TextCodec(
        tokenizer, chat_template=None, bos_token=None, eos_token=None, eos_token_ids=[]
    )
    ids = codec.encode("aéa")
    assert ids == [1, 2, 3, 1]
    decoder = codec.stream_decoder()
    assert [decoder.add(i) for i in ids] == ["a", "", "é", "a"]
    assert decoder.flush() == ""


@pytest.mark.parametrize("kind", sorted(KINDS))
@given(ids=st.lists(st.integers(0, 127), max_size=40))
def test_stream_deltas_concatenate_to_the_full_decode(kind: str, ids: list[int]) -> None:
    codec = _shared_codec(kind)
    decoder = codec.stream_decoder()
    text = "".join(decoder.add(i) for i in ids) + decoder.flush()
    assert text == codec.decode(ids)
    assert decoder.text == text  # what the reply index keys a reply by


@functools.cache
def _shared_codec(kind: str) -> TextCodec:
    """One codec per kind for every hypothesis example (fixtures are not reset between them)."""
    tokenizer = Tokenizer.from_str(KINDS[kind].files(128)["tokenizer.json"])
    return TextCodec(
        tokenizer, chat_template=None, bos_token=None, eos_token=None, eos_token_ids=[]
    )


@given(
    text=st.text(alphabet="abc", max_size=30),
    cuts=st.lists(st.integers(0, 30), max_size=6),
    stops=st.lists(st.text(alphabet="abc", min_size=1, max_size=3), min_size=1, max_size=2),
)
def test_stop_strings_cut_at_the_first_match_however_the_text_is_split(
    text: str, cuts: list[int], stops: list[str]
) -> None:
    bounds = sorted({0, len(text), *(min(c, len(text)) for c in cuts)})
    matcher = StopStrings(stops)
    out = "".join(matcher.feed(text[a:b]) for a, b in itertools.pairwise(bounds))
    out += matcher.flush()
    hits = [text.find(s) for s in stops if s in text]
    expected = text[: min(hits)] if hits else text
    assert out == expected
    assert (matcher.stopped is not None) == bool(hits)

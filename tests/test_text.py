"""The synthetic tokenizer, loading an install's text files, streaming detokenisation, stops."""

from __future__ import annotations

import itertools
import json
import string
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models

from turbospark.errors import InvalidInput
from turbospark.hookspecs import ArchConfig
from turbospark.text import (
    BOS_ID,
    END_OF_TURN_ID,
    EOS_ID,
    START_OF_TURN_ID,
    StopStrings,
    TextCodec,
    load_text,
    synthetic_text_files,
)


def arch(vocab_size: int) -> ArchConfig:
    return ArchConfig(
        family="x", model_type="x", vocab_size=vocab_size, hidden_size=8, num_hidden_layers=1
    )


def write(path: Path, files: dict[str, str]) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    for name, content in files.items():
        (path / name).write_text(content)
    return path


@pytest.fixture
def codec(tmp_path: Path) -> TextCodec:
    return load_text(write(tmp_path, synthetic_text_files(arch(128))))


@pytest.mark.parametrize("vocab_size", [40, 128, 300])
def test_every_id_of_the_vocabulary_exists_and_decodes(tmp_path: Path, vocab_size: int) -> None:
    codec = load_text(write(tmp_path, synthetic_text_files(arch(vocab_size))))
    assert codec.vocab_size == vocab_size
    pieces = [codec.decode([i], skip_special_tokens=False) for i in range(vocab_size)]
    assert all(pieces) and len(set(pieces)) == vocab_size
    assert pieces[:6] == ["<pad>", "<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>", "<unk>"]


def test_too_small_a_vocabulary_is_refused() -> None:
    with pytest.raises(InvalidInput, match="vocab_size >= 128"):
        synthetic_text_files(arch(12))


def test_printable_ascii_round_trips_one_token_per_character(codec: TextCodec) -> None:
    text = string.printable.replace("\t", "").replace("\r", "").replace("\x0b", "")
    text = text.replace("\x0c", "")
    ids = codec.encode(text)
    assert len(ids) == len(text)
    assert codec.decode(ids) == text
    assert codec.encode("hi", add_special_tokens=True) == [BOS_ID, *codec.encode("hi")]


def test_chat_template_renders_gemma_turns(codec: TextCodec) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": " Hello! "},
        {"role": "user", "content": "Bye"},
    ]
    assert codec.apply_chat_template(messages) == (
        "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n"
        "<start_of_turn>model\nHello!<end_of_turn>\n"
        "<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n"
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
    files = synthetic_text_files(arch(128))
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


@given(st.lists(st.integers(0, 127), max_size=40))
def test_stream_deltas_concatenate_to_the_full_decode(ids: list[int]) -> None:
    codec = _shared_codec()
    decoder = codec.stream_decoder()
    text = "".join(decoder.add(i) for i in ids) + decoder.flush()
    assert text == codec.decode(ids)


_CODEC: list[TextCodec] = []


def _shared_codec() -> TextCodec:
    """One codec for every hypothesis example (fixtures are not reset between them)."""
    if not _CODEC:
        files = synthetic_text_files(arch(128))
        tokenizer = Tokenizer.from_str(files["tokenizer.json"])
        _CODEC.append(
            TextCodec(
                tokenizer, chat_template=None, bos_token=None, eos_token=None, eos_token_ids=[]
            )
        )
    return _CODEC[0]


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

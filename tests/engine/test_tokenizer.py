"""Tests for ridge.engine.tokenizer: loading, encode/decode, chat templates, and the
incremental detokenizer's contracts (deltas add up to .text, .text is decode(ids),
nothing partial is streamed, stop strings split across tokens)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from ridge.engine.tokenizer import (
    Attach,
    ByteTokenizer,
    IncrementalDetokenizer,
    load_tokenizer,
)
from tests.engine.conftest import (
    ALL,
    CHATML,
    GPT2_VECTORS,
    MULTIBYTE,
    PROPERTY,
    STORIES,
    id_lists,
    interesting_ids,
    need,
    stream,
    texts,
)

# -- Tokenizer: stories260K (SentencePiece BPE with byte fallback) --------------------


def test_stories_encode_decode(stories):
    ids = stories.encode("Once upon a time")
    assert ids == [1, 403, 407, 261, 378]  # bos, then ▁Once ▁upon ▁a ▁time
    assert stories.encode("Once upon a time", add_special_tokens=False) == ids[1:]
    assert stories.decode(ids) == "Once upon a time"
    assert stories.decode(ids, skip_special_tokens=False) == "<s> Once upon a time"
    assert (stories.vocab_size, stories.bos_token_id, stories.eos_token_ids) == (512, 1, frozenset({2}))
    assert stories.convert_ids_to_tokens(ids) == ["<s>", "▁Once", "▁upon", "▁a", "▁time"]
    assert stories.convert_tokens_to_string(["▁Once", "▁upon"]) == "Once upon"


def test_stories_byte_fallback_round_trips(stories):
    ids = stories.encode(MULTIBYTE, add_special_tokens=False)
    assert stories.decode(ids) == MULTIBYTE
    assert any(stories.piece(i).attach is Attach.BYTE_RUN for i in ids)


def test_tokenizer_model_alone_matches_tokenizer_json(stories, tmp_path):
    """A directory with tokenizer.model (and the config naming its class) but no
    tokenizer.json loads to the same tokenizer."""
    shutil.copy(STORIES / "tokenizer.model", tmp_path)
    shutil.copy(STORIES / "tokenizer_config.json", tmp_path)
    sp = load_tokenizer(tmp_path)
    for text in ["Once upon a time", "  two  spaces", MULTIBYTE, 'Lily said: "hi!"\n']:
        assert sp.encode(text) == stories.encode(text), text
        assert sp.decode(sp.encode(text)) == stories.decode(stories.encode(text))
    assert (sp.vocab_size, sp.bos_token_id, sp.eos_token_ids) == (512, 1, frozenset({2}))


# -- Tokenizer: GPT-2 (byte-level BPE) against llama.cpp's test vectors ---------------


def test_gpt2_test_vectors(gpt2):
    inputs = need(Path(f"{GPT2_VECTORS}.inp")).read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")
    expected = Path(f"{GPT2_VECTORS}.out").read_text(encoding="utf-8").split("\n")
    # Both files end with a separator, so each split ends with one empty entry.
    assert inputs[-1] == "" and expected[-1] == ""
    inputs, expected = inputs[:-1], expected[:-1]
    assert len(inputs) == len(expected) == 46
    for text, ids in zip(inputs, expected):
        assert gpt2.encode(text) == [int(i) for i in ids.split()], repr(text)
        assert gpt2.decode(gpt2.encode(text)) == text


def test_gpt2_basics(gpt2):
    assert gpt2.vocab_size == 50257
    assert gpt2.eos_token_ids == frozenset({50256})
    assert gpt2.encode("Hello world") == [15496, 995]
    assert gpt2.decode([50256, 15496], skip_special_tokens=False) == "<|endoftext|>Hello"
    assert gpt2.decode([50256, 15496]) == "Hello"


@PROPERTY
@given(text=st.text(max_size=40))
def test_gpt2_is_lossless(gpt2, text):
    assert gpt2.decode(gpt2.encode(text)) == text


# -- ByteTokenizer --------------------------------------------------------------------


def test_byte_tokenizer(byte):
    assert (byte.vocab_size, byte.bos_token_id, byte.eos_token_ids) == (259, 1, frozenset({2}))
    ids = byte.encode("hé")
    assert ids == [1, ord("h") + 3, 0xC3 + 3, 0xA9 + 3]
    assert byte.encode("hé", add_special_tokens=False) == ids[1:]
    assert byte.decode(ids) == "hé"
    assert byte.decode([1, *ids[1:], 2], skip_special_tokens=False) == "<s>hé</s>"
    assert byte.decode([0xC3 + 3]) == "\ufffd"  # a lone lead byte
    assert byte.decode([ord("a") + 3, 300, 259]) == "a"  # past the vocabulary: nothing
    # A skipped special token does not split a character; a rendered one does.
    assert byte.decode([0xC3 + 3, 2, 0xA9 + 3]) == "é"
    assert byte.decode([0xC3 + 3, 2, 0xA9 + 3], skip_special_tokens=False) == "\ufffd</s>\ufffd"
    tokens = byte.convert_ids_to_tokens(ids)
    assert tokens == ["<s>", "<0x68>", "<0xC3>", "<0xA9>"]
    assert byte.convert_tokens_to_string(tokens) == "<s>hé"
    assert not byte.has_chat_template


@PROPERTY
@given(text=st.text(max_size=40))
def test_byte_tokenizer_round_trips(byte, text):
    assert byte.decode(byte.encode(text)) == text
    assert len(byte.encode(text, add_special_tokens=False)) == len(text.encode("utf-8"))


# -- load_tokenizer: errors and configs -----------------------------------------------


def test_load_missing_dir(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(ValueError, match="nope"):
        load_tokenizer(missing)


def test_load_dir_without_tokenizer_files(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match=f"no tokenizer files.*{tmp_path.name}"):
        load_tokenizer(tmp_path)


@pytest.mark.parametrize("content", ["{not json", "", '{"version": "1.0"}'])
def test_load_corrupt_tokenizer_json(tmp_path, content):
    (tmp_path / "tokenizer.json").write_text(content)
    with pytest.raises(ValueError, match=f"cannot load the tokenizer in .*{tmp_path.name}"):
        load_tokenizer(tmp_path)


def test_eos_ids_merged_from_configs(tmp_path):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(need(STORIES) / name, tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "eos_token_id": 9}))
    tok = load_tokenizer(tmp_path)
    assert tok.eos_token_ids == frozenset({2, 7, 9})
    assert tok.bos_token_id == 1


def test_bos_and_eos_from_config_when_tokenizer_names_none(tmp_path):
    """tokenizer.json alone names no special tokens in transformers 5; config.json does."""
    shutil.copy(need(STORIES) / "tokenizer.json", tmp_path)
    shutil.copy(STORIES / "config.json", tmp_path)
    tok = load_tokenizer(tmp_path)
    assert tok.hf_tokenizer.bos_token_id is None
    assert (tok.bos_token_id, tok.eos_token_ids) == (1, frozenset({2}))
    assert tok.encode("Once upon a time") == [1, 403, 407, 261, 378]


def test_malformed_eos_in_config(tmp_path):
    shutil.copy(need(STORIES) / "tokenizer.json", tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": "</s>"}))
    with pytest.raises(ValueError, match="generation_config.json"):
        load_tokenizer(tmp_path)


# -- chat templates -------------------------------------------------------------------

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "hello"},
]


def test_chat_template_from_model(chat):
    assert chat.has_chat_template
    assert chat.apply_chat_template(CONVERSATION) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    )
    assert chat.apply_chat_template(CONVERSATION, add_generation_prompt=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhello<|im_end|>\n"
    )
    assert chat.eos_token_ids == frozenset({chat.encode("<|im_end|>")[0]})


@pytest.mark.parametrize("tokenizer", ["stories", "byte"], indirect=True)
def test_chat_prompts_start_with_bos_like_any_prompt(tokenizer):
    """The fallback template writes no bos, so encode_chat adds it (the bug: it was dropped
    while generate added it); a model's template writes its own, so none is added."""
    ids = tokenizer.encode_chat(CONVERSATION)
    assert ids[0] == tokenizer.bos_token_id
    assert ids == tokenizer.encode(tokenizer.apply_chat_template(CONVERSATION))


def test_a_model_template_is_encoded_without_added_special_tokens(chat):
    text = chat.apply_chat_template(CONVERSATION)
    assert chat.encode_chat(CONVERSATION) == chat.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("tokenizer", ["stories", "byte"], indirect=True)
def test_chat_fallback_template(tokenizer):
    assert not tokenizer.has_chat_template
    assert tokenizer.apply_chat_template(CONVERSATION) == "system: Be brief.\nuser: hello\nassistant:"
    assert tokenizer.apply_chat_template(CONVERSATION, add_generation_prompt=False) == (
        "system: Be brief.\nuser: hello\n"
    )


@pytest.mark.parametrize("tokenizer", ["chat", "stories", "byte"], indirect=True)
@pytest.mark.parametrize(
    ("messages", "message"),
    [
        ("hello", "must be a list"),
        ({"role": "user", "content": "hi"}, "must be a list"),
        ([], "must not be empty"),
        (["hi"], r"messages\[0\] must be a dict"),
        ([{"content": "hi"}], r"messages\[0\] must have 'role' and 'content'"),
        ([{"role": "user"}], r"messages\[0\] must have 'role' and 'content'"),
        ([{"role": 3, "content": "hi"}], r"messages\[0\]\['role'\] must be a str"),
        ([{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}], r"messages\[1\] has unknown role"),
        ([{"role": "user", "content": None}], r"messages\[0\]\['content'\] must be a str"),
        ([{"role": "user", "content": [{"type": "text", "text": "hi"}]}], "must be a str"),
    ],
)
def test_malformed_messages(tokenizer, messages, message):
    with pytest.raises(ValueError, match=message):
        tokenizer.apply_chat_template(messages)


def test_template_errors_become_value_errors(chat):
    chat.hf_tokenizer.chat_template = "{{ raise_exception('roles must alternate') }}"
    try:
        with pytest.raises(ValueError, match="roles must alternate"):
            chat.apply_chat_template(CONVERSATION)
    finally:
        chat.hf_tokenizer.chat_template = CHATML


# -- IncrementalDetokenizer: text and deltas ------------------------------------------


@pytest.mark.parametrize("tokenizer", ALL, indirect=True)
def test_deltas_add_up_to_decode_of_random_ids(tokenizer):
    """For any ids, fed in any chunks with deltas taken at any points: the deltas add up
    to .text, .text is decode(ids), and no delta before the last ends in U+FFFD."""
    tok = tokenizer

    @PROPERTY
    @given(
        ids=id_lists(tok),
        skip=st.booleans(),
        chunks=st.lists(st.integers(1, 4), max_size=5),
        takes=st.lists(st.booleans(), max_size=5),
    )
    def prop(ids, skip, chunks, takes):
        detok = IncrementalDetokenizer(tok, [], skip_special_tokens=skip)
        deltas, stop = stream(detok, ids, chunks, takes)
        assert stop is None
        assert detok.text == tok.decode(ids, skip_special_tokens=skip)
        assert "".join(deltas) == detok.text
        assert not any(d.endswith("\ufffd") for d in deltas[:-1])

    prop()


@pytest.mark.parametrize("tokenizer", ALL, indirect=True)
@pytest.mark.parametrize("skip", [False, True])
def test_unknown_ids_are_dropped_before_joining_as_decode_does(tokenizer, skip):
    """An id past the vocabulary between two pieces of one byte run: decode drops it and
    joins the run (the case hypothesis found: stories [131, 517, 3] gave '\\ufffd\\x00')."""
    tok = tokenizer
    known = [i for i in interesting_ids(tok) if i < tok.vocab_size]
    first = next(i for i in known if tok.piece(i).text == "\ufffd")  # a lone high byte
    second = next((i for i in known if tok.piece(i).attach is Attach.BYTE_RUN), first)
    unknown = tok.vocab_size + 5
    for ids in ([first, unknown, second], [unknown, first, unknown, second, unknown], [unknown]):
        for chunks in ([1], [len(ids)]):
            detok = IncrementalDetokenizer(tok, [first], skip_special_tokens=skip)
            deltas, _ = stream(detok, ids, chunks, [True])
            assert detok.text == tok.decode(ids, skip_special_tokens=skip) == "".join(deltas)


@pytest.mark.parametrize("tokenizer", ["stories", "gpt2", "chat"], indirect=True)
def test_output_continues_the_prompt_text(tokenizer):
    """With a prompt, .text is what the output adds to the prompt's text: decoding
    prompt + output, less the prompt's text (SentencePiece keeps the leading space)."""
    tok = tokenizer

    @PROPERTY
    @given(prompt=texts(1, 12), ids=id_lists(tok, 8), skip=st.booleans())
    def prop(prompt, ids, skip):
        prompt_ids = tok.encode(prompt)
        before = tok.decode(prompt_ids, skip_special_tokens=skip)
        after = tok.decode(prompt_ids + ids, skip_special_tokens=skip)
        # A prompt ending in a split character or an open byte run merges with the output.
        assume(after.startswith(before))
        detok = IncrementalDetokenizer(tok, prompt_ids, skip_special_tokens=skip)
        deltas, _ = stream(detok, ids, [1], [True])
        assert detok.text == after[len(before) :]
        assert "".join(deltas) == detok.text

    prop()


def test_leading_space_comes_from_the_prompt(stories):
    prompt = stories.encode("Once upon a")
    time_ = stories.encode(" time", add_special_tokens=False)
    assert stories.convert_ids_to_tokens(time_) == ["▁time"]
    with_prompt = IncrementalDetokenizer(stories, prompt)
    with_prompt.add_tokens(time_)
    assert with_prompt.text == with_prompt.take_delta() == " time"
    # Without context the first token starts the text, as in decode().
    alone = IncrementalDetokenizer(stories, [1])
    alone.add_tokens(time_)
    assert alone.text == stories.decode(time_) == "time"


@pytest.mark.parametrize("tokenizer", ALL, indirect=True)
def test_multibyte_characters_never_stream_partially(tokenizer):
    """Valid text fed one token at a time (for ByteTokenizer one byte at a time): no
    delta contains U+FFFD, and they add up to the text."""
    tok = tokenizer

    @PROPERTY
    @given(text=texts(), takes=st.lists(st.booleans(), min_size=1, max_size=4))
    def prop(text, takes):
        ids = tok.encode(text, add_special_tokens=False)
        detok = IncrementalDetokenizer(tok, tok.encode("Once"))
        deltas, _ = stream(detok, ids, [1], takes + [True])
        assert not any("\ufffd" in d for d in deltas)
        assert "".join(deltas) == detok.text
        assert detok.text.lstrip(" ") == tok.decode(ids).lstrip(" ")

    prop()


def test_emoji_split_byte_by_byte(byte):
    detok = IncrementalDetokenizer(byte, [1])
    deltas = []
    for i in byte.encode("a😀b", add_special_tokens=False):
        detok.add_tokens([i])
        deltas.append(detok.take_delta())
    assert deltas == ["a", "", "", "", "😀", "b"]


def test_byte_fallback_run_is_held_until_it_ends(stories):
    """An open byte-fallback run can still turn into U+FFFDs (an invalid byte after it
    invalidates the whole run in decode), so it is not streamed until it ends."""
    e4, b8, x96, x80 = (b + 3 for b in (0xE4, 0xB8, 0x96, 0x80))  # byte b is id b + 3
    assert stories.convert_ids_to_tokens([e4, b8, x96, x80]) == ["<0xE4>", "<0xB8>", "<0x96>", "<0x80>"]
    detok = IncrementalDetokenizer(stories, stories.encode("Once"))
    detok.add_tokens([e4, b8, x96])
    assert detok.text == "世"
    assert detok.take_delta() == ""
    detok.add_tokens([x80])
    assert detok.text == stories.decode([e4, b8, x96, x80]) == "\ufffd" * 4
    assert detok.take_delta() == ""
    detok.add_tokens(stories.encode(" end", add_special_tokens=False))
    assert detok.take_delta() == "\ufffd" * 4 + " end"


@pytest.mark.parametrize(("skip", "text"), [(True, "世"), (False, "\ufffd<s>\ufffd\ufffd")])
def test_skipped_special_token_inside_a_byte_run(stories, skip, text):
    """decode drops skipped specials before joining bytes, so a bos inside a run does
    not split the character; rendered, it does."""
    ids = [0xE4 + 3, 1, 0xB8 + 3, 0x96 + 3]
    assert stories.decode(ids, skip_special_tokens=skip) == text
    detok = IncrementalDetokenizer(stories, [], skip_special_tokens=skip)
    deltas, _ = stream(detok, ids, [1], [True])
    assert detok.text == "".join(deltas) == text


def test_work_per_token_does_not_grow_with_the_output():
    """O(new tokens) per step: the ids decoded per step stay bounded as output grows."""

    class CountingByteTokenizer(ByteTokenizer):
        def __init__(self):
            super().__init__()
            self.decoded = 0

        def decode(self, token_ids, skip_special_tokens=True):
            self.decoded += len(token_ids)
            return super().decode(token_ids, skip_special_tokens)

    tok = CountingByteTokenizer()
    ids = tok.encode("Ünïcödé 日本 😀 and some ascii. " * 100, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [1, 70])
    for i in ids:
        detok.add_tokens([i])
        detok.take_delta()
    assert detok.text == tok.decode(ids)
    assert tok.decoded < 8 * len(ids)  # a re-decode per step would be ~len(ids)**2 / 2


# -- IncrementalDetokenizer: stop strings ---------------------------------------------


def test_stop_string_split_across_tokens(byte):
    detok = IncrementalDetokenizer(byte, [1], stop=["o w"])
    hits = [detok.add_tokens([i]) for i in byte.encode("Hello world", add_special_tokens=False)[:7]]
    assert hits == [None] * 6 + ["o w"]  # found on the byte that completes it
    assert detok.text == "Hell"
    assert detok.take_delta() == "Hell"
    with pytest.raises(RuntimeError, match="already hit"):
        detok.add_tokens([byte.encode("x", add_special_tokens=False)[0]])


def test_stop_string_included_in_output(byte):
    detok = IncrementalDetokenizer(byte, [1], stop=["o w"], include_stop_str_in_output=True)
    assert detok.add_tokens(byte.encode("Hello world", add_special_tokens=False)) == "o w"
    assert detok.text == detok.take_delta() == "Hello w"


def test_stop_string_spanning_sentencepiece_tokens(stories):
    ids = stories.encode("Once upon a time", add_special_tokens=False)
    detok = IncrementalDetokenizer(stories, [1], stop=["ce up"])
    assert detok.add_tokens(ids[:1]) is None
    assert detok.take_delta() == "On"  # "ce" could begin the stop string
    assert detok.add_tokens(ids[1:2]) == "ce up"
    assert detok.text == "On"
    assert detok.take_delta() == ""


def test_partial_stop_string_is_held_back_then_flushed(byte):
    detok = IncrementalDetokenizer(byte, [1], stop=["time", "\n\n"])
    detok.add_tokens(byte.encode("a ti", add_special_tokens=False))
    assert detok.take_delta() == "a "
    detok.add_tokens(byte.encode("e\n", add_special_tokens=False))
    assert detok.take_delta() == "tie"  # no longer a stop prefix; "\n" still could be
    assert detok.take_delta(finished=True) == "\n"
    assert detok.text == "a tie\n"
    with pytest.raises(RuntimeError, match="finished"):
        detok.add_tokens(byte.encode("\n", add_special_tokens=False))


def test_first_ending_stop_wins(byte):
    detok = IncrementalDetokenizer(byte, [1], stop=["abcd", "bc"])
    assert detok.add_tokens(byte.encode("xabcd", add_special_tokens=False)) == "bc"
    assert detok.text == "xa"


def test_stop_strings_must_be_non_empty(byte):
    with pytest.raises(ValueError, match="non-empty"):
        IncrementalDetokenizer(byte, [], stop=["x", ""])


def expected_stop(text: str, stops: list[str]):
    """The stop string that completes first in ``text`` (the longest among those that
    complete at the same character), and where it starts."""
    for end in range(1, len(text) + 1):
        for stop in sorted(stops, key=len, reverse=True):
            if text[:end].endswith(stop):
                return stop, end - len(stop)
    return None, None


@pytest.mark.parametrize("tokenizer", ["byte", "stories", "gpt2"], indirect=True)
def test_stop_strings_against_a_reference(tokenizer):
    """Stop strings over random text fed one token at a time: the right stop is found,
    .text is cut at it, nothing streamed before the hit is part of it (so no partial
    stop string is streamed), and the deltas add up to .text."""
    tok = tokenizer

    @PROPERTY
    @given(
        text=texts(0, 24),
        stops=st.lists(texts(1, 3), min_size=1, max_size=3),
        include=st.booleans(),
        takes=st.lists(st.booleans(), min_size=1, max_size=4),
    )
    def prop(text, stops, include, takes):
        ids = tok.encode(text, add_special_tokens=False)
        full = tok.decode(ids)
        detok = IncrementalDetokenizer(tok, [], stop=stops, include_stop_str_in_output=include)
        streamed, stop = "", None
        for n, i in enumerate(ids):
            stop = detok.add_tokens([i])
            if stop is not None:
                break
            if takes[n % len(takes)]:
                streamed += detok.take_delta()
                assert detok.text.startswith(streamed)
                assert "\ufffd" not in streamed
        want, start = expected_stop(full, stops)
        assert stop == want
        if want is None:
            assert detok.text == full
        else:
            assert detok.text == full[: start + (len(want) if include else 0)]
            assert len(streamed) <= start  # not one character of the stop string streamed
        assert streamed + detok.take_delta(finished=stop is None) == detok.text

    prop()

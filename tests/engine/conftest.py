"""The tokenizers the engine tests run on (SentencePiece, GPT-2 byte-level BPE, a ChatML
BPE trained here, the bytes tokenizer), and helpers that draw and stream token ids."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from ridge.engine.tokenizer import ByteTokenizer, load_tokenizer

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from tests.conftest import SHARED  # noqa: E402

STORIES = SHARED / "models" / "stories260K"
GPT2 = SHARED / "models" / "gpt2-tokenizer"
GPT2_VECTORS = GPT2 / "ggml-vocab-gpt-2.gguf"

PROPERTY = settings(max_examples=60, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Text that exercises multi-byte UTF-8: accents (2 bytes), CJK (3), emoji (4), ZWJ, VS16.
MULTIBYTE = "Führer ça 日本語 😀🎉 👍🏽 😶\u200d🌫️ 🦙 ½"
# Pieces of generated text: ASCII, accents, CJK, emoji (one with a variation selector);
# no U+FFFD of their own.
PIECES = [*"ab cé\nü日本語😀🦙.,", "🌫️"]


def texts(min_size: int = 0, max_size: int = 20):
    return st.lists(st.sampled_from(PIECES), min_size=min_size, max_size=max_size).map("".join)


def need(path: Path) -> Path:
    if not path.exists():
        pytest.skip(f"{path} is absent (the shared files live in ../shared beside the checkout)")
    return path


# -- fixtures ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def stories():
    return load_tokenizer(need(STORIES))


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory) -> Path:
    """vocab.json + merges.txt, plus the tokenizer_config.json AutoTokenizer needs."""
    need(GPT2)
    d = tmp_path_factory.mktemp("gpt2")
    shutil.copy(GPT2 / "vocab.json", d)
    shutil.copy(GPT2 / "merges.txt", d)
    (d / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "GPT2Tokenizer"}))
    return d


@pytest.fixture(scope="module")
def gpt2(gpt2_dir):
    return load_tokenizer(gpt2_dir)


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory) -> Path:
    """A tiny byte-level BPE with ChatML special tokens and a chat template, trained and
    saved here so the test needs no files."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = RawTokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|im_start|>", "<|im_end|>", "<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    raw.train_from_iterator(["hello world", "the cat sat on the mat", "user assistant system"], trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<|im_end|>")
    hf.chat_template = CHATML
    d = tmp_path_factory.mktemp("chat")
    hf.save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def chat(chat_dir):
    return load_tokenizer(chat_dir)


@pytest.fixture(scope="module")
def byte():
    return ByteTokenizer()


@pytest.fixture
def tokenizer(request):
    """The tokenizer fixture named by an indirect `tokenizer` parameter."""
    return request.getfixturevalue(request.param)


ALL = ["stories", "gpt2", "byte", "chat"]


def interesting_ids(tok) -> list[int]:
    """Ids a random draw would rarely hit together: specials, single bytes, the pieces
    of multi-byte text, and one id past the vocabulary (a model's padded vocab)."""
    ids = set(tok.encode(MULTIBYTE, add_special_tokens=False)) | set(tok.eos_token_ids)
    ids |= set(range(min(tok.vocab_size, 259)))  # all four keep specials and single bytes low
    if tok.bos_token_id is not None:
        ids.add(tok.bos_token_id)
    ids.add(tok.vocab_size + 5)
    return sorted(ids)


def id_lists(tok, max_size: int = 12):
    """Random ids mixed with the pieces of valid text, so that complete characters,
    split ones, invalid bytes and special tokens meet in every order."""
    one = st.one_of(st.integers(0, tok.vocab_size - 1), st.sampled_from(interesting_ids(tok))).map(lambda i: [i])
    valid = texts(1, 3).map(lambda t: tok.encode(t, add_special_tokens=False))
    return st.lists(st.one_of(one, valid), max_size=max_size).map(lambda parts: [i for p in parts for i in p])


def stream(detok, ids, chunk_sizes, take_points, finish=True):
    """Feed ``ids`` in chunks, taking deltas where ``take_points`` says; return the deltas
    (the last one taken with finished=True when ``finish``) and the stop string hit."""
    deltas, stop, pos, step = [], None, 0, 0
    while pos < len(ids) and stop is None:
        size = chunk_sizes[step % len(chunk_sizes)] if chunk_sizes else 1
        stop = detok.add_tokens(ids[pos : pos + size])
        pos += size
        if take_points and take_points[step % len(take_points)]:
            deltas.append(detok.take_delta())
        step += 1
    if finish:
        deltas.append(detok.take_delta(finished=True))
    return deltas, stop

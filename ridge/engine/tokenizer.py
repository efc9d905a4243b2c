"""Tokenizers and incremental detokenization.

Three pieces, all used by the engine and the server:

* :class:`Tokenizer` wraps a Hugging Face tokenizer loaded from a model directory
  (:func:`load_tokenizer`), and :class:`ByteTokenizer` needs no files (UTF-8 bytes, for
  models built with random weights). Both share :class:`BaseTokenizer`'s interface:
  ``encode``, ``decode``, ``apply_chat_template``, ``vocab_size``, ``bos_token_id``,
  ``eos_token_ids`` and ``piece`` (what the detokenizer needs to know about one token).
* :class:`IncrementalDetokenizer` turns a stream of generated ids into text, a few
  tokens at a time, and applies stop strings.

Detokenization contract. ``.text`` is exactly ``tokenizer.decode(output_ids)`` except
that a leading space the decoder strips from a sequence's first token (SentencePiece)
is kept when the prompt gives it context, as if the output were decoded after the
prompt. Streaming (``take_delta``) never takes text back: it holds back text that a
later token could still change, so the deltas always concatenate to ``.text``.

How it stays O(new tokens) per step: ``decode`` is concatenative except across a few
kinds of token boundary, which :class:`Attach` names. Text before the last *safe*
boundary is final, so only the tokens after it (the "window", usually one token) are
re-decoded, with the token just before the window as context.
"""

from __future__ import annotations

import enum
import functools
import json
import os
import re
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Roles an OpenAI-style conversation may use; anything else is a caller error.
KNOWN_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})

# Files at least one of which a model directory needs for AutoTokenizer to build a tokenizer.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "spiece.model",
    "sentencepiece.bpe.model",
    "vocab.json",
    "vocab.txt",
    "tekken.json",
)

# SentencePiece byte-fallback pieces: "<0x41>" stands for the byte 0x41.
_BYTE_PIECE = re.compile(r"<0x[0-9A-Fa-f]{2}>")

_REPLACEMENT = "\ufffd"


class Attach(enum.Enum):
    """How a token's text attaches to the text of the token before it.

    The boundary before a token is *safe* (the text before it can no longer change) when
    the token is FREE, or when it is a BYTE_RUN piece and the token before it is not.
    """

    FREE = "free"
    """Starts fresh: nothing before it changes once it arrives."""
    BYTE_RUN = "byte_run"
    """A byte-fallback piece. Consecutive pieces decode as one unit, and an invalid run
    decodes to one U+FFFD per piece, so a run's text is unknown until the run ends."""
    CONTINUES = "continues"
    """Decodes alone to text starting with U+FFFD: it may complete a character begun by
    the token before it (byte-level BPE), so the boundary before it is not safe."""


@dataclass(frozen=True)
class TokenPiece:
    """What the detokenizer needs to know about one token id."""

    text: str
    """``decode([id], skip_special_tokens=False)``."""
    attach: Attach
    special: bool
    """True when ``decode(..., skip_special_tokens=True)`` drops this token."""
    in_vocab: bool = True
    """False for an id the tokenizer does not know (a model's padded vocabulary can
    sample one): ``decode`` drops it before joining its neighbours, whatever the flags."""


def _safe_boundary(prev: TokenPiece, cur: TokenPiece) -> bool:
    """True when the text of everything before ``cur`` is final once ``cur`` arrives."""
    if cur.attach is Attach.BYTE_RUN:
        return prev.attach is not Attach.BYTE_RUN
    return cur.attach is Attach.FREE


def validate_messages(messages: Any) -> list[dict]:
    """Check a chat conversation and return it as a list of dicts.

    A conversation is a non-empty list of ``{"role": str, "content": str}`` dicts whose
    roles are in :data:`KNOWN_ROLES`; other keys pass through to the template. An assistant
    message may carry ``tool_calls`` instead of content (see :func:`_template_tool_calls`).
    Raises ValueError naming the first offending message.
    """
    expected = 'a list of {"role": str, "content": str} dicts'
    if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Sequence):
        raise ValueError(f"messages must be {expected}, got {type(messages).__name__}")
    if len(messages) == 0:
        raise ValueError("messages must not be empty")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ValueError(f"messages[{i}] must be a dict, got {type(message).__name__}")
        if "role" not in message or ("content" not in message and not message.get("tool_calls")):
            raise ValueError(f"messages[{i}] must have 'role' and 'content' keys, got {sorted(message)}")
        role, content = message["role"], message.get("content")
        if not isinstance(role, str):
            raise ValueError(f"messages[{i}]['role'] must be a str, got {type(role).__name__}")
        if role not in KNOWN_ROLES:
            raise ValueError(f"messages[{i}] has unknown role {role!r}; expected one of {sorted(KNOWN_ROLES)}")
        message = dict(message)
        if message.get("tool_calls") is not None:
            message["tool_calls"] = _template_tool_calls(message["tool_calls"], f"messages[{i}]")
            if content is None:  # an assistant turn that only calls tools
                content = message["content"] = ""
        if not isinstance(content, str):
            raise ValueError(f"messages[{i}]['content'] must be a str, got {type(content).__name__}")
        out.append(message)
    return out


def _template_tool_calls(calls: Any, where: str) -> list[dict]:
    """An assistant message's ``tool_calls`` as chat templates expect them: OpenAI sends each
    call's ``arguments`` as a JSON string, templates render them as a mapping (``| tojson``),
    so the string is parsed here (as vLLM does). Raises ValueError naming a malformed call."""
    if not isinstance(calls, Sequence) or isinstance(calls, (str, bytes)):
        raise ValueError(f"{where}['tool_calls'] must be a list, got {type(calls).__name__}")
    out = []
    for j, call in enumerate(calls):
        here = f"{where}['tool_calls'][{j}]"
        function = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise ValueError(f"{here} must be {{'type': 'function', 'function': {{'name': str, 'arguments': str}}}}")
        arguments = function.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except ValueError as exc:
                raise ValueError(f"{here}['function']['arguments'] is not valid JSON: {exc}") from None
        out.append({**call, "function": {**function, "arguments": arguments}})
    return out


def check_text(text: object, what: str = "text") -> str:
    """``text`` if it is a string of valid Unicode, else ValueError saying where it is not.

    A JSON body can carry a lone surrogate (``"\\ud800"``), and a command line's undecodable
    bytes arrive as surrogate escapes (``\\xff`` -> U+DCFF): neither can be encoded as UTF-8,
    so no tokenizer can take them.
    """
    if not isinstance(text, str):
        raise ValueError(f"{what} must be a string, got {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        char = ord(text[exc.start])
        if 0xDC80 <= char <= 0xDCFF:  # surrogateescape: a byte that was not valid UTF-8
            detail = f"the byte 0x{char - 0xDC00:02x}, which is not valid UTF-8"
        else:
            detail = f"a lone surrogate U+{char:04X}, which is not valid Unicode"
        raise ValueError(f"{what} has {detail}, at character {exc.start}") from None
    return text


def render_plain_chat(messages: list[dict], add_generation_prompt: bool, tools: list[dict] | None = None) -> str:
    """The fallback chat format for tokenizers without a template: one ``role: content``
    line per message, then ``assistant:`` when a reply is wanted. Tools, when given, come
    first as one ``tools:`` line of JSON; an assistant's tool calls follow its content as
    ``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` (the hermes format)."""
    lines = [f"tools: {json.dumps(tools, ensure_ascii=False)}\n"] if tools else []
    for m in messages:
        calls = "".join(
            "<tool_call>"
            + json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]}, ensure_ascii=False)
            + "</tool_call>"
            for c in m.get("tool_calls") or ()
        )
        lines.append(f"{m['role']}: {m['content']}{calls}\n")
    text = "".join(lines)
    return text + "assistant:" if add_generation_prompt else text


class BaseTokenizer(ABC):
    """The interface the engine, the server and the detokenizer use.

    Subclasses set ``vocab_size``, ``bos_token_id`` and ``eos_token_ids`` and implement
    the abstract methods; ``piece`` results are cached per instance.
    """

    vocab_size: int
    bos_token_id: int | None
    eos_token_ids: frozenset[int]

    def __init__(self) -> None:
        self._pieces: dict[int, TokenPiece] = {}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; with ``add_special_tokens`` the tokenizer's own
        additions (usually a leading bos). Raises ValueError for text that is not valid
        Unicode (see :func:`check_text`): every entry point (API, server, CLI) passes here."""
        return self._encode(check_text(text), add_special_tokens)

    @abstractmethod
    def _encode(self, text: str, add_special_tokens: bool) -> list[int]: ...

    @abstractmethod
    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``token_ids``. Ids outside the vocabulary decode to nothing."""

    @abstractmethod
    def convert_ids_to_tokens(self, ids: int | Sequence[int]) -> str | None | list[str | None]:
        """Token strings (None for ids outside the vocabulary)."""

    @abstractmethod
    def convert_tokens_to_string(self, tokens: Sequence[str]) -> str:
        """Text of a list of token strings."""

    @property
    @abstractmethod
    def has_chat_template(self) -> bool:
        """Whether the model ships a chat template (else the plain fallback is used)."""

    @abstractmethod
    def _render_chat(self, messages: list[dict], add_generation_prompt: bool, tools: list[dict] | None) -> str: ...

    @abstractmethod
    def _make_piece(self, token_id: int) -> TokenPiece: ...

    @property
    @abstractmethod
    def max_token_chars(self) -> int:
        """An upper bound on the characters of input text that one token encodes (the
        longest token string): a text of C characters needs at least C / this tokens."""

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None
    ) -> str:
        """Render a conversation to prompt text with the model's chat template, or with
        :func:`render_plain_chat` when it has none. The text may already contain bos, so
        encode it with ``add_special_tokens=False`` when it does. ``tools``: OpenAI's tool
        definitions, which the template renders as the model was trained to see them (with
        an assistant's ``tool_calls`` and ``role: tool`` results in ``messages``).

        Raises ValueError for a malformed conversation or one the template rejects.
        """
        return self._render_chat(validate_messages(messages), add_generation_prompt, tools or None)

    def encode_chat(
        self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None
    ) -> list[int]:
        """Token ids of a conversation. A model's template writes its own special tokens
        (bos among them), so its text is encoded without adding them again; the plain
        fallback writes none, so its prompt gets bos as ``encode`` gives any other text."""
        text = self.apply_chat_template(messages, add_generation_prompt, tools)
        return self.encode(text, add_special_tokens=not self.has_chat_template)

    def piece(self, token_id: int) -> TokenPiece:
        """What the detokenizer needs to know about ``token_id`` (cached)."""
        piece = self._pieces.get(token_id)
        if piece is None:
            piece = self._pieces[token_id] = self._make_piece(token_id)
        return piece


class Tokenizer(BaseTokenizer):
    """A Hugging Face tokenizer behind ridge's tokenizer interface.

    ``eos_token_ids`` is the tokenizer's eos plus ``extra_eos_token_ids`` (what
    :func:`load_tokenizer` reads from ``generation_config.json`` and ``config.json``).
    ``bos_token_id`` is the tokenizer's, else ``default_bos_token_id``. ``add_bos`` None
    leaves the special tokens to the HF tokenizer; True or False decides bos alone (a GGUF
    file's ``tokenizer.ggml.add_bos_token``, which transformers versions honour differently).
    """

    def __init__(
        self,
        hf_tokenizer: Any,
        extra_eos_token_ids: Iterable[int] = (),
        default_bos_token_id: int | None = None,
        add_bos: bool | None = None,
    ) -> None:
        super().__init__()
        self.hf_tokenizer = hf_tokenizer
        self.add_bos = add_bos
        self.vocab_size = len(hf_tokenizer)
        bos = hf_tokenizer.bos_token_id
        self.bos_token_id = bos if bos is not None else default_bos_token_id
        eos = {int(i) for i in extra_eos_token_ids}
        if hf_tokenizer.eos_token_id is not None:
            eos.add(hf_tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos)

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        if self.add_bos is None:
            return list(self.hf_tokenizer.encode(text, add_special_tokens=add_special_tokens))
        ids = list(self.hf_tokenizer.encode(text, add_special_tokens=False))
        if add_special_tokens and self.add_bos and self.bos_token_id is not None and ids[:1] != [self.bos_token_id]:
            ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.hf_tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: int | Sequence[int]) -> str | None | list[str | None]:
        return self.hf_tokenizer.convert_ids_to_tokens(ids if isinstance(ids, int) else list(ids))

    def convert_tokens_to_string(self, tokens: Sequence[str]) -> str:
        return self.hf_tokenizer.convert_tokens_to_string(list(tokens))

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf_tokenizer, "chat_template", None))

    def _render_chat(self, messages: list[dict], add_generation_prompt: bool, tools: list[dict] | None) -> str:
        if not self.has_chat_template:
            return render_plain_chat(messages, add_generation_prompt, tools)
        try:
            # transformers 5 tokenizes by default (and returns a dict); we want the text.
            text = self.hf_tokenizer.apply_chat_template(
                messages, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt
            )
        except Exception as e:  # jinja errors, raise_exception() in templates, ...
            raise ValueError(f"the chat template rejected the messages: {e}") from e
        if not isinstance(text, str):
            raise ValueError(f"the chat template returned {type(text).__name__}, not text")
        return text

    @functools.cached_property
    def max_token_chars(self) -> int:
        # Token strings are never shorter than the text they encode: byte-level BPE spells
        # one character per byte, SentencePiece '<0x41>' is six for one byte, '▁the' is ' the'.
        tokens = self.hf_tokenizer.convert_ids_to_tokens(list(range(self.vocab_size)))
        return max([len(t) for t in tokens if t], default=1)

    def _make_piece(self, token_id: int) -> TokenPiece:
        text = self.decode([token_id], skip_special_tokens=False)
        # Probing decode itself, rather than reading special-token lists, matches exactly
        # what decode(..., skip_special_tokens=True) drops, whatever the backend.
        special = bool(text) and not self.decode([token_id], skip_special_tokens=True)
        token = self.hf_tokenizer.convert_ids_to_tokens(token_id)
        if token is None:
            return TokenPiece(text="", attach=Attach.FREE, special=False, in_vocab=False)
        if isinstance(token, str) and _BYTE_PIECE.fullmatch(token):
            attach = Attach.BYTE_RUN
        elif text.startswith(_REPLACEMENT):
            attach = Attach.CONTINUES
        else:
            attach = Attach.FREE
        return TokenPiece(text=text, attach=attach, special=special)


class ByteTokenizer(BaseTokenizer):
    """A file-free tokenizer over UTF-8 bytes, for models built with random weights.

    Ids: 0 ``<pad>``, 1 ``<s>`` (bos), 2 ``</s>`` (eos), byte ``b`` -> ``b + 3``;
    ``vocab_size`` 259. Decoding joins the bytes (special tokens skipped, or rendered by
    name) and replaces invalid UTF-8 with U+FFFD; ids >= 259, which a model with a larger
    vocabulary can sample, decode to nothing, as they do in Hugging Face tokenizers.
    The chat template is the plain fallback.
    """

    PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
    OFFSET = 3
    SPECIAL_TOKENS = ("<pad>", "<s>", "</s>")

    def __init__(self) -> None:
        super().__init__()
        self.vocab_size = 256 + self.OFFSET
        self.bos_token_id = self.BOS_ID
        self.eos_token_ids = frozenset({self.EOS_ID})

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        ids = [b + self.OFFSET for b in text.encode("utf-8")]
        return [self.BOS_ID, *ids] if add_special_tokens else ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        parts: list[str] = []
        pending = bytearray()
        for i in token_ids:
            if self.OFFSET <= i < self.vocab_size:
                pending.append(i - self.OFFSET)
            elif 0 <= i < self.OFFSET and not skip_special_tokens:
                # A rendered special token ends the byte run, as an added token does.
                parts.append(pending.decode("utf-8", errors="replace"))
                pending.clear()
                parts.append(self.SPECIAL_TOKENS[i])
        parts.append(pending.decode("utf-8", errors="replace"))
        return "".join(parts)

    def convert_ids_to_tokens(self, ids: int | Sequence[int]) -> str | None | list[str | None]:
        if isinstance(ids, int):
            return self._token(ids)
        return [self._token(i) for i in ids]

    def _token(self, i: int) -> str | None:
        if 0 <= i < self.OFFSET:
            return self.SPECIAL_TOKENS[i]
        if self.OFFSET <= i < self.vocab_size:
            return f"<0x{i - self.OFFSET:02X}>"
        return None

    def convert_tokens_to_string(self, tokens: Sequence[str]) -> str:
        ids = []
        for t in tokens:
            if t in self.SPECIAL_TOKENS:
                ids.append(self.SPECIAL_TOKENS.index(t))
            elif _BYTE_PIECE.fullmatch(t):
                ids.append(int(t[3:5], 16) + self.OFFSET)
            else:
                raise ValueError(f"not a ByteTokenizer token: {t!r}")
        return self.decode(ids, skip_special_tokens=False)

    @property
    def has_chat_template(self) -> bool:
        return False

    def _render_chat(self, messages: list[dict], add_generation_prompt: bool, tools: list[dict] | None) -> str:
        return render_plain_chat(messages, add_generation_prompt, tools)

    @property
    def max_token_chars(self) -> int:
        return 1  # a character is at least one byte, and each byte is a token

    def _make_piece(self, token_id: int) -> TokenPiece:
        if 0 <= token_id < self.OFFSET:
            return TokenPiece(self.SPECIAL_TOKENS[token_id], Attach.FREE, special=True)
        if not self.OFFSET <= token_id < self.vocab_size:
            return TokenPiece("", Attach.FREE, special=False, in_vocab=False)
        b = token_id - self.OFFSET
        # Only continuation bytes (10xxxxxx) can join the bytes before them; any other
        # byte starts a new character and settles whatever came before.
        attach = Attach.CONTINUES if 0x80 <= b < 0xC0 else Attach.FREE
        return TokenPiece(bytes([b]).decode("utf-8", errors="replace"), attach, special=False)


def _read_token_ids(path: Path, key: str) -> list[int]:
    """``key`` (an int or a list of ints) from a JSON config; [] when absent."""
    if not path.is_file():
        return []
    try:
        value = json.loads(path.read_text(encoding="utf-8")).get(key)
    except (OSError, ValueError, AttributeError) as e:
        raise ValueError(f"cannot read {key} from {path}: {e}") from e
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise ValueError(f"{path}: {key} must be an int or a list of ints, got {value!r}")
    return values


def load_tokenizer(model_dir: str | os.PathLike) -> Tokenizer:
    """Load the tokenizer of a Hugging Face model directory, offline.

    Uses ``AutoTokenizer.from_pretrained(model_dir, local_files_only=True)``, so either
    ``tokenizer.json`` or ``tokenizer.model`` (with ``tokenizer_config.json`` naming the
    class) is enough. Adds the ``eos_token_id`` of ``generation_config.json`` and
    ``config.json`` to the eos set, and takes their ``bos_token_id`` when the tokenizer
    names none. Raises ValueError naming the directory when it has no tokenizer files
    or they cannot be loaded.
    """
    from transformers import AutoTokenizer  # heavy import, only when a model has files

    path = Path(model_dir)
    if path.is_file() and path.suffix.lower() == ".gguf":
        return load_gguf_tokenizer(path)
    if not path.is_dir():
        raise ValueError(f"tokenizer directory {str(path)!r} does not exist")
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise ValueError(f"no tokenizer files ({', '.join(TOKENIZER_FILES)}) in {str(path)!r}")
    try:
        hf = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as e:  # corrupt JSON, unknown class, sentencepiece errors, ...
        raise ValueError(f"cannot load the tokenizer in {str(path)!r}: {type(e).__name__}: {e}") from e
    if hf is None or not len(hf):
        raise ValueError(f"the tokenizer in {str(path)!r} is empty")

    eos: list[int] = []
    bos: list[int] = []
    for name in ("generation_config.json", "config.json"):
        eos += _read_token_ids(path / name, "eos_token_id")
        bos += _read_token_ids(path / name, "bos_token_id")
    return Tokenizer(hf, extra_eos_token_ids=eos, default_bos_token_id=bos[0] if bos else None)


def load_gguf_tokenizer(path: Path) -> Tokenizer:
    """The tokenizer (and chat template) a GGUF file carries in its metadata, built by
    transformers (``gguf_file=``). Files whose special-token ids point past the vocabulary
    (llama.cpp writes -1 for "none") are read with those ids dropped. Whether a prompt gets
    bos is the file's ``tokenizer.ggml.add_bos_token``, else llama.cpp's default (yes for
    SentencePiece vocabularies, no for GPT-2 BPE ones), whatever transformers would do."""
    from gguf import GGUFReader
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    try:
        fields = GGUFReader(path).fields
    except Exception as e:
        raise ValueError(f"{path.name} is not a readable GGUF file ({type(e).__name__}: {e})") from None
    add_bos_field, model_field = fields.get("tokenizer.ggml.add_bos_token"), fields.get("tokenizer.ggml.model")
    if add_bos_field is not None:
        add_bos = bool(add_bos_field.contents())
    else:
        add_bos = model_field is not None and model_field.contents() == "llama"

    try:
        hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    except IndexError:
        hf = None
    except Exception as e:
        raise ValueError(f"cannot build the tokenizer of {path.name}: {type(e).__name__}: {e}") from e
    if hf is None:
        from transformers.integrations.gguf import convert_gguf_tokenizer
        from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_TOKENIZER_MAPPING
        from transformers.integrations.gguf.reader import read_gguf_metadata

        meta, _ = read_gguf_metadata(str(path), ("tokenizer.ggml.tokens", "tokenizer.ggml.merges"))
        tokens = meta.get("tokenizer.ggml.tokens") or []
        for key in [k for k in meta if k.startswith("tokenizer.ggml.") and k.endswith("_token_id")]:
            if not 0 <= int(meta[key]) < len(tokens):
                del meta[key]
        grouped = {
            group: {name: meta[f"tokenizer.{key}"] for key, name in renames.items() if f"tokenizer.{key}" in meta}
            for group, renames in GGUF_TOKENIZER_MAPPING.items()
        }
        backend, _ = convert_gguf_tokenizer(meta["general.architecture"], grouped["tokenizer"])
        config = grouped["tokenizer_config"]
        if grouped["tokenizer"].get("tokenizer_type") == "llama":
            config.setdefault("add_bos_token", True)
        specials = {"bos_token": "bos_token_id", "eos_token": "eos_token_id", "unk_token": "unknown_token_id"}
        for name, key in specials.items():
            if f"tokenizer.ggml.{key}" in meta:
                config[name] = tokens[int(meta[f"tokenizer.ggml.{key}"])]
        hf = PreTrainedTokenizerFast(tokenizer_object=backend, **config)
    if not len(hf):
        raise ValueError(f"the tokenizer in {path.name} is empty")
    if model_field is not None and model_field.contents() == "llama":
        space_field = fields.get("tokenizer.ggml.add_space_prefix")
        _spm_whitespace(hf, add_space_prefix=bool(space_field.contents()) if space_field is not None else True)
    return Tokenizer(hf, add_bos=add_bos)


def _spm_whitespace(hf, add_space_prefix: bool) -> None:
    """llama.cpp's SentencePiece whitespace, whatever the installed transformers builds: a space
    before each text fragment (the text's start, and after each special token) where the file
    says ``add_space_prefix`` (llama.cpp's default), then every space escaped to U+2581; what
    sentencepiece computes. transformers 5.2x's Metaspace (prepend_scheme "first") skips the
    prefix where a text already starts with a space: " leading space" lost a token there."""
    from tokenizers import decoders, normalizers

    backend = hf.backend_tokenizer
    steps = [normalizers.Prepend("\u2581")] if add_space_prefix else []
    backend.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", "\u2581")])
    backend.pre_tokenizer = None
    # and back: U+2581 to spaces, <0xNN> pieces to bytes, less the one space the prefix added
    strip = [decoders.Strip(" ", 1, 0)] if add_space_prefix else []
    backend.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), *strip]
    )


class IncrementalDetokenizer:
    """Turns a stream of generated token ids into text, correct across multi-byte
    characters and SentencePiece leading spaces, and applies stop strings.

    Contracts:

    * ``.text`` equals ``tokenizer.decode(output_ids, skip_special_tokens)`` with no stop
      hit, except that the first output token's leading space is kept when the prompt's
      last token gives it context (the text continues the prompt's).
    * A stop string is matched as soon as it appears in ``.text``, even split across
      tokens; ``.text`` is then cut before it (or after it, with
      ``include_stop_str_in_output``) and the detokenizer accepts no more tokens.
      Among several matches the one that ends first wins.
    * The deltas from ``take_delta`` concatenate to ``.text`` once one is taken with
      ``finished=True`` (which ends the output) or after a stop; before that they never
      include text a later token could change (an open byte-fallback run, a trailing
      U+FFFD of a partial character) nor a suffix that could begin a stop string.

    Cost per step is O(new tokens + the open window), not a re-decode of the output.
    """

    def __init__(
        self,
        tokenizer: BaseTokenizer,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
    ) -> None:
        if isinstance(stop, str):
            stop = [stop]
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError(f"stop strings must be non-empty strings, got {list(stop)!r}")
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._stops = tuple(dict.fromkeys(stop))
        self._max_stop = max((len(s) for s in self._stops), default=0)
        self._include_stop = include_stop_str_in_output

        # The output as decode sees it: with skip_special_tokens, skipped ids are dropped
        # here, since decode drops them before its decoder joins neighbouring tokens.
        self._ids: list[int] = []
        self._pieces: list[TokenPiece] = []
        # Context: the token just before the window (the prompt's last, at first), so
        # the window decodes as a continuation, not as a sequence start.
        self._ctx: list[int] = []
        self._ctx_text = ""
        for i in reversed(prompt_token_ids):
            if self._kept(tokenizer.piece(i)):
                self._ctx = [i]
                self._ctx_text = self._decode([i])
                break

        self._chunks: list[str] = []  # final text, before the window
        self._committed_len = 0
        self._anchor = 0  # index in _ids where the window starts; a safe boundary
        self._window_text = ""
        self._streamed = 0  # characters of .text already returned by take_delta
        self._token_cursor = 0  # characters of .text already returned by take_token_text
        self._stop_hit: str | None = None
        self._finished = False  # take_delta(finished=True) flushed everything

    @property
    def text(self) -> str:
        """The output text so far (cut at a stop string once one is hit)."""
        if len(self._chunks) > 1:
            self._chunks = ["".join(self._chunks)]  # amortize repeated reads
        return (self._chunks[0] if self._chunks else "") + self._window_text

    @property
    def stop_hit(self) -> str | None:
        """The stop string that ended the output, if any."""
        return self._stop_hit

    def add_tokens(self, token_ids: Sequence[int]) -> str | None:
        """Append generated tokens; return the stop string they complete, else None.

        Raises RuntimeError after a stop string was hit or ``take_delta(finished=True)``.
        """
        if self._stop_hit is not None:
            raise RuntimeError(f"stop string {self._stop_hit!r} already hit; no more tokens accepted")
        if self._finished:
            raise RuntimeError("the output was finished by take_delta(finished=True); no more tokens accepted")
        old_len = len(self._ids)
        for i in map(int, token_ids):
            piece = self._tok.piece(i)
            if not self._kept(piece):
                continue
            self._ids.append(i)
            self._pieces.append(piece)
        if len(self._ids) == old_len:
            return None
        if old_len == 0 and self._ctx and not _safe_boundary(self._tok.piece(self._ctx[0]), self._pieces[0]):
            # The first token may join the prompt's last (a split character): decode the
            # output on its own, as decode(output_ids) does.
            self._ctx, self._ctx_text = [], ""

        old_committed_len, old_window_text = self._committed_len, self._window_text
        self._advance_anchor(old_len, old_window_text)
        self._window_text = self._decode_in_context(self._ids[self._anchor :])

        if not self._stops:
            return None
        # Text before `changed` is as it was; a stop string can only end after it.
        new_tail = self._text_from(old_committed_len)
        changed = old_committed_len + len(os.path.commonprefix([old_window_text, new_tail]))
        return self._find_stop(max(0, changed - self._max_stop + 1))

    def take_delta(self, finished: bool = False) -> str:
        """The text since the last call that is safe to stream.

        With ``finished`` (or after a stop string) everything left is returned, so the
        deltas then add up to ``.text``, and no more tokens are accepted.
        """
        pending = self._text_from(self._streamed)
        if finished or self._stop_hit is not None:
            self._finished = True
            n = len(pending)
        else:
            if self._pieces and self._pieces[-1].attach is Attach.BYTE_RUN:
                pending = pending[: max(0, self._committed_len - self._streamed)]  # run's text unknown yet
            # A trailing U+FFFD may be the start of a character the next token completes.
            pending = pending.rstrip(_REPLACEMENT)
            n = len(pending) - self._stop_prefix_len(pending)
        self._streamed += n
        return pending[:n]

    def take_token_text(self, final: bool = False) -> str:
        """The text that the tokens added since the last call contribute to ``.text``: the
        results of successive calls concatenate to ``.text`` (once one is taken with
        ``final``, or after a stop, or up to the cut of a stop string). Text a later token
        could still change (an open byte run, a trailing U+FFFD) is left for the token that
        settles it. Logprob entries use this, one call per token; its cursor is its own, so
        it does not disturb ``take_delta``.
        """
        pending = self._text_from(min(self._token_cursor, self._text_len()))
        if not (final or self._stop_hit is not None or self._finished):
            if self._pieces and self._pieces[-1].attach is Attach.BYTE_RUN:
                pending = pending[: max(0, self._committed_len - self._token_cursor)]
            pending = pending.rstrip(_REPLACEMENT)
        self._token_cursor += len(pending)
        return pending

    # -- internals -------------------------------------------------------------------

    def _kept(self, piece: TokenPiece) -> bool:
        """Whether decode keeps this token when joining: it drops unknown ids always, and
        special tokens with skip_special_tokens, before its decoder joins the rest."""
        return piece.in_vocab and not (self._skip and piece.special)

    def _text_len(self) -> int:
        return self._committed_len + len(self._window_text)

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip)

    def _decode_in_context(self, ids: list[int]) -> str:
        """Text of ``ids`` as it follows the context tokens."""
        full = self._decode(self._ctx + ids)
        if full.startswith(self._ctx_text):
            return full[len(self._ctx_text) :]
        # Not expected at a safe boundary; decoding without context is the best guess.
        return self._decode(ids)

    def _advance_anchor(self, old_len: int, old_window_text: str) -> None:
        """Move the window start to the last safe boundary among the new tokens,
        committing the text before it."""
        ids, pieces = self._ids, self._pieces
        boundary = None
        for k in range(len(ids) - 1, max(self._anchor, old_len - 1, 0), -1):
            if _safe_boundary(pieces[k - 1], pieces[k]):
                boundary = k
                break
        if boundary is None:
            return
        if boundary == old_len:
            # The usual step: the old window is exactly what gets committed, and its text
            # (decoded last step with the same context) is final.
            committed = old_window_text
        else:
            committed = self._decode_in_context(ids[self._anchor : boundary])
        self._chunks.append(committed)
        self._committed_len += len(committed)
        self._anchor = boundary
        self._ctx = [ids[boundary - 1]]
        # Its own text: it is never a skipped special, so skipping changes nothing.
        self._ctx_text = pieces[boundary - 1].text

    def _text_from(self, pos: int) -> str:
        """``self.text[pos:]``, in time proportional to its length."""
        start = self._committed_len
        parts = [self._window_text]
        i = len(self._chunks)
        while i > 0 and start > pos:
            i -= 1
            start -= len(self._chunks[i])
            parts.append(self._chunks[i])
        return "".join(reversed(parts))[pos - start :]

    def _find_stop(self, search_from: int) -> str | None:
        region = self._text_from(search_from)
        best = None  # (end, start, stop)
        for stop in self._stops:
            at = region.find(stop)
            if at >= 0:
                match = (at + len(stop), at, stop)
                if best is None or match < best:
                    best = match
        if best is None:
            return None
        end, start, stop = best
        cut = search_from + (end if self._include_stop else start)
        self._chunks = [self.text[:cut]]
        self._committed_len = cut
        self._window_text = ""
        self._stop_hit = stop
        return stop

    def _stop_prefix_len(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop."""
        longest = 0
        last = text[-1:]
        for stop in self._stops:
            for n in range(min(len(stop) - 1, len(text)), longest, -1):
                if stop[n - 1] == last and text.endswith(stop[:n]):
                    longest = n
                    break
        return longest

"""The output processor's logprob texts: the sampled tokens' texts join into the output text,
for SentencePiece (stories260K), byte-level BPE (GPT-2, ChatML) and the bytes tokenizer."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ridge.engine.output_processor import OutputProcessor, RequestState, SequenceState
from ridge.engine.step import RunnerOutput, SchedulerOutput
from ridge.engine.stop import StopLimits
from ridge.engine.tokenizer import IncrementalDetokenizer
from ridge.sampling import SamplingParams
from tests.engine.conftest import ALL, PROPERTY, id_lists, texts


def generate(tok, prompt_ids: list[int], output_ids: list[int], **params):
    """Feed ``output_ids`` one step at a time, as the runner's outputs come; returns the
    final output and the sequence (for its finish reason)."""
    sp = SamplingParams(max_tokens=max(len(output_ids), 1), logprobs=2, **params)
    limits = StopLimits(sp, sp.max_tokens, len(prompt_ids), 10**9, frozenset(tok.eos_token_ids))
    proc = OutputProcessor(tok)
    detok = IncrementalDetokenizer(
        tok,
        list(prompt_ids),
        skip_special_tokens=sp.skip_special_tokens,
        stop=sp.stop,
        include_stop_str_in_output=sp.include_stop_str_in_output,
    )
    seq = SequenceState("r", "r", limits, detok, [])
    proc.add(RequestState("r", None, list(prompt_ids), 0.0, stream=True, sequences=[seq]))
    final = None
    for token in output_ids:
        alternative = (token + 1) % tok.vocab_size
        out = RunnerOutput({"r": [token]}, {"r": [(-0.5, [(alternative, -0.1), (token, -0.5)])]})
        for output in proc.process(SchedulerOutput(), out).outputs:
            final = output
        if seq.is_finished:
            break
    return final, seq


def continuation(tok, prompt: str, more: str) -> tuple[list[int], list[int]]:
    """(prompt ids, the ids that continue them into ``prompt + more``)."""
    prompt_ids, full = tok.encode(prompt), tok.encode(prompt + more)
    assert full[: len(prompt_ids)] == prompt_ids
    return prompt_ids, full[len(prompt_ids) :]


def sampled_texts(comp) -> list[str]:
    return [entry[token].decoded_token for token, entry in zip(comp.token_ids, comp.logprobs)]


@pytest.mark.parametrize("tokenizer", ALL, indirect=True)
def test_sampled_token_texts_join_into_the_text(tokenizer):
    tok = tokenizer

    @PROPERTY
    @given(prompt=texts(1, 4), ids=id_lists(tok, max_size=10), skip=st.booleans())
    def prop(prompt, ids, skip):
        eos = set(tok.eos_token_ids)
        ids = [i for i in ids if i not in eos] or [tok.vocab_size - 1]
        prompt_ids = tok.encode(prompt)
        out, req = generate(tok, prompt_ids, ids, skip_special_tokens=skip, ignore_eos=True)
        comp = out.outputs[0]
        assert out.finished and len(comp.logprobs) == len(comp.token_ids) == len(ids)
        assert "".join(sampled_texts(comp)) == comp.text

    prop()


@pytest.mark.parametrize("tokenizer", ["stories", "gpt2", "chat", "byte"], indirect=True)
def test_words_keep_their_leading_space(tokenizer):
    """The bug: SentencePiece tokens decoded alone lost their space (', there was' came
    back as [',', 'there', 'was'])."""
    tok = tokenizer
    prompt_ids, words = continuation(tok, "Once upon a time", ", there was a cat")
    out, _ = generate(tok, prompt_ids, words)
    comp = out.outputs[0]
    texts_ = sampled_texts(comp)
    assert comp.text == ", there was a cat" == "".join(texts_)
    spaced = [k for k, t in enumerate(texts_) if t.startswith(" ")]
    assert len(spaced) == 4  # " there", " was", " a", " cat" (or their first pieces)
    # The alternatives are decoded after the token before them: their spaces show too.
    proc = OutputProcessor(tok)
    assert all(proc._text_after(words[k - 1], words[k]) == texts_[k] for k in spaced)


@pytest.mark.parametrize("tokenizer", ["stories", "byte"], indirect=True)
def test_a_split_character_belongs_to_the_token_that_completes_it(tokenizer):
    tok = tokenizer
    prompt_ids, ids = continuation(tok, "Once", "a日本")
    assert len(ids) > 3  # byte fallback / bytes: the characters are split over tokens
    out, _ = generate(tok, prompt_ids, ids)
    texts_ = sampled_texts(out.outputs[0])
    assert "".join(texts_) == "a日本" and set(texts_) <= {"", "a", "日", "本", "日本"}  # whole characters


def test_an_unseen_eos_carries_its_own_text_after_the_held_back_text(stories):
    """An open byte run then eos: the run's text is not lost from the tokens."""
    tok = stories
    eos = min(tok.eos_token_ids)
    prompt_ids, ids = continuation(tok, "Once", "a日")
    out, req = generate(tok, prompt_ids, ids + [eos])
    comp = out.outputs[0]
    assert req.finish_reason == "stop" and comp.text == "a日"
    assert "".join(sampled_texts(comp)) == comp.text + tok.piece(eos).text

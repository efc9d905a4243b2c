"""SamplingParams(prompt_logprobs=k): every prompt token's logprob under the model, its rank and
the top-k at its position, against transformers on the same weights."""

from __future__ import annotations

import pytest
import torch
import transformers

from ridge import LLM, SamplingParams

PROMPT = "Once upon a time, there was a little girl named Lily. She loved to play"


@pytest.fixture(scope="module")
def reference(stories_dir):
    return transformers.LlamaForCausalLM.from_pretrained(stories_dir, dtype=torch.float32).eval()


def _check(out, hf, k):
    ids = out.prompt_token_ids
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
    got = out.prompt_logprobs
    assert len(got) == len(ids) and got[0] is None
    for pos in range(1, len(ids)):
        entry, row = got[pos], ref[pos - 1]
        token = ids[pos]
        assert abs(entry[token].logprob - row[token].item()) <= 1e-4
        assert entry[token].rank == int((row > row[token]).sum()) + 1
        top = row.topk(k).indices.tolist()
        assert set(top) <= set(entry) and len(entry) <= k + 1  # the top-k, and the prompt token
        assert all(abs(entry[t].logprob - row[t].item()) <= 1e-4 for t in top)


def test_prompt_logprobs_match_transformers(stories_dir, reference):
    llm = LLM(str(stories_dir), num_kv_blocks=64)
    out = llm.generate([PROMPT], SamplingParams(max_tokens=3, prompt_logprobs=3, temperature=0), use_tqdm=False)[0]
    _check(out, reference, 3)
    # the prompt tokens' texts join into the prompt (after its first token, <s>)
    text = "".join(out.prompt_logprobs[p][t].decoded_token for p, t in enumerate(out.prompt_token_ids) if p)
    assert text == PROMPT


def test_prompt_logprobs_are_computed_whatever_the_cache_and_the_chunking(stories_dir, reference):
    params = SamplingParams(max_tokens=2, prompt_logprobs=0, temperature=0)
    llm = LLM(str(stories_dir), num_kv_blocks=64, block_size=4, max_num_batched_tokens=5)  # chunks of 5
    llm.generate([PROMPT], SamplingParams(max_tokens=2), use_tqdm=False)  # fills the prefix cache
    out = llm.generate([PROMPT], params, use_tqdm=False)[0]
    assert out.num_cached_tokens == 0  # not served from the cache
    _check(out, reference, 0)
    n2 = llm.generate(
        [PROMPT], SamplingParams(n=2, max_tokens=2, prompt_logprobs=1, temperature=1, seed=1), use_tqdm=False
    )[0]
    assert len(n2.prompt_logprobs) == len(n2.prompt_token_ids)


def test_prompt_logprobs_out_of_range_is_a_clear_error():
    with pytest.raises(ValueError, match="prompt_logprobs must be an int in \\[0, 20\\] or None"):
        SamplingParams(prompt_logprobs=21)

"""Served together (with preemptions) or alone, every greedy request produces the same tokens."""

from __future__ import annotations

import pytest
import torch

from ridge import LLM, SamplingParams

from ..models.hf_tiny import build


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("llama-invariance")
    build("llama-gqa", directory, seed=3)
    return directory


def test_batched_with_preemption_equals_alone(model_dir):
    gen = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(3, 300, (int(n),), generator=gen).tolist() for n in torch.randint(1, 41, (32,), generator=gen)
    ]
    params = [
        SamplingParams(temperature=0.0, max_tokens=int(m), ignore_eos=True)
        for m in torch.randint(4, 25, (32,), generator=gen)
    ]

    # 40 blocks of 4 tokens cannot hold 32 requests of up to 64 tokens: preemption is forced.
    crowded = LLM(
        str(model_dir), tokenizer="bytes", dtype="float32", block_size=4, num_kv_blocks=40, max_num_batched_tokens=48
    )
    together = crowded.generate(prompts, params, use_tqdm=False)
    assert crowded.engine.scheduler.num_preemptions > 0
    crowded.engine.kv.check_integrity()
    assert crowded.engine.kv.pool.counts()["used"] == 0  # the pool is whole once idle

    roomy = LLM(str(model_dir), tokenizer="bytes", dtype="float32", block_size=4, num_kv_blocks=64)
    for prompt, sp, out in zip(prompts, params, together):
        alone = roomy.generate([prompt], sp, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == alone.outputs[0].token_ids
        assert len(out.outputs[0].token_ids) == sp.max_tokens

"""Parity with Hugging Face transformers: logits within 1e-4 and identical greedy tokens.

float32 throughout. The engine's logits are captured at every sampling step and compared
with transformers' logits for the same sequence (teacher forcing on ridge's tokens); the
tokens must be the argmax of transformers' logits at every step.
"""

from __future__ import annotations

import pytest
import torch

from ridge import LLM, SamplingParams
from ridge.layers.attention import AttentionMetadata, PrefillChunk

from .hf_tiny import VARIANTS, build

ATOL = 1e-4
NUM_DECODE_STEPS = 16


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def hf_model(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    return request.param, directory, build(request.param, directory)


def _prompts(n: int, seed: int = 1) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = [5, 23, 40, 1, 17, 33, 9, 64][:n]
    return [torch.randint(3, 300, (length,), generator=gen).tolist() for length in lengths]


def _record_logits(llm: LLM) -> dict[str, list[torch.Tensor]]:
    """Wrap the runner so every sampled row's logits are kept, per request id."""
    runner = llm.engine.executor.worker.runner
    seen: dict[str, list[torch.Tensor]] = {}
    original = runner.forward_logits

    def recording(batch):
        logits = original(batch)
        for rid, row in zip(batch.sample_request_ids, logits):
            seen.setdefault(rid, []).append(row.clone())
        return logits

    runner.forward_logits = recording
    return seen


def _check_against_hf(hf, prompt: list[int], tokens: list[int], logits: list[torch.Tensor]) -> None:
    with torch.no_grad():
        ref = hf(torch.tensor([prompt + tokens])).logits[0]
    ref = ref[len(prompt) - 1 : len(prompt) - 1 + len(tokens)]
    got = torch.stack(logits).cpu()  # the engine runs on CUDA where there is one
    assert got.shape == ref.shape
    diff = (got - ref).abs().max().item()
    assert diff <= ATOL, f"largest logit difference {diff:.3g}"
    assert tokens == ref.argmax(-1).tolist(), "greedy tokens differ from transformers"


@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("chunked", [False, True])
def test_engine_matches_transformers(hf_model, block_size, chunked):
    name, directory, hf = hf_model
    # A small token budget forces chunked prefill and mixes chunks with decodes in one step.
    budget = 8 if chunked else 512
    llm = LLM(
        str(directory),
        tokenizer="bytes",
        dtype="float32",
        block_size=block_size,
        max_num_batched_tokens=budget,
        enable_chunked_prefill=chunked,
        num_kv_blocks=4096 // block_size,
    )
    seen = _record_logits(llm)
    prompts = _prompts(6 if chunked else 8)
    params = SamplingParams(temperature=0.0, max_tokens=NUM_DECODE_STEPS, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outputs):
        tokens = out.outputs[0].token_ids
        assert len(tokens) == NUM_DECODE_STEPS
        _check_against_hf(hf, prompt, tokens, seen[out.request_id])
    llm.engine.kv.check_integrity()


def test_preempted_and_recomputed_requests_still_match_transformers(hf_model):
    """A pool too small for the batch: requests are preempted, recomputed, and still agree."""
    name, directory, hf = hf_model
    llm = LLM(str(directory), tokenizer="bytes", dtype="float32", block_size=4, num_kv_blocks=40)
    seen = _record_logits(llm)
    prompts = _prompts(8)
    params = SamplingParams(temperature=0.0, max_tokens=NUM_DECODE_STEPS, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    for prompt, out in zip(prompts, outputs):
        # a preempted request's logits are recorded again when it recomputes: keep the last run's
        tokens = out.outputs[0].token_ids
        _check_against_hf(hf, prompt, tokens, seen[out.request_id][-len(tokens) :])
    llm.engine.kv.check_integrity()


def test_alone_equals_hf_generate(hf_model):
    """One request alone, against transformers' own greedy generate()."""
    name, directory, hf = hf_model
    llm = LLM(str(directory), tokenizer="bytes", dtype="float32", num_kv_blocks=64)
    prompt = _prompts(2)[1]
    out = llm.generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=NUM_DECODE_STEPS, ignore_eos=True), use_tqdm=False
    )[0]
    with torch.no_grad():
        ref = hf.generate(
            torch.tensor([prompt]),
            max_new_tokens=NUM_DECODE_STEPS,
            min_new_tokens=NUM_DECODE_STEPS,
            do_sample=False,
            pad_token_id=0,
        )
    assert out.outputs[0].token_ids == ref[0, len(prompt) :].tolist()


@pytest.mark.parametrize("chunk", [7, 16])
def test_prefill_logits_every_position(hf_model, chunk):
    """Prefill logits at every position, the prompt fed in chunks through the paged cache."""
    name, directory, hf = hf_model
    llm = LLM(str(directory), tokenizer="bytes", dtype="float32", block_size=4, num_kv_blocks=64)
    model, caches, device = llm.engine.executor.worker.model, llm.engine.executor.worker.kv_caches, llm.engine.device
    prompt = _prompts(3)[2]  # 40 tokens
    table = torch.arange(16, device=device)
    got = []
    with torch.no_grad():
        for start in range(0, len(prompt), chunk):
            end = min(start + chunk, len(prompt))
            positions = torch.arange(start, end, device=device)
            slots = table[positions // 4] * 4 + positions % 4
            meta = AttentionMetadata(slot_mapping=slots, prefills=[PrefillChunk(0, end - start, end, table)])
            hidden = model(torch.tensor(prompt[start:end], device=device), positions, caches, meta)
            got.append(model.compute_logits(hidden))
        ref = hf(torch.tensor([prompt])).logits[0]
    diff = (torch.cat(got).cpu() - ref).abs().max().item()
    assert diff <= ATOL, f"largest logit difference {diff:.3g}"

"""The runner's flat batch (``ModelRunner.prepare``): decode rows first, prefill chunks after,
logit rows in the chunks' order; short prompt chunks as decode rows where the kernels ask."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from ridge.worker.runner import ChunkInput, ModelRunner


def _runner(short_chunk_rows: int) -> ModelRunner:
    model = SimpleNamespace(kernels=SimpleNamespace(short_chunk_rows=short_chunk_rows))
    return ModelRunner(model, [], 4, torch.device("cpu"))


CHUNKS = [
    ChunkInput("long", 0, list(range(10, 30)), [0, 1, 2, 3, 4], True),  # a 20-token prompt
    ChunkInput("short", 5, [7, 8, 9], [5, 6], True),  # a 3-token chunk after 5 cached tokens
    ChunkInput("decode", 8, [4], [7, 8, 9], True),
    ChunkInput("verify", 2, [1, 2, 3], [10, 11], False, verify=True),
]


def test_short_chunks_run_as_decode_rows_ahead_of_prefills():
    batch = _runner(16).prepare(CHUNKS)
    meta = batch.meta
    # rows: short 0-2, decode 3, verify 4-6 | long 7-26
    assert meta.num_decode_tokens == 7
    assert batch.positions[:7].tolist() == [5, 6, 7, 8, 2, 3, 4]
    assert meta.decode_context_lens.tolist() == [6, 7, 8, 9, 3, 4, 5]
    assert meta.slot_mapping[:3].tolist() == [6 * 4 + 1, 6 * 4 + 2, 6 * 4 + 3]  # its block 1 (positions 4-7) is 6
    assert [(c.start, c.end, c.context_len) for c in meta.prefills] == [(7, 27, 20)]
    # logit rows: the samplers in the chunks' order, then the verify run
    assert batch.sample_request_ids == ["long", "short", "decode"]
    assert batch.sample_rows.tolist() == [26, 2, 3, 4, 5, 6]
    assert batch.verify_runs == [("verify", [2, 3])]


@pytest.mark.parametrize("short_chunk_rows", [0, 2])
def test_without_the_kernels_asking_short_chunks_are_prefills(short_chunk_rows):
    batch = _runner(short_chunk_rows).prepare(CHUNKS)
    # rows: decode 0, verify 1-3 | long 4-23, short 24-26
    assert batch.meta.num_decode_tokens == 4
    assert [(c.start, c.end, c.context_len) for c in batch.meta.prefills] == [(4, 24, 20), (24, 27, 8)]
    assert batch.sample_rows.tolist() == [23, 26, 0, 1, 2, 3]


def test_a_chunk_that_wants_prompt_logprobs_stays_a_prefill():
    chunk = ChunkInput("p", 0, [5, 6, 7], [0], True, prompt_logprobs=(1, 2))
    batch = _runner(16).prepare([chunk])
    assert batch.meta.num_decode_tokens == 0 and len(batch.meta.prefills) == 1
    assert batch.sample_rows.tolist() == [2, 0, 1]


def test_a_batch_of_plain_decodes_takes_the_hidden_states_as_they_are():
    decodes = [ChunkInput(f"r{i}", 5 + i, [i], [i, 9], True) for i in range(3)]
    batch = _runner(16).prepare(decodes)
    assert batch.every_row and batch.sample_rows.tolist() == [0, 1, 2]
    verify_alone = _runner(16).prepare([ChunkInput("v", 2, [1, 2, 3], [10, 11], False, verify=True)])
    assert verify_alone.every_row and verify_alone.sample_rows.tolist() == [0, 1, 2]
    assert not _runner(16).prepare(CHUNKS).every_row  # logit rows out of order, prefill rows unsampled

    # forward_logits: the gather only where it changes the rows
    seen = []
    hidden = torch.arange(27 * 2, dtype=torch.float32).view(27, 2)

    class Model:
        kernels = SimpleNamespace(short_chunk_rows=16)

        def __call__(self, ids, positions, kv_caches, meta):
            return hidden[: ids.shape[0]]

        def compute_logits(self, h):
            seen.append(h)
            return h * 2

    runner = ModelRunner(Model(), [], 4, torch.device("cpu"))
    assert torch.equal(runner.forward_logits(batch), hidden[:3] * 2)
    assert seen[-1].data_ptr() == hidden.data_ptr()  # no copy
    mixed = runner.prepare(CHUNKS)
    assert torch.equal(runner.forward_logits(mixed), hidden[mixed.sample_rows] * 2)

"""--speculative-config: vLLM's keys, clear errors for anything else."""

from __future__ import annotations

import pytest

from ridge import LLM
from ridge.spec_decode.config import SpeculativeConfig


def test_parses_json_and_dicts():
    spec = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}')
    assert (spec.method, spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max) == (
        "ngram",
        4,
        1,
        3,
    )
    assert spec.adaptive
    draft = SpeculativeConfig.parse({"method": "draft_model", "model": "random:tiny", "num_speculative_tokens": 2})
    assert draft.model == "random:tiny"
    assert SpeculativeConfig.parse(None) is None


@pytest.mark.parametrize(
    "value, message",
    [
        ('{"method": "eagle", "num_speculative_tokens": 2}', "method must be one of"),
        ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens must be an integer >= 1"),
        ('{"method": "ngram"}', "needs 'num_speculative_tokens'"),
        (
            '{"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3}',
            "unknown speculative config key(s) lookahead",
        ),
        (
            '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}',
            "must not exceed",
        ),
        ('{"method": "draft_model", "num_speculative_tokens": 2}', 'needs "model"'),
        ('{"method": "ngram", "num_speculative_tokens": 2, "model": "x"}', "takes no model"),
        ("{method: ngram}", "not valid JSON"),
        ("[1, 2]", "must be a JSON object"),
    ],
)
def test_bad_configs_name_the_problem(value, message):
    with pytest.raises(ValueError, match=None) as err:
        SpeculativeConfig.parse(value)
    assert message in str(err.value)


def test_draft_with_another_vocabulary_is_refused():
    # random:tiny has 320 tokens; random:tinyllama-1.1b 32000
    with pytest.raises(ValueError, match="vocabulary"):
        LLM(
            "random:tiny",
            device="cpu",
            num_kv_blocks=16,
            speculative_config={"method": "draft_model", "model": "random:tinyllama-1.1b", "num_speculative_tokens": 2},
        )


def test_a_draft_with_a_shorter_context_proposes_only_while_a_sequence_fits_it(tmp_path):
    """vLLM's behaviour: accepted; past the draft's context the target decodes alone, and the
    greedy output is the target's own."""
    import json

    from ridge import SamplingParams

    from ..models.hf_tiny import build

    build("llama-gqa", tmp_path / "target", seed=1)  # max_position_embeddings 256
    config = json.loads((tmp_path / "target" / "config.json").read_text())
    (tmp_path / "draft").mkdir()
    for f in (tmp_path / "target").iterdir():  # the target itself as its draft: every draft is accepted
        (tmp_path / "draft" / f.name).write_bytes(f.read_bytes())
    (tmp_path / "draft" / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 64}))
    options = dict(tokenizer="bytes", device="cpu", dtype="float32", num_kv_blocks=64, block_size=4)
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    prompt = list(range(3, 40))  # 37 tokens: the draft's 64 end mid-way through the output
    plain = LLM(str(tmp_path / "target"), **options).generate([prompt], params, use_tqdm=False)
    spec = {"method": "draft_model", "model": str(tmp_path / "draft"), "num_speculative_tokens": 3, "adaptive": False}
    llm = LLM(str(tmp_path / "target"), speculative_config=spec, **options)
    (out,) = llm.generate([prompt], params, use_tqdm=False)
    assert out.outputs[0].token_ids == plain[0].outputs[0].token_ids
    stats = llm.engine.stats().spec_decode
    assert stats.num_accepted_tokens > 0 and stats.acceptance_rate == 1.0
    # drafts only while the sequence fits 64 positions: at most (64 - 37) / 4 + 1 verify runs
    assert 0 < stats.num_verify_runs <= (64 - 37) // 4 + 1

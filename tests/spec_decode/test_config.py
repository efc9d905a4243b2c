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


def test_draft_with_a_shorter_context_is_refused(tmp_path):
    import json

    from ..models.hf_tiny import build

    build("llama-gqa", tmp_path / "target", seed=1)  # max_position_embeddings 256
    build("llama-gqa", tmp_path / "draft", seed=2)
    config = json.loads((tmp_path / "draft" / "config.json").read_text())
    (tmp_path / "draft" / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 64}))
    with pytest.raises(ValueError, match="shorter than the target's max_model_len"):
        LLM(
            str(tmp_path / "target"),
            tokenizer="bytes",
            device="cpu",
            num_kv_blocks=16,
            speculative_config={"method": "draft_model", "model": str(tmp_path / "draft"), "num_speculative_tokens": 2},
        )


def test_cli_refuses_a_bad_config_in_one_line():
    from ..test_cli import ridge

    res = ridge(
        "generate",
        "--model",
        "random:tiny",
        "--prompt",
        "hi",
        "--speculative-config",
        '{"method": "nope", "num_speculative_tokens": 1}',
    )
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "method must be one of" in lines[0], lines

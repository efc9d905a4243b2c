"""Sampling with speculation keeps the target's distribution: the first three generated
tokens of a few thousand seeded samples, with and without speculation, pass a two-sample
chi-square test (false-alarm rate 0.1% per comparison; the seeds are fixed, so the verdict
is deterministic). The draft is stories260K with noise added to its weights: a related but
different model, so drafts are both accepted and rejected."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from safetensors.torch import load_file, save_file

from ridge import LLM, SamplingParams

SAMPLES = 2000
PROMPT = "Once upon a time, there was a little girl named Lily. Once upon a time, there was a little"
Z_999 = 3.090  # the standard normal's 99.9% quantile


def chi2_critical(df: int, z: float = Z_999) -> float:
    """Wilson-Hilferty: the chi-square quantile matching the normal quantile z."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def two_sample_chi2(a: Counter, b: Counter, min_expected: float = 5.0) -> tuple[float, int]:
    """Statistic and degrees of freedom; categories rarer than ``min_expected`` are pooled."""
    n_a, n_b = sum(a.values()), sum(b.values())
    cells, rare_a, rare_b = [], 0, 0
    for token in set(a) | set(b):
        if (a[token] + b[token]) / 2 >= min_expected:
            cells.append((a[token], b[token]))
        else:
            rare_a, rare_b = rare_a + a[token], rare_b + b[token]
    if rare_a + rare_b:
        cells.append((rare_a, rare_b))
    k1, k2 = math.sqrt(n_b / n_a), math.sqrt(n_a / n_b)
    stat = sum((k1 * x - k2 * y) ** 2 / (x + y) for x, y in cells if x + y)
    return stat, len(cells) - 1


@pytest.fixture(scope="module")
def noisy_draft(stories_dir, tmp_path_factory):
    directory = tmp_path_factory.mktemp("noisy-stories")
    for f in stories_dir.iterdir():
        if f.name != "model.safetensors" and f.is_file():
            (directory / f.name).write_bytes(f.read_bytes())
    gen = torch.Generator().manual_seed(0)
    weights = load_file(stories_dir / "model.safetensors")
    noisy = {
        k: (v + 0.3 * v.std() * torch.randn(v.shape, generator=gen)) if v.dim() == 2 else v for k, v in weights.items()
    }
    save_file(noisy, directory / "model.safetensors")
    return directory


def _first_three(llm: LLM, **params) -> list[Counter]:
    sp = [SamplingParams(max_tokens=3, ignore_eos=True, seed=i, **params) for i in range(SAMPLES)]
    outs = llm.generate([PROMPT] * SAMPLES, sp, use_tqdm=False)
    return [Counter(o.outputs[0].token_ids[j] for o in outs) for j in range(3)]


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ngram", "draft_model"])
@pytest.mark.parametrize("params", [{"temperature": 1.0}, {"temperature": 1.0, "top_p": 0.9}], ids=["t1", "top_p"])
def test_first_three_tokens_keep_their_distribution(stories_dir, noisy_draft, method, params):
    common = dict(dtype="float32", device="cpu", max_num_seqs=256, seed=1)
    plain = _first_three(LLM(str(stories_dir), **common), **params)
    spec = {"method": method, "num_speculative_tokens": 3, "adaptive": False}
    if method == "draft_model":
        spec["model"] = str(noisy_draft)
    llm = LLM(str(stories_dir), speculative_config=spec, **common)
    speculated = _first_three(llm, **params)
    stats = llm.engine.speculator.stats
    assert stats.num_accepted_tokens > 0
    if "top_p" not in params:  # (top-p 0.9 leaves this prompt's next token certain: all accepted)
        assert stats.num_accepted_tokens < stats.num_draft_tokens  # drafts were rejected too
    for j in range(3):
        stat, df = two_sample_chi2(plain[j], speculated[j])
        assert df >= 1
        assert stat < chi2_critical(df), (j, stat, df, plain[j].most_common(5), speculated[j].most_common(5))

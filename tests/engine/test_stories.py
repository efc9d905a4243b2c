"""The real stories260K model: ridge's greedy story equals transformers' token for token."""

from __future__ import annotations

import torch
import transformers

from ridge import LLM, SamplingParams

EXPECTED_START = "Once upon a time, there was a little girl named Lily. She loved to play outside in the park."


def test_greedy_story_matches_transformers(stories_dir):
    llm = LLM(str(stories_dir), dtype="float32")
    out = llm.generate(["Once upon a time"], SamplingParams(temperature=0.0, max_tokens=40), use_tqdm=False)[0]
    tok = transformers.AutoTokenizer.from_pretrained(stories_dir, local_files_only=True)
    hf = transformers.AutoModelForCausalLM.from_pretrained(stories_dir, dtype=torch.float32).eval()
    ids = tok("Once upon a time", return_tensors="pt").input_ids
    assert out.prompt_token_ids == ids[0].tolist()
    with torch.no_grad():
        ref = hf.generate(ids, max_new_tokens=40, do_sample=False)[0, ids.shape[1] :].tolist()
    ref = ref[: len(out.outputs[0].token_ids)]  # transformers may run past eos; ridge stops there
    assert out.outputs[0].token_ids == ref
    assert ("Once upon a time" + out.outputs[0].text).startswith(EXPECTED_START)

"""``LLM``: the offline Python API (vLLM's), a thin loop over ``LLMEngine``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from ridge.config import EngineConfig
from ridge.engine.engine import LLMEngine
from ridge.engine.outputs import RequestOutput
from ridge.sampling import SamplingParams

PromptType = str | list[int] | dict


class LLM:
    """``LLM(model="path/or/random:preset", dtype=..., max_num_seqs=..., ...)``.

    Keywords are the engine options (``EngineConfig`` fields, the CLI flags in snake_case).
    """

    def __init__(self, model: str = "random:tiny", **engine_options: Any) -> None:
        self.engine = LLMEngine(EngineConfig.from_kwargs(model, **engine_options))

    def get_tokenizer(self):
        return self.engine.tokenizer

    def close(self) -> None:
        """Stop the engine's worker processes (tensor parallelism); also at garbage collection."""
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt; one ``RequestOutput`` per prompt, in order.

        A prompt is a string, a list of token ids, or ``{"prompt": ...}`` /
        ``{"prompt_token_ids": [...]}``. Every prompt is validated before any runs: one bad
        prompt raises ValueError and nothing is left queued.
        """
        prompt_list = _as_prompt_list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or SamplingParams()] * len(prompt_list)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError(f"{len(params_list)} sampling params for {len(prompt_list)} prompts")
        ids = self._add_all(prompt_list, params_list)
        return self._run(ids, use_tqdm)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        tools: list[dict] | None = None,
    ) -> list[RequestOutput]:
        """Chat conversations rendered with the model's chat template (a plain one if it has none);
        ``tools``: OpenAI tool definitions for the template to show the model (vLLM's ``LLM.chat``)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [self.engine.tokenizer.encode_chat(conv, tools=tools) for conv in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _add_all(self, prompts: list, params: list[SamplingParams]) -> list[str]:
        added: list[str] = []
        try:
            for prompt, sp in zip(prompts, params):
                added.append(self.engine.add_request(None, prompt, sp, stream=False))
        except ValueError as exc:
            for rid in added:
                self.engine.abort_request(rid)
            raise ValueError(f"prompt {len(added)}: {exc}") from None
        return added

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        final: dict[str, RequestOutput] = {}
        wanted = set(ids)
        with tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm) as bar:
            while wanted - final.keys():
                for out in self.engine.step():
                    if out.finished and out.request_id in wanted:
                        final[out.request_id] = out
                        bar.update(1)
        return [final[i] for i in ids]


def _as_prompt_list(prompts) -> list:
    if isinstance(prompts, (str, dict)):
        return [_unwrap(prompts)]
    if isinstance(prompts, (list, tuple)) and prompts and all(isinstance(t, int) for t in prompts):
        return [list(prompts)]  # one prompt of token ids
    if isinstance(prompts, (list, tuple)):
        return [_unwrap(p) for p in prompts]
    raise ValueError("prompts must be a string, a list of token ids, or a list of those")


def _unwrap(prompt):
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return list(prompt["prompt_token_ids"])
        if "prompt" in prompt:
            return prompt["prompt"]
        raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
    return prompt

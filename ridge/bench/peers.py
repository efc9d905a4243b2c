"""The engines a comparison drives, each timed the same way: ridge (``RidgeRunner``, step by
step), Hugging Face transformers (``TransformersRunner``, the greedy KV-cache loop) and
llama.cpp through llama-cpp-python's C bindings (``LlamaCppRunner``), and llama.cpp's own
quantizer for its files (``quantize_gguf``).

Every runner takes token ids and answers greedy tokens, with ``run_batch`` (one batch of equal
prompts: the prefill's wall time, each decode step's, the tokens) and ``run_offline`` (a
workload of requests served to the end: its wall time). ``benchmarks/compare.py`` and
``benchmarks/moe_sweep.py`` run them against each other, and the GGUF tests take llama.cpp's
greedy tokens from ``LlamaCppRunner``. transformers and llama-cpp-python are imported where a
runner starts, so the module loads without them.
"""

from __future__ import annotations

import collections
import ctypes
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass
class Timed:
    """One batch run: prefill wall time, the wall time of every decode pass (a step of several
    passes, --num-scheduler-steps, gives each an equal share), the tokens made."""

    prefill_s: float
    decode_s: list[float]
    tokens: list[list[int]]


class RidgeRunner:
    """ridge's engine, driven step by step; each ``step()`` timed from outside."""

    name = "ridge"

    def __init__(self, llm, name: str = "ridge") -> None:
        self.llm, self.name = llm, name

    @property
    def weight_bytes_per_param(self) -> float:
        """What the loaded layers hold per matrix parameter (blocks and scales included)."""
        model = self.llm.engine.executor.worker.model
        return model.linear_weight_bytes() / model.linear_weight_params()

    def run_batch(self, prompts: list[list[int]], new_tokens: int) -> Timed:
        from ridge.sampling import SamplingParams

        engine = self.llm.engine
        params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
        ids = [engine.add_request(None, p, params) for p in prompts]
        started: set[str] = set()
        tokens: dict[str, list[int]] = {}
        have: dict[str, int] = {}  # tokens each request had after the last step
        prefill_s, decode_s = 0.0, []
        while engine.has_unfinished_requests():
            all_started = len(started) == len(ids)  # every request has its first token: a decode step
            t0 = time.perf_counter()
            outputs = engine.step()
            elapsed = time.perf_counter() - t0
            passes = 1  # forward passes the step ran: more under --num-scheduler-steps
            for out in outputs:
                count = len(out.outputs[0].token_ids)
                passes = max(passes, count - have.get(out.request_id, 0))
                have[out.request_id] = count
                if count:
                    started.add(out.request_id)
                if out.finished:
                    tokens[out.request_id] = list(out.outputs[0].token_ids)
            if all_started:  # one entry a pass, each an equal share of the step
                decode_s.extend([elapsed / passes] * passes)
            else:
                prefill_s += elapsed
        return Timed(prefill_s, decode_s, [tokens[i] for i in ids])

    def run_offline(self, prompts: list[list[int]], output_lens: list[int]) -> float:
        from ridge.sampling import SamplingParams

        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in output_lens]
        t0 = time.perf_counter()
        outs = self.llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - t0
        assert [len(o.outputs[0].token_ids) for o in outs] == output_lens
        return elapsed

    def close(self) -> None:
        pass


class TransformersRunner:
    """Hugging Face transformers: the greedy KV-cache loop of ``generate``, timed per step."""

    name = "transformers"

    def __init__(self, hf_dir: Path, dtype: torch.dtype, static_batch: int) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype).eval()
        self.static_batch = static_batch

    def run_batch(self, prompts: list[list[int]], new_tokens: int) -> Timed:
        ids = torch.tensor(prompts)  # equal lengths: no padding, no mask
        decode_s, steps = [], []
        with torch.inference_mode():
            t0 = time.perf_counter()
            out = self.model(input_ids=ids, use_cache=True, logits_to_keep=1)
            nxt = out.logits[:, -1].argmax(-1)
            prefill_s = time.perf_counter() - t0
            steps.append(nxt)
            cache = out.past_key_values
            for _ in range(new_tokens - 1):
                t0 = time.perf_counter()
                out = self.model(input_ids=nxt[:, None], past_key_values=cache, use_cache=True)
                nxt = out.logits[:, -1].argmax(-1)
                cache = out.past_key_values
                decode_s.append(time.perf_counter() - t0)
                steps.append(nxt)
        return Timed(prefill_s, decode_s, torch.stack(steps, dim=1).tolist())

    def run_offline(self, prompts: list[list[int]], output_lens: list[int]) -> float:
        """Static batches in request order, left padded; each batch runs to its longest output."""
        pad = 0
        t0 = time.perf_counter()
        with torch.inference_mode():
            for start in range(0, len(prompts), self.static_batch):
                batch = prompts[start : start + self.static_batch]
                longest = max(len(p) for p in batch)
                ids = torch.tensor([[pad] * (longest - len(p)) + p for p in batch])
                mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in batch])
                steps = max(output_lens[start : start + self.static_batch])
                self.model.generate(
                    input_ids=ids,
                    attention_mask=mask,
                    max_new_tokens=steps,
                    min_new_tokens=steps,
                    do_sample=False,
                    pad_token_id=pad,
                )
        return time.perf_counter() - t0

    def close(self) -> None:
        del self.model


_LLAMA_QUIET = None  # llama.cpp's log callback, set once per process (see LlamaCppRunner)


class LlamaCppRunner:
    """llama.cpp through llama-cpp-python's C bindings: ``llama_batch`` + ``llama_decode``, greedy.

    One context per number of sequences (``n_seq_max``), KV per sequence (``kv_unified`` off,
    llama.h's advice for sequences without a shared prefix). Prompts go in ``n_batch``-token
    chunks, decodes first, a slot per request: continuous batching, as llama-server does it.
    Only ``llama_decode`` and the argmax of its logits are timed, not the Python that fills
    the batch (a C++ caller would not pay for it).
    """

    name = "llama.cpp"

    def __init__(
        self, gguf_path: Path, threads: int, context_per_seq: int, n_batch: int = 512, name: str = "llama.cpp"
    ) -> None:
        import llama_cpp as lc

        self.name = name
        self.lc = lc
        self.threads, self.n_batch = threads, n_batch
        self.context_per_seq = -(-context_per_seq // 256) * 256
        lc.llama_backend_init()
        # The callback stays alive as long as the process: llama.cpp keeps calling it from C
        # (one freed with a runner crashed the next llama_model_quantize)
        global _LLAMA_QUIET
        if _LLAMA_QUIET is None:
            _LLAMA_QUIET = lc.llama_log_callback(lambda level, text, data: None)
        lc.llama_log_set(_LLAMA_QUIET, ctypes.c_void_p())
        mparams = lc.llama_model_default_params()
        mparams.n_gpu_layers = 0
        self.model = lc.llama_model_load_from_file(str(gguf_path).encode(), mparams)
        if not self.model:
            raise RuntimeError(f"llama.cpp cannot load {gguf_path}")
        self.n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.model))
        self.batch = lc.llama_batch_init(n_batch, 0, 1)
        self.contexts: dict[int, object] = {}

    def context(self, slots: int):
        if slots not in self.contexts:
            lc = self.lc
            cp = lc.llama_context_default_params()
            cp.n_ctx = slots * self.context_per_seq
            cp.n_batch = cp.n_ubatch = self.n_batch
            cp.n_seq_max = slots
            cp.n_threads = cp.n_threads_batch = self.threads
            cp.kv_unified = False
            ctx = lc.llama_init_from_model(self.model, cp)
            if not ctx:
                raise RuntimeError(f"llama.cpp cannot create a context for {slots} sequences")
            self.contexts[slots] = ctx
        return self.contexts[slots]

    def run_batch(self, prompts: list[list[int]], new_tokens: int) -> Timed:
        tokens, steps = self._serve(prompts, [new_tokens] * len(prompts), slots=len(prompts))
        # Steps up to the one that gave the last first token are the prefill.
        first_all = max(i for i, (_, first_tokens) in enumerate(steps) if first_tokens)
        prefill_s = sum(s for s, _ in steps[: first_all + 1])
        return Timed(prefill_s, [s for s, _ in steps[first_all + 1 :]], tokens)

    def run_offline(self, prompts: list[list[int]], output_lens: list[int]) -> float:
        t0 = time.perf_counter()
        tokens, _ = self._serve(prompts, output_lens, slots=len(prompts))
        elapsed = time.perf_counter() - t0
        assert [len(t) for t in tokens] == output_lens
        return elapsed

    def _serve(self, prompts, output_lens, slots: int) -> tuple[list[list[int]], list[tuple[float, int]]]:
        """Greedy generation; returns the tokens and, per ``llama_decode``, (seconds, first tokens made)."""
        import numpy as np

        lc, b = self.lc, self.batch
        ctx = self.context(slots)
        memory = lc.llama_get_memory(ctx)
        lc.llama_memory_clear(memory, True)
        queue = collections.deque(range(len(prompts)))
        free = list(range(slots))
        slot_of: dict[int, int] = {}
        fed: dict[int, int] = {}  # prompt tokens already in the cache
        outputs: list[list[int]] = [[] for _ in prompts]
        active: list[int] = []
        steps: list[tuple[float, int]] = []

        def add(i: int, token: int, pos: int, seq: int, logits: bool) -> None:
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = token, pos, 1, logits
            b.seq_id[i][0] = seq

        while queue or active:
            while queue and free:
                r = queue.popleft()
                slot_of[r], fed[r] = free.pop(0), 0
                active.append(r)
            n, rows, first_tokens = 0, [], 0
            for r in active:  # decodes first
                if fed[r] == len(prompts[r]) and n < self.n_batch:
                    add(n, outputs[r][-1], len(prompts[r]) + len(outputs[r]) - 1, slot_of[r], True)
                    rows.append((n, r))
                    n += 1
            for r in active:  # then prompt chunks, up to n_batch tokens in all
                prompt = prompts[r]
                take = min(len(prompt) - fed[r], self.n_batch - n)
                for j in range(fed[r], fed[r] + max(take, 0)):
                    last = j == len(prompt) - 1
                    add(n, prompt[j], j, slot_of[r], last)
                    if last:
                        rows.append((n, r))
                        first_tokens += 1
                    n += 1
                fed[r] += max(take, 0)
            b.n_tokens = n
            t0 = time.perf_counter()
            status = lc.llama_decode(ctx, b)
            if status != 0:
                raise RuntimeError(f"llama_decode returned {status}")
            for index, r in rows:
                logits = np.ctypeslib.as_array(lc.llama_get_logits_ith(ctx, index), shape=(self.n_vocab,))
                outputs[r].append(int(logits.argmax()))
            steps.append((time.perf_counter() - t0, first_tokens))
            for r in [r for r in active if len(outputs[r]) >= output_lens[r]]:
                active.remove(r)
                lc.llama_memory_seq_rm(memory, slot_of[r], -1, -1)
                free.append(slot_of[r])
        return outputs, steps

    def close(self) -> None:
        lc = self.lc
        for ctx in self.contexts.values():
            lc.llama_free(ctx)
        self.contexts.clear()
        lc.llama_batch_free(self.batch)
        lc.llama_model_free(self.model)


# llama.cpp's file types by name (compare.py's --formats; llama_model_quantize's ftype names)
LLAMA_FTYPES = {
    "q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0",
    "q6_k": "LLAMA_FTYPE_MOSTLY_Q6_K",
    "q5_k_m": "LLAMA_FTYPE_MOSTLY_Q5_K_M",
    "q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0",
    "q4_k_m": "LLAMA_FTYPE_MOSTLY_Q4_K_M",
    "iq4_xs": "LLAMA_FTYPE_MOSTLY_IQ4_XS",
    "q3_k_m": "LLAMA_FTYPE_MOSTLY_Q3_K_M",
    "q2_k": "LLAMA_FTYPE_MOSTLY_Q2_K",
}


def quantize_gguf(source: Path, fmt: str, threads: int) -> Path:
    """``source`` (the bf16 export) quantized by llama.cpp's own quantizer, cached beside it."""
    import llama_cpp as lc

    target = source.with_name(f"model-{fmt}.gguf")
    if target.is_file() and target.stat().st_mtime >= source.stat().st_mtime:
        return target
    print(
        f"[peers] quantizing {source.name} to {fmt} with llama_model_quantize -> {target}", file=sys.stderr, flush=True
    )
    params = lc.llama_model_quantize_default_params()
    params.ftype = getattr(lc, LLAMA_FTYPES[fmt])
    params.nthread = threads
    tmp = target.with_suffix(".tmp")
    if lc.llama_model_quantize(str(source).encode(), str(tmp).encode(), ctypes.byref(params)) != 0:
        raise RuntimeError(f"llama_model_quantize failed for {fmt}")
    tmp.rename(target)
    return target

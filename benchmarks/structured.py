"""Structured output: what a grammar costs a decode step, how long it takes to compile, and
whether every constrained output validates. One run, rounds interleaved.

* **Masks in the step.** ``random:tinyllama-1.1b`` with int4 weights (a 32,000-token vocabulary),
  2 threads, decode steps at batch 1 and 32: each round runs the same requests free and
  constrained (a string-heavy and a structure-heavy JSON schema), order alternating. Per
  step: the wall time, and the time filling the bitmask (the engine's ``mask_s``). The
  target: a constrained step costs at most 5% more than a free one. The first token's time
  (prefill, batch 1) free and with a cached grammar shows what starting a cached one costs.
* **Compile.** A small schema and a large one (50 properties, nested), fresh and cached:
  ridge's compile (validation), the matcher's construction and the first mask, which is when
  a request can first sample.
* **The grammar engines side by side.** llguidance (what ridge uses) and xgrammar (vLLM's and
  SGLang's default), on ridge's tokenizers: compile times and the time to fill one mask row
  mid-JSON. xgrammar is measured only when it imports; it needs no GPU for this, and
  ``pip install --no-deps --target DIR xgrammar apache-tvm-ffi`` then ``PYTHONPATH=DIR``
  brings it in without its triton and torch requirements.
* **Validity.** 200 requests at temperature 1 across 20 schemas (nested objects, bounded
  arrays, enums, ``anyOf``, required and optional fields, string patterns, number bounds):
  each output must parse and validate (``jsonschema``).

The tokenizer: the random model has none, so the benchmark trains a 32,000-token byte-level
BPE on the Python standard library's sources (2 s). A mask's cost depends on the vocabulary's
size and the shape of its tokens, not on what text trained it; GPT-2's 50,257 tokens
(``../shared/models/gpt2-tokenizer``) are measured beside it in the engine comparison.

    python benchmarks/structured.py [--rounds 5] [--steps 24] [--requests 200]

Writes ``benchmarks/structured.json``.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sysconfig
import tempfile
import time
from pathlib import Path

import torch

from ridge.config import EngineConfig
from ridge.engine.engine import LLMEngine
from ridge.engine.tokenizer import load_tokenizer
from ridge.roofline.probe import cpu_model
from ridge.sampling import SamplingParams
from ridge.structured.backend import make_backend
from ridge.structured.params import StructuredOutputsParams

OUT = Path(__file__).with_name("structured.json")
SHARED = Path(__file__).resolve().parents[2] / "shared"
MODEL = "random:tinyllama-1.1b"
VOCAB = 32000

# -- the schemas ------------------------------------------------------------------------------

# The step's two constraints: neither ends within the measured steps.
LONG_STRING = {
    "type": "object",
    "properties": {"story": {"type": "string", "minLength": 4000}},
    "required": ["story"],
}
MANY_ITEMS = {
    "type": "array",
    "minItems": 50,
    "items": {
        "type": "object",
        "properties": {
            "id": {"type": "integer"},
            "tag": {"enum": ["red", "green", "blue"]},
            "ok": {"type": "boolean"},
        },
        "required": ["id", "tag", "ok"],
        "additionalProperties": False,
    },
}
SMALL = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}


def large_schema() -> dict:
    """50 properties: 40 flat of every kind, and 10 nested objects of their own."""
    kinds = [
        {"type": "string", "maxLength": 16},
        {"type": "integer", "minimum": 0, "maximum": 1000},
        {"type": "boolean"},
        {"enum": ["a", "b", "c", "d"]},
        {"type": "array", "items": {"type": "integer"}, "maxItems": 4},
        {"anyOf": [{"type": "string", "maxLength": 8}, {"type": "null"}]},
        {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
        {"type": "number", "minimum": -1, "maximum": 1},
    ]
    props = {f"field_{i:02d}": kinds[i % len(kinds)] for i in range(40)}
    for i in range(10):
        props[f"group_{i}"] = {
            "type": "object",
            "properties": {
                "id": {"type": "integer"},
                "label": {"type": "string", "maxLength": 12},
                "tags": {"type": "array", "items": {"enum": ["x", "y", "z"]}, "minItems": 1, "maxItems": 3},
            },
            "required": ["id", "label"],
            "additionalProperties": False,
        }
    return {"type": "object", "properties": props, "required": sorted(props)[::2], "additionalProperties": False}


def validity_schemas() -> list[dict]:
    """20 schemas, each bounded (strings, arrays, numbers) so that a random model's output ends."""
    s = lambda n: {"type": "string", "maxLength": n}  # noqa: E731
    i = lambda lo, hi: {"type": "integer", "minimum": lo, "maximum": hi}  # noqa: E731

    def obj(props: dict, required: list[str] | None = None) -> dict:
        return {
            "type": "object",
            "properties": props,
            "required": list(props) if required is None else required,
            "additionalProperties": False,
        }

    return [
        obj({"name": s(12), "age": i(0, 120)}),
        obj({"city": s(10), "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}),
        obj({"color": {"enum": ["red", "green", "blue"]}, "shade": i(0, 9)}),
        obj({"tags": {"type": "array", "items": s(6), "minItems": 1, "maxItems": 4}}),
        obj({"point": obj({"x": i(-99, 99), "y": i(-99, 99)})}),
        obj({"id": i(1, 9999), "note": s(16)}, required=["id"]),
        obj({"value": {"anyOf": [i(0, 99), s(8), {"type": "boolean"}]}}),
        obj({"ok": {"type": "boolean"}, "reason": {"anyOf": [s(12), {"type": "null"}]}}),
        obj(
            {
                "user": obj(
                    {
                        "name": s(10),
                        "roles": {"type": "array", "items": {"enum": ["admin", "dev", "ops"]}, "maxItems": 3},
                    }
                )
            }
        ),
        obj({"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}, "count": i(0, 50)}),
        {"type": "array", "items": obj({"k": s(5), "v": i(0, 9)}), "minItems": 1, "maxItems": 3},
        obj({"matrix": {"type": "array", "items": {"type": "array", "items": i(0, 9), "maxItems": 3}, "maxItems": 3}}),
        obj({"date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"}, "title": s(14)}),
        obj({"score": {"type": "number", "minimum": 0, "maximum": 1}, "label": {"enum": ["pos", "neg"]}}),
        obj({"a": s(4), "b": s(4), "c": i(0, 9), "d": {"type": "boolean"}}, required=["a", "c"]),
        obj({"kind": {"const": "event"}, "at": i(0, 86400), "who": s(8)}),
        obj(
            {
                "order": obj(
                    {
                        "items": {
                            "type": "array",
                            "items": obj({"sku": s(6), "qty": i(1, 9)}),
                            "minItems": 1,
                            "maxItems": 2,
                        },
                        "paid": {"type": "boolean"},
                    }
                )
            }
        ),
        obj({"shape": {"anyOf": [obj({"r": i(1, 9)}), obj({"w": i(1, 9), "h": i(1, 9)})]}}),
        obj(
            {
                "email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.(com|org)$"},
                "verified": {"type": "boolean"},
            }
        ),
        obj(
            {
                "meta": obj(
                    {"version": i(0, 9), "flags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 4}}
                ),
                "name": s(10),
            },
            required=["meta"],
        ),
    ]


# -- the tokenizer ----------------------------------------------------------------------------


def train_tokenizer(out: Path, vocab: int = VOCAB) -> Path:
    """A byte-level BPE of ``vocab`` tokens trained on the standard library's sources."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    files = []
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        if "test" in path.parts or "site-packages" in path.parts:
            continue
        try:
            path.read_text("utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        files.append(str(path))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=["<s>", "</s>", "<unk>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train(files, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.save_pretrained(out)
    return out


def gpt2_tokenizer(files: Path, out: Path) -> Path:
    """GPT-2's tokenizer (50,257 tokens) from its ``vocab.json`` and ``merges.txt``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE.from_file(str(files / "vocab.json"), str(files / "merges.txt")))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|endoftext|>")
    fast.save_pretrained(out)
    return out


# -- masks in the step ------------------------------------------------------------------------


def run_steps(engine: LLMEngine, batch: int, steps: int, structured: dict | None, seed: int) -> dict:
    """``batch`` requests decoding: the first token's time, then ``steps`` steps timed one by one."""
    rng = random.Random(seed)
    params = SamplingParams(
        max_tokens=steps + 4,
        ignore_eos=True,
        temperature=1.0,
        seed=seed,
        structured_outputs={"json": structured} if structured else None,
    )
    start = time.perf_counter()
    ids = [engine.add_request(None, [rng.randrange(3, VOCAB) for _ in range(32)], params) for _ in range(batch)]
    started: set[str] = set()
    while len(started) < batch:
        for out in engine.step():
            if out.outputs[0].token_ids:
                started.add(out.request_id)
    first_s = time.perf_counter() - start
    engine.step()  # settle
    mask0 = engine.structured.stats.mask_s
    walls = []
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()
        walls.append(time.perf_counter() - t)
    mask_s = (engine.structured.stats.mask_s - mask0) / steps
    for rid in ids:
        engine.abort_request(rid)
    while engine.has_unfinished_requests():
        engine.step()
    return {"step_ms": 1e3 * statistics.median(walls), "mask_ms": 1e3 * mask_s, "first_token_ms": 1e3 * first_s}


def mask_rounds(engine: LLMEngine, rounds: int, steps: int) -> dict:
    modes = {"free": None, "long_string": LONG_STRING, "many_items": MANY_ITEMS}
    results: dict = {}
    for batch in (1, 32):
        per = {m: [] for m in modes}
        for r in range(rounds + 1):  # round 0 warms up (and compiles): not kept
            order = list(modes) if r % 2 == 0 else list(reversed(modes))
            for mode in order:  # each run its own prompts: no prefix-cache hit between them
                seed = 1000 * r + 100 * list(modes).index(mode) + batch
                got = run_steps(engine, batch, steps, modes[mode], seed=seed)
                if r:
                    per[mode].append(got)
        row = {}
        for mode, runs in per.items():
            row[mode] = {k: statistics.median(run[k] for run in runs) for k in runs[0]}
        for mode in ("long_string", "many_items"):
            # same-round ratios: constrained over free
            ratios = [c["step_ms"] / f["step_ms"] for c, f in zip(per[mode], per["free"])]
            row[mode]["step_overhead_pct"] = 100 * (statistics.median(ratios) - 1)
            row[mode]["mask_share_pct"] = 100 * row[mode]["mask_ms"] / row[mode]["step_ms"]
        results[f"batch_{batch}"] = row
        print(f"batch {batch}: " + json.dumps(row, indent=None), flush=True)
    return results


# -- compile, and the two grammar engines ------------------------------------------------------


def _median_ms(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def llguidance_times(tokenizer, vocab: int, schema: dict, repeat: int) -> dict:
    backend = make_backend(tokenizer, vocab)
    salt = iter(range(10**9))

    def fresh():  # a new key each time: the cache never answers
        params = StructuredOutputsParams(json={**schema, "$comment": f"run {next(salt)}"})
        grammar = backend.compile(params)
        matcher = backend.matcher(grammar)
        backend.fill_bitmask(matcher, backend.allocate_bitmask(1), 0)

    params = StructuredOutputsParams(json=schema)
    grammar = backend.compile(params)
    mask = backend.allocate_bitmask(1)
    return {
        "compile_ms": _median_ms(
            lambda: backend.compile(StructuredOutputsParams(json={**schema, "$comment": str(next(salt))})), repeat
        ),
        "cached_compile_ms": _median_ms(lambda: backend.compile(params), repeat),
        "to_first_mask_ms": _median_ms(fresh, repeat),
        "cached_to_first_mask_ms": _median_ms(lambda: backend.fill_bitmask(backend.matcher(grammar), mask, 0), repeat),
        "mask_row_ms": _mask_row_ms_llg(backend, grammar, tokenizer, schema),
    }


def _json_prefix(tokenizer, schema: dict) -> list[int]:
    """Tokens of a valid answer's first part: masks are measured mid-JSON, not at the start."""
    text = '{"name": "Ada Lovelace", "age": 36' if schema is SMALL else '{"field_00": "abc", "field_01": 7, '
    return tokenizer.encode(text.replace(": ", ":").replace(", ", ","), add_special_tokens=False)


def _mask_row_ms_llg(backend, grammar, tokenizer, schema) -> float:
    matcher = backend.matcher(grammar)
    for token in _json_prefix(tokenizer, schema):
        if not matcher.consume_token(token):
            break
    mask = backend.allocate_bitmask(1)
    return _median_ms(lambda: backend.fill_bitmask(matcher, mask, 0), 50)


def xgrammar_times(hf_tokenizer, vocab: int, schema: dict, repeat: int, tokenizer) -> dict | None:
    try:
        import xgrammar as xgr
    except ImportError:
        return None
    info = xgr.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=vocab)
    text = json.dumps(schema)
    fresh_compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    cached_compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=True)
    cached_compiler.compile_json_schema(text, any_whitespace=False)
    mask = xgr.allocate_token_bitmask(1, vocab)

    def fresh():
        compiled = fresh_compiler.compile_json_schema(text, any_whitespace=False)
        xgr.GrammarMatcher(compiled).fill_next_token_bitmask(mask, 0)

    compiled = cached_compiler.compile_json_schema(text, any_whitespace=False)
    matcher = xgr.GrammarMatcher(compiled)
    for token in _json_prefix(tokenizer, schema):
        if not matcher.accept_token(token):
            break
    return {
        "compile_ms": _median_ms(lambda: fresh_compiler.compile_json_schema(text, any_whitespace=False), repeat),
        "cached_compile_ms": _median_ms(
            lambda: cached_compiler.compile_json_schema(text, any_whitespace=False), repeat
        ),
        "to_first_mask_ms": _median_ms(fresh, repeat),
        "cached_to_first_mask_ms": _median_ms(
            lambda: xgr.GrammarMatcher(compiled).fill_next_token_bitmask(mask, 0), repeat
        ),
        "mask_row_ms": _median_ms(lambda: matcher.fill_next_token_bitmask(mask, 0), 50),
    }


def engines(tokenizers: dict[str, Path], repeat: int) -> dict:
    out = {}
    for name, path in tokenizers.items():
        tok = load_tokenizer(path)
        vocab = tok.vocab_size
        row = {"vocab": vocab}
        for label, schema in (("small", SMALL), ("large", large_schema())):
            row[label] = {
                "llguidance": llguidance_times(tok, vocab, schema, repeat),
                "xgrammar": xgrammar_times(tok.hf_tokenizer, vocab, schema, repeat, tok),
            }
        out[name] = row
        print(f"{name}: " + json.dumps(row), flush=True)
    return out


# -- validity -------------------------------------------------------------------------------


def validity(engine: LLMEngine, requests: int) -> dict:
    import jsonschema

    schemas = validity_schemas()
    rng = random.Random(7)
    ids = {}
    for k in range(requests):
        schema = schemas[k % len(schemas)]
        params = SamplingParams(max_tokens=600, temperature=1.0, seed=k, structured_outputs={"json": schema})
        prompt = [rng.randrange(3, VOCAB) for _ in range(12)]
        ids[engine.add_request(None, prompt, params)] = k % len(schemas)
    done = {}
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0]
    elapsed = time.perf_counter() - start
    valid, failures, lengths, reasons = 0, [], [], {}
    for rid, index in ids.items():
        c = done[rid]
        reasons[c.finish_reason] = reasons.get(c.finish_reason, 0) + 1
        lengths.append(len(c.token_ids))
        try:
            jsonschema.validate(json.loads(c.text), schemas[index])
            valid += 1
        except (ValueError, jsonschema.ValidationError) as exc:
            failures.append({"schema": index, "text": c.text[:200], "error": str(exc)[:200]})
    return {
        "requests": requests,
        "schemas": len(schemas),
        "valid": valid,
        "valid_pct": 100 * valid / requests,
        "finish_reasons": reasons,
        "tokens_median": statistics.median(lengths),
        "tokens_max": max(lengths),
        "seconds": elapsed,
        "failures": failures[:10],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=24, help="decode steps timed per run")
    ap.add_argument("--requests", type=int, default=200, help="validity: requests across the 20 schemas")
    ap.add_argument("--repeat", type=int, default=7, help="compile timings: repetitions per figure")
    ap.add_argument("--skip", nargs="*", default=[], choices=["masks", "engines", "validity"])
    args = ap.parse_args()
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        tok_dir = train_tokenizer(Path(tmp) / "bpe32k")
        result: dict = {
            "machine": platform.processor() or platform.machine(),
            "cpu": cpu_model(),
            "torch": torch.__version__,
            "model": MODEL,
            "quantization": "int4",
            "tokenizer": "byte-level BPE, 32,000 tokens, trained on the standard library's sources",
        }
        tokenizers = {"bpe32k": tok_dir}
        gpt2 = SHARED / "models" / "gpt2-tokenizer"
        if (gpt2 / "vocab.json").is_file():
            tokenizers["gpt2"] = gpt2_tokenizer(gpt2, Path(tmp) / "gpt2")
        if "engines" not in args.skip:
            result["engines"] = engines(tokenizers, args.repeat)
        if not {"masks", "validity"} <= set(args.skip):
            engine = LLMEngine(
                EngineConfig(
                    model=MODEL,
                    tokenizer=str(tok_dir),
                    quantization="int4",
                    dtype="bfloat16",
                    device="cpu",
                    max_num_seqs=32,
                    num_threads=2,
                    max_model_len=2048,
                )
            )
            if "masks" not in args.skip:
                result["masks"] = mask_rounds(engine, args.rounds, args.steps)
            if "validity" not in args.skip:
                result["validity"] = validity(engine, args.requests)
                print("validity: " + json.dumps(result["validity"]), flush=True)
            result["compile"] = vars(engine.structured.stats)
    if OUT.is_file():  # sections skipped this run keep their last figures
        result = {**{k: v for k, v in json.loads(OUT.read_text()).items() if k in args.skip}, **result}
    OUT.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()

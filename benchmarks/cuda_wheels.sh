#!/usr/bin/env bash
# The wheels the GPU machine's image lacks (it has torch, triton, transformers, pytest, xdist,
# hypothesis, httpx; not the server's stack, gguf, llguidance or the openai client), fetched here
# into .whl/ for `benchmarks/cuda_run.sh` to install there (no network on that machine). Run
# from the repository root; add `/.whl/` to .git/info/exclude and carry `.whl` in the call.
set -euo pipefail
mkdir -p .whl
platforms=(--platform any)
for n in 17 24 27 28 31 34; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
platforms+=(--platform manylinux2014_x86_64)
for pkg in fastapi uvicorn pydantic pydantic-core starlette annotated-types annotated-doc typing-inspection \
  typing-extensions anyio opentelemetry-api gguf llguidance openai jiter distro sniffio httpx2 httpcore2 truststore \
  idna jsonschema referencing rpds-py jsonschema-specifications; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d .whl "$pkg"
done
du -sh .whl

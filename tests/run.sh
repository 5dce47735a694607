#!/usr/bin/env bash
# The README's test command: install kvtier with its test extras and vLLM's CPU build (the CPU torch 2.13.0
# first, and held there by a constraint, so no multi-GB CUDA build is ever pulled), the third-party plugin
# package the tests use, redis-server if it is missing, then run mypy (the shipped code strictly, then the
# tests) and pytest.  Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
PIP=("$PY" -m pip install -q --disable-pip-version-check)
CONSTRAINT=$(mktemp)
trap 'rm -f "$CONSTRAINT"' EXIT
echo "torch==2.13.0" > "$CONSTRAINT"
"${PIP[@]}" torch==2.13.0
"${PIP[@]}" -c "$CONSTRAINT" -e '.[test,vllm,sglang]'
# The plugin package depends on kvtier, which is only resolvable once installed (not in the same pip call).
"${PIP[@]}" -c "$CONSTRAINT" ./tests/thirdparty_pkg
# SGLang's wheel without its GPU dependency tree (its storage classes, host pool and cache-controller threads
# run on CPU; what they import came with the sglang extra above).
"${PIP[@]}" --no-deps sglang==0.5.23
# vLLM's CPU wheel pulls torchvision / torchaudio / torchcodec built for another torch: they fail to import
# ("operator torchvision::nms does not exist") and then transformers cannot import Llama.  kvtier and vLLM's
# text models need none of them, so they go.
if ! "$PY" -c "import torchvision" >/dev/null 2>&1; then
  "$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
fi
# redis-server for the Redis tests; g++ and libssl-dev for SGLang's page-hash extension (built at first use).
NEED=()
command -v redis-server >/dev/null 2>&1 || NEED+=(redis-server)
dpkg -s g++ libssl-dev >/dev/null 2>&1 || NEED+=(g++ libssl-dev)
if [ ${#NEED[@]} -gt 0 ]; then
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
  $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${NEED[@]}"
fi
# mypy's incremental cache lives outside the checkout, one per run's options, so a fresh clone on a machine
# that ran this before re-checks only what changed (a cold check takes minutes here; the cache is keyed on
# each file's contents, never trusted blindly).
CACHE="${XDG_CACHE_HOME:-$HOME/.cache}/kvtier"
"$PY" -m mypy --cache-dir "$CACHE/mypy-src"
# The tests too: their bodies are checked against kvtier's API (a test function needs no annotations).
"$PY" -m mypy --cache-dir "$CACHE/mypy-tests" --allow-untyped-defs --exclude 'tests/thirdparty_pkg/' tests
# The documentation site, strictly: a broken link or anchor, a page left out of the nav, or a reference the
# hooks cannot generate from the code fails here (the variable silences Material's end-of-life banner).
SITE=$(mktemp -d); NO_MKDOCS_2_WARNING=1 "$PY" -m mkdocs build --strict --quiet --site-dir "$SITE"; rm -rf "$SITE"
exec "$PY" -m pytest "$@"

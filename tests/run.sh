#!/usr/bin/env bash
# The README's test command: install kvtier with its test extras (the CPU torch 2.13.0 first, so no
# multi-GB CUDA build is pulled), the third-party plugin package the tests use, redis-server if it is
# missing, then run pytest.  Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
"$PY" -m pip install -q --disable-pip-version-check torch==2.13.0
"$PY" -m pip install -q --disable-pip-version-check -e '.[test]' ./tests/thirdparty_pkg
if ! command -v redis-server >/dev/null 2>&1; then
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
  $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq redis-server
fi
exec "$PY" -m pytest "$@"

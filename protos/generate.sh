#!/usr/bin/env bash
# Regenerates the Python stubs next to the .proto files. The only way stubs are made;
# tests/test_protos_fresh.py fails when the committed stubs differ from what this writes.
# PYTHON names the interpreter that has grpcio-tools (the Makefile passes the project's venv).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
out="${1:-$here}"
"${PYTHON:-python3}" -m grpc_tools.protoc -I "$here" --python_out="$out" --pyi_out="$out" --grpc_python_out="$out" \
  "$here"/ddtree/v1/*.proto

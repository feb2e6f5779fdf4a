#!/usr/bin/env bash
# Regenerates the Python code and .pyi stubs for protos/v1/*.proto.
#   protos/generate.sh          rewrite the committed files
#   protos/generate.sh --check  fail if the committed files are stale (CI)
# Uses grpcio-tools and mypy-protobuf at the versions pinned in constraints.txt.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
python=${PYTHON:-python}
# mypy-protobuf's plugins live beside the interpreter (a virtualenv's bin/).
PATH="$(dirname "$(command -v "$python")"):$PATH"
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT

cd "$root"
# Compiled from the repository root through the fedra/protos link, so the generated
# modules import each other as fedra.protos.v1.*.
"$python" -m grpc_tools.protoc -I . \
  --python_out="$out" --grpc_python_out="$out" \
  --mypy_out=quiet:"$out" --mypy_grpc_out=quiet:"$out" \
  fedra/protos/v1/*.proto

generated=$(cd "$out/fedra/protos/v1" && ls)
if [[ "${1:-}" == "--check" ]]; then
  stale=0
  for f in $generated; do
    if ! cmp -s "$out/fedra/protos/v1/$f" "protos/v1/$f"; then
      echo "stale: protos/v1/$f (run protos/generate.sh)" >&2
      stale=1
    fi
  done
  for f in protos/v1/*_pb2*.py protos/v1/*_pb2*.pyi; do
    [[ -e "$out/fedra/protos/v1/$(basename "$f")" ]] || { echo "orphan: $f" >&2; stale=1; }
  done
  [[ $stale == 0 ]] && echo "generated protobuf code is up to date"
  exit $stale
fi
rm -f protos/v1/*_pb2*.py protos/v1/*_pb2*.pyi
cp "$out"/fedra/protos/v1/* protos/v1/
echo "regenerated: $(echo $generated | tr '\n' ' ')"

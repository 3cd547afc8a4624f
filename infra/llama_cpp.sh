#!/usr/bin/env bash
# Build llama.cpp's `llama-server` once from a pinned source: the llama.cpp that llama-cpp-python 0.3.36
# vendors (its sdist on PyPI, checked by sha256). 5-7 min on 2 cores; later runs find the binary and return.
#   bash infra/llama_cpp.sh            # prints the path of llama-server
# Output: <cache>/llama.cpp/<version>/bin/llama-server plus the converters (convert_*_to_gguf.py, gguf-py).
# A CUDA build where nvcc is on PATH and MEMALPHA_LLAMA_CUDA=1.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PY:-$REPO/.venv/bin/python}"
[[ -x "$PY" ]] || PY=python3.11
VERSION=0.3.36
SDIST_SHA256=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
CACHE="${MEMALPHA_CACHE:-$REPO/.cache}"
HOME_DIR="$CACHE/llama.cpp/$VERSION"
SERVER="$HOME_DIR/bin/llama-server"

if [[ -x "$SERVER" ]]; then echo "$SERVER"; exit 0; fi

mkdir -p "$HOME_DIR"
work="$(mktemp -d "$CACHE/llama.cpp/build.XXXXXX")"
trap 'rm -rf "$work"' EXIT
echo "llama.cpp: fetching the llama-cpp-python $VERSION sdist (its vendored llama.cpp) ..." >&2
"$PY" -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$work" >&2
sdist="$work/llama_cpp_python-$VERSION.tar.gz"
actual="$(sha256sum "$sdist" | cut -d' ' -f1)"
if [[ "$actual" != "$SDIST_SHA256" ]]; then
    echo "llama.cpp: $sdist has sha256 $actual, expected $SDIST_SHA256" >&2
    exit 1
fi
tar -xzf "$sdist" -C "$work"
src="$work/llama_cpp_python-$VERSION/vendor/llama.cpp"
cuda=OFF
if [[ "${MEMALPHA_LLAMA_CUDA:-0}" == 1 ]] && command -v nvcc >/dev/null; then cuda=ON; fi
started=$SECONDS
echo "llama.cpp: building llama-server (CUDA $cuda; 5-7 min on 2 cores) ..." >&2
cmake -S "$src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DGGML_NATIVE=ON \
    -DGGML_CUDA="$cuda" -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF >"$work/cmake.log" 2>&1 || { tail -n 30 "$work/cmake.log" >&2; exit 1; }
cmake --build "$work/build" --target llama-server -j "$(nproc)" >"$work/build.log" 2>&1 \
    || { tail -n 40 "$work/build.log" >&2; exit 1; }
# the converters turn a trained writer (HF folder, PEFT adapter) into GGUF (memalpha export)
staged="$HOME_DIR.tmp"
rm -rf "$staged" && mkdir -p "$staged/bin"
cp "$work/build/bin/llama-server" "$staged/bin/"
cp -r "$src"/convert_hf_to_gguf.py "$src"/convert_lora_to_gguf.py "$src/gguf-py" "$staged/"
[[ -d "$src/conversion" ]] && cp -r "$src/conversion" "$staged/"
cp "$src/LICENSE" "$staged/LICENSE"
echo "$VERSION built in $((SECONDS - started)) s on $(nproc) cores, CUDA $cuda" >"$staged/BUILD"
rm -rf "$HOME_DIR" && mv "$staged" "$HOME_DIR"
echo "llama.cpp: built in $((SECONDS - started)) s" >&2
echo "$SERVER"

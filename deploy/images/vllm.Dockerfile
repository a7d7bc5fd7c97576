# The vLLM replica image: `shardline serve` with the `vllm` runtime, and vLLM in an environment of its own beside
# it (vLLM pins an older fastapi than Prefect: they cannot share one). The runtime starts vLLM's OpenAI server
# with /opt/vllm/venv/bin/python for each model (SHARDLINE_VLLM_PYTHON) and relays to it.
#
#   docker build -f deploy/images/vllm.Dockerfile -t REGISTRY/shardline-vllm:0.1.0 .  (from the repository root)
#
# Shardline's side is pinned by constraints.txt, vLLM's by deploy/images/vllm-requirements.txt.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
WORKDIR /src
RUN python -m venv /opt/shardline/venv && python -m venv /opt/vllm/venv
COPY deploy/images/vllm-requirements.txt /src/vllm-requirements.txt
RUN /opt/vllm/venv/bin/pip install -r /src/vllm-requirements.txt \
    && /opt/vllm/venv/bin/python -c "import importlib.metadata as m; m.version('vllm')"
COPY pyproject.toml constraints.txt README.md ./
COPY shardline/ shardline/
COPY build/ build/
COPY storage/ storage/
COPY quality/ quality/
COPY tasks/ tasks/
COPY flows/ flows/
COPY online/ online/
COPY cli/ cli/
COPY observability/ observability/
COPY capacity/ capacity/
COPY controller/ controller/
COPY cost/ cost/
# The serving side only: the vLLM runtime relays to vLLM's server; `cpu` serves any ONNX model beside it.
RUN PIP_CONSTRAINT=/src/constraints.txt /opt/shardline/venv/bin/pip install -c constraints.txt ".[cpu,embedding]" \
    && /opt/shardline/venv/bin/pip check

FROM ${PYTHON_IMAGE} AS runtime
RUN groupadd --system --gid 10001 shardline \
    && useradd --system --uid 10001 --gid shardline --create-home --home-dir /home/shardline shardline
COPY --from=build /opt/vllm/venv /opt/vllm/venv
COPY --from=build /opt/shardline/venv /opt/shardline/venv
ENV PATH=/opt/shardline/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility \
    DO_NOT_TRACK=1 \
    VLLM_NO_USAGE_STATS=1 \
    VLLM_DO_NOT_TRACK=1 \
    ORT_DISABLE_TELEMETRY=1 \
    PREFECT_SERVER_ANALYTICS_ENABLED=false \
    HF_HUB_DISABLE_TELEMETRY=1 \
    HF_HUB_OFFLINE=1 \
    SHARDLINE_STORAGE_HOME=/var/lib/shardline \
    SHARDLINE_VLLM_PYTHON=/opt/vllm/venv/bin/python \
    SHARDLINE_VLLM_LOG_DIR=/tmp/shardline-vllm
RUN mkdir -p /var/lib/shardline && chown 10001:10001 /var/lib/shardline
WORKDIR /home/shardline
USER 10001:10001
EXPOSE 8000 8002
CMD ["shardline", "serve", "--host", "0.0.0.0", "--metrics-host", "0.0.0.0"]

# The CPU image: the router, `shardline serve` replicas on CPU, the batch flow-run pods, the Dask scheduler and
# workers (one image for all of them: the workers import the same shardline, dask and distributed as the flow).
#
#   docker build -f deploy/images/cpu.Dockerfile -t REGISTRY/shardline:0.1.0 .      (from the repository root)
#
# Pinned: every Python package by constraints.txt (the versions the test suite ran with). onnxruntime's CPU build
# only (extra `cpu`); the GPU image has onnxruntime-gpu instead, never both.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
WORKDIR /src
RUN python -m venv /opt/shardline/venv
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
# PIP_CONSTRAINT pins setuptools in pip's build environment too, as -c does the rest.
RUN PIP_CONSTRAINT=/src/constraints.txt /opt/shardline/venv/bin/pip install -c constraints.txt \
        ".[cpu,package,embedding,kubernetes]" \
    && /opt/shardline/venv/bin/python -c "import importlib.metadata as m; m.version('onnxruntime')" \
    && /opt/shardline/venv/bin/pip check

FROM ${PYTHON_IMAGE} AS runtime
RUN groupadd --system --gid 10001 shardline \
    && useradd --system --uid 10001 --gid shardline --create-home --home-dir /home/shardline shardline
COPY --from=build /opt/shardline/venv /opt/shardline/venv
# The flows' entry points and prefect.yaml: a Kubernetes work pool's flow-run pods start here
# (deploy/k8s/base/prefect: `prefect deploy` runs in this folder, so the pull step comes back to it).
COPY --chown=10001:10001 prefect.yaml /opt/shardline/app/
COPY --chown=10001:10001 flows/ /opt/shardline/app/flows/
# The DaskCluster templates a flow run creates its job's cluster from (SHARDLINE_DASK_KUBERNETES_SPEC, relative to
# this folder: deploy/k8s/base/tenant/dask/cluster-cpu.yaml or cluster-gpu.yaml).
COPY --chown=10001:10001 deploy/k8s/base/tenant/dask/ /opt/shardline/app/deploy/k8s/base/tenant/dask/
ENV PATH=/opt/shardline/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    DO_NOT_TRACK=1 \
    ORT_DISABLE_TELEMETRY=1 \
    PREFECT_SERVER_ANALYTICS_ENABLED=false \
    GX_ANALYTICS_ENABLED=false \
    MLFLOW_DISABLE_TELEMETRY=true \
    HF_HUB_DISABLE_TELEMETRY=1 \
    HF_HUB_OFFLINE=1 \
    SHARDLINE_STORAGE_HOME=/var/lib/shardline
RUN mkdir -p /var/lib/shardline && chown 10001:10001 /var/lib/shardline
WORKDIR /opt/shardline/app
USER 10001:10001
EXPOSE 8000 8002 8080 8082
CMD ["shardline", "--help"]

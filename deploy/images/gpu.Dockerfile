# The GPU image: `shardline serve` replicas and Dask workers on NVIDIA GPUs (a whole GPU or a MIG slice) with
# onnxruntime-gpu. onnxruntime and onnxruntime-gpu both own the `onnxruntime` package and silently replace each
# other: this image installs the `gpu` extra and never `cpu` (the build fails if the CPU build got in).
#
#   docker build -f deploy/images/gpu.Dockerfile -t REGISTRY/shardline-gpu:0.1.0 .   (from the repository root)
#
# The CUDA and cuDNN libraries come as wheels (onnxruntime-gpu[cuda,cudnn]); the driver comes from the node
# (NVIDIA container toolkit, installed by the GPU operator).
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
RUN PIP_CONSTRAINT=/src/constraints.txt /opt/shardline/venv/bin/pip install -c constraints.txt \
        ".[gpu,embedding,kubernetes]" \
    && /opt/shardline/venv/bin/python -c "import importlib.metadata as m, sys; sys.exit('onnxruntime (CPU) must not be installed beside onnxruntime-gpu') if any(d.metadata['Name'] == 'onnxruntime' for d in m.distributions()) else m.version('onnxruntime-gpu')" \
    && /opt/shardline/venv/bin/pip check

FROM ${PYTHON_IMAGE} AS runtime
RUN groupadd --system --gid 10001 shardline \
    && useradd --system --uid 10001 --gid shardline --create-home --home-dir /home/shardline shardline
COPY --from=build /opt/shardline/venv /opt/shardline/venv
COPY --chown=10001:10001 prefect.yaml /opt/shardline/app/
COPY --chown=10001:10001 flows/ /opt/shardline/app/flows/
# The DaskCluster templates a flow run creates its job's cluster from (SHARDLINE_DASK_KUBERNETES_SPEC, relative to
# this folder: deploy/k8s/base/tenant/dask/cluster-cpu.yaml or cluster-gpu.yaml).
COPY --chown=10001:10001 deploy/k8s/base/tenant/dask/ /opt/shardline/app/deploy/k8s/base/tenant/dask/
ENV PATH=/opt/shardline/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility \
    DO_NOT_TRACK=1 \
    ORT_DISABLE_TELEMETRY=1 \
    PREFECT_SERVER_ANALYTICS_ENABLED=false \
    GX_ANALYTICS_ENABLED=false \
    MLFLOW_DISABLE_TELEMETRY=true \
    HF_HUB_DISABLE_TELEMETRY=1 \
    HF_HUB_OFFLINE=1 \
    SHARDLINE_STORAGE_HOME=/var/lib/shardline \
    SHARDLINE_RUNTIME_DEVICE=cuda
RUN mkdir -p /var/lib/shardline && chown 10001:10001 /var/lib/shardline
WORKDIR /opt/shardline/app
USER 10001:10001
EXPOSE 8000 8002
CMD ["shardline", "serve", "--host", "0.0.0.0", "--metrics-host", "0.0.0.0"]

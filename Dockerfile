# syntax=docker/dockerfile:1
# One image for every Phalanx component; the command picks which (see docker-compose.yml):
#   docker run --rm phalanx:latest server --host 0.0.0.0 --port 8000
#   docker run --rm phalanx:latest agent --server http://server:8000 --cpu-slots 1

# --- build: a virtual environment with torch's CPU wheel and Phalanx ------------------------------
FROM python:3.11-slim AS build

ARG TORCH_VERSION=2.13.0
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/phalanx/bin:$PATH

RUN python -m venv /opt/phalanx

# torch first, from its CPU index: a bare `torch` requirement would pull a multi-GB CUDA build,
# and `torch>=2.4` in pyproject.toml then leaves this one alone. Its own layer: cached across
# source changes.
RUN pip install torch==${TORCH_VERSION} --index-url https://download.pytorch.org/whl/cpu

WORKDIR /src
# README.md* matches nothing while the project has no README; pyproject.toml keeps the COPY valid.
COPY pyproject.toml README.md* ./
# The packages pyproject.toml installs ([tool.setuptools.packages.find]); tests/unit/test_compose.py
# checks that this list and that one agree.
COPY phalanx ./phalanx
COPY stack ./stack
COPY server ./server
COPY scheduler ./scheduler
COPY worker_agent ./worker_agent
COPY web ./web
COPY migrations ./migrations
# The examples and lightning extras too: the agents of this image run the example jobs
# (docker-compose.yml's first submit is examples/digits, which loads scikit-learn's dataset).
RUN pip install '.[examples,lightning,transformers]' \
    && python -c "import stack.cli, server.app, scheduler.tasks, worker_agent.agent, sklearn.datasets"

# --- runtime --------------------------------------------------------------------------------------
FROM python:3.11-slim

ENV PATH=/opt/phalanx/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PHALANX_DATA_DIR=/data

# A fixed uid, so that volumes and bind mounts can be prepared for it on the host. /data exists
# and belongs to it: a named volume mounted there starts with this owner.
RUN groupadd --system --gid 10001 phalanx \
    && useradd --system --uid 10001 --gid phalanx --create-home --home-dir /home/phalanx phalanx \
    && mkdir -p /data \
    && chown phalanx:phalanx /data

COPY --from=build /opt/phalanx /opt/phalanx

USER phalanx
WORKDIR /home/phalanx
EXPOSE 8000

ENTRYPOINT ["phalanx"]
CMD ["--help"]

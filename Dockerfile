# The Sluice image: the `sluice` command (gateway, worker, serve, sim, bench, keys) and nothing
# else - no dev dependencies, no compiler, no llama-server. The Kubernetes base (deploy/k8s) runs
# `sluice gateway` and `sluice worker` from it; docs/kubernetes.md says how to build and push it.
#
#   docker build -t sluice:0.1.0 .
#
# `sluice serve` with no engine would build llama-server from source: that needs a compiler this
# image does not have. Give it --backend (or run the gateway and worker roles) instead.
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# A fixed numeric uid and gid, so that a pod's securityContext (runAsUser: 10001, runAsNonRoot)
# matches it and the kubelet can check that it is not root.
RUN groupadd --system --gid 10001 sluice \
    && useradd --system --uid 10001 --gid 10001 --home-dir /home/sluice --create-home \
       --shell /usr/sbin/nologin sluice

# Only what the package is built from (.dockerignore keeps the rest out of the context), installed
# with its runtime dependencies only: every one has a manylinux wheel, so no compiler is needed.
COPY pyproject.toml README.md /src/
COPY src /src/src
RUN pip install /src && rm -rf /src

USER 10001:10001
WORKDIR /home/sluice
EXPOSE 8000

# Python is PID 1 here: the roles install their own SIGTERM handlers (the drain), which is what a
# pod's termination needs; no init process is required.
ENTRYPOINT ["sluice"]
CMD ["--help"]

# fractional-dra: one image for the node agent (`fractional plugin`) and the controller
# (`fractional controller`), entrypoint `fractional`.
#   make image                    hermetic: wheels downloaded on the host, built with the network off
#   docker build -t fractional-dra:dev .     anywhere with network access (pip uses PyPI)
# PYTHON_IMAGE is any Debian-like image with Python 3.11 and its venv module (hack/image-base.sh
# makes one with debootstrap where python:3.11-slim cannot be pulled).
ARG PYTHON_IMAGE=python:3.11-slim

# -- builder: install the package and its runtime dependencies into a virtualenv ---------------
FROM ${PYTHON_IMAGE} AS builder
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
RUN python3 -m venv /opt/venv
WORKDIR /src
# wheelhouse/ holds only its README unless `make image` filled it with wheels: then pip installs
# from it alone (no index, so the build needs no network); otherwise from PyPI.
COPY wheelhouse /wheels
RUN if ls /wheels/*.whl > /dev/null 2>&1; then \
      printf '[global]\nno-index = true\nfind-links = /wheels\n' > /opt/venv/pip.conf; \
    fi
COPY pyproject.toml README.md ./
# Every dependency ships manylinux wheels for 3.11: no compiler is needed (or present).
# The runtime dependencies first, in a layer of their own (a change to driver/ reuses it). Then
# strip what the agent and the controller never run: type stubs, and kubernetes/aio, the
# client's asyncio twin (68 MB with its bytecode; we use the threaded client, and
# `import kubernetes` does not import it). Bytecode is compiled once here: the image runs with
# PYTHONDONTWRITEBYTECODE, and importing the kubernetes client uncompiled costs about 2 s at
# every start.
RUN python3 -c 'import tomllib; print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]))' \
      > /tmp/requirements.txt \
 && /opt/venv/bin/pip install --prefer-binary --no-compile -r /tmp/requirements.txt \
 && rm -rf /opt/venv/lib/python3*/site-packages/kubernetes/aio \
 && find /opt/venv \( -name '*.pyi' -o -name '*.pyx' -o -name '*.pxd' \) -type f -delete \
 && /opt/venv/bin/python -m compileall -q -j 0 /opt/venv/lib
COPY driver ./driver
# The project itself; then pip and setuptools go (only installing needs them).
RUN /opt/venv/bin/pip install --no-deps --no-compile . \
 && rm -f /opt/venv/pip.conf \
 && /opt/venv/bin/pip uninstall -y -q pip setuptools \
 && /opt/venv/bin/python -m compileall -q /opt/venv/lib/python3*/site-packages/driver

# -- runtime: the virtualenv and the fake-device profiles, nothing else -------------------------
FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="fractional-dra" \
      org.opencontainers.image.description="Kubernetes DRA driver: GPU shares by memory and compute" \
      org.opencontainers.image.licenses="Apache-2.0"
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
COPY --from=builder /opt/venv /opt/venv
COPY fake_devices /opt/fractional-dra/fake_devices
# Shipped profile names (`--profile h100-8x`) resolve next to the installed package
# (driver.inventory.fake.PROFILE_DIR); the chart passes file paths and does not need this link.
RUN ln -s /opt/fractional-dra/fake_devices \
      "$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/fake_devices" \
 && fractional --version
WORKDIR /opt/fractional-dra
# Non-root by default (the controller). The chart runs the node agent as root without
# capabilities, because the kubelet's socket directories on the host belong to root.
USER 65532:65532
ENTRYPOINT ["fractional"]
CMD ["--help"]

# syntax=docker/dockerfile:1
# fractional-dra: one image for the node agent (`fractional plugin`) and the controller
# (`fractional controller`). Build: docker build -t fractional-dra:dev .
ARG PYTHON_IMAGE=python:3.11-slim

# -- builder: install the package and its dependencies into a virtualenv ------------------------
FROM ${PYTHON_IMAGE} AS builder
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
RUN python -m venv /opt/venv
WORKDIR /src
COPY pyproject.toml README.md ./
COPY driver ./driver
# Every dependency ships manylinux wheels for 3.11: no compiler is needed (or present).
RUN /opt/venv/bin/pip install --prefer-binary . \
 && /opt/venv/bin/python -m compileall -q /opt/venv/lib \
 && /opt/venv/bin/pip uninstall -y -q pip setuptools

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
 && fractional --help > /dev/null
WORKDIR /opt/fractional-dra
# Non-root by default (the controller). The chart runs the node agent as root without
# capabilities, because the kubelet's socket directories on the host belong to root.
USER 65532:65532
ENTRYPOINT ["fractional"]
CMD ["--help"]

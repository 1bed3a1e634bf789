# bagserve prediction service.
#   docker build -t bagserve .
#   docker run -p 127.0.0.1:8000:8000 -v "$PWD/models:/models:ro" bagserve
# Models are artifacts under /models/<name>/<version>/ (bagserve train / bagserve demo),
# mounted read-only; /data keeps the SQLite database of jobs, idempotency records and
# the audit trail (or BAGSERVE_DATABASE_URL names a PostgreSQL database);
# settings are BAGSERVE_* variables (service/settings.py, the package bagserve.service).
# The image listens on 0.0.0.0: set BAGSERVE_API_KEYS (or BAGSERVE_ALLOW_ANONYMOUS=true
# behind a gateway that authenticates), else it warns at start and in /readyz.
#
# Two builds give the same environment: the base image is pinned by digest, its tag in
# the comment above it (`make base-digest` prints the tag's current digest where a
# registry is reachable), and every Python package comes from a hashed lock in
# requirements/ (`make lock`), installed with --require-hashes; the bagserve wheel goes
# in without dependencies. `make sbom` writes the CycloneDX SBOM of this environment.

# python:3.11-slim (Python 3.11.15, Debian 13): the tag's image index built 2026-08-05
FROM python:3.11-slim@sha256:90744cff8f32887f075c47d747a173ff333e9e98801667af93c357fa9f5e28ff AS build
# Optional input formats served by the image (Parquet, AnnData .h5ad), PostgreSQL for
# shared state (compose's scale profile) and signed model releases
# (BAGSERVE_TRUSTED_KEYS). The lock installed is requirements/<EXTRAS, commas as
# dashes>.txt: `make lock` writes one for this default and one per extra; an empty
# EXTRAS builds the smaller image from requirements/runtime.txt (--build-arg EXTRAS=).
ARG EXTRAS=parquet,anndata,postgres,signing
WORKDIR /src
COPY requirements ./requirements
RUN python -m pip install --no-cache-dir --require-hashes -r requirements/build.txt
COPY pyproject.toml README.md LICENSE ./
COPY core ./core
COPY service ./service
COPY bagserve ./bagserve
# The locked setuptools builds the wheel: no build isolation, so nothing unpinned is fetched.
RUN lock="requirements/$(echo "${EXTRAS:-runtime}" | tr , -).txt" \
 && if [ ! -f "$lock" ]; then echo "no $lock for EXTRAS=$EXTRAS (make lock)" >&2; exit 1; fi \
 && python -m pip wheel --no-cache-dir --no-deps --no-build-isolation --wheel-dir /wheels . \
 && cp "$lock" /wheels/requirements.txt

# python:3.11-slim (Python 3.11.15, Debian 13): the tag's image index built 2026-08-05
FROM python:3.11-slim@sha256:90744cff8f32887f075c47d747a173ff333e9e98801667af93c357fa9f5e28ff
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    MPLCONFIGDIR=/tmp/matplotlib \
    OMP_NUM_THREADS=1 \
    OPENBLAS_NUM_THREADS=1 \
    BAGSERVE_HOST=0.0.0.0 \
    BAGSERVE_PORT=8000 \
    BAGSERVE_MODELS_DIR=/models \
    BAGSERVE_DATA_DIR=/data \
    BAGSERVE_WORKERS=2 \
    BAGSERVE_LOG_FORMAT=json
COPY --from=build /wheels /wheels
RUN python -m pip install --no-cache-dir --require-hashes -r /wheels/requirements.txt \
 && python -m pip install --no-cache-dir --no-deps /wheels/bagserve-*.whl \
 && rm -rf /wheels \
 && useradd --system --uid 10001 --no-create-home --shell /usr/sbin/nologin bagserve \
 && mkdir /data && chown 10001 /data
USER 10001
WORKDIR /tmp
# Models are read-only; /data (jobs, idempotency records, audit trail) must be writable.
VOLUME ["/models", "/data"]
EXPOSE 8000
HEALTHCHECK --interval=15s --timeout=3s --start-period=90s --retries=3 \
  CMD ["python", "-c", "import sys, urllib.request; sys.exit(0 if urllib.request.urlopen('http://127.0.0.1:8000/readyz', timeout=2).status == 200 else 1)"]
CMD ["bagserve", "serve"]

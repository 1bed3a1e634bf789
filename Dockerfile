# bagserve prediction service.
#   docker build -t bagserve .
#   docker run -p 127.0.0.1:8000:8000 -v "$PWD/models:/models:ro" bagserve
# Models are artifacts under /models/<name>/<version>/ (bagserve train / bagserve demo),
# mounted read-only; /data keeps the SQLite database of jobs, idempotency records and
# the audit trail (or BAGSERVE_DATABASE_URL names a PostgreSQL database);
# settings are BAGSERVE_* variables (service/settings.py, the package bagserve.service).

FROM python:3.11-slim AS build
# Optional input formats served by the image (Parquet, AnnData .h5ad), PostgreSQL for
# shared state (compose's scale profile) and signed model releases
# (BAGSERVE_TRUSTED_KEYS); an empty EXTRAS builds the smaller image without them
# (--build-arg EXTRAS=).
ARG EXTRAS=parquet,anndata,postgres,signing
WORKDIR /src
COPY pyproject.toml README.md LICENSE ./
COPY core ./core
COPY service ./service
COPY bagserve ./bagserve
RUN python -m pip install --no-cache-dir --upgrade pip \
 && python -m pip wheel --no-cache-dir --wheel-dir /wheels ".${EXTRAS:+[$EXTRAS]}"

FROM python:3.11-slim
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
RUN python -m pip install --no-cache-dir /wheels/*.whl \
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

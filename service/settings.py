"""Service settings, from ``BAGSERVE_*`` environment variables (pydantic-settings)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

if TYPE_CHECKING:
    from .codecs import RequestLimits

__all__ = ["Settings"]

#: An HL7 ``HD`` (MSH-3..6): a namespace id, or namespace^universal id^universal id type;
#: characters that need no escaping in any HL7 field.
_HD = (
    r"^([A-Za-z0-9._\-]{1,20}"
    r"|[A-Za-z0-9._\-]{0,20}\^[A-Za-z0-9._:/\-]{1,199}\^[A-Za-z0-9\-]{1,6})$"
)


class Settings(BaseSettings):
    """Everything the service can be told, each with a ``BAGSERVE_`` variable.

    Lists (``api_keys``, ``cors_origins``, ``trusted_keys``) are JSON arrays or
    comma-separated strings.
    """

    model_config = SettingsConfigDict(env_prefix="BAGSERVE_", extra="ignore")

    models_dir: Path = Field(Path("models"), description="MODELS_DIR/<name>/<version>/ artifacts")
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    workers: int = Field(2, ge=1, le=64, description="compute worker processes")
    queue_size: int = Field(16, ge=0, description="requests waiting for a worker before 503")
    request_timeout: float = Field(60.0, gt=0, description="seconds for one prediction")
    retry_after: int = Field(1, ge=1, description="Retry-After seconds on 503")
    max_body_bytes: int = Field(256 * 2**20, gt=0)
    max_bags: int = Field(1000, ge=1)
    max_points_per_bag: int = Field(2_000_000, ge=1)
    max_total_points: int = Field(10_000_000, ge=1)
    max_columns: int = Field(
        512, ge=1, description="columns (markers and other channels) per bag; FCS files carry ~5-70"
    )
    max_decoded_bytes: int | None = Field(
        None,
        gt=0,
        description=(
            "what a compressed body may inflate to, and its cells may take as float64; "
            "default: 32 bytes per point of max_total_points (320 MB)"
        ),
    )
    max_pending_bytes: int = Field(
        1 << 30,
        gt=0,
        description=(
            "bytes of request bodies held while they wait for a worker; a body that would "
            "pass it is refused (503) before it is read (never below max_body_bytes)"
        ),
    )
    api_keys: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description=(
            "KEY or ROLE:KEY entries, ROLE one of read, predict (the default), admin; "
            "empty: no authentication"
        ),
    )
    allow_anonymous: bool = Field(
        False,
        description=(
            "no API keys on a non-loopback host is meant (e.g. behind a gateway that "
            "authenticates): no start-up warning, no warning in /readyz"
        ),
    )
    trusted_keys: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description=(
            "release keys: PATH or NAME=PATH entries of PEM public keys (or directories of "
            "them); when set, only models whose OpenSSF model-signing signature verifies "
            "against one of them are served"
        ),
    )
    metrics_auth: bool = Field(
        False, description="/metrics needs an API key (of any role) when keys are configured"
    )
    cors_origins: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="empty: CORS off"
    )
    data_dir: Path = Field(
        Path("bagserve-data"),
        description="writable: the SQLite database of jobs, idempotency records and audit trail",
    )
    database_url: str | None = Field(
        None,
        description=(
            "postgresql://user:password@host:5432/db to share state between replicas on "
            "several hosts; default: SQLite in DATA_DIR/bagserve.sqlite3"
        ),
    )
    database_pool: int = Field(8, ge=1, le=256, description="PostgreSQL connections at most")
    database_timeout: float = Field(
        2.0,
        gt=0,
        description=(
            "seconds after which a database that does not answer is given up and the "
            "request gets 503 with Retry-After: a connection, a statement (a PostgreSQL "
            "server that does not answer at all, frozen, a second more), a lock another "
            "process holds on the SQLite file; /readyz is 503 meanwhile"
        ),
    )
    lease: float = Field(
        30.0,
        gt=0,
        description=(
            "seconds a replica holds a running job or a key it computes without renewing; "
            "after that another replica takes it over"
        ),
    )
    job_poll: float = Field(0.5, gt=0, description="seconds between looks for queued jobs")
    audit_log: Path | None = Field(
        None,
        description="a pre-database audit file to import once; default: DATA_DIR/audit.jsonl",
    )
    audit_file_names: bool = Field(False, description="keep uploaded file names in the audit trail")
    audit_values: bool = Field(
        False,
        description=(
            "keep the answers' values (bag values, classes, class counts) in the audit "
            "trail; by default it keeps statuses, flags and domain scores only"
        ),
    )
    fhir_performer: str | None = Field(
        None,
        pattern=r"^[A-Z][A-Za-z]+/[A-Za-z0-9\-.]{1,64}$",
        description=(
            "the FHIR reference of who performs the test (e.g. Organization/lab-1): the "
            "performer of every DiagnosticReport and Observation"
        ),
    )
    fhir_timezone: str | None = Field(
        None,
        description=(
            "the instruments' time zone (IANA name, e.g. Europe/Berlin): FCS acquisition "
            "times ($DATE, $BTIM) carry none; without it FHIR's effectiveDateTime is the "
            "acquisition date alone"
        ),
    )
    hl7_forward: str | None = Field(
        None,
        pattern=r"^mllp://[^/:]+:\d{1,5}$",
        description=(
            "mllp://HOST:PORT: every finished job's answer is queued for delivery there as "
            "an HL7 v2.5.1 ORU^R01 message, apart from the jobs (the job is succeeded once "
            "its answer is stored); AA delivers it, AR refuses it, anything else is retried; "
            "each try is audited and the job says pending, delivered or undelivered"
        ),
    )
    hl7_retries: int = Field(
        10, ge=0, le=100, description="HL7 forwarding: tries after the first before giving up"
    )
    hl7_backoff: float = Field(
        1.0,
        ge=0,
        description=(
            "HL7 forwarding: seconds before the first retry, doubled after each (at most "
            "300 s between tries)"
        ),
    )
    hl7_timeout: float = Field(
        10.0,
        gt=0,
        description=(
            "HL7 forwarding: seconds one try may take in all (connect, send, wait for and "
            "read the ACK)"
        ),
    )
    hl7_give_up: float = Field(
        3600.0,
        gt=0,
        description=(
            "HL7 forwarding: seconds after a job's answer is stored when a message not yet "
            "accepted is no longer retried (undelivered; a restart retries it again)"
        ),
    )
    hl7_sending_application: str = Field(
        "bagserve",
        pattern=_HD,
        description="MSH-3 of every HL7 message: NAMESPACE or NAMESPACE^UNIVERSAL_ID^TYPE",
    )
    hl7_sending_facility: str | None = Field(
        None, pattern=_HD, description="MSH-4 of every HL7 message (the laboratory); empty if unset"
    )
    hl7_receiving_application: str | None = Field(
        None, pattern=_HD, description="MSH-5 of every HL7 message (e.g. the LIS); empty if unset"
    )
    hl7_receiving_facility: str | None = Field(
        None, pattern=_HD, description="MSH-6 of every HL7 message; empty if unset"
    )
    jobs_ttl: float = Field(86400.0, gt=0, description="seconds a finished job's result is kept")
    idempotency_ttl: float = Field(86400.0, gt=0, description="seconds a stored answer is replayed")
    log_format: Literal["json", "text"] = "json"
    log_level: str = "info"
    log_probes: bool = Field(
        False, description="log /healthz, /readyz and /metrics requests (probes) too"
    )

    @property
    def decoded_limit(self) -> int:
        """``max_decoded_bytes``, or its default derived from the point limit.

        32 bytes per point allowed in a request: four markers as float64, or about
        three ten-character numbers of text. At the default 10^7 points that is 320 MB:
        more than the largest text body the 256 MiB body limit lets through decodes to,
        and a thousandth of what a gzip bomb of that size asks for.
        """
        return self.max_decoded_bytes or 32 * self.max_total_points

    def request_limits(self) -> RequestLimits:
        """The limits the workers decode and validate requests within."""
        from .codecs import RequestLimits

        return RequestLimits(
            max_decoded_bytes=self.decoded_limit,
            max_bags=self.max_bags,
            max_points_per_bag=self.max_points_per_bag,
            max_total_points=self.max_total_points,
            max_columns=self.max_columns,
        )

    @field_validator("api_keys", "cors_origins", "trusted_keys", mode="before")
    @classmethod
    def _split(cls, value: object) -> object:
        if isinstance(value, str):
            if value.lstrip().startswith("["):
                import json

                return json.loads(value)
            return [v.strip() for v in value.split(",") if v.strip()]
        return value

    @field_validator("fhir_timezone")
    @classmethod
    def _zone(cls, value: str | None) -> str | None:
        if value is None:
            return None
        from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

        try:
            ZoneInfo(value)
        except (ZoneInfoNotFoundError, ValueError) as exc:
            raise ValueError(f"not an IANA time zone name: {value!r}") from exc
        return value

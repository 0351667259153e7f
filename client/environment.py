"""The CLI's `KVMESH_*` environment variables, read in one place.

Precedence is flags, then these variables, then built-in defaults: the variables only change
the defaults that `kvmesh --help` shows, so a flag on the command line always wins.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

DEFAULT_ADDRESS = "127.0.0.1:50051"
LOG_LEVELS = ("debug", "info", "warning", "error")
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


@dataclass(frozen=True, slots=True)
class CliEnvironment:
    """Defaults taken from the environment; None means "not set, use the built-in default"."""

    address: str = DEFAULT_ADDRESS
    """KVMESH_ADDRESS: the coordinator the read commands talk to (HOST:PORT)."""
    timeout_s: float | None = None
    """KVMESH_TIMEOUT_S: deadline of each client call, in seconds."""
    redis_url: str | None = field(default=None, repr=False)
    """KVMESH_REDIS_URL: the index's Redis for `serve` (and `up`, instead of an embedded one),
    and for `index verify`; it may hold a password, so it is kept out of repr."""
    ray_address: str = "auto"
    """KVMESH_RAY_ADDRESS: the Ray cluster `serve` joins."""
    model: str = "tiny-random"
    """KVMESH_MODEL: preset name or Hugging Face checkpoint folder."""
    policy: str = "kvmesh"
    """KVMESH_POLICY: routing policy name."""
    device: str = "auto"
    """KVMESH_DEVICE: worker device (auto, cpu, cuda)."""
    token: str | None = field(default=None, repr=False)
    """KVMESH_TOKEN: bearer token the client commands send."""
    tls_ca: str | None = None
    """KVMESH_TLS_CA: PEM CA file; client commands then connect with TLS."""
    auth_token: str | None = field(default=None, repr=False)
    """KVMESH_AUTH_TOKEN: bearer token `up` / `serve` accept (instead of --auth-token)."""
    admin_token: str | None = field(default=None, repr=False)
    """KVMESH_ADMIN_TOKEN: admin token `up` / `serve` accept (instead of --admin-token)."""
    metrics_port: int = 0
    """KVMESH_METRICS_PORT: Prometheus endpoint of `up` / `serve` (0: off)."""
    log_level: str = "info"
    """KVMESH_LOG_LEVEL: log level of `up` / `serve` (debug, info, warning, error)."""
    log_json: bool = False
    """KVMESH_LOG_JSON: `up` / `serve` log JSON lines (1/true/yes/on or 0/false/no/off)."""

    def __post_init__(self) -> None:
        if not self.address:
            raise ValueError("KVMESH_ADDRESS is set but empty; use HOST:PORT")
        if self.timeout_s is not None and not (
            math.isfinite(self.timeout_s) and self.timeout_s > 0
        ):
            raise ValueError(f"KVMESH_TIMEOUT_S must be a number > 0, got {self.timeout_s}")
        if not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"KVMESH_METRICS_PORT must be in [0, 65535], got {self.metrics_port}")
        if self.log_level not in LOG_LEVELS:
            raise ValueError(
                f"KVMESH_LOG_LEVEL must be one of {LOG_LEVELS}, got {self.log_level!r}"
            )


def read_environment(environ: Mapping[str, str]) -> CliEnvironment:
    """The CLI defaults from `environ` (normally os.environ); empty values count as unset."""
    values = {k: v.strip() for k, v in environ.items() if k.startswith("KVMESH_") and v.strip()}
    timeout_text = values.get("KVMESH_TIMEOUT_S")
    try:
        timeout_s = float(timeout_text) if timeout_text is not None else None
    except ValueError:
        raise ValueError(
            f"KVMESH_TIMEOUT_S must be a number of seconds, got {timeout_text!r}"
        ) from None
    defaults = CliEnvironment()
    port_text = values.get("KVMESH_METRICS_PORT", "0")
    if not port_text.isdigit():
        raise ValueError(f"KVMESH_METRICS_PORT must be a port number, got {port_text!r}")
    json_text = values.get("KVMESH_LOG_JSON", "0").lower()
    if json_text not in _TRUE + _FALSE:
        raise ValueError(f"KVMESH_LOG_JSON must be one of {_TRUE + _FALSE}, got {json_text!r}")
    return CliEnvironment(
        address=values.get("KVMESH_ADDRESS", defaults.address),
        timeout_s=timeout_s,
        redis_url=values.get("KVMESH_REDIS_URL"),
        ray_address=values.get("KVMESH_RAY_ADDRESS", defaults.ray_address),
        model=values.get("KVMESH_MODEL", defaults.model),
        policy=values.get("KVMESH_POLICY", defaults.policy),
        device=values.get("KVMESH_DEVICE", defaults.device),
        token=values.get("KVMESH_TOKEN"),
        tls_ca=values.get("KVMESH_TLS_CA"),
        auth_token=values.get("KVMESH_AUTH_TOKEN"),
        admin_token=values.get("KVMESH_ADMIN_TOKEN"),
        metrics_port=int(port_text),
        log_level=values.get("KVMESH_LOG_LEVEL", defaults.log_level).lower(),
        log_json=json_text in _TRUE,
    )

"""MonitoringConfig: the metrics endpoint and health check of one peer."""
from __future__ import annotations

import ipaddress
import re
from typing import Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator

HOSTNAME = re.compile(
    r"(?=.{1,253}$)[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*"
)


class MonitoringConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    metrics_port: Union[Literal["off"], int] = Field(
        default=0, description="Port for /metrics and /healthz; 0 picks a free port; off disables the endpoint."
    )
    @field_validator("metrics_port", mode="before")
    @classmethod
    def _port_or_off(cls, value):
        if value == "off":
            return value
        try:
            port = int(value)
        except (TypeError, ValueError):
            port = -1
        if isinstance(value, bool) or not 0 <= port <= 65535 or str(port) != str(value).strip():
            raise ValueError("must be a port in 0..65535 (0 picks a free one) or off")
        return port

    metrics_host: str = Field(
        default="127.0.0.1",
        description="Address the metrics endpoint listens on: 127.0.0.1 serves this machine only; 0.0.0.0 every "
                    "interface (for a Prometheus elsewhere, behind a firewall).")

    @field_validator("metrics_host")
    @classmethod
    def _ip_or_hostname(cls, value: str) -> str:
        try:
            ipaddress.ip_address(value)
        except ValueError:
            if not HOSTNAME.fullmatch(value):
                raise ValueError("must be an IP address (0.0.0.0 for all interfaces) or a host name") from None
        return value
    health_window_seconds: float = Field(
        default=300.0,
        gt=0,
        description="/healthz turns 503 when the training loop made no progress for this long.",
    )

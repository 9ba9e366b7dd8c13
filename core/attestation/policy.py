"""The verifier's policy: reference measurements and limits, read from ``core/policy/*.toml``.

A policy is a reference-integrity manifest: the firmware, driver and code digests a device must
report, the CC modes it may run in, how old a report may be and how long a token lives. Every bad
entry is a ``ConfigError`` naming its key.
"""

from __future__ import annotations

import importlib.resources
import math
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gputravel.core.attestation.evidence import HEX64, CCMode, Measurements, code_measurement
from gputravel.core.errors import ConfigError

__all__ = ["DEFAULT_POLICY", "Policy", "load_policy"]

DEFAULT_POLICY = "policy/default.toml"
"""The shipped policy, as package data of ``gputravel.core``."""

_POLICY_REQUIRED = ("firmware", "driver", "code")
_POLICY_OPTIONAL = ("allowed_modes", "max_report_age_s", "token_ttl_s")


def _seconds(value: Any) -> float | None:
    """``value`` as a positive, finite number of seconds, or None."""
    try:  # an integer beyond float range (TOML readers take any size) is not a number of seconds
        seconds = float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None
    except OverflowError:
        seconds = None
    return seconds if seconds is not None and math.isfinite(seconds) and seconds > 0 else None


@dataclass(frozen=True, slots=True)
class Policy:
    """Reference values the verifier compares evidence against (a reference-integrity manifest).

    ``code`` may be ``"auto"``: the ``code_measurement()`` of the installed package.
    """

    firmware: str
    driver: str
    code: str
    allowed_modes: tuple[CCMode, ...] = (CCMode.ON,)
    max_report_age_s: float = 60.0
    token_ttl_s: float = 3600.0

    def __post_init__(self) -> None:
        for key in _POLICY_REQUIRED:
            value = getattr(self, key)
            if not isinstance(value, str) or not (HEX64.fullmatch(value) or (key == "code" and value == "auto")):
                allowed = 'lowercase hex SHA-256 or "auto"' if key == "code" else "lowercase hex SHA-256"
                raise ConfigError(f"policy: {key} must be a {allowed}")
        if isinstance(self.allowed_modes, str | bytes) or not self.allowed_modes:
            raise ConfigError("policy: allowed_modes must be a non-empty list of modes")
        try:
            modes = tuple(CCMode(m) for m in self.allowed_modes)
        except (ValueError, TypeError):
            raise ConfigError(
                f"policy: allowed_modes must hold only {', '.join(m.value for m in CCMode)}"
            ) from None
        object.__setattr__(self, "allowed_modes", modes)
        for key in ("max_report_age_s", "token_ttl_s"):
            seconds = _seconds(getattr(self, key))
            if seconds is None:
                raise ConfigError(f"policy: {key} must be a positive number of seconds")
            object.__setattr__(self, key, seconds)

    def expected(self, *, code: str | None = None) -> Measurements:
        """The reference measurements, with ``"auto"`` resolved (to ``code`` if given)."""
        if self.code == "auto":
            resolved = code if code is not None else code_measurement()
        else:
            resolved = self.code
        return Measurements(firmware=self.firmware, driver=self.driver, code=resolved)


def _policy_text(path: Path | None) -> tuple[str, str]:
    """(where, text): the file's name for messages and its contents."""
    if path is None:
        text = importlib.resources.files("gputravel.core").joinpath(DEFAULT_POLICY).read_text("utf-8")
        return "default policy", text
    try:
        return str(path), Path(path).read_text("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"policy {path}: cannot read: {exc}") from None


def load_policy(path: Path | None = None) -> Policy:
    """Read a policy TOML; ``None`` reads the shipped ``core/policy/default.toml``.

    Raises ``ConfigError`` naming the key for unknown, missing, mistyped or malformed entries.
    """
    where, text = _policy_text(path)
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"policy {where}: invalid TOML: {exc}") from None
    unknown = sorted(set(data) - set(_POLICY_REQUIRED) - set(_POLICY_OPTIONAL))
    if unknown:
        raise ConfigError(f"policy {where}: unknown key(s): {', '.join(unknown)}")
    missing = [k for k in _POLICY_REQUIRED if k not in data]
    if missing:
        raise ConfigError(f"policy {where}: missing key(s): {', '.join(missing)}")
    kwargs = dict(data)
    if "allowed_modes" in kwargs:
        modes = kwargs["allowed_modes"]
        if not isinstance(modes, list) or not all(isinstance(m, str) for m in modes):
            raise ConfigError(f"policy {where}: allowed_modes must be a list of strings")
        kwargs["allowed_modes"] = tuple(modes)
    try:
        return Policy(**kwargs)
    except ConfigError as exc:
        raise ConfigError(f"policy {where}: {exc.reason.removeprefix('policy: ')}") from None

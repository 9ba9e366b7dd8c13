"""Choices the CLI and the console share, typed as choices, and the help conventions both follow.

Cheap to import (no torch): the model presets are named here and checked against
``core.training.model.PRESETS`` by a test.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any

import typer
import typer.core

from gputravel.core.phases import VISIT_PHASES

__all__ = ["CcMode", "DataPathChoice", "ModelPreset", "PhaseChoice", "ThemeChoice", "TransportChoice",
           "quiet_flag_types", "version_callback", "version_text"]


class CcMode(StrEnum):
    ON = "on"
    OFF = "off"
    DEVTOOLS = "devtools"


class TransportChoice(StrEnum):
    SSH = "ssh"
    LOCAL = "local"


class DataPathChoice(StrEnum):
    DIRECT = "direct"
    CHANNEL = "channel"
    SSH = "ssh"  # the name `bench provision` and the docs use for the channel path
    CONVENTIONAL = "conventional"


class CipherEngine(StrEnum):
    """Who opens provisioning chunks on the device (core/device/openers.py)."""

    AUTO = "auto"
    CPU = "cpu"
    GPU = "gpu"


class ModelPreset(StrEnum):
    TINY = "tiny"
    SMALL = "small"
    GPT2 = "gpt2"


#: The phases a breakpoint may stop before (case-insensitive on the command line): the visit's own phases.
PhaseChoice = StrEnum("PhaseChoice", {str(p): str(p) for p in VISIT_PHASES})  # type: ignore[misc]


class ThemeChoice(StrEnum):
    """The palettes the console's command palette offers (``themes.THEMES``)."""

    DARK = "dark"
    LIGHT = "light"
    HIGH_CONTRAST = "high-contrast"


def version_text() -> str:
    from importlib import metadata  # here, not at the top: 40 ms every command and the console would pay

    try:
        return f"gputravel {metadata.version('gputravel')}"
    except metadata.PackageNotFoundError:  # pragma: no cover - run from a source tree without an install
        return "gputravel (not installed)"


def version_callback(value: bool) -> None:
    """``--version``: print the version and exit (an eager typer option)."""
    if value:
        typer.echo(version_text())
        raise typer.Exit()


def quiet_flag_types() -> None:
    """Typer's rich help prints ``<bool>`` in the type column of every flag (``--json <bool>``), which
    reads as if the flag took a value. Flags show no type, as click's plain help does."""
    option = typer.core.TyperOption
    if getattr(option.display_type_rich, "_gputravel_quiet", False):
        return
    original = option.display_type_rich

    def display_type_rich(self: typer.core.TyperOption, ctx: Any) -> str | None:
        if self.is_flag and self.metavar is None:
            return None
        return original(self, ctx)

    display_type_rich._gputravel_quiet = True  # type: ignore[attr-defined]
    option.display_type_rich = display_type_rich  # type: ignore[method-assign]


def fast_bool_flags() -> None:
    """Typer (0.29) coerces a parameter's value through a pydantic ``TypeAdapter`` it builds on first use, and
    imports pydantic for it (0.2-0.4 s of CPU here): ``gputravel bench --help`` paid that for ``--help`` and the
    completion flags, whose value is None. A flag's value comes from click as a bool or None already, so a
    ``bool`` parameter passes through as typer's own pass-through does (no pydantic); every other type is
    typer's. A typer without these internals is left as it is (issue 35.4: ``--help`` <= 0.5 s)."""
    import importlib

    try:
        typer_core: Any = importlib.import_module("typer.core")  # typer's internals: typed loosely on purpose
        from typer._coercion import PassThroughRuntimeParam
    except ImportError:
        return
    build = typer_core.__dict__.get("build_runtime_param")
    if build is None or build.__dict__.get("_gputravel_fast", False):
        return

    def build_runtime_param(descriptor: Any) -> Any:
        if descriptor.annotation is bool and descriptor.file_annotation is None:
            return PassThroughRuntimeParam(annotation=bool, parameter_info=descriptor.parameter_info)
        return build(descriptor)

    build_runtime_param._gputravel_fast = True  # type: ignore[attr-defined]
    typer_core.build_runtime_param = build_runtime_param

"""The console's themes: palettes as ``Theme`` objects, styles in ``console.tcss`` (colours only as $tokens).

``--theme dark|light|high-contrast`` picks one; each is registered under ``gputravel-<name>``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Final

from textual.theme import Theme

__all__ = ["CSS_PATH", "THEMES", "theme_name"]

CSS_PATH: Final = Path(__file__).with_name("console.tcss")

THEMES: Final[dict[str, Theme]] = {
    "dark": Theme(
        name="gputravel-dark",
        primary="#4EA1FF",
        secondary="#9C7CF4",
        accent="#FFB454",
        warning="#FFB454",
        error="#FF6B6B",
        success="#5FD38D",
        foreground="#D8DEE9",
        background="#11151C",
        surface="#181E27",
        panel="#232B36",
        dark=True,
        variables={"footer-key-foreground": "#4EA1FF", "block-cursor-background": "#2F4A6B"},
    ),
    "light": Theme(
        name="gputravel-light",
        primary="#1F5FBF",
        secondary="#6B4FBB",
        accent="#B35900",
        warning="#A86400",
        error="#C0392B",
        success="#1E7D45",
        foreground="#1B1F24",
        background="#F7F8FA",
        surface="#EDEFF3",
        panel="#DDE2EA",
        dark=False,
        variables={"footer-key-foreground": "#1F5FBF"},
    ),
    "high-contrast": Theme(
        name="gputravel-high-contrast",
        primary="#FFFF00",
        secondary="#00FFFF",
        accent="#FF00FF",
        warning="#FFFF00",
        error="#FF3333",
        success="#00FF00",
        foreground="#FFFFFF",
        background="#000000",
        surface="#000000",
        panel="#1A1A1A",
        dark=True,
        luminosity_spread=0.0,
        text_alpha=1.0,
        variables={"footer-key-foreground": "#FFFF00", "border": "#FFFFFF", "block-cursor-background": "#FFFF00",
                   "block-cursor-foreground": "#000000"},
    ),
}


def theme_name(choice: str) -> str:
    """``dark`` -> ``gputravel-dark``; an unknown choice raises ``KeyError`` naming the valid ones."""
    if choice not in THEMES:
        raise KeyError(f"unknown theme {choice!r}: choose {', '.join(THEMES)}")
    return THEMES[choice].name

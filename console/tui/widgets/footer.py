"""The footer: the keys that work here, and always ``r Run``, ``c Cancel``, ``: cmd``, ``? Help`` and ``q Quit``.

Textual's footer lists every shown binding and lets the right end fall off a narrow terminal, which at 80
columns took Help and Quit with it (and later Run, Cancel and the command line). This one drops the other keys
from the end first (the help overlay lists every key), so the essential ones stay whatever the width, each in
its place among the others.
"""

from __future__ import annotations

from textual import events
from textual.app import ComposeResult
from textual.binding import Binding
from textual.widgets import Footer
from textual.widgets._footer import FooterKey

__all__ = ["ESSENTIAL_ACTIONS", "ConsoleFooter"]

#: Kept in the footer at any width (where the screen offers them), in the bindings' order.
ESSENTIAL_ACTIONS = ("run", "cancel", "command_line", "show_help", "quit")
PALETTE_WIDTH = 14  # "▏^p palette", docked at the right


class ConsoleFooter(Footer):
    def compose(self) -> ComposeResult:
        if not self._bindings_ready:
            return
        active = self.screen.active_bindings
        seen: dict[str, tuple[Binding, bool, str]] = {}
        for _node, binding, enabled, tooltip in active.values():
            if binding.show and binding.action not in seen:
                seen[binding.action] = (binding, enabled, tooltip)
        essential = [seen[a] for a in ESSENTIAL_ACTIONS if a in seen]
        others = [v for a, v in seen.items() if a not in ESSENTIAL_ACTIONS]
        order = list(seen)

        def width(entry: tuple[Binding, bool, str]) -> int:
            binding = entry[0]
            return len(self.app.get_key_display(binding)) + len(binding.description) + 3

        room = (self.size.width or self.app.size.width) - PALETTE_WIDTH - sum(width(e) for e in essential)
        kept = []
        for entry in others:
            room -= width(entry)
            if room < 0:
                break
            kept.append(entry)
        shown = sorted(kept + essential, key=lambda entry: order.index(entry[0].action))
        self.styles.grid_size_columns = len(shown)
        for binding, enabled, tooltip in shown:
            yield FooterKey(binding.key, self.app.get_key_display(binding), binding.description,
                            binding.action, disabled=not enabled, tooltip=tooltip).data_bind(
                                compact=Footer.compact)
        if self.show_command_palette and self.app.ENABLE_COMMAND_PALETTE:
            try:
                _node, binding, enabled, tooltip = active[self.app.COMMAND_PALETTE_BINDING]
            except KeyError:
                return
            yield FooterKey(binding.key, self.app.get_key_display(binding), binding.description, binding.action,
                            classes="-command-palette", disabled=not enabled,
                            tooltip=binding.tooltip or binding.description)

    def on_resize(self, event: events.Resize) -> None:
        self.call_after_refresh(self.recompose)

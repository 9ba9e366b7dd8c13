"""The ``/`` filter of a table (k9s style): type to keep the rows that contain the text, escape clears it."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from textual import on
from textual.binding import Binding
from textual.message import Message
from textual.widgets import Input

__all__ = ["TableFilter", "row_matches"]


def row_matches(needle: str, cells: Iterable[object]) -> bool:
    """Case-insensitive: does any cell's text contain ``needle`` (an empty needle keeps every row)?"""
    if not needle:
        return True
    needle = needle.lower()
    return any(needle in str(cell).lower() for cell in cells)


class TableFilter(Input):
    """A one-line input, hidden until ``/`` opens it; posts :class:`TableFilter.FilterChanged` as the text changes.

    ``enter`` keeps the filter and gives the keys back to the table; ``escape`` clears it and closes.
    """

    DEFAULT_CSS = """
    TableFilter {
        display: none;
        height: 1;
        border: none;
        padding: 0 1;
        background: $panel;
    }
    TableFilter:focus {
        border: none;
        height: 1;
    }
    TableFilter.-open, TableFilter.-active {
        display: block;
    }
    """

    BINDINGS = [Binding("escape", "clear", "Clear filter", show=False)]

    class FilterChanged(Message):
        """The filter text changed (``needle`` is empty once cleared)."""

        def __init__(self, needle: str) -> None:
            super().__init__()
            self.needle = needle

    def __init__(self, *, placeholder: str = "filter rows (enter keeps, escape clears)", id: str | None = None,
                 classes: str | None = None) -> None:
        super().__init__(placeholder=placeholder, id=id, classes=classes, compact=True)
        self.can_focus = False

    @property
    def needle(self) -> str:
        return self.value.strip()

    def open(self) -> None:
        self.can_focus = True
        self.add_class("-open")
        self.focus()

    def action_clear(self) -> None:
        self.value = ""
        self._close()

    def _close(self) -> None:
        self.remove_class("-open")
        self.set_class(bool(self.needle), "-active")  # a kept filter stays visible, so rows are never hidden unseen
        self.can_focus = False
        self.screen.set_focus(None)

    @on(Input.Changed)
    def _changed(self, event: Input.Changed) -> None:
        event.stop()
        self.post_message(self.FilterChanged(self.needle))

    @on(Input.Submitted)
    def _submitted(self, event: Input.Submitted) -> None:
        event.stop()
        self._close()

    @staticmethod
    def keep(needle: str, rows: Sequence[Sequence[object]]) -> list[int]:
        """Indexes of ``rows`` the needle keeps."""
        return [i for i, row in enumerate(rows) if row_matches(needle, row)]

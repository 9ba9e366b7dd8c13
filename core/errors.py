"""The one error tree, re-exported for the engine (defined in ``core.protocol.errors``)."""

from gputravel.core.protocol.errors import *  # noqa: F403
from gputravel.core.protocol.errors import __all__ as __all__

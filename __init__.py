"""gputravel: confidential collaborative ML training with a travelling confidential GPU."""

__version__ = "0.1.0"

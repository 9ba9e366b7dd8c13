"""The device service's session part: the session secrets and the control channel's epoch, owned here alone.

:class:`DeviceSecrets` is one part of :class:`~gputravel.core.device.service.DeviceService` (a part holds its
state; the service composes it, no mixin): a new session replaces the secrets and starts the control channel at
epoch 0; ``rotate`` moves the control channel to a newer epoch only.
"""

from __future__ import annotations

from gputravel.core.errors import DeviceError, ProtocolError
from gputravel.core.handshake import SessionSecrets

__all__ = ["DeviceSecrets"]


class DeviceSecrets:
    """The session secrets (None before the first session) and the control channel's current epoch."""

    def __init__(self) -> None:
        self.secrets: SessionSecrets | None = None
        #: the control channel's current epoch (the transport swaps its keys after a ROTATE reply)
        self.control_epoch = 0

    def start(self, secrets: SessionSecrets) -> None:
        """A new session: its secrets replace the last one's, the control channel starts again at epoch 0."""
        self.secrets = secrets
        self.control_epoch = 0

    def require(self) -> SessionSecrets:
        """The session's secrets; a named error before a session is open."""
        if self.secrets is None:
            raise DeviceError("no session: attest and open a session first")
        return self.secrets

    def rotate(self, epoch: int) -> int:
        """Move the control channel to ``epoch``, which must be newer than the current one."""
        rotate_to = int(epoch)
        if rotate_to <= self.control_epoch:
            raise ProtocolError(f"rotate to epoch {rotate_to} is not newer than {self.control_epoch}")
        self.control_epoch = rotate_to
        return rotate_to

"""A fleet member's emulated platform: the fleet's one vendor PKI, this member's own device identity."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from gputravel.core.attestation import VendorCA, load_policy
from gputravel.core.deviceclient.anchors import TrustAnchors
from gputravel.core.platform.emulated import EmulatedPlatform

__all__ = ["FleetPlatform"]


class FleetPlatform(EmulatedPlatform):
    """Starts ``python -m gputravel.core.fleet.device`` as device ``device_id``, certified by the vendor
    in ``vendor_dir`` (linked into this member's state folder), and pins that vendor's root."""

    def __init__(self, state_dir: Path, *, vendor_dir: Path, device_id: str, **kw: Any) -> None:
        super().__init__(state_dir, module="gputravel.core.fleet.device", extra_args=("--device-id", device_id),
                         **kw)
        self.vendor_dir = Path(vendor_dir).resolve()
        self.device_id = device_id
        self.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        link = self.state_dir / "vendor"
        if not link.exists():
            os.symlink(self.vendor_dir, link)

    def anchors(self) -> TrustAnchors:
        ca = VendorCA.load(self.vendor_dir)
        return TrustAnchors(root=ca.root, crl=ca.crl(), policy=self.policy or load_policy())

"""Fetched collateral kept with its expiry (issue 31 item 3): a cache folder, and a bundle an air-gapped holder
carries in.

An entry is one file named by the SHA-256 of its key (the URL it came from), beside a manifest line with the key,
when it was fetched and when it expires (the collateral's own ``nextUpdate``, a CRL's next update, a
certificate's end). ``get`` never returns an expired entry; ``export`` copies the live entries into a bundle
folder; a cache opened ``offline`` never fetches, and an entry it lacks or that expired is refused by name
(``CollateralUnavailable``). Standard library only.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["CollateralCache", "CollateralUnavailable", "MANIFEST"]

MANIFEST = "manifest.json"


class CollateralUnavailable(ValueError):
    """Offline, and the bundle has no live entry for this key (missing or expired): named in ``claim``."""

    def __init__(self, claim: str, reason: str) -> None:
        super().__init__(f"{claim}: {reason}")
        self.claim = claim


@dataclass(slots=True)
class CollateralCache:
    """A folder of fetched collateral; ``offline``: a bundle, nothing is fetched."""

    folder: Path
    offline: bool = False
    #: every key read or written through this object, in order (what ``gputravel evidence bundle`` exports)
    touched: list[str] = field(default_factory=list)

    def _manifest(self) -> dict[str, dict[str, float | str]]:
        try:
            doc = json.loads((self.folder / MANIFEST).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return {}
        return doc if isinstance(doc, dict) else {}

    @staticmethod
    def _name(key: str) -> str:
        return hashlib.sha256(key.encode()).hexdigest() + ".bin"

    def get(self, key: str, *, now: float | None = None) -> bytes | None:
        """The entry, if present and not expired at ``now``; offline, a missing or expired one raises.

        Raises:
            CollateralUnavailable: offline and no live entry (``bundle-missing`` / ``bundle-expired``).
        """
        at = time.time() if now is None else now
        if key not in self.touched:
            self.touched.append(key)
        meta = self._manifest().get(self._name(key))
        if meta is None:
            if self.offline:
                raise CollateralUnavailable("bundle-missing", f"the bundle in {self.folder} has nothing for {key}")
            return None
        if at >= float(meta["expires"]):
            if self.offline:
                raise CollateralUnavailable("bundle-expired", f"{key} in the bundle expired at "
                                            f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime(float(meta['expires'])))}")
            return None
        try:
            return (self.folder / self._name(key)).read_bytes()
        except OSError:
            return None

    def put(self, key: str, data: bytes, *, expires: float) -> None:
        if self.offline:
            raise CollateralUnavailable("bundle-read-only", "an offline bundle is not written to")
        self.folder.mkdir(parents=True, exist_ok=True)
        name = self._name(key)
        tmp = self.folder / f".{name}.tmp"
        tmp.write_bytes(data)
        os.replace(tmp, self.folder / name)
        manifest = self._manifest()
        manifest[name] = {"key": key, "fetched": time.time(), "expires": expires}
        tmp = self.folder / f".{MANIFEST}.tmp"
        tmp.write_text(json.dumps(manifest, indent=1, sort_keys=True), encoding="utf-8")
        os.replace(tmp, self.folder / MANIFEST)

    def export(self, out: Path, keys: list[str], *, now: float | None = None) -> list[dict[str, float | str]]:
        """Copy the live entries for ``keys`` into a bundle folder ``out``; their manifest lines.

        Raises:
            CollateralUnavailable: a key has no live entry (``bundle-missing``).
        """
        at = time.time() if now is None else now
        manifest, lines = self._manifest(), {}
        for key in keys:
            name = self._name(key)
            meta = manifest.get(name)
            if meta is None or at >= float(meta["expires"]):
                raise CollateralUnavailable("bundle-missing", f"nothing live in {self.folder} for {key}")
            out.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(self.folder / name, out / name)
            lines[name] = meta
        (out / MANIFEST).write_text(json.dumps(lines, indent=1, sort_keys=True), encoding="utf-8")
        return list(lines.values())

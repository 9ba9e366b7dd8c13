"""Known-answer tests for the GPU cipher: the AES-256 cases of the GCM specification (McGrew & Viega,
test cases 13-16, the 96-bit IV ones) and NIST's CAVP files as shipped by ``cryptography-vectors``."""

from __future__ import annotations

import importlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from gputravel.core.gpucipher.engine import GpuAesGcm, LaunchShape


@dataclass(frozen=True, slots=True)
class GcmVector:
    """One known answer; ``valid`` is False for a decrypt vector whose tag must be rejected."""

    name: str
    key: bytes
    iv: bytes
    pt: bytes
    aad: bytes
    ct: bytes
    tag: bytes
    valid: bool = True
    decrypt: bool = False


_K15 = "feffe9928665731c6d6a8f9467308308" * 2
_P15 = ("d9313225f88406e5a55909c5aff5269a86a7a9531534f7da2e4c303d8a318a72"
        "1c3c0c95956809532fcf0e2449a6b525b16aedf5aa0de657ba637b391aafd255")
_C15 = ("522dc1f099567d07f47f37a32a84427d643a8cdcbfe5c0c97598a2bd2555d1aa"
        "8cb08e48590dbb3da7b08b1056828838c5f61e6393ba7a0abcc9f662898015ad")
_IV15 = "cafebabefacedbaddecaf888"
_A16 = "feedfacedeadbeeffeedfacedeadbeefabaddad2"


def _v(name: str, key: str, iv: str, pt: str, aad: str, ct: str, tag: str) -> GcmVector:
    h = bytes.fromhex
    return GcmVector(name, h(key), h(iv), h(pt), h(aad), h(ct), h(tag))


#: McGrew & Viega, "The Galois/Counter Mode of Operation", test cases 13-16 (17 and 18 use 64- and
#: 480-bit IVs, which the GPU cipher does not implement: the project's nonces are 96-bit counters).
SPEC_VECTORS: tuple[GcmVector, ...] = (
    _v("spec-13", "00" * 32, "00" * 12, "", "", "", "530f8afbc74536b9a963b4f1c4cb738b"),
    _v("spec-14", "00" * 32, "00" * 12, "00" * 16, "", "cea7403d4d606b6e074ec5d3baf39d18",
       "d0d1c8a799996bf0265b98b5d48ab919"),
    _v("spec-15", _K15, _IV15, _P15, "", _C15, "b094dac5d93471bdec1a502270e3cc6c"),
    _v("spec-16", _K15, _IV15, _P15[:120], _A16, _C15[:120], "76fc6ece0f4e1768cddf8853bb2d551b"),
)

CAVP_FILES = ("gcmEncryptExtIV256.rsp", "gcmDecrypt256.rsp")


def cavp_folder() -> Path | None:
    """Where ``cryptography-vectors`` keeps the AES-GCM files, or None when it is not installed."""
    try:
        module = importlib.import_module("cryptography_vectors")
    except ImportError:
        return None
    folder = Path(list(module.__path__)[0]) / "ciphers" / "AES" / "GCM"
    return folder if folder.is_dir() else None


def parse_rsp(path: Path) -> Iterable[tuple[dict[str, int], dict[str, str], bool]]:
    """(section parameters, fields, fail flag) for each record of a CAVP .rsp file."""
    params: dict[str, int] = {}
    rec: dict[str, str] = {}
    fail = False
    for raw in [*path.read_text().splitlines(), ""]:
        line = raw.strip()
        if line.startswith("[") and line.endswith("]"):
            k, _, v = line[1:-1].partition("=")
            params[k.strip()] = int(v)
        elif line == "FAIL":
            fail = True
        elif "=" in line and not line.startswith("#"):
            k, _, v = line.partition("=")
            rec[k.strip()] = v.strip()
        elif not line and rec:
            yield dict(params), rec, fail
            rec, fail = {}, False


def cavp_vectors(*, per_group: int | None = None, tag_bits: Sequence[int] | None = None) -> list[GcmVector]:
    """The 96-bit-IV records of both AES-256 files. ``per_group`` keeps the first N passing (and, for
    decrypt, the first N failing) records of each (PT length, AAD length, tag length) section; the tag
    lengths default to all for encrypt and 128 for decrypt (a 16-byte-tag API cannot check shorter
    tags on open; encrypt records of every tag length are checked on the tag's prefix)."""
    folder = cavp_folder()
    if folder is None:
        return []
    out: list[GcmVector] = []
    for fname in CAVP_FILES:
        decrypt = "Decrypt" in fname
        taken: dict[tuple[int, int, int, bool], int] = {}
        for params, rec, fail in parse_rsp(folder / fname):
            if params.get("IVlen") != 96 or params.get("Keylen") != 256:
                continue
            tlen = params["Taglen"]
            if (tag_bits is not None and tlen not in tag_bits) or (tag_bits is None and decrypt and tlen != 128):
                continue
            group = (params["PTlen"], params["AADlen"], tlen, fail)
            if per_group is not None and taken.get(group, 0) >= per_group:
                continue
            taken[group] = taken.get(group, 0) + 1
            h = bytes.fromhex
            out.append(GcmVector(f"{fname}:{params['PTlen']}/{params['AADlen']}/{tlen}#{rec['Count']}",
                                 h(rec["Key"]), h(rec["IV"]), h(rec.get("PT", "")), h(rec.get("AAD", "")),
                                 h(rec["CT"]), h(rec["Tag"]), valid=not fail, decrypt=decrypt))
    return out


@dataclass(slots=True)
class VectorReport:
    total: int = 0
    passed: int = 0
    failures: list[str] = field(default_factory=list)


def check_vector(v: GcmVector, *, shape: LaunchShape | None = None) -> bool:
    """Run one vector through the GPU cipher: a valid one must seal to its CT and tag (prefix) and
    open back; an invalid one must be rejected with its output untouched."""
    eng = GpuAesGcm(v.key, shape=shape)
    if not v.valid:
        out = bytearray(len(v.ct))
        return eng.open([v.iv], [v.ct], [v.tag], [v.aad], [out]) == [False] and not any(out)
    ct, tags = eng.seal([v.iv], [v.pt], [v.aad])
    if ct[0] != v.ct or tags[0][: len(v.tag)] != v.tag:
        return False
    out = bytearray(len(v.ct))
    return eng.open([v.iv], [v.ct], [tags[0]], [v.aad], [out]) == [True] and bytes(out) == v.pt


def run_vectors(vectors: Iterable[GcmVector], *, shape: LaunchShape | None = None) -> VectorReport:
    report = VectorReport()
    for v in vectors:
        report.total += 1
        if check_vector(v, shape=shape):
            report.passed += 1
        else:
            report.failures.append(v.name)
    return report

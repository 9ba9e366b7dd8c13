"""The hash-chained audit ledger: every phase of every visit, provable afterwards.

Each event is a row in an SQLite table whose ``hash`` is
``sha256(prev_hash_hex_ascii + canonical_json(fields))`` over the row's own fields (``seq``, ``ts``,
``run_id``, ``kind``, ``phase``, ``holder``, ``epoch``, ``key_fp``, ``nbytes``, ``duration_s``,
``outcome`` and the stored ``detail`` text), with ``prev_hash`` the previous row's hash (64 zeros for
the first row). Altering a field, breaking a link, deleting a row in the middle or reordering rows is
found by :func:`verify_ledger`, which opens the file read-only.

What the chain cannot show on its own: rows cut off the *end* (truncation) or a whole chain rewritten
from some row on. An operator proves those against a head ``(seq, hash)`` recorded elsewhere
(:meth:`Ledger.head`, printed as ``SEQ:HASH`` by ``gputravel run`` and ``gputravel ledger verify``), with
``verify_ledger(path, expect_head=...)`` or ``gputravel ledger verify --head SEQ:HASH``.

Keys appear only by fingerprint: :meth:`Ledger.append` refuses ``detail`` names that look like key
material (``key``, ``secret``, ``master``, ``private``, except ``key_fp``/``*_fp``/``*_fingerprint``) and any
value that is not plain JSON (bytes included).

The engine's progress (``state``) is upserted in the same transaction as the event that records it, so
after a crash the ledger and the progress it records never disagree.

Standard library only.
"""

from __future__ import annotations

from gputravel.core.ledger.reading import (
    check_heads,
    parse_head,
    read_rows,
    read_run_id,
    read_state,
    verify_ledger,
    verify_ledger_select,
    witnessed_heads,
)
from gputravel.core.ledger.rows import (
    GENESIS_HASH,
    SCHEMA_VERSION,
    LedgerRow,
    VerifyResult,
    canonical_json,
    row_hash,
)
from gputravel.core.ledger.writer import Ledger

__all__ = [
    "check_heads",
    "GENESIS_HASH",
    "SCHEMA_VERSION",
    "Ledger",
    "LedgerRow",
    "VerifyResult",
    "canonical_json",
    "parse_head",
    "read_rows",
    "read_run_id",
    "read_state",
    "row_hash",
    "verify_ledger",
    "verify_ledger_select",
    "witnessed_heads",
]

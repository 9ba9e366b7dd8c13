"""What is deployed to a holder machine: the agent and its bundle (``bundle``).

The agent by concern: ``dataset`` (the holder's files, read by range), ``link`` (its end of the holder
link), ``dataconn`` (the direct path's connection to the device and its shared-memory ring), ``provision``
(one hand-off: seal, send, acknowledgements, retransmission) and ``agent`` (HELLO, the run loop, ``main``).

Everything in this package is uploaded, hashed and run on the holder, beside ``gputravel.core.protocol``:
standard library and ``cryptography`` only (an import contract and ``tests/agents/test_import_rules.py`` hold it
so). The orchestrator's side (SSH deployment, the fleet, the inventory, the embedded SSH server) is the
rest of ``gputravel.agents``, and is never uploaded.
"""

from __future__ import annotations

from gputravel.agents.holder.agent import AGENT_VERSION, Agent, main
from gputravel.agents.holder.bundle import (
    BUNDLE_FILES,
    agent_sha256,
    bundle_contents,
    digest_files,
    package_root,
)
from gputravel.agents.holder.dataset import Dataset, open_dataset

__all__ = ["AGENT_VERSION", "BUNDLE_FILES", "Agent", "Dataset", "agent_sha256", "bundle_contents", "digest_files",
           "main", "open_dataset", "package_root"]

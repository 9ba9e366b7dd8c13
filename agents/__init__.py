"""Holder agents and their deployment, in two halves that never mix.

* ``holder/``: what is deployed to a holder machine, and nothing else: the agent and its bundle
  (standard library, ``cryptography`` and ``gputravel.core.protocol`` only).
* the orchestrator's side, the other modules here: ``deploy`` (SSH deployment and the SSH holder link),
  ``ssh_links`` (links from an inventory or the embedded server), ``inventory`` (the holders file) and
  ``sshserver`` (the embedded loopback SSH server). They use asyncssh and the engine, never the console,
  and are never uploaded.

Import contracts in pyproject.toml hold both halves to this.
"""

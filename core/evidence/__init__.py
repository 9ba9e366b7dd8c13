"""Evidence in the vendors' own formats, and its verification (offline).

- ``nvidia_spdm``: an NVIDIA GPU's SPDM 1.1 GET_MEASUREMENTS report and its certificate chain (stdlib +
  cryptography: what a holder needs to check a GPU).
- ``nvidia_rim``: NVIDIA's signed reference-integrity manifests (lxml, signxml).
- ``nvidia_gpu``: report + chain + RIMs + policy -> NVIDIA-named claims and one verdict.
- ``tdx``: Intel TDX v4 quotes with dcap-qvl, and the TD policy.
- ``policy``: ``core/policy/evidence.toml`` (tomllib); ``claims``: the claim record.
- ``sim_gpu``, ``sim_rim``, ``sim_tdx``: SIM evidence in the same formats under SIM roots.

This package imports no other core module (an import-linter contract), and nothing here is imported eagerly:
import the module you need, so a holder checking SPDM or TDX evidence never loads the XML stack.
"""

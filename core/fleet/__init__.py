"""A fleet of travelling GPUs: N devices, each a rank of one torch.distributed job (see docs/fleet.md). Read first:

* ``run.py``: the torchrun command line (launcher side) and one rank's run (worker side);
* ``rank.py``: ``fleet_engine`` and its ``FleetRank``, one rank driving its own device through its share of the schedule
  (``schedule.py``);
* ``device.py``: ``FleetPart``, the fleet's part of a device service (``fleet_join``, ``fleet_train``,
  ``fleet_leave``), and ``ddp.py``, the device's side of the sealed gradient ring;
* ``keyagree.py``, ``auth.py``, ``pki.py``, ``node.py``: the fleet key agreed by attestation, and how the ranks
  trust each other;
* ``verify.py``: proving a whole fleet run from its ledgers.
* ``lifeline.py``: every process of a fleet ends with its launcher, however the launcher ends.
"""

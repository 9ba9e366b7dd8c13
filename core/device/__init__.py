"""The device service: the GPU package boundary (emulated: a process whose memory is torch tensors).

Read first, in this order:

* ``service.py``: ``DeviceService``, the composition root (no mixin). It builds the parts below, each owning its
  state and given, at construction, narrow typed references to the parts it reads; each adds its entries to the
  one operation table (``operations``: wire name -> handler; ``handle`` dispatches), as a part from outside does
  with ``add_part`` (the fleet's ``FleetPart``, core/fleet/device.py);
* the parts, one module each:

  - ``session_keys.py``: ``DeviceSecrets``, the session secrets and the control channel's epoch;
  - ``counters.py``: ``Counters``, every count (totals, chunks refused and whom they were charged to,
    connections refused, busy time);
  - ``window.py``: ``BufferWindows``, the buffer's provisioning windows (``handoff``, ``close_window``,
    ``window_status``, ``scrub``, ``digest``);
  - ``intake.py``: ``ChunkIntake``, a chunk's checks against the open window and its hand-off to the opener
    (``openers.py``) and the data plane (``dataplane.py``: slots, workers, rings);
  - ``model.py``: ``ModelSlot``, the code region and the model (``configure``, ``measure``, ``train``,
    ``tamper``), its generation and digest memo;
  - ``ckpt_ops.py``: ``StateStreams``, the model state's streams (``checkpoint``, ``checkpoint_next``,
    ``checkpoint_end``, ``restore``, ``restore_chunk``, ``restore_end``);
  - ``operations.py``: ``DeviceOps``, the service's own (``attest``, ``gpu_evidence``, ``rotate``, ``shutdown``,
    ``info``, ``stats``, ``aes_rate``, ``set_data_path``);

* the transport: ``server.py`` (``DeviceServer``: the listeners, the budgets of connections not yet
  authenticated, ``pending.py``), ``control.py`` (``serve_control``: the command loop), ``dataconn.py``
  (``DataConnection``: one data connection, admitted per window by ``admission.py``); ``entry.py`` the command
  line.

Nothing on the orchestrator's side imports this package: the platform starts it as a process.
"""

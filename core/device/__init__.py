"""The device service: the GPU package boundary (emulated: a process whose memory is torch tensors). Read first:

* ``service.py``: ``DeviceService``, the session (``open_session``) and the one operation table (``handle``
  dispatches a wire name to its handler); a part adds its entries with ``add_part`` (the fleet's, in
  ``core/fleet/device.py``);
* ``session_keys.py``: ``DeviceSecrets``, the part that owns the session secrets and the control channel's epoch;
* ``window.py``, ``model.py``, ``ckpt_ops.py``, ``operations.py``: the table's entries by concern (the buffer's
  windows, the model, its state streams, the service's own: attest, rotate, info, stats);
* ``intake.py`` and ``openers.py``: how a provisioning chunk is admitted and opened; ``dataplane.py`` the slots
  and rings it goes through;
* ``server.py``: ``DeviceServer``, the transport (Unix socket, TCP data port, hand-shake deadlines).

Nothing on the orchestrator's side imports this package: the platform starts it as a process.
"""

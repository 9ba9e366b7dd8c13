"""The orchestrator's side of the device link: ``client.DeviceClient`` (attest, open a session, one typed method
per operation), ``anchors.TrustAnchors`` (what it pins to trust a device), ``ringckpt.RingCheckpoint`` (a
checkpoint drained from a shared-memory ring), ``counters.read_counters`` (telemetry's own short connection).
Torch-free; it speaks the wire vocabulary in ``core.protocol.devicelink`` and ``core.protocol.deviceanswers``
and imports nothing of ``core.device`` (the device's own code)."""

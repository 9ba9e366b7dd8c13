"""The device service: the GPU package boundary (emulated: a process whose memory is torch tensors)."""

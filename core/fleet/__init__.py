"""A fleet of travelling GPUs: N devices, each a rank of one torch.distributed job (see docs/fleet.md)."""

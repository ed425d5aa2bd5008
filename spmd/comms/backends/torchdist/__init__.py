"""The torch.distributed backends: the general path, gloo, nccl, and their helpers."""

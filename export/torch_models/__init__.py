"""PyTorch re-implementations whose state-dict keys match published face-model checkpoints."""

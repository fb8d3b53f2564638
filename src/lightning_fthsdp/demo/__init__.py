"""``fthsdp demo``: three replica groups of a plain-PyTorch training script, one killed and restarted."""

"""The torch runtime: torch's own distributed stack (DistributedDataParallel, torch.distributed.checkpoint).

``capabilities.py`` (pure: ``TORCH``, what it executes), ``backend.py`` (``TorchBackend``: a Decision applied with
torch), ``dcp.py`` (checkpoints through torch.distributed.checkpoint, every file read by the restricted unpickler).
This ``__init__`` imports nothing, so the pure modules stay importable without torch; import each by its own name.
"""

"""The DeepSpeed runtime: the only package that imports ``deepspeed``.

``capabilities.py`` (pure: ``DEEPSPEED``, what it executes), ``config.py`` (pure: Plan -> DeepSpeed config dict),
``pipeline.py`` (PipelineModule over the module's ``fleet_pipeline()`` layers, placed by the plan's order),
``universal.py`` (resharding through DeepSpeed's universal checkpoint), and the backend, weights and reader modules
that apply a plan and read its checkpoints. This ``__init__`` imports nothing, so the pure modules stay importable
without torch or deepspeed; import each module by its own name.
"""

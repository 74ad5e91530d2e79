"""Calibration: measure the machine and the framework, and write what was found as a cluster YAML.

Four rooms, in the order they may import one another (each only the ones before it):

- ``ranks.py``    pure (stdlib and the planning core): whether a job's ranks differ, judged from their probe rounds
  (:class:`~.ranks.RankMeasures`), and the line that says why.
- ``measure.py``  below the strategy. Microbenchmarks on the live process group (GEMMs, all-reduce,
  operator dispatch, element-wise, causal fused attention, AdamW, host copies), their fits
  (:class:`~.measure.MatmulFit`, ring alpha-beta, :class:`~.measure.AttentionFit`), :class:`~.measure.WorldShape`,
  :func:`~.measure.measure` /
  :func:`~.measure.measure_cluster`, :func:`~.measure.across_ranks` and the per-host cache. Imports
  torch and the planning core; the strategy imports it.
- ``probe.py``    above the strategy. Trains a tiny model through FleetStrategy to measure the
  framework's own time per step and micro-batch; :func:`~.probe.quiet_output`.
- ``command.py``  the process ``fleet calibrate`` starts (``python -m lightning_fleet.calibrate.command``):
  argument parsing, process group, the summary it prints.

Nothing below the strategy imports ``probe`` or ``command``. This file imports nothing, so that
importing ``lightning_fleet.calibrate.measure`` (as the strategy does) never loads the probe, which
imports the strategy: that would be an import cycle.
"""

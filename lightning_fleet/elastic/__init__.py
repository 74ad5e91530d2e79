"""Data order and (in later work) fault tolerance: samplers keyed by global sample index.

Imports nothing; its modules are imported by name.
"""

"""The example GPT at the sizes the cost-model benchmark runs (shared by its driver and its workers)."""

SIZES = {
    "S (2x64)": dict(num_layers=2, hidden_size=64, num_heads=4, seq_length=64),
    "M (4x128)": dict(num_layers=4, hidden_size=128, num_heads=4, seq_length=128),
}
"""name -> GPT(...) arguments (vocabulary 256, the example's byte-level text)."""

GLOBAL_BATCH = 4
"""Samples per optimizer step, the same for every plan and world size."""

DATA_BYTES = 400_000
"""Bytes of the example's stdlib text corpus to load (enough batches for every run)."""

"""A small GPT trained on the Python standard library's own source text (exists offline everywhere)."""

"""yeto-demo: a local syncer plus islands training a small GPT on CPU."""

"""Facts of the protocol, stated once: the round schedule, the session rules and the named refusal reasons.

Pure: no I/O, no torch, no sockets; imports nothing from the rest of ``diloco``. Both sides (the
syncer and the island) and the tools (demo, steplog, benchmarks) ask these modules instead of
re-deriving a rule.
"""

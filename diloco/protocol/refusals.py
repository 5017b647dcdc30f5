"""The named refusal reasons: the ``code`` of an ERROR, of a syncer ``Refused``/``Dropped``, and
what the island does about each.

Every refusal the syncer raises names one of :data:`REASONS` (a test checks the code base against
this table). Groups:

* :data:`FATAL`: the island cannot recover by retrying (misconfigured, or too late): it stops with
  the reason at its next boundary;
* :data:`REJOIN`: the syncer lost the island's binding (it restarted), or parts of island 0's INIT
  were lost on the way: the island says HELLO again (and resumes INIT where the syncer stands);
* :data:`COUNTED`: PUSH refusals that count towards ``--max-refusals`` (what the island sent was
  wrong; races, such as an attempt that moved on meanwhile, do not count);
* :data:`SILENT`: refusals answered with nothing (replays, foreign routing ids): telling the
  sender why would only help a replayer; the syncer still logs them.

Pure: strings and frozensets only.
"""

from __future__ import annotations

REASONS: dict[str, str] = {
    # HELLO and the session
    "protocol": "the peer speaks another protocol version",
    "unknown_island": "the island id is not one of the syncer's --islands",
    "bad_generation": "the HELLO's connection generation is not a positive 62-bit int",
    "old_generation": "a HELLO older than the island's current connection",
    "unknown_generation": "a message of a connection generation the syncer does not know",
    "hello_rate": "HELLOs of this island arrive faster than the syncer admits",
    "bad_session": "the message's session nonce or sequence number is wrong",
    "island_in_use": "another live process holds this island id",
    "key_not_owner": "the Curve key is not bound to this island id",
    "bad_fingerprint": "the layout fingerprint differs from the run's",
    "fingerprint_mismatch": "the layout fingerprint differs from the run's (island-side name)",
    "bad_fragments": "the fragment plan is malformed",
    "bad_holds": "the HELLO's claimed value digests are malformed",
    "fragments_mismatch": "the fragment plan differs from the run's",
    "fragment_too_large": "a fragment exceeds the syncer's limits (use more fragments)",
    "bad_dtype": "the wire dtype is not one the syncer accepts",
    "bad_quant": "the low-bit kind or block size is not accepted",
    "not_bound": "the sender is not bound to an island (say HELLO first)",
    "finished": "the run is over",
    "evicted": "the island was dropped from the run (dead, or too many refusals)",
    "unexpected_kind": "a message kind the syncer never accepts from an island",
    # INIT
    "init_not_island0": "only island 0 streams INIT",
    "no_lanes": "the syncer takes no second INIT connection (--init-lanes 0)",
    "lane_not_island0": "only island 0 opens an INIT lane",
    "lane_is_session": "a session's first connection cannot also be its lane",
    "replayed_lane": "the session bound its lane already (a LANE binds once per session)",
    "duplicate_init": "the fragment was already initialised",
    "bad_init": "an INIT value failed the data plane's checks",
    "bad_schema": "the INIT schema is malformed or too large",
    "init_gap": "an INIT part arrived out of order (earlier parts were lost): redial and resume INIT",
    # PUSH and parts
    "bad_part": "a part's index, count or size is wrong",
    "bad_counts": "a PUSH's step or token counts are out of bounds",
    "bad_step": "a step number is out of bounds",
    "bad_base_version": "the PUSH's base version is not one the syncer sent",
    "stale_base": "the PUSH's base is older than the fragment's newest cut: install it, push again",
    "stale_attempt": "the PUSH answers an attempt the round has moved on from",
    "round_closed": "the round is committed or dropped",
    "unknown_round": "no such round is open",
    "unknown_fragment": "no such fragment",
    "wrong_fragment": "the PUSH names another fragment than its round",
    "not_member": "the island is not a member of the round",
    "duplicate_push": "the island already pushed for this round and attempt",
    "refused_push": "an earlier part of this push was refused",
    "unexpected_tensors": "a message carries tensors it must not",
    "bad_push": "a PUSH value failed the data plane's checks",
    "bad_digests": "the digests in a FINAL_ACK are malformed",
    "bad_versions": "the versions in a FINAL_ACK are malformed",
    "not_final": "a FINAL_ACK before finalization",
    "not_expected": "a FINAL_ACK from an island the syncer does not wait for",
    # silent (Dropped)
    "wrong_peer": "the island id is bound to another routing id",
    "bad_nonce": "the session nonce is not the island's",
    "replayed_seq": "a sequence number already seen (a replay)",
    "replayed_hello": "a HELLO already seen (a replay)",
}
"""Every refusal code, with one line saying what it means."""

FATAL: frozenset[str] = frozenset({"protocol", "unknown_island", "fingerprint_mismatch", "fragments_mismatch",
                                   "bad_fingerprint", "bad_fragments", "bad_holds", "bad_dtype", "finished", "fragment_too_large",
                                   "bad_init"})
"""ERROR codes after which retrying cannot help: the island is misconfigured or too late."""

REJOIN: frozenset[str] = frozenset({"not_bound", "unknown_generation", "init_gap"})
"""ERROR codes meaning the syncer lost the island's binding (it restarted) or INIT parts: say HELLO
again (the WELCOME then says which fragments the syncer holds)."""

COUNTED: frozenset[str] = frozenset({"bad_part", "bad_counts", "bad_base_version", "stale_base", "wrong_fragment"})
"""PUSH refusals that count towards ``--max-refusals`` (with ``bad_push`` from the data plane)."""

SILENT: frozenset[str] = frozenset({"wrong_peer", "bad_nonce", "replayed_seq", "replayed_hello"})
"""Refusals answered with nothing (``Dropped``)."""

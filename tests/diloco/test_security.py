"""Envelope integrity and replay fields, derived Curve keys, yeto-keys, and the island's Curve variables."""

from __future__ import annotations

import pytest
import torch
import zmq

from diloco import wire
from diloco.config import ConfigError, IslandConfig
from diloco.keys_cli import main as yeto_keys
from diloco.security import ClientCurve, ServerCurve, derive_password, load_client_keys, load_public, load_secret

KEY = b"k" * 20


def _message() -> list[bytes]:
    header = wire.Push(island=1, generation=5, fragment=0, round=1, attempt=0, base_version=0, local_steps=1,
                       tokens=3, part=0, n_parts=1)
    tensors = [("w", torch.arange(12, dtype=torch.float32)), ("b", torch.ones(5))]
    return [bytes(memoryview(f)) for f in wire.encode(header, tensors, key=KEY, chunk_bytes=32, nonce=77, seq=9)]


def test_nonce_and_seq_travel_under_the_mac() -> None:
    opened = wire.open_message(_message(), key=KEY)
    assert (opened.nonce, opened.seq) == (77, 9)
    for bad in (-1, 2**63):
        with pytest.raises(wire.WireError, match="nonce"):
            wire.open_message(wire.encode(wire.Shutdown(reason="x"), key=KEY, seq=bad), key=KEY)


def test_every_flipped_bit_is_caught_and_never_applied() -> None:
    frames = _message()
    flips = 0
    for i, frame in enumerate(frames):
        for bit in range(len(frame) * 8):
            mangled = list(frames)
            raw = bytearray(frame)
            raw[bit // 8] ^= 1 << (bit % 8)
            mangled[i] = bytes(raw)
            with pytest.raises(wire.WireError):
                wire.decode(mangled, key=KEY)  # the MAC, the header checks or a chunk digest
            flips += 1
    assert flips == 8 * sum(len(f) for f in frames) > 2000


def test_zero_times_huge_dimension_is_refused_before_allocating() -> None:
    import hmac

    import msgspec

    env = msgspec.msgpack.decode(_message()[1])
    env["tensors"] = [["w", "float32", [0, 2**63], []]]
    body = msgspec.msgpack.encode(env)
    with pytest.raises(wire.WireError, match="dimension above"):
        wire.open_message([hmac.digest(KEY, body, "sha256"), body], key=KEY)


def test_hmac_mode_derives_a_plain_password_and_keeps_secrets_out_of_reprs() -> None:
    public, secret = zmq.curve_keypair()
    assert secret.decode() not in repr(ServerCurve(public, secret)) and secret.decode() not in repr(
        ClientCurve(public, public, secret))
    # HMAC mode: a PLAIN handshake with a password derived from the key (never the key itself).
    server, client = ServerCurve.from_shared_key(KEY), ClientCurve.from_shared_key(KEY)
    assert server.plain_password == client.plain_password == derive_password(KEY) != derive_password(KEY + b"x")
    assert KEY not in (server.plain_password or b"") and b"plain" not in repr(server).encode().lower()


def test_yeto_keys_generates_lists_and_refuses_to_overwrite(tmp_path, capsys) -> None:
    assert yeto_keys(["generate", str(tmp_path), "syncer", "island-0"]) == 0
    assert (tmp_path / "island-0.key_secret").stat().st_mode & 0o077 == 0
    assert yeto_keys(["generate", str(tmp_path), "syncer"]) == 2  # rotation needs --force
    assert yeto_keys(["generate", str(tmp_path), "--force", "syncer"]) == 0
    capsys.readouterr()
    assert yeto_keys(["list", str(tmp_path)]) == 0
    listing = capsys.readouterr().out.splitlines()
    assert len(listing) == 4 and {ln.split("\t")[1] for ln in listing} == {"public", "secret"}
    public, secret = load_secret(str(tmp_path / "island-0.key_secret"))
    assert load_public(str(tmp_path / "island-0.key")) == public == load_public(public.decode())
    assert public in load_client_keys(str(tmp_path))
    assert yeto_keys(["public", str(tmp_path / "island-0.key")]) == 0
    assert capsys.readouterr().out.strip() == public.decode()


def test_island_curve_variables_are_validated_naming_them(tmp_path) -> None:
    assert yeto_keys(["generate", str(tmp_path), "syncer", "island-0"]) == 0
    base = {"YETO_SYNC_ADDR": "tcp://h:1", "YETO_ISLAND_ID": "0"}
    with pytest.raises(ConfigError, match="YETO_CURVE_SECRET_FILE"):
        IslandConfig.from_env({**base, "YETO_CURVE_SERVER_KEY": str(tmp_path / "syncer.key")})
    with pytest.raises(ConfigError, match="YETO_CURVE_SERVER_KEY"):
        IslandConfig.from_env({**base, "YETO_CURVE_SERVER_KEY": "not-a-key",
                               "YETO_CURVE_SECRET_FILE": str(tmp_path / "island-0.key_secret")})
    with pytest.raises(ConfigError, match="YETO_CURVE_SECRET_FILE"):
        IslandConfig.from_env({**base, "YETO_CURVE_SERVER_KEY": str(tmp_path / "syncer.key"),
                               "YETO_CURVE_SECRET_FILE": str(tmp_path / "syncer.key")})  # public only
    cfg = IslandConfig.from_env({**base, "YETO_CURVE_SERVER_KEY": str(tmp_path / "syncer.key"),
                                 "YETO_CURVE_SECRET_FILE": str(tmp_path / "island-0.key_secret")})
    curve = cfg.client_curve()
    assert curve is not None and curve.server_public == load_public(str(tmp_path / "syncer.key"))
    assert IslandConfig(sync_addr="tcp://h:1", island_id=0).client_curve() is None


def test_chunk_digests_are_keyed_so_a_recomputed_digest_does_not_pass() -> None:
    """HMAC mode has no transport encryption: an on-path attacker who alters a chunk and
    recomputes its (unseeded) xxh3 digest in the header must still fail, because the digests
    are seeded with a key-derived secret and the header MAC covers them."""
    import torch
    import xxhash

    t = torch.arange(1024, dtype=torch.float32)
    frames = [bytes(f) for f in wire.encode(wire.Pull(0, 1, 0), [("t", t)], key=KEY)]
    assert wire.digest_seed(KEY) != 0 and wire.digest_seed(b"") == 0
    # The digest in the header is not the plain xxh3 of the chunk (it is keyed).
    assert xxhash.xxh3_64_intdigest(frames[2]) != wire.digest_seed(KEY) and frames[2]
    opened = wire.open_message(frames, key=KEY)
    assert opened.metas[0].chunks[0] != xxhash.xxh3_64_intdigest(frames[2])
    assert opened.metas[0].chunks[0] == xxhash.xxh3_64_intdigest(frames[2], seed=wire.digest_seed(KEY))
    # A flipped payload bit is caught (the header and its MAC untouched).
    bad = bytearray(frames[2])
    bad[7] ^= 1
    with pytest.raises(wire.WireError, match="digest"):
        wire.decode(frames[:2] + [bytes(bad)], key=KEY)

"""yeto-syncer flag validation: a bad value exits 2 with a message naming the flag."""

from __future__ import annotations

import logging

import pytest

from diloco.syncer.cli import EXIT_CONFIG, main

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--islands", "0"], "--islands"),
        (["--islands", "2", "--quorum", "3"], "--quorum"),
        (["--islands", "2", "--sync-every", "0"], "--sync-every"),
        (["--islands", "2", "--outer-lr", "nan"], "--outer-lr"),
        (["--islands", "2", "--grace-ms", "-1"], "--grace-ms"),
        (["--islands", "2", "--insecure", "--io-threads", "-1"], "--io-threads"),
        (["--islands", "2", "--resume"], "--resume"),
        (["--islands", "2", "--key-file", "/nonexistent/key"], "--key-file"),
        (["--islands", "2"], "--insecure"),  # neither Curve nor HMAC: refused, naming the flags
        (["--islands", "2", "--curve-secret-file", "/nonexistent"], "--curve-clients-dir"),
        (["--islands", "2", "--curve-secret-file", "/nonexistent", "--curve-clients-dir", "/tmp"],
         "--curve-secret-file"),
        (["--islands", "2", "--insecure", "--curve-secret-file", "x", "--curve-clients-dir", "/tmp"], "--insecure"),
    ],
)
def test_bad_flag_exits_2_naming_it(argv: list[str], flag: str, caplog) -> None:
    with caplog.at_level(logging.ERROR):
        assert main(["--bind", "tcp://127.0.0.1:*", *argv]) == EXIT_CONFIG
    assert flag in caplog.text


def test_resume_without_checkpoint_fails(tmp_path, caplog) -> None:
    with caplog.at_level(logging.ERROR):
        assert main(["--islands", "1", "--insecure", "--resume", "--checkpoint-dir", str(tmp_path)]) == EXIT_CONFIG
    assert f"no checkpoint in {tmp_path}" in caplog.text


def test_no_security_names_every_option(caplog, monkeypatch) -> None:
    monkeypatch.delenv("YETO_SYNC_KEY", raising=False)
    with caplog.at_level(logging.ERROR):
        assert main(["--bind", "tcp://127.0.0.1:*", "--islands", "1"]) == EXIT_CONFIG
    for flag in ("--curve-secret-file", "--curve-clients-dir", "--key-file", "--insecure"):
        assert flag in caplog.text

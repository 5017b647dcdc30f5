"""``yeto-keys``: generate and list CurveZMQ key pairs for the syncer and the islands.

Uses pyzmq's own ``zmq.auth.create_certificates`` / ``load_certificate``, so the files are
the standard ZeroMQ certificate format (``NAME.key`` public, ``NAME.key_secret`` secret).
See docs/SECURITY.md for the layout of a deployment and key rotation.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import zmq.auth

EXIT_USAGE = 2


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="yeto-keys",
        description="Generate and list CurveZMQ key pairs (zmq certificates) for yeto-syncer and islands.",
        epilog="Typical setup: 'yeto-keys generate keys/syncer syncer' and 'yeto-keys generate keys/islands "
               "island-0 island-1 ...'; give the syncer --curve-secret-file keys/syncer/syncer.key_secret and a "
               "--curve-clients-dir holding only the islands' public .key files; give island i "
               "YETO_CURVE_SECRET_FILE=keys/islands/island-i.key_secret and YETO_CURVE_SERVER_KEY=<the "
               "syncer's public key, or keys/syncer/syncer.key>.")
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="create NAME.key and NAME.key_secret for each NAME in DIR")
    g.add_argument("dir", help="directory for the certificates (created if missing; secrets are mode 0600)")
    g.add_argument("names", nargs="+", help="certificate names, e.g. syncer island-0 island-1")
    g.add_argument("--force", action="store_true", help="overwrite existing certificates (key rotation)")
    ls = sub.add_parser("list", help="print the public key of every certificate in DIR")
    ls.add_argument("dir")
    pub = sub.add_parser("public", help="print the public key of one certificate file")
    pub.add_argument("file")
    return p


def _generate(directory: str, names: list[str], force: bool) -> int:
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    for name in names:
        if not name or "/" in name or name.startswith("."):
            print(f"yeto-keys: bad certificate name {name!r}", file=sys.stderr)
            return EXIT_USAGE
        if not force and ((path / f"{name}.key").exists() or (path / f"{name}.key_secret").exists()):
            print(f"yeto-keys: {path / name}.key exists (use --force to rotate it)", file=sys.stderr)
            return EXIT_USAGE
    for name in names:
        public_file, secret_file = zmq.auth.create_certificates(str(path), name)
        os.chmod(secret_file, 0o600)
        public, _ = zmq.auth.load_certificate(public_file)
        print(f"{name}\t{public.decode()}\t{secret_file}")
    return 0


def _list(directory: str) -> int:
    path = Path(directory)
    if not path.is_dir():
        print(f"yeto-keys: {directory!r} is not a directory", file=sys.stderr)
        return EXIT_USAGE
    for cert in sorted(path.iterdir()):
        if cert.suffix in (".key", ".key_secret") and cert.is_file():
            try:
                public, secret = zmq.auth.load_certificate(str(cert))
            except (OSError, ValueError) as exc:
                print(f"yeto-keys: {cert}: {exc}", file=sys.stderr)
                continue
            kind = "secret" if secret is not None else "public"
            print(f"{cert.name}\t{kind}\t{public.decode()}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "generate":
        return _generate(args.dir, args.names, args.force)
    if args.command == "list":
        return _list(args.dir)
    try:
        public, _ = zmq.auth.load_certificate(args.file)
    except (OSError, ValueError) as exc:
        print(f"yeto-keys: {args.file}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    print(public.decode())
    return 0


if __name__ == "__main__":
    sys.exit(main())

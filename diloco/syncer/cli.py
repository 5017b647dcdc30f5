"""``yeto-syncer``: command line entry point of the syncer process.

Parses and validates flags (a bad value exits 2 with a message naming the
flag), reads the HMAC key from ``--key-file`` or ``YETO_SYNC_KEY``, optionally
resumes from the newest complete checkpoint, then runs the ROUTER loop.
Exit codes: 0 finished (every island acknowledged the final cut), 1
finalization failed, 2 bad configuration, 130 interrupted (checkpoint written).
Every flag is listed in docs/SYNCER.md.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import signal
import sys
from types import FrameType

import zmq

from diloco.hostmem import tune_syncer_malloc
from diloco.keys import read_key_file
from diloco.security import ServerCurve
from diloco.syncer.core.config import ConfigError, SyncerConfig
from diloco.syncer.connguard import ConnCaps
from diloco.syncer.dataplane import default_threads
from diloco.syncer.allowlist import read_allow_list
from diloco.syncer.loop import SyncerLoop
from diloco.syncer.loopoptions import LoopOptions
from diloco.syncer.metrics_http import MetricsUnavailable, serve_loop
from diloco.syncer.core.coordinator import Coordinator
from diloco.syncer.resume import ResumeError, choose
from diloco.syncer.store import CheckpointStore

log = logging.getLogger("diloco.syncer")

KEY_ENV = "YETO_SYNC_KEY"
EXIT_CONFIG = 2


def build_parser() -> argparse.ArgumentParser:
    """The flag parser (every flag is documented in docs/SYNCER.md and the README)."""
    p = argparse.ArgumentParser(
        prog="yeto-syncer", description="DiLoCo syncer: merges fragment deltas from islands.",
        epilog="exit codes: 0 finished, 1 finalization failed, 2 bad configuration, 130 interrupted")
    p.add_argument("--bind", default="tcp://0.0.0.0:5555",
                   help="zmq endpoint to bind (tcp://HOST:* or tcp://HOST:0 picks a free port; the log names it)")
    p.add_argument("--islands", type=int, required=True, help="number of islands (ids 0..N-1)")
    p.add_argument("--quorum", type=int, default=0, help="K pushes that may close a round after the grace window (default: all islands)")
    p.add_argument("--sync-every", type=int, default=100, help="H: inner steps between two syncs of one fragment")
    p.add_argument("--outer-lr", type=float, default=1.0,
                   help="outer Nesterov learning rate (1.0 with momentum 0: plain averaging; docs/PERFORMANCE.md)")
    p.add_argument("--outer-momentum", type=float, default=0.0,
                   help="outer Nesterov momentum (DiLoCo's 0.9, with --outer-lr 0.7, needs hundreds of outer steps)")
    p.add_argument("--quorum-timeout-s", type=float, default=600.0, help="seconds an attempt waits for K pushes before re-pulling")
    p.add_argument("--grace-ms", type=float, default=2000.0, help="ms a round with >= K pushes waits for stragglers")
    p.add_argument("--total-steps", type=int, default=0, help="last inner step (0: finalize when islands report done)")
    p.add_argument("--checkpoint-dir", default=None, help="checkpoint directory (none: no checkpoints)")
    p.add_argument("--checkpoint-every", type=int, default=1, help="checkpoint every N commits (0: final only)")
    p.add_argument("--resume", action="store_true",
                   help="resume from the newest checkpoint in --checkpoint-dir that verifies (checksums, finite)")
    p.add_argument("--resume-with-new-settings", action="store_true",
                   help="resume even though --outer-lr/--outer-momentum/--sync-every/--weighting differ from the "
                        "checkpoint's (each change is logged)")
    p.add_argument("--key-file", default=None, help=f"file holding the shared HMAC key (else env {KEY_ENV})")
    p.add_argument("--curve-secret-file", default=None,
                   help="the syncer's CurveZMQ secret certificate (yeto-keys generate); needs --curve-clients-dir")
    p.add_argument("--curve-clients-dir", default=None,
                   help="directory of the admitted islands' public certificates (*.key); SIGHUP re-reads it")
    p.add_argument("--insecure", action="store_true",
                   help="run with neither Curve nor an HMAC key: anyone who reaches --bind can push deltas")
    p.add_argument("--flush-merge", default="mean", choices=("mean", "outer"),
                   help="flush rounds (after every island finished) merge by the weighted mean of the final deltas "
                        "(mean: the final cut is the islands' mean) or by the training rounds' outer step (outer)")
    p.add_argument("--weighting", default="tokens", choices=("tokens", "steps", "equal"),
                   help="merge weights: tokens (pushes must report tokens > 0), steps, or equal")
    p.add_argument("--dead-after-s", type=float, default=120.0, help="an island silent this long leaves the live set")
    p.add_argument("--final-timeout-s", type=float, default=600.0, help="seconds to wait for every FINAL_ACK")
    p.add_argument("--join-timeout-s", type=float, default=600.0,
                   help="finalization waits this long after start for islands that never joined (0: do not wait)")
    p.add_argument("--event-log", default=None, help="JSON-lines file, one line per commit")
    p.add_argument("--status-every-s", type=float, default=2.0, help="period of the status line on stderr")
    p.add_argument("--part-mib", default="auto",
                   help="MiB of fp32 per part: fragments travel as parts of this size (multiple of 1/64 MiB, <= 128); "
                        "auto: about 1/128 of the largest fragment, a power of two from 1 to 32 MiB")
    p.add_argument("--max-fragment-gib", type=float, default=32.0,
                   help="largest fragment (GiB of fp32) accepted; a bigger plan is refused at HELLO with the fix")
    p.add_argument("--quant-block", type=int, default=64,
                   help="elements per bf16 scale of int8 / q4 pushes; islands must use the same (YETO_QUANT_BLOCK)")
    p.add_argument("--max-refusals", type=int, default=5,
                   help="an island whose pushes are refused this many times in a row leaves the rounds until it "
                        "says HELLO again")
    p.add_argument("--island-keys", default=None,
                   help="Curve mode: file of 'ID = PUBLIC-KEY' lines binding island ids to keys (default: first use)")
    p.add_argument("--max-tokens-per-step", type=int, default=1 << 24,
                   help="tokens one local step may claim; a push's tokens are clamped to this x its local steps")
    p.add_argument("--max-weight-factor", type=float, default=4.0,
                   help="a push weighs at most this x the lower median weight per step of the round's other pushes, x its steps")
    p.add_argument("--norm-clip-factor", type=float, default=8.0,
                   help="a push part whose RMS exceeds this x the fragment's reference RMS is folded scaled down to it")
    p.add_argument("--norm-refuse-factor", type=float, default=64.0,
                   help="a push part whose RMS exceeds this x the fragment's reference RMS is refused")
    p.add_argument("--max-open-rounds", type=int, default=2,
                   help="rounds open at once (each holds one fragment's running sum); a further round opens "
                        "once one commits")
    p.add_argument("--max-gathering-rounds", type=int, default=1,
                   help="open rounds still gathering pushes at once (each sum filling is one fragment); the "
                        "next round opens once the earlier ones have all their pushes")
    p.add_argument("--init-lanes", type=int, default=1,
                   help="second connections island 0 may open for INIT beside its first (0 or 1): one TCP "
                        "stream carries about 5 GB/s on loopback, two about 8")
    p.add_argument("--stream-window", type=int, default=2,
                   help="parts of one fragment stream zmq may hold per island (a heartbeat waits behind at most these)")
    p.add_argument("--data-threads", type=int, default=default_threads(),
                   help="data-plane worker threads (decode, fold, outer step, encode); torch itself runs 1 thread")
    p.add_argument("--io-threads", type=int, default=0,
                   help="zmq I/O threads, each carrying some islands' connections (0, the default: one per island and "
                        "INIT lane, at most 4)")
    p.add_argument("--max-connections", type=int, default=1024,
                   help="open connections in all; one more is shut down at once and counted")
    p.add_argument("--max-connections-per-address", type=int, default=64,
                   help="open connections from one source IP (islands behind one NAT share one)")
    p.add_argument("--max-handshaking", type=int, default=64,
                   help="connections still in their handshake (younger than --handshake-timeout-s) in all")
    p.add_argument("--max-handshaking-per-address", type=int, default=8,
                   help="connections still in their handshake from one source IP")
    p.add_argument("--handshake-timeout-s", type=float, default=5.0,
                   help="a connection that has not authenticated by then is closed (ZMQ_HANDSHAKE_IVL)")
    p.add_argument("--metrics-port", type=int, default=0,
                   help="serve Prometheus metrics and /healthz on this HTTP port (0: off; needs the metrics extra)")
    p.add_argument("--metrics-bind", default="127.0.0.1",
                   help="address of the metrics endpoint (default loopback only; docs/SECURITY.md)")
    p.add_argument("--metrics-linger-s", type=float, default=0.0,
                   help="after the run, keep serving the final metrics this long (a signal ends it)")
    p.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"), help="logging level")
    return p


def _part_elems(part_mib: str) -> int:
    """Elements per part for ``--part-mib`` (4-byte elements; 0 for ``auto``); validated by SyncerConfig."""
    if part_mib == "auto":
        return 0
    try:
        elems = float(part_mib) * 2**18
    except ValueError:
        elems = math.nan
    if not math.isfinite(elems) or elems <= 0 or elems != int(elems):
        raise ConfigError(f"--part-mib: must be auto or a positive multiple of 1/64 MiB, got {part_mib}")
    return int(elems)


def _island_keys(args: argparse.Namespace) -> tuple[tuple[int, str], ...]:
    """``--island-keys`` read and checked (Curve mode only); () without it."""
    if args.island_keys is None:
        return ()
    if not args.curve_clients_dir:
        raise ConfigError("--island-keys: needs Curve mode (--curve-secret-file and --curve-clients-dir)")
    try:
        return tuple(sorted(read_allow_list(args.island_keys, args.islands).items()))
    except ValueError as e:
        raise ConfigError(str(e)) from e


def _read_key(key_file: str | None) -> bytes:
    if key_file is not None:
        try:
            return read_key_file(key_file)
        except ValueError as e:
            raise ConfigError(f"--key-file: {e}") from e
    return os.environ.get(KEY_ENV, "").encode()


def _curve(args: argparse.Namespace, key: bytes) -> ServerCurve | None:
    """The transport security the flags ask for; None only with ``--insecure`` (and nothing else)."""
    files = (args.curve_secret_file, args.curve_clients_dir)
    if any(files) and not all(files):
        raise ConfigError("--curve-secret-file and --curve-clients-dir: give both or neither")
    if args.insecure:
        if key or any(files):
            raise ConfigError("--insecure: conflicts with --key-file / YETO_SYNC_KEY / --curve-* (drop one)")
        return None
    if all(files):
        try:
            curve = ServerCurve.from_files(args.curve_secret_file, args.curve_clients_dir)
        except ValueError as e:
            raise ConfigError(f"--curve-secret-file/--curve-clients-dir: {e}") from e
        if not curve.allowed:
            log.warning("--curve-clients-dir %s holds no certificate: no island can connect yet (SIGHUP re-reads "
                        "it)", args.curve_clients_dir)
        return curve
    if key:
        return ServerCurve.from_shared_key(key)
    raise ConfigError(f"no security configured: give --curve-secret-file and --curve-clients-dir (CurveZMQ), "
                      f"or --key-file / {KEY_ENV} (HMAC), or --insecure to run without either")


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``yeto-syncer``; returns the exit status (see the module docstring)."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, args.log_level),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        config = SyncerConfig(
            islands=args.islands,
            quorum=args.quorum,
            sync_every=args.sync_every,
            outer_lr=args.outer_lr,
            outer_momentum=args.outer_momentum,
            quorum_timeout_s=args.quorum_timeout_s,
            grace_ms=args.grace_ms,
            total_steps=args.total_steps,
            checkpoint_every=args.checkpoint_every,
            weighting=args.weighting,
            flush_merge=args.flush_merge,
            dead_after_s=args.dead_after_s,
            final_timeout_s=args.final_timeout_s,
            join_timeout_s=args.join_timeout_s,
            part_elems=_part_elems(args.part_mib),
            max_fragment_bytes=int(args.max_fragment_gib * 2**30),
            quant_block=args.quant_block,
            max_refusals=args.max_refusals,
            max_open_rounds=args.max_open_rounds,
            max_gathering_rounds=args.max_gathering_rounds,
            init_lanes=args.init_lanes,
            island_keys=_island_keys(args),
            max_tokens_per_step=args.max_tokens_per_step,
            weight_factor=args.max_weight_factor,
            norm_hard_factor=args.norm_refuse_factor,
            norm_clip_factor=args.norm_clip_factor,
        )
        if args.data_threads < 1:
            raise ConfigError(f"--data-threads: must be >= 1, got {args.data_threads}")
        if not 0 <= args.io_threads <= 64:
            raise ConfigError(f"--io-threads: must be 0 (one per island and INIT lane, at most 4) to 64, "
                              f"got {args.io_threads}")
        if args.stream_window < 1:
            raise ConfigError(f"--stream-window: must be >= 1, got {args.stream_window}")
        if args.resume and not args.checkpoint_dir:
            raise ConfigError("--resume: needs --checkpoint-dir")
        if not args.status_every_s > 0:
            raise ConfigError(f"--status-every-s: must be > 0, got {args.status_every_s}")
        if not 0 <= args.metrics_port <= 65535:
            raise ConfigError(f"--metrics-port: must be 0 (off) or a TCP port, got {args.metrics_port}")
        if not args.metrics_linger_s >= 0:
            raise ConfigError(f"--metrics-linger-s: must be >= 0, got {args.metrics_linger_s}")
        try:
            caps = ConnCaps(max_connections=args.max_connections, max_per_address=args.max_connections_per_address,
                            max_handshaking=args.max_handshaking,
                            max_handshaking_per_address=args.max_handshaking_per_address,
                            handshake_s=args.handshake_timeout_s)
        except ValueError as e:
            raise ConfigError(str(e)) from e
        key = _read_key(args.key_file)
        curve = _curve(args, key)
    except ConfigError as e:
        log.error("bad configuration: %s", e)
        return EXIT_CONFIG
    if curve is None:
        log.warning("--insecure: messages are UNAUTHENTICATED and UNENCRYPTED; anyone who can reach %s can push "
                    "deltas or exhaust the syncer's memory", args.bind)
    else:
        log.info("transport: %s", f"CurveZMQ, {len(curve.allowed)} island keys from {curve.clients_dir}"
                 if curve.clients_dir else "HMAC mode: PLAIN handshake with a key-derived password, keyed digests, "
                 "not encrypted (docs/SECURITY.md)")
    # Received parts are malloc'd and freed by libzmq at tens of MiB per second: keep such
    # blocks mapped-and-unmapped so transient buffers never stay resident (diloco.hostmem).
    tune_syncer_malloc()
    store = CheckpointStore(args.checkpoint_dir) if args.checkpoint_dir else None
    snapshot = None
    if args.resume and store is not None:
        try:
            path, snapshot = choose(store, config, args.resume_with_new_settings)
        except ResumeError as e:
            log.error("%s", e)
            return EXIT_CONFIG
        log.info("resuming from %s", path)
    try:
        state = Coordinator(config, snapshot=snapshot)
    except ValueError as e:
        log.error("--resume: checkpoint does not fit this configuration: %s", e)
        return EXIT_CONFIG
    # The state adopted the values (and momenta) it needs. Holding the snapshot here would keep each
    # restored value alive after its first commit supersedes it: counted against the fragment buffers'
    # budget, so every later round would wait book.OVER_BUDGET_WAIT_S to open (and momenta read at
    # --outer-momentum 0 would stay resident).
    del snapshot
    options = LoopOptions(bind=args.bind, key=key, event_log=args.event_log, status_every_s=args.status_every_s,
                          data_threads=args.data_threads, window=args.stream_window, curve=curve,
                          caps=caps)
    # One I/O thread per island by default: at 2.7B two threads moved the broadcasts at 3.3-3.7 GB/s per
    # island instead of 1.5 and the run took 133 s instead of 142 (docs/PERFORMANCE.md, session 9).
    io_threads = args.io_threads or max(1, min(4, config.islands + config.init_lanes))
    log.info("zmq I/O threads: %d (--io-threads)", io_threads)
    try:
        loop = SyncerLoop(state, options, store, context=zmq.Context(io_threads=io_threads))
    except Exception as e:  # zmq.ZMQError on a bad endpoint, OSError on the event log
        log.error("--bind/--event-log: cannot start: %s", e)
        return EXIT_CONFIG

    def _stop(signum: int, _frame: FrameType | None) -> None:
        log.warning("signal %d received", signum)
        loop.stop_event.set()

    signal.signal(signal.SIGINT, _stop)
    signal.signal(signal.SIGTERM, _stop)
    if curve is not None and curve.clients_dir is not None:
        signal.signal(signal.SIGHUP, lambda _s, _f: loop.reload_keys.set())
    # Tests and launchers read the real endpoint from here when zmq picked the port
    # (``--bind tcp://127.0.0.1:*``, or ``:0``: zmq accepts both).
    log.info("bound %s", loop.endpoint)
    metrics = None
    if args.metrics_port:
        try:
            metrics = serve_loop(loop, args.metrics_port, args.metrics_bind)
        except (MetricsUnavailable, OSError) as e:
            log.error("--metrics-port/--metrics-bind: cannot serve metrics: %s", e)
            loop.close()
            return EXIT_CONFIG
    code = loop.run()
    if metrics is not None:
        metrics.finish(loop, args.metrics_linger_s)
    return code

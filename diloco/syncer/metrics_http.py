"""``yeto-syncer --metrics-port``: Prometheus metrics and ``/healthz`` over HTTP, on a thread of their own.

The server shares nothing with the ZMQ port: its own listening socket (``--metrics-bind``,
127.0.0.1 unless told otherwise: the metrics name islands and sizes, see docs/SECURITY.md),
its own daemon thread (``http.server``), and it reads only :class:`SyncerMetrics` snapshots, so
a slow or hostile scraper costs the control loop nothing. ``prometheus_client`` (the ``metrics``
extra) is imported only when the port is asked for; without it :func:`start_metrics_server`
raises :class:`MetricsUnavailable` naming the extra.

Paths: ``/metrics`` (Prometheus text format; also ``/``), ``/healthz`` (200 while the control
loop turns, 503 once it stopped or stalled for :data:`~diloco.syncer.metrics.STALL_AFTER_S`).
Every series is named ``yeto_syncer_*`` (plus the client's standard ``process_*``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import TYPE_CHECKING, Any

from diloco.syncer.metrics import COMMIT_BUCKETS_S, SyncerMetrics

if TYPE_CHECKING:
    from diloco.syncer.loop import SyncerLoop

log = logging.getLogger(__name__)

EXTRA = "metrics"


class MetricsUnavailable(RuntimeError):
    """``--metrics-port`` was asked for but prometheus_client is not installed."""


def _collector(metrics: SyncerMetrics) -> Any:
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

    class Collector:
        """Builds the metric families from the latest snapshot at scrape time."""

        def collect(self) -> Iterator[Any]:
            s = metrics.snapshot()
            if s is None:
                return
            p = "yeto_syncer_"

            def counter(name: str, doc: str, value: float) -> Any:
                c = CounterMetricFamily(p + name, doc)
                c.add_metric([], value)
                return c

            def gauge(name: str, doc: str, value: float) -> Any:
                return GaugeMetricFamily(p + name, doc, value=value)

            phase = GaugeMetricFamily(p + "phase", "1 for the syncer's current phase", labels=["phase"])
            for name in ("running", "final", "done"):
                phase.add_metric([name], 1.0 if s.phase == name else 0.0)
            yield phase
            yield counter("rounds_committed", "Rounds committed (commit events in the event log)", s.rounds_committed)
            yield counter("rounds_changed", "Committed rounds that changed the model (a new version)", s.rounds_changed)
            yield counter("rounds_failed", "Commits dropped (result not finite), re-pulled", s.rounds_failed)
            yield counter("rounds_repulled", "Round attempts dropped and pulled again", s.repulls)
            yield gauge("open_rounds", "Rounds open now", s.open_rounds)
            yield gauge("oldest_open_round_age_seconds", "Age of the oldest open round's current attempt",
                        s.oldest_open_round_age_s)
            yield gauge("versions_published", "Sum of every fragment's committed version", s.versions_published)
            heard = GaugeMetricFamily(p + "island_last_heard_age_seconds", "Seconds since the island was heard from",
                                      labels=["island"])
            lag = GaugeMetricFamily(p + "island_lag_versions", "Changed commits since the island's last merged push",
                                    labels=["island"])
            live = GaugeMetricFamily(p + "island_live", "1 while the island is bound and alive", labels=["island"])
            pushes = CounterMetricFamily(p + "pushes", "Pushes of committed rounds, by island and outcome",
                                         labels=["island", "outcome"])
            link = {name: GaugeMetricFamily(p + "island_" + name, doc, labels=["island"]) for name, doc in (
                ("up_bytes_per_second", "The island's uplink: data bytes/s of its pushes arriving (smoothed)"),
                ("down_bytes_per_second", "The island's downlink: value bytes/s reaching it (smoothed)"),
                ("rtt_seconds", "Round-trip time to the island"),
                ("round_transfer_predicted_seconds", "One round's transfer predicted from the link: push up, commit, value down"),
                ("round_window_seconds", "Seconds between two rounds at the measured step time"))}
            for isl in s.islands:
                i = str(isl.island)
                for name, v in (("up_bytes_per_second", isl.link.up_bytes_s),
                                ("down_bytes_per_second", isl.link.down_bytes_s), ("rtt_seconds", isl.link.rtt_s),
                                ("round_transfer_predicted_seconds", isl.link.round_s),
                                ("round_window_seconds", isl.link.window_s)):
                    link[name].add_metric([i], v)
                if isl.heard_age_s is not None:
                    heard.add_metric([i], isl.heard_age_s)
                lag.add_metric([i], isl.lag_versions)
                live.add_metric([i], 1.0 if isl.live else 0.0)
                pushes.add_metric([i, "merged"], isl.pushes_merged)
                pushes.add_metric([i, "empty"], isl.pushes_empty)
            yield from (heard, lag, live, pushes, *link.values())
            refused = CounterMetricFamily(p + "pushes_refused", "Messages refused, by reason code", labels=["reason"])
            for reason, n in sorted(s.refusals.items()):
                refused.add_metric([reason], n)
            yield refused
            clipped = CounterMetricFamily(p + "pushes_clipped", "Pushes clipped, by reason", labels=["reason"])
            for reason, n in sorted(s.clipped.items()):
                clipped.add_metric([reason], n)
            yield clipped
            yield counter("received_bytes", "Bytes received on the ZMQ socket (every frame)", s.bytes_in)
            yield counter("sent_bytes", "Bytes sent on the ZMQ socket (every frame)", s.bytes_out)
            hist = HistogramMetricFamily(p + "commit_seconds", "Commit latency: merge, outer step, finite check")
            bounds = [str(b) for b in COMMIT_BUCKETS_S] + ["+Inf"]
            hist.add_metric([], list(zip(bounds, [float(n) for n in s.commit_buckets])), s.commit_sum_s)
            yield hist
            yield gauge("resident_memory_bytes", "Resident set size of the syncer process", s.resident_bytes)
            buf = GaugeMetricFamily(p + "buffer_bytes", "Model-sized buffers, by kind", labels=["kind"])
            for kind, n in s.buffer_bytes.items():
                buf.add_metric([kind], n)
            yield buf
            yield gauge("connections_open", "TCP connections open on the ZMQ port", s.connections_open)
            yield counter("connections_accepted", "TCP connections accepted on the ZMQ port", s.connections_accepted)
            conn = CounterMetricFamily(p + "connections_refused", "Connections shut by the caps, by reason",
                                       labels=["reason"])
            for reason, n in sorted(s.connections_refused.items()):
                conn.add_metric([reason], n)
            yield conn
            yield counter("dropped_sends", "Control messages dropped (peer slow or gone)", s.dropped_sends)
            yield counter("lost_streams", "Value streams abandoned on a send error (resent)", s.lost_streams)
            yield gauge("snapshot_age_seconds", "Age of the snapshot these values come from",
                        max(0.0, metrics.beat_at - s.taken_at))

    return Collector()


class MetricsServer:
    """The HTTP endpoint; :meth:`close` stops it. Build with :func:`start_metrics_server`."""

    def __init__(self, metrics: SyncerMetrics, httpd: HTTPServer, thread: threading.Thread) -> None:
        self.metrics = metrics
        self._httpd = httpd
        self._thread = thread
        host, port = httpd.server_address[:2]
        self.address = (str(host), int(port))

    def finish(self, loop: SyncerLoop, linger_s: float) -> None:
        """After ``loop.run`` returned: publish the final values (``/healthz`` turns 503), serve them
        ``linger_s`` more seconds (a signal ends the wait), then stop. ``--metrics-linger-s``."""
        self.metrics.final(loop)
        if linger_s > 0:
            log.info("metrics: serving the final values for %.0fs (--metrics-linger-s)", linger_s)
            loop.stop_event.clear()
            loop.stop_event.wait(linger_s)
        self.close()

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)


def serve_loop(loop: SyncerLoop, port: int, bind: str = "127.0.0.1") -> MetricsServer:
    """Attach a :class:`SyncerMetrics` to ``loop`` (before ``run``) and serve it (see below)."""
    metrics = SyncerMetrics(loop.state.config.islands)
    server = start_metrics_server(metrics, port, bind)
    loop.metrics = metrics
    return server


def start_metrics_server(metrics: SyncerMetrics, port: int, bind: str = "127.0.0.1") -> MetricsServer:
    """Serve ``metrics`` on ``bind:port`` (0: a free port, see ``.address``) from a daemon thread.

    Raises MetricsUnavailable without prometheus_client, OSError if the address cannot be bound."""
    try:
        from prometheus_client import CollectorRegistry, ProcessCollector
        from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
    except ImportError as e:
        raise MetricsUnavailable(f"--metrics-port needs prometheus_client: pip install 'yeto-diloco[{EXTRA}]' "
                                 f"(or pip install prometheus_client)") from e
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_collector(metrics))
    ProcessCollector(registry=registry)

    class Handler(BaseHTTPRequestHandler):
        timeout = 5.0  # one request at a time (one thread), each bounded: a stuck scraper costs 5 s

        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            path = self.path.split("?", 1)[0]
            if path == "/healthz":
                ok, why = metrics.healthy()
                self._reply(200 if ok else 503, "text/plain; charset=utf-8", (why + "\n").encode())
            elif path in ("/metrics", "/"):
                self._reply(200, CONTENT_TYPE_LATEST, generate_latest(registry))
            else:
                self._reply(404, "text/plain; charset=utf-8", b"not found: /metrics or /healthz\n")

        def _reply(self, code: int, ctype: str, body: bytes) -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - http.server's signature
            log.debug("metrics %s: " + format, self.address_string(), *args)

    httpd = HTTPServer((bind, port), Handler)
    thread = threading.Thread(target=httpd.serve_forever, name="yeto-metrics", daemon=True)
    thread.start()
    server = MetricsServer(metrics, httpd, thread)
    log.info("metrics on http://%s:%d/metrics (health: /healthz)", *server.address)
    return server

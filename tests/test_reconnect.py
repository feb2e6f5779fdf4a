"""A site is back within its reconnect_max_s of the coordinator serving again, however
long the coordinator was away: gRPC's own reconnect backoff (1 s growing by 1.6 up to
120 s by default) is capped like fedra's."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest

from fedra.config import READY_FILE
from fedra.local import LocalCluster
from tests.test_cluster import FAST, SYNTHETIC

pytestmark = pytest.mark.multiprocess

RECONNECT_MAX_S = 1.0
# Long enough that gRPC's default backoff, uncapped, would leave a gap of at least 2 s
# (tries at about 0, 1, 2.6, 5.2 and 9.3 s after the coordinator went away, each delay
# within 20% of that), past the cap's 1.2 s and the check's margin below.
DOWN_S = 6.0
# One register call and the coordinator's listing of its sites, on a busy machine.
MARGIN_S = 1.5
JITTER = 0.2  # gRPC's, on each backoff delay


class PortHolder:
    """The coordinator's port while it is away: each connection attempt is accepted and
    closed at once (the site's handshake fails, as against a closed port), and its time
    recorded, so the test sees every try of the site's channel."""

    def __init__(self, port: int) -> None:
        self.socket = socket.socket()
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.socket.bind(("127.0.0.1", port))
        self.socket.listen(16)
        self.tries: list[float] = []
        self.tried = threading.Condition()
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.socket.accept()
            except OSError:  # closed: the coordinator takes the port back
                return
            conn.close()
            with self.tried:
                self.tries.append(time.monotonic())
                self.tried.notify_all()

    def release_after_next_try(self, timeout_s: float) -> None:
        """Let the port go the moment the site has tried once more."""
        with self.tried:
            seen = len(self.tries)
            assert self.tried.wait_for(lambda: len(self.tries) > seen, timeout_s), self.tries
            self.socket.shutdown(socket.SHUT_RDWR)
            self.socket.close()
        self.thread.join(10)


def test_a_site_is_back_within_reconnect_max_s_after_a_long_outage(
    cluster: LocalCluster,
) -> None:
    address = cluster.start_coordinator(flags=FAST)
    port = int(address.rsplit(":", 1)[1])
    data = {"shift": 0.0, "seed": 0, "samples": 64}
    site = cluster.start_site("site-0", [SYNTHETIC], data, reconnect_max_s=RECONNECT_MAX_S)
    cluster.wait_for_sites(["site-0"])
    assert cluster.coordinator is not None
    assert cluster.coordinator.stop() == 0
    holder = PortHolder(port)
    # The outage itself, not a wait for a condition: the site retries all along.
    time.sleep(DOWN_S)
    holder.release_after_next_try(timeout_s=60)  # bounded: gRPC's own cap is 120 s
    cluster.start_coordinator(port=port, flags=FAST)
    ready = json.loads((cluster.state_dir / READY_FILE).read_text())["started_unix_s"]
    with cluster.admin() as admin:
        deadline = time.monotonic() + 60
        while not any(s.site_id == "site-0" and s.online for s in admin.sites()):
            assert site.alive() and time.monotonic() < deadline, site.log_tail()
            time.sleep(0.05)  # polling the listing, with a deadline
        back_s = time.time() - ready
    assert back_s <= RECONNECT_MAX_S + MARGIN_S, (
        f"site-0 came back {back_s:.1f} s after the coordinator was serving again:\n"
        + site.log_tail()
    )
    # And while it was away, gRPC's own tries never grew past the cap.
    gaps = [b - a for a, b in zip(holder.tries, holder.tries[1:], strict=False)]
    assert max(gaps) <= RECONNECT_MAX_S * (1 + JITTER) + 0.5, gaps  # gRPC's backoff is capped


def test_a_connection_closed_right_after_a_reconnect_wait_leaves_grpc_s_poller_quiet(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``wait_reconnected`` subscribes to the channel's state, and gRPC's poller goes on up
    to 0.2 s after the subscriber left; a channel closed under it used to make it raise
    in its thread ("Cannot monitor channel state: Channel closed!"), about one close in
    four when the wait was short. The close now lets the poller end first."""
    from fedra.client.connection import Connection

    raised: list[BaseException | None] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: raised.append(args.exc_value))
    with socket.socket() as s:  # a port that nothing serves: the channel stays down
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    stop = threading.Event()
    for i in range(24):
        connection = Connection(address, "s1")
        connection.wait_reconnected(0.0005 * (i % 4), stop)
        connection.close()
    for thread in threading.enumerate():
        if "_poll_connectivity" in thread.name:
            thread.join(5)
            assert not thread.is_alive(), "gRPC's connectivity poller did not end"
    assert raised == []

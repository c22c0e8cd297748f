"""What one HTTP connection may cost the service, and who a connection's client is.

:class:`HttpLimits` holds every limit of the HTTP layer (each a ``serve`` flag). :func:`peer_key` says which
client a connection counts against: one key for all the addresses one client can send from at will (all of
loopback, an IPv6 /64). :func:`guarded_protocol` is uvicorn's httptools protocol with the limits uvicorn does not
have: header bytes and count, read time, connections per client (:class:`OpenConnections` picks the connection
to shed when room is needed: idle or still arriving, the longest waiting first; never a busy one), requests in
flight per connection, and one budget for the request bytes all connections hold (:class:`BytesInFlight`).
"""

from __future__ import annotations

import collections
import contextlib
import fcntl
import ipaddress
import json
import socket
import struct
import termios
import time
from dataclasses import dataclass, fields

from env_service.http.auth import AUTH_HEADER, RUN_ID_HEADER
from env_service.http.delivery import Deliveries, Delivery

#: Largest request body read at all. The assistant content limit (manager.MAX_CONTENT_BYTES, 256 KiB)
#: applies after decoding; JSON escapes can inflate text up to 6x, hence the margin.
MAX_BODY_BYTES = 2 * 1024 * 1024


@dataclass(frozen=True)
class HttpLimits:
    """What one connection may cost the server before it is refused or dropped.

    ``max_header_bytes``: request line plus headers (431 beyond; httptools itself has no limit, and a
    64 MB header took seconds of event-loop time). ``max_headers``: header count (431 beyond).
    ``max_body_bytes``: request body (413). ``read_timeout_s``: a request must arrive complete within
    this long of its first byte, and a new connection must start one within it (408, then closed: a
    slow client must not hold a connection forever). ``keep_alive_s``: idle time between requests on
    a kept-alive connection, well above the client's think time so pooled connections are rarely
    closed under a request. ``max_connections``: open connections and requests in flight (503 beyond); also the
    service's thread count, so a request waiting for its episode's worker never holds a thread another needs.
    """

    max_header_bytes: int = 64 * 1024
    max_headers: int = 100
    max_body_bytes: int = MAX_BODY_BYTES
    read_timeout_s: float = 30.0
    keep_alive_s: float = 75.0
    max_connections: int = 2048
    # Open connections of one client address (``peer_key``: all of loopback is one address, an IPv6 /64 is one).
    # Beyond it, or when all connections together near ``max_connections``, connections are shed to make room
    # (this address's own, else the biggest holder's): idle kept-alive ones and ones whose request is still
    # arriving, the one that has waited longest first (``OpenConnections``); so a client hoarding idle or slow
    # connections cannot lock the others out. A new one is refused (503) only when all of its address's are busy
    # (processing or answering a request).
    max_connections_per_peer: int = 1024
    # Requests of one client address (``peer_key``, all its run ids) in flight at once; more are refused (429) before
    # they take a thread or a place in a worker's queue. A service started for a trainer gets room for the trainer's
    # peak episodes (``serving``, ``serve --peak-episodes``: the launcher derives them from the recipe); this
    # default is for everyone else (a trainer of up to 48 episodes at once fits it).
    max_requests_per_owner: int = 96
    # Run ids one client address (``peer_key``) may use at once (one not seen for the manager's idle timeout is
    # forgotten): what is kept per run (failure profiles, worker-time shares) cannot be multiplied by minting run ids.
    # A trainer uses one per run.
    max_run_ids_per_peer: int = 16
    # Requests of one connection parsed and not yet answered (HTTP pipelining); the connection is not read beyond
    # them until one is answered, whatever the method or authentication. A client waits for each answer (1 in flight).
    max_pipelined_requests: int = 4
    # Request bytes held for all connections together (``BytesInFlight``): the declared bodies of requests not yet
    # answered, and pipelined bytes read but held back. A body is charged when its headers arrive; one that does not
    # fit is refused (503) before a byte of it is buffered, once bodies still arriving and held-back bytes (the
    # longest held first) have been shed. At least ``max_body_bytes``.
    max_body_bytes_in_flight: int = 64 * 1024 * 1024
    # An answer must be taken by its client within this long of being written (the bytes this service holds for it:
    # in its write buffer and its socket's send queue); else the connection is dropped (reset, so the kernel frees
    # what it holds at once). A client of ours reads each answer as it comes, in milliseconds; one that never reads
    # held its answers (and a request in flight) for good.
    write_timeout_s: float = 30.0
    # Answer bytes held for all connections together whose clients have not taken them (``AnswersInFlight``); beyond,
    # the connections holding theirs the longest are dropped first. A client reading its answers holds ~0 of it; 160
    # connections that each asked for a 1.4 MiB answer and never read held 229 MiB before.
    max_answer_bytes_in_flight: int = 64 * 1024 * 1024

    def __post_init__(self) -> None:
        if self.max_body_bytes_in_flight < self.max_body_bytes:
            raise ValueError(
                f"max_body_bytes_in_flight ({self.max_body_bytes_in_flight}) must be at least max_body_bytes "
                f"({self.max_body_bytes})"
            )
        if self.max_pipelined_requests < 1:
            raise ValueError("max_pipelined_requests must be at least 1")

    @classmethod
    def serving(cls, peak_episodes: int | None = None, **given) -> HttpLimits:
        """The limits of a service whose main client (a trainer) runs up to ``peak_episodes`` episodes at once: the
        per-client limits raised to hold :data:`REQUESTS_PER_EPISODE` requests of each (the defaults where they are
        higher); a limit in ``given`` (an explicit ``serve`` flag) stays as given."""
        raised = {}
        if peak_episodes is not None and int(peak_episodes) < 1:
            raise ValueError(f"peak_episodes must be at least 1, got {peak_episodes}")
        if peak_episodes:
            defaults, need = cls(), REQUESTS_PER_EPISODE * int(peak_episodes)
            raised = {name: max(getattr(defaults, name), need) for name in PER_CLIENT_REQUEST_LIMITS}
        return cls(**{**raised, **given})

    def shortfalls(self, peak_episodes: int) -> list[str]:
        """One line per limit that cannot hold ``peak_episodes`` episodes of one client with a request in flight
        each: with fewer, the client's own requests are refused whenever all its episodes call at once."""
        limit_names = {f.name for f in fields(self)}
        return [
            f"{name} is {getattr(self, name)}, below the {peak_episodes} episodes the trainer runs at once (one request "
            f"each in flight; {REQUESTS_PER_EPISODE * peak_episodes} leaves room for retries)"
            for name in PER_CLIENT_REQUEST_LIMITS
            if name in limit_names and getattr(self, name) < peak_episodes
        ]


#: Requests one episode can have in flight at the service: the one its client waits on, and one the client stopped
#: waiting for (a read timeout) and sent again while the service still works on it.
REQUESTS_PER_EPISODE = 2
#: The limits every request of one client counts against (``HttpLimits.serving`` raises them for a trainer): each
#: request in flight holds a place in the client's requests and a connection, of its own and of the service's.
PER_CLIENT_REQUEST_LIMITS = ("max_requests_per_owner", "max_connections_per_peer", "max_connections")


# ---------------------------------------------------------------------------------------------
# Client identity: what per-address limits count against
# ---------------------------------------------------------------------------------------------

#: The one client address every loopback address stands for (see ``peer_key``).
LOOPBACK_PEER = "loopback"


def peer_key(host: str) -> str:
    """The client a connection or request from ``host`` counts against, for every per-address limit and the
    ``addr:`` owner: one key for all the addresses one client can send from at will.

    Any process on this machine may bind any of 127.0.0.0/8 or ::1, so every loopback address (IPv4-mapped ones
    too) is ``LOOPBACK_PEER``; an IPv4-mapped IPv6 address is its IPv4 address; another IPv6 address is its /64
    (one host is routinely given a whole /64); another IPv4 address is itself; one that does not parse is kept.
    """
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return host
    if address.version == 6 and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    if address.is_loopback:
        return LOOPBACK_PEER
    if address.version == 6:
        return str(ipaddress.IPv6Network((address, 64), strict=False))
    return str(address)


# ---------------------------------------------------------------------------------------------
# Connection limits (uvicorn's httptools protocol bounds neither header size nor read time)
# ---------------------------------------------------------------------------------------------


def _raw_error(status: int, code: str, detail: str) -> bytes:
    """A complete ``Connection: close`` HTTP response, for refusals made before the app sees a request."""
    body = json.dumps({"error": code, "detail": detail}).encode()
    from http import HTTPStatus

    return (
        f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    ).encode() + body


#: Headers a request may carry once: each decides who sends it, for which run, or where its body ends. With two,
#: each reader may take another (the first, the last, both joined), which is how requests are smuggled past a check
#: (llhttp itself refuses a second Content-Length, and Transfer-Encoding beside one).
SINGLE_HEADERS = (b"host", b"content-length", b"transfer-encoding", b"content-type", AUTH_HEADER.encode(),
                  RUN_ID_HEADER.encode())  # fmt: skip


def _duplicated(headers) -> tuple[int, str, str] | None:
    """The refusal of a request that carries one of ``SINGLE_HEADERS`` twice, or None."""
    names = [name for name, _ in headers]
    twice = next((name for name in SINGLE_HEADERS if names.count(name) > 1), None)
    if twice is None:
        return None
    return 400, "duplicate_header", f"the request carries the {twice.decode()} header more than once; send it once"


IDLE, ARRIVING, BUSY = "idle", "arriving", "busy"


class OpenConnections:
    """The open connections of each client (``peer_key``), filed by what each is doing, with when it started
    doing it (each group in that order: dicts keep insertion order):

    * ``IDLE``: kept alive between requests;
    * ``ARRIVING``: its request has not arrived complete (nothing sent yet, or headers or body still coming);
    * ``BUSY``: a complete request is being processed, or a response is being sent.

    Under pressure the connection that has waited longest for its client goes first: idle the longest, or with its
    request arriving the longest, whichever started earlier; busy ones never. A client sends its whole request
    at once and reuses its connection soon after an answer, so a hoarder's or a slow sender's connections are
    the ones that have waited longest. (Shedding every idle connection before any arriving one closed clients'
    connections as they reused them, their requests lost, while slow senders reconnected: 12 of 300 episodes in
    the benchmark's slow-bodies class.) Only the event loop touches it: no lock, and O(1) per connection event.
    """

    def __init__(self, clock=time.monotonic) -> None:
        self._clock = clock
        self._by_peer: dict[str, dict[str, dict]] = {}  # peer -> activity -> connection -> since
        self._filed: dict = {}  # connection -> (peer, activity)

    def __len__(self) -> int:
        return len(self._filed)

    def of(self, peer: str) -> int:
        return sum(len(group) for group in self._by_peer.get(peer, {}).values())

    def biggest(self) -> str:
        return max(self._by_peer, key=self.of)

    def file(self, connection, peer: str, activity: str) -> None:
        """Record ``connection`` as doing ``activity`` (the newest of that group unless it is there already)."""
        if self._filed.get(connection) == (peer, activity):
            return
        self.remove(connection)
        groups = self._by_peer.setdefault(peer, {IDLE: {}, ARRIVING: {}, BUSY: {}})
        groups[activity][connection] = self._clock()
        self._filed[connection] = (peer, activity)

    def remove(self, connection) -> None:
        peer, activity = self._filed.pop(connection, (None, None))
        if peer is None:
            return
        groups = self._by_peer[peer]
        del groups[activity][connection]
        if not any(groups.values()):
            del self._by_peer[peer]

    def shed_one(self, peer: str) -> bool:
        """Close ``peer``'s connection that has waited longest for its client; False when every one is busy."""
        while (connection := self._longest_waiting(peer)) is not None:
            if connection.activity() == BUSY and not connection.transport.is_closing():
                # Filed at its last parser or response event; a response it started since makes it busy.
                self.file(connection, peer, BUSY)
                continue
            self.remove(connection)
            connection.let_go()
            return True
        return False

    def _longest_waiting(self, peer: str):
        """The first of ``peer``'s idle and arriving connections to have started waiting, or None."""
        groups = self._by_peer.get(peer, {})
        firsts = [next(iter(groups[activity].items())) for activity in (IDLE, ARRIVING) if groups.get(activity)]
        return min(firsts, key=lambda first: first[1])[0] if firsts else None


class BytesInFlight:
    """The request bytes held for all connections together, within one budget: each connection's declared bodies
    of requests not yet answered, and its pipelined bytes read but held back.

    To admit more, holdings that wait on their client are shed (the connection closed), the longest held first:
    a body still arriving, or bytes held back behind a connection's pipelined requests (no client of ours
    pipelines). A body that has arrived and is being processed is never shed: what cannot be admitted then is
    refused. Only the event loop touches it: no lock.
    """

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.total = 0
        self._held: dict = {}  # connection -> bytes; dicts keep insertion order: the longest held first

    def admit(self, connection, nbytes: int) -> bool:
        """Charge ``nbytes`` to ``connection``, shedding others' waiting holdings to make room; False if none fits."""
        if self.total + nbytes > self.budget:
            for other in list(self._held):
                if other is not connection and other.waits_on_client():
                    self.release(other)
                    other.shed("its request bytes waited longest while the service needed room for others")
                    if self.total + nbytes <= self.budget:
                        break
            else:
                return False
        self._held[connection] = self._held.get(connection, 0) + nbytes
        self.total += nbytes
        return True

    def release(self, connection, nbytes: int | None = None) -> None:
        """Give back ``nbytes`` of ``connection``'s holding (all of it when None; nothing once shed)."""
        held = self._held.get(connection, 0)
        freed = held if nbytes is None else min(nbytes, held)
        self.total -= freed
        if held - freed > 0:
            self._held[connection] = held - freed
        else:
            self._held.pop(connection, None)


def unsent_bytes(sock) -> int:
    """Bytes in ``sock``'s kernel send queue (not yet acknowledged by the peer: memory of ours), 0 where unknown."""
    try:
        return struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0"))[0]
    except (OSError, ValueError, AttributeError):
        return 0


class AnswersInFlight:
    """The answer bytes held for clients that have not taken them, all connections together, within one budget and one
    time limit (``max_answer_bytes_in_flight``, ``write_timeout_s``).

    What a connection holds is measured (``held_answer_bytes``: its write buffer and its socket's send queue, where the
    kernel keeps most of an unread answer): at once when its write buffer fills, else at the next sweep after it
    answered (``answered`` only files it: measuring takes a system call, which would release the interpreter's lock
    after every answer). One holding nothing is let go; beyond the budget, the connections holding theirs the longest
    are dropped to make room, among those whose clients took nothing since they were last measured (a connection
    measured mid-answer, its client reading, is never dropped for room). Sweeps run every quarter of the timeout (at most
    1 s) while anything is held or answered: a connection whose answers were taken leaves, one that has held answers
    for ``timeout_s`` since it answered is dropped. Only the event loop touches it: no lock.
    """

    def __init__(self, budget: int, timeout_s: float, clock=time.monotonic) -> None:
        self.budget, self.timeout_s, self._clock = budget, timeout_s, clock
        self.total = 0
        # connection -> [bytes, holding since, stalled]; insertion order: the longest holding first
        self._held: dict = {}
        self._answered: dict = {}  # connection -> when it answered, not measured yet
        self._sweep = None

    def answered(self, connection) -> None:
        if connection not in self._held:
            self._answered.setdefault(connection, self._clock())
            self._arm(connection.loop)

    def note(self, connection, since: float | None = None) -> None:
        held = connection.held_answer_bytes()
        entry = self._held.get(connection)
        if not held:
            self.forget(connection)
            return connection.answers_taken()
        if entry is None:
            self._held[connection] = entry = [0, self._clock() if since is None else since, False]
        else:  # stalled: its client took nothing since it was last measured
            entry[2] = held >= entry[0]
        self.total += held - entry[0]
        entry[0] = held
        for other, (_, _, stalled) in list(self._held.items()):  # the longest holding first
            if self.total <= self.budget:
                break
            if stalled:  # never one caught mid-answer: a client that reads takes its answer within milliseconds
                self.forget(other)
                other.drop("its answers waited longest while the service needed room for others' answers")
        self._arm(connection.loop)

    def forget(self, connection) -> None:
        self._answered.pop(connection, None)
        entry = self._held.pop(connection, None)
        if entry is not None:
            self.total -= entry[0]

    def _arm(self, loop) -> None:
        if self._sweep is None and (self._held or self._answered):
            self._sweep = loop.call_later(min(1.0, self.timeout_s / 4), self._swept, loop)

    def _swept(self, loop) -> None:
        self._sweep = None
        answered, self._answered = self._answered, {}
        for connection, since in answered.items():
            self.note(connection, since)
        now = self._clock()
        for connection, (_, since, _) in list(self._held.items()):
            if connection.held_answer_bytes() and now - since > self.timeout_s:
                self.forget(connection)
                connection.drop(f"its client did not take its answer within {self.timeout_s:g} s")
            else:
                self.note(connection)
        self._arm(loop)


#: Answer bytes held above which an orderly close waits for them to be taken (``LingeringTransport``). An error answer
#: or ``/health`` (a few KB, answered and closed by the thousand under header abuse) is closed at once: what the
#: kernel then delivers of it is small, and a close that lingered would keep the connection, and its slot, a sweep long.
LINGER_AT_BYTES = 16 * 1024


class LingeringTransport:
    """A connection's transport whose orderly close waits for its client to take the answers it holds.

    uvicorn closes a connection in order after answering a request that asked for it (``Connection: close``,
    HTTP/1.0): the socket is closed once the service's write buffer has gone into it, and what its send queue holds then
    goes on in the kernel (an orphan, up to its send buffer, retried for minutes), where ``AnswersInFlight`` no longer
    sees it. So a close with answer bytes held only marks the connection closing (``defer``: reading stops, it stays
    measured) and it is closed once they are taken, or dropped by the write timeout or for room. Everything else is
    the transport's own."""

    def __init__(self, transport, defer) -> None:
        self.raw = transport
        self._defer = defer  # called once, at the first close: closes now, or lingers
        self._closing = False

    def __getattr__(self, name):
        return getattr(self.raw, name)

    def is_closing(self) -> bool:
        return self._closing or self.raw.is_closing()

    def close(self) -> None:
        if not self.is_closing():
            self._closing = True
            self._defer()


def guarded_protocol(limits: HttpLimits, deliveries: Deliveries | None = None):
    """uvicorn's httptools protocol class with ``limits`` on header bytes, header count, read time, connections
    per client, requests in flight per connection and request bytes in flight (see ``HttpLimits``).

    The parser is fed a piece at a time, cut where a request can end: the end of its headers (at most the
    remaining header allowance, so an oversized header is refused after ``max_header_bytes`` of parsing, not
    after all of it was buffered), then the declared body. Between requests, a connection with
    ``max_pipelined_requests`` unanswered is not fed (nor read) further: llhttp parses all it is given at once,
    and uvicorn builds a request per message parsed and, while one is processed, resumes reading; so a connection
    pipelining 2 MiB of requests made 63 k of them (~150 MiB). uvicorn's h11 protocol stops parsing at the next
    request, but buffers all it reads and has none of the limits here.

    ``deliveries``: where each connection is filed for the app, which tells it what to undo if an answer is not
    taken (``env_service.http.delivery``); each connection says when its answers were taken or not.
    """
    from uvicorn.protocols.http.flow_control import FlowControl
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    open_connections = OpenConnections()  # one per server, touched only by its event loop
    bytes_in_flight = BytesInFlight(limits.max_body_bytes_in_flight)
    answers_in_flight = AnswersInFlight(limits.max_answer_bytes_in_flight, limits.write_timeout_s)
    deliveries = deliveries if deliveries is not None else Deliveries()
    deliveries.served = True
    shed_at = max(limits.max_connections - max(limits.max_connections // 16, 1), 1)

    class HoldingFlowControl(FlowControl):
        """uvicorn's flow control, but reading stays paused while the connection holds bytes back."""

        def __init__(self, transport, holding) -> None:
            super().__init__(transport)
            self._holding = holding

        def resume_reading(self) -> None:
            if not self._holding():
                super().resume_reading()

    class GuardedHttpToolsProtocol(HttpToolsProtocol):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self.transport = LingeringTransport(transport, self._close_when_taken)  # uvicorn closes through it
            self.flow = HoldingFlowControl(transport, lambda: bool(self._held_back))
            self._in_headers, self._header_bytes, self._header_count = True, 0, 0
            self._refusal: tuple[int, str, str] | None = None
            self._read_timer = None
            # A fresh connection owes us a request: it counts as arriving until that request is complete.
            self._receiving, self._unanswered = True, 0
            # Bytes read but not yet parsed (all but the first ``_parsed``); ``_held_back``: those charged to
            # ``bytes_in_flight`` while the connection waits for answers to its pipelined requests.
            self._unparsed, self._parsed, self._held_back = b"", 0, 0
            self._tail = b""  # the last 3 bytes fed: the end of a request's headers may begin there
            self._body_left = 0  # declared body bytes of the request being parsed not yet fed to the parser
            self._charges: collections.deque[int] = collections.deque()  # body charge of each unanswered request
            self._peer = peer_key((transport.get_extra_info("peername") or ("?",))[0])
            self.delivery, self._delivery_key = Delivery(self.loop), Deliveries.key(self.server, self.client)
            deliveries.opened(self._delivery_key, self)
            if not self._make_room():
                return self._refuse(
                    503,
                    "too_many_connections",
                    f"this client address (all of loopback counts as one) holds {limits.max_connections_per_peer} "
                    "busy connections",
                )
            self._file()
            self._arm_read_timer()  # a connection that never sends a request is dropped too

        def connection_lost(self, exc) -> None:
            # Reset (its client closed it with the answer unread, or reset it), or closed before the answer was written:
            # not taken. Else it was closed in order after its answers had gone (by us: idle, or shed empty-handed).
            if self.delivery and (exc is not None or not self._answered()):
                self.delivery.not_taken(f"the connection was lost ({type(exc).__name__ if exc else 'closed'})")
            self.delivery.taken()
            deliveries.closed(self._delivery_key, self)
            self._disarm_read_timer()
            open_connections.remove(self)
            bytes_in_flight.release(self)
            answers_in_flight.forget(self)
            self._unparsed, self._parsed, self._held_back = b"", 0, 0
            super().connection_lost(exc)

        def eof_received(self):
            """Its client closed its side: it took the answer if every byte of it had arrived (a close with bytes
            unread is a reset, not this), else it left without it. One with answer bytes still held is dropped at once:
            a close would wait for the flush for good, its connection out of every budget (160 such held ~110 MiB of
            send queues, all open 35 s later)."""
            held = self.held_answer_bytes()
            if self.delivery:
                if self._answered() and not held:
                    self.delivery.taken()
                else:
                    self.delivery.not_taken("its client closed the connection before it had taken the answer")
            if held:
                return self.drop("its client closed its side of the connection without taking its answers")
            return super().eof_received()

        def _answered(self) -> bool:
            return self.cycle is None or self.cycle.response_complete

        def may_answer(self) -> bool:
            """Whether an answer written now can still leave (the connection open, its request's client there)."""
            return not self.transport.is_closing() and not (self.cycle is not None and self.cycle.disconnected)

        def activity(self) -> str:
            """``IDLE``, ``ARRIVING`` or ``BUSY`` (see ``OpenConnections``); one holding pipelined bytes back counts
            as arriving: its client sends more than it waits for (no client of ours does), so it may be shed."""
            if self._held_back:
                return ARRIVING
            responding = self.cycle is not None and self.cycle.response_started and not self.cycle.response_complete
            if self._unanswered or responding:
                return BUSY
            return ARRIVING if self._receiving else IDLE

        def waits_on_client(self) -> bool:
            """True while this connection's charged bytes wait on its client (see ``BytesInFlight``)."""
            return bool(self._held_back or self._body_left)

        def shed(self, why: str) -> None:
            self.drop(why)

        def drop(self, why: str) -> None:
            """Close at once, whatever it holds: not close(), which waits for answers the client may never read; and
            reset, so the kernel frees the answer bytes in the socket's send queue now rather than after minutes of
            retries."""
            self.logger.warning("dropped a connection of %s: %s", self.client, why)
            self.delivery.not_taken(f"the connection was dropped: {why}")
            sock = self.transport.get_extra_info("socket")
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.transport.abort()

        def let_go(self) -> None:
            """Close a connection that waits on its client: gracefully, unless its client has not taken its answers."""
            if self.held_answer_bytes():
                self.drop("it was shed with answers its client has not taken")
            else:
                self.transport.close()

        def held_answer_bytes(self) -> int:
            """Answer bytes this connection holds that its client has not taken: its write buffer and send queue."""
            raw = self.transport.raw  # a lingering close still holds them
            if raw.is_closing():
                return 0
            return raw.get_write_buffer_size() + unsent_bytes(raw.get_extra_info("socket"))

        def _close_when_taken(self) -> None:
            """An orderly close (``LingeringTransport``): now, or once the answers it holds are taken."""
            if self.held_answer_bytes() <= LINGER_AT_BYTES:
                return self.transport.raw.close()
            self.flow.pause_reading()  # it takes no more requests
            answers_in_flight.note(self)  # measured from now: closed once taken, dropped past the write timeout

        def answers_taken(self) -> None:
            """``AnswersInFlight``: its client took all it held; a close that waited for that happens now."""
            if self.transport.is_closing() and not self.transport.raw.is_closing():
                self.transport.raw.close()

        def shutdown(self) -> None:
            if self.held_answer_bytes():  # the service stops: it waits for no client
                return self.drop("the service is stopping")
            super().shutdown()

        def pause_writing(self) -> None:
            super().pause_writing()
            answers_in_flight.note(self)

        def timeout_keep_alive_handler(self) -> None:
            if not self.transport.is_closing():
                self.let_go()

        def _file(self) -> None:
            if not self.transport.is_closing():
                open_connections.file(self, self._peer, self.activity())

        def _make_room(self) -> bool:
            """Below this client's cap, and the global shedding point, with room to spare: shed connections (this
            client's own first, then the biggest holder's) until there is; False when all of this client's are busy."""
            while open_connections.of(self._peer) >= limits.max_connections_per_peer:
                if not open_connections.shed_one(self._peer):
                    return False
            while len(open_connections) >= shed_at:
                if not open_connections.shed_one(open_connections.biggest()):
                    break  # nothing to shed: uvicorn's own limit answers 503 beyond max_connections
            return True

        def data_received(self, data: bytes) -> None:
            self._unparsed = self._unparsed[self._parsed :] + data if self._unparsed else data
            self._parsed = 0
            self._parse()

        def _parse(self) -> None:
            """Feed the parser what was read, a piece at a time, until all of it is parsed or the connection has
            ``max_pipelined_requests`` unanswered; then hold the rest back (reading paused) until one is answered."""
            data = self._unparsed
            view = memoryview(data)
            while self._parsed < len(data) and not self.transport.is_closing():
                if not self._receiving and len(self._charges) >= limits.max_pipelined_requests:
                    return self._hold_back()
                start, self._parsed = self._parsed, self._piece_end(data)
                self._feed(view[start : self._parsed])
            self._unparsed, self._parsed = b"", 0
            if self._held_back:
                bytes_in_flight.release(self, self._held_back)
                self._held_back = 0
                self._disarm_read_timer()  # the hold's; a request begun from what was held gets its own from now
                if self._receiving:
                    self._arm_read_timer()
                self._file()
                self.flow.resume_reading()

        def _piece_end(self, data: bytes) -> int:
            """Where the next piece ends: a request completes only at a piece's end (its body's end, else its
            headers': llhttp takes only CRLF CRLF there, which may begin in the bytes fed before)."""
            start = self._parsed
            if self._body_left:
                return min(start + self._body_left, len(data))
            straddling = (self._tail + data[start : start + 3]).find(b"\r\n\r\n")
            if straddling >= 0:
                return start + straddling + 4 - len(self._tail)
            room_end = min(start + max(limits.max_header_bytes - self._header_bytes, 1), len(data))
            headers_end = data.find(b"\r\n\r\n", start, room_end)
            return room_end if headers_end < 0 else headers_end + 4

        def _feed(self, piece: memoryview) -> None:
            if self._body_left:
                self._body_left -= len(piece)
            elif self._in_headers:
                self._header_bytes += len(piece)
            self._tail = (self._tail + piece[-3:].tobytes())[-3:]
            super().data_received(piece)
            if self._refusal is None and self._in_headers and self._header_bytes >= limits.max_header_bytes:
                self._refusal = (
                    431,
                    "headers_too_large",
                    f"request line and headers exceed {limits.max_header_bytes} bytes",
                )
            if self._refusal is not None:
                self._refuse(*self._refusal)

        def _hold_back(self) -> None:
            """Keep the unparsed rest, charged to ``bytes_in_flight``, and read no more until a request is answered."""
            self._unparsed, self._parsed = self._unparsed[self._parsed :], 0
            more = len(self._unparsed) - self._held_back
            if more > 0 and not bytes_in_flight.admit(self, more):
                return self.shed("it pipelined more than the service holds for all connections together")
            if more < 0:
                bytes_in_flight.release(self, -more)
            self._held_back = len(self._unparsed)
            self.flow.pause_reading()
            self._file()
            # Busy or not, a connection holding bytes back must get its next request parsed within the read timeout:
            # one that pipelines and never reads its answers stalls its own requests, and is closed.
            self._arm_read_timer()

        def on_response_complete(self) -> None:
            # Only a complete request was counted: one answered early (its body still coming) never was.
            self._unanswered = max(self._unanswered - 1, 0)
            if self._charges:
                bytes_in_flight.release(self, self._charges.popleft())
            super().on_response_complete()
            answers_in_flight.answered(self)
            self._file()
            if self._unparsed and not self.transport.is_closing():
                self.loop.call_soon(self._parse_if_open)

        def _parse_if_open(self) -> None:
            if self.parser is not None and not self.transport.is_closing():
                self._parse()

        def on_message_begin(self) -> None:
            self.delivery.taken()  # its client sends the next request: it has read the answers before it
            super().on_message_begin()
            self._receiving = True
            self._file()
            self._arm_read_timer()

        def on_header(self, name: bytes, value: bytes) -> None:
            self._header_count += 1
            if self._header_count > limits.max_headers:
                self._refusal = self._refusal or (
                    431,
                    "headers_too_many",
                    f"more than {limits.max_headers} request headers",
                )
            elif self._refusal is None:
                super().on_header(name, value)

        # A refused request never reaches the app: its remaining parser events are dropped.
        def on_headers_complete(self) -> None:
            if self._refusal is None:
                self._refusal = _duplicated(self.headers) or self._admit_body()
            if self._refusal is None:
                self._in_headers, self._header_bytes = False, 0
                super().on_headers_complete()

        def _admit_body(self) -> tuple[int, str, str] | None:
            """Charge the declared body to ``bytes_in_flight`` before a byte of it is read; a refusal if it cannot."""
            names = {name for name, _ in self.headers}
            if b"transfer-encoding" in names:  # no client of ours sends one: every body's size is known up front
                return 411, "length_required", "send the request body with Content-Length (not chunked)"
            declared = next((value for name, value in self.headers if name == b"content-length"), b"0")
            if not declared.isdigit():  # llhttp refuses a malformed one itself; this keeps int() total
                return 400, "bad_request", "Content-Length must be a decimal number"
            declared = int(declared)
            # A body over max_body_bytes is refused unread by the app (413): nothing of it is kept.
            charge = declared if declared <= limits.max_body_bytes else 0
            if charge and not bytes_in_flight.admit(self, charge):
                return (
                    503,
                    "too_many_bytes_in_flight",
                    f"request bodies in flight use the service's {limits.max_body_bytes_in_flight} bytes for them; "
                    "retry shortly",
                )
            self._charges.append(charge)
            self._body_left = declared
            return None

        def on_body(self, body: bytes) -> None:
            if self._refusal is None:
                super().on_body(body)

        def on_message_complete(self) -> None:
            if self._refusal is None:
                self._disarm_read_timer()
                self._in_headers, self._header_count = True, 0
                self._receiving, self._body_left = False, 0
                if not self.cycle.response_complete:  # else the app answered it before its body was complete
                    self._unanswered += 1
                super().on_message_complete()
                self._file()

        def _arm_read_timer(self) -> None:
            if self._read_timer is None:
                self._read_timer = self.loop.call_later(limits.read_timeout_s, self._read_timed_out)

        def _disarm_read_timer(self) -> None:
            if self._read_timer is not None:
                self._read_timer.cancel()
                self._read_timer = None

        def _read_timed_out(self) -> None:
            self._read_timer = None
            if self.cycle is None or self.cycle.response_complete:  # nothing of ours is being sent
                self._refuse(408, "request_timeout", f"the request did not arrive within {limits.read_timeout_s:g} s")
            else:  # dropped, not closed: a close waits for answers the client may never read
                self.drop(f"its next request did not arrive within {limits.read_timeout_s:g} s")

        def _refuse(self, status: int, code: str, detail: str) -> None:
            self.logger.warning("refused a request from %s: %s", self.client, detail)
            if not self.transport.is_closing():
                self.transport.write(_raw_error(status, code, detail))
                self.transport.close()

    return GuardedHttpToolsProtocol


__all__ = [
    "LOOPBACK_PEER",
    "MAX_BODY_BYTES",
    "AnswersInFlight",
    "BytesInFlight",
    "HttpLimits",
    "LingeringTransport",
    "OpenConnections",
    "guarded_protocol",
    "peer_key",
]

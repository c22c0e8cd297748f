"""The web-search backend's page fetch, held to public addresses and a time and size budget.

bfcl's ``WebSearchAPI.fetch_url_content`` fetches whatever URL the model names with ``requests.get`` (redirects
followed): left alone, a policy could make the service read its own ``/health``, anything else on loopback or
the private network, or a cloud metadata address. :func:`install` puts :class:`GuardedRequests` in place of the
``requests`` module inside that backend (its only use there is ``requests.get``), so every fetch

* names http or https, and a host whose every resolved address is public (not loopback, private, link-local,
  multicast, reserved or unspecified; IPv4-mapped IPv6 addresses are judged as IPv4);
* connects to an address the check vetted, never resolving the host name again: a hostile DNS server that
  answers a public address to the check and a private one to the connection (DNS rebinding) reaches nothing.
  The ``Host`` header, TLS SNI and certificate verification still name the host, not the address;
* takes nothing from the environment: no ``HTTP(S)_PROXY``/``ALL_PROXY`` proxy (which would carry the
  connection elsewhere than the vetted address), no ``.netrc`` credentials, no ``REQUESTS_CA_BUNDLE``;
* follows at most ``MAX_REDIRECTS`` redirects itself, checking and pinning each new URL the same way;
* takes at most ``FETCH_BUDGET_S`` in all and keeps at most ``MAX_FETCH_BYTES`` of the page.

A refusal is an exception inside bfcl's own ``try``, so the model reads ``An error occurred while fetching
<url>: <why>``.
"""

from __future__ import annotations

import functools
import importlib
import ipaddress
import socket
import time
from collections.abc import Callable
from urllib.parse import urljoin, urlsplit

import requests
from requests.adapters import HTTPAdapter
from urllib3.connection import HTTPConnection, HTTPSConnection
from urllib3.connectionpool import HTTPConnectionPool, HTTPSConnectionPool
from urllib3.exceptions import ConnectTimeoutError, NewConnectionError
from urllib3.util.connection import create_connection

MAX_REDIRECTS = 5
FETCH_BUDGET_S = 10.0
MAX_FETCH_BYTES = 2 * 1024 * 1024
_WEB_SEARCH_MODULE = "bfcl_eval.eval_checker.multi_turn_eval.func_source_code.web_search"


class UnsafeURL(ValueError):
    """A URL the guard will not fetch (the message says why)."""


def public_address(ip: str) -> bool:
    """Whether ``ip`` is an address on the public internet."""
    address = ipaddress.ip_address(ip.split("%", 1)[0])  # drop an IPv6 zone id
    if address.version == 6 and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    private = (
        address.is_loopback
        or address.is_private
        or address.is_link_local
        or address.is_multicast
        or address.is_reserved
        or address.is_unspecified
    )
    return address.is_global and not private


def check_url(url: str, allowed: Callable[[str], bool] = public_address) -> list[str]:
    """The addresses ``url``'s host resolves to, the only ones a fetch of it may connect to.

    Raises :class:`UnsafeURL` unless ``url`` is http(s) and every one of them is ``allowed``.
    """
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise UnsafeURL(f"only http and https URLs with a host are fetched, not {url[:200]!r}")
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
        resolved = socket.getaddrinfo(parts.hostname, port, type=socket.SOCK_STREAM)
    except (OSError, ValueError) as error:
        raise UnsafeURL(f"cannot resolve {parts.hostname[:200]!r}: {error}") from None
    addresses = [sockaddr[0] for *_, sockaddr in resolved]
    if not addresses:
        raise UnsafeURL(f"{parts.hostname[:200]} resolves to no address")
    for address in addresses:
        if not allowed(address):
            raise UnsafeURL(f"{parts.hostname[:200]} resolves to {address}, which is not a public address")
    return addresses


class GuardedRequests:
    """Stands in for the ``requests`` module inside bfcl's web-search backend (``get`` only).

    ``allowed`` judges each resolved address; ``ca_bundle`` replaces the trust anchors https is verified
    against (tests name their own certificate authority; the service keeps requests' default).
    """

    def __init__(self, allowed: Callable[[str], bool] = public_address, ca_bundle: str | None = None):
        self.allowed = allowed
        self.ca_bundle = ca_bundle

    def get(self, url: str, headers=None, timeout=None, allow_redirects: bool = True, **_ignored) -> requests.Response:
        deadline = time.monotonic() + FETCH_BUDGET_S
        for _ in range(MAX_REDIRECTS + 1):
            address = check_url(url, self.allowed)[0]
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise requests.Timeout(f"the fetch took more than its budget of {FETCH_BUDGET_S:g} s")
            hop_timeout = min(timeout or remaining, remaining)
            with _pinned_session(address, self.ca_bundle) as session:
                response = session.get(url, headers=headers, timeout=hop_timeout, allow_redirects=False, stream=True)
                if not (allow_redirects and response.is_redirect):
                    return _bounded(response, deadline)
                url = urljoin(url, response.headers.get("location", ""))
                response.close()
        raise requests.TooManyRedirects(f"more than {MAX_REDIRECTS} redirects")


def _pinned_session(address: str, ca_bundle: str | None) -> requests.Session:
    """A session for one request, whose connections all go to ``address``, with nothing from the environment."""
    session = requests.Session()
    # No proxy (it would connect elsewhere than ``address``), no .netrc credentials, no REQUESTS_CA_BUNDLE.
    session.trust_env = False
    session.verify = ca_bundle or True
    adapter = _PinnedAdapter(address)
    session.mount("http://", adapter)
    session.mount("https://", adapter)
    return session


class _PinnedConnection:
    """Mixed into urllib3's connections: the socket goes to ``pinned_ip``, the vetted address.

    ``host`` stays the URL's host name, so the ``Host`` header, TLS SNI and certificate verification name it.
    """

    def __init__(self, *args, pinned_ip: str, **kwargs):
        super().__init__(*args, **kwargs)
        self.pinned_ip = pinned_ip

    def _new_conn(self) -> socket.socket:
        # urllib3's own _new_conn resolves ``host`` again, which a hostile DNS server may answer differently
        # than it answered the check; an address literal is not looked up.
        try:
            return create_connection(
                (self.pinned_ip, self.port),
                self.timeout,
                source_address=self.source_address,
                socket_options=self.socket_options,
            )
        except TimeoutError as error:
            raise ConnectTimeoutError(self, f"connecting to {self.host} at {self.pinned_ip} timed out") from error
        except OSError as error:
            raise NewConnectionError(self, f"cannot connect to {self.host} at {self.pinned_ip}: {error}") from error


class _PinnedHTTPConnection(_PinnedConnection, HTTPConnection):
    pass


class _PinnedHTTPSConnection(_PinnedConnection, HTTPSConnection):
    pass


class _PinnedHTTPConnectionPool(HTTPConnectionPool):
    ConnectionCls = _PinnedHTTPConnection


class _PinnedHTTPSConnectionPool(HTTPSConnectionPool):
    ConnectionCls = _PinnedHTTPSConnection


class _PinnedAdapter(HTTPAdapter):
    """requests' adapter whose pools hand ``pinned_ip`` to every connection they make."""

    def __init__(self, pinned_ip: str):
        self.pinned_ip = pinned_ip  # before HTTPAdapter.__init__, which builds the pool manager
        super().__init__()

    def init_poolmanager(self, *args, **kwargs) -> None:
        super().init_poolmanager(*args, **kwargs)
        self.poolmanager.pool_classes_by_scheme = {
            "http": functools.partial(_PinnedHTTPConnectionPool, pinned_ip=self.pinned_ip),
            "https": functools.partial(_PinnedHTTPSConnectionPool, pinned_ip=self.pinned_ip),
        }


def _bounded(response: requests.Response, deadline: float) -> requests.Response:
    """``response`` with at most ``MAX_FETCH_BYTES`` of its body read, before ``deadline``."""
    chunks, size = [], 0
    try:
        for chunk in response.iter_content(64 * 1024):
            chunks.append(chunk[: MAX_FETCH_BYTES - size])
            size += len(chunks[-1])
            if size >= MAX_FETCH_BYTES or time.monotonic() > deadline:
                break
    finally:
        response.close()
    response._content = b"".join(chunks)  # what .text and .content read from now on
    return response


def install() -> None:
    """Guard bfcl's web-search fetches in this process (idempotent)."""
    module = importlib.import_module(_WEB_SEARCH_MODULE)
    if not isinstance(module.requests, GuardedRequests):
        module.requests = GuardedRequests()


__all__ = ["FETCH_BUDGET_S", "MAX_FETCH_BYTES", "MAX_REDIRECTS", "GuardedRequests", "UnsafeURL", "check_url", "install"]

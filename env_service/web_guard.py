"""The web-search backend's page fetch, held to public addresses and a time and size budget.

bfcl's ``WebSearchAPI.fetch_url_content`` fetches whatever URL the model names with ``requests.get`` (redirects
followed): left alone, a policy could make the service read its own ``/health``, anything else on loopback or
the private network, or a cloud metadata address. :func:`install` puts :class:`GuardedRequests` in place of the
``requests`` module inside that backend (its only use there is ``requests.get``), so every fetch

* names http or https, and a host whose every resolved address is public (not loopback, private, link-local,
  multicast, reserved or unspecified; IPv4-mapped IPv6 addresses are judged as IPv4);
* follows at most ``MAX_REDIRECTS`` redirects itself, checking each new URL the same way;
* takes at most ``FETCH_BUDGET_S`` in all and keeps at most ``MAX_FETCH_BYTES`` of the page.

A refusal is an exception inside bfcl's own ``try``, so the model reads ``An error occurred while fetching
<url>: <why>``. (A host that resolves to a public address when checked and to a private one when requests
connects, DNS rebinding, is not covered: the connection is made by requests.)
"""

from __future__ import annotations

import importlib
import ipaddress
import socket
import time
from collections.abc import Callable
from urllib.parse import urljoin, urlsplit

import requests

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


def check_url(url: str, allowed: Callable[[str], bool] = public_address) -> None:
    """Raise :class:`UnsafeURL` unless ``url`` is http(s) and every address its host resolves to is ``allowed``."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise UnsafeURL(f"only http and https URLs with a host are fetched, not {url[:200]!r}")
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
        resolved = socket.getaddrinfo(parts.hostname, port, type=socket.SOCK_STREAM)
    except (OSError, ValueError) as error:
        raise UnsafeURL(f"cannot resolve {parts.hostname[:200]!r}: {error}") from None
    for *_, sockaddr in resolved:
        if not allowed(sockaddr[0]):
            raise UnsafeURL(f"{parts.hostname[:200]} resolves to {sockaddr[0]}, which is not a public address")


class GuardedRequests:
    """Stands in for the ``requests`` module inside bfcl's web-search backend (``get`` only)."""

    def __init__(self, allowed: Callable[[str], bool] = public_address):
        self.allowed = allowed

    def get(self, url: str, headers=None, timeout=None, allow_redirects: bool = True, **_ignored) -> requests.Response:
        deadline = time.monotonic() + FETCH_BUDGET_S
        for _ in range(MAX_REDIRECTS + 1):
            check_url(url, self.allowed)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise requests.Timeout(f"the fetch took more than its budget of {FETCH_BUDGET_S:g} s")
            response = requests.get(
                url, headers=headers, timeout=min(timeout or remaining, remaining), allow_redirects=False, stream=True
            )
            if not (allow_redirects and response.is_redirect):
                return _bounded(response, deadline)
            url = urljoin(url, response.headers.get("location", ""))
            response.close()
        raise requests.TooManyRedirects(f"more than {MAX_REDIRECTS} redirects")


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

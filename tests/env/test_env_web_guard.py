"""Server-side request forgery through the web-search backend's page fetch: only public addresses, checked for
every resolved address and after every redirect, within a time and size budget; the connection goes to the
address that was checked (DNS rebinding) and not through a proxy from the environment. Everything here stays on
loopback: refused URLs are refused before any connection, and the other tests serve on 127.0.0.x, with
127.0.0.2 standing in for a public server and ``*.test`` names answered by a rebinding resolver.
"""

from __future__ import annotations

import collections
import contextlib
import http.server
import json
import shutil
import socket
import ssl
import subprocess
import threading

import pytest
import requests

from env_service.bfcl import web_guard
from env_service.bfcl.ood_tasks import SERPAPI_KEY_ENV
from env_service.client import EnvClient
from env_service.episodes.manager import EpisodeManager
from env_service.http.service import ServerThread

WEB_TASK = "web_search_base_0"


def fetch(url: str) -> str:
    return "<tool_call>" + json.dumps({"name": "fetch_url_content", "arguments": {"url": url}}) + "</tool_call>"


@pytest.fixture(scope="module")
def service():
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(SERPAPI_KEY_ENV, "not-a-real-key")  # the fetch needs no search; nothing leaves the machine
        with ServerThread(EpisodeManager(workers=1)) as server:
            yield server


def test_the_service_never_fetches_its_own_or_private_addresses(service):
    port = service.port
    urls = [
        f"http://127.0.0.1:{port}/health",  # the issue's: the service's own health
        f"http://localhost:{port}/health",  # ours, from here on: names, encodings and ranges of the same
        f"http://2130706433:{port}/health",  # 127.0.0.1 written as one decimal number
        f"http://[::ffff:127.0.0.1]:{port}/health",  # IPv4-mapped IPv6
        f"http://[::1]:{port}/health",
        f"http://0.0.0.0:{port}/health",
        "http://169.254.169.254/latest/meta-data/",  # cloud metadata (link-local)
        "http://10.0.0.1/",
        "http://192.168.1.1/",
        "http://224.0.0.1/",
        "http://240.0.0.1/",  # reserved
    ]
    with EnvClient(service.url, retries=0, timeout_s=60) as client:
        instance_id = client.create(WEB_TASK, "validate")["instance_id"]
        for url in urls:
            content = client.step(instance_id, fetch(url))["message"]["content"]
            assert "service_id" not in content and "workers" not in content, url  # before: the health JSON
            assert "not a public address" in content or "only http and https" in content, (url, content[:300])
        client.release(instance_id)


class _Redirect(http.server.BaseHTTPRequestHandler):
    target = ""

    def do_GET(self):
        self.send_response(302)
        self.send_header("Location", self.target)
        self.end_headers()

    def log_message(self, *args):
        pass


def test_a_redirect_to_a_private_address_is_refused():
    # 127.0.0.2 stands in for a public server (the only address this test lets through); it redirects to loopback.
    with http.server.ThreadingHTTPServer(("127.0.0.2", 0), _Redirect) as redirector:
        _Redirect.target = "http://127.0.0.1:9/secret"
        threading.Thread(target=redirector.serve_forever, daemon=True).start()
        guarded = web_guard.GuardedRequests(allowed=lambda ip: ip == "127.0.0.2")
        try:
            with pytest.raises(web_guard.UnsafeURL, match="127.0.0.1, which is not a public address"):
                guarded.get(f"http://127.0.0.2:{redirector.server_port}/start", timeout=5)
            _Redirect.target = f"http://127.0.0.2:{redirector.server_port}/again"  # ours: a redirect loop
            with pytest.raises(Exception, match="redirects"):
                guarded.get(f"http://127.0.0.2:{redirector.server_port}/start", timeout=5)
        finally:
            redirector.shutdown()


def test_public_addresses_pass_the_check():
    for ip in ("8.8.8.8", "1.1.1.1", "2606:4700:4700::1111"):
        assert web_guard.public_address(ip), ip


# --- the connection goes to the checked address ---------------------------------------------------------------

PUBLIC_STAND_IN = "127.0.0.2"  # the only address these tests allow
PAGE = b"<html>the page on the checked address</html>"


def only_the_stand_in(ip: str) -> bool:
    return ip == PUBLIC_STAND_IN


@pytest.fixture
def rebinding_dns(monkeypatch):
    """``*.test`` names answer 127.0.0.2 to their first lookup and 127.0.0.1 to every later one, for the guard and
    for requests and urllib3 alike; the returned counter holds each name's lookups."""
    real_getaddrinfo = socket.getaddrinfo
    lookups = collections.Counter()

    def getaddrinfo(host, port, *args, **kwargs):
        if not (isinstance(host, str) and host.endswith(".test")):
            return real_getaddrinfo(host, port, *args, **kwargs)
        lookups[host] += 1
        return real_getaddrinfo(PUBLIC_STAND_IN if lookups[host] == 1 else "127.0.0.1", port, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    return lookups


class _Recorder(http.server.BaseHTTPRequestHandler):
    """Serves its server's ``body`` (``/redirect?<url>`` answers 302 to that URL) and records each request."""

    def do_GET(self):
        self.server.requests.append({"path": self.path, "sni": getattr(self.request, "sni", None), **self.headers})
        if self.path.startswith("/redirect?"):
            self.send_response(302)
            self.send_header("Location", self.path.split("?", 1)[1])
            self.end_headers()
            return
        self.send_response(200)
        self.send_header("Content-Length", str(len(self.server.body)))
        self.end_headers()
        self.wfile.write(self.server.body)

    def log_message(self, *args):
        pass


class _Listener(http.server.ThreadingHTTPServer):
    """A loopback HTTP(S) server that counts the connections it accepts and records the requests it serves."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], body: bytes, tls: ssl.SSLContext | None = None):
        self.body, self.accepted, self.requests = body, 0, []
        super().__init__(address, _Recorder)
        if tls is not None:
            tls.sni_callback = lambda connection, name, _context: setattr(connection, "sni", name)
            self.socket = tls.wrap_socket(self.socket, server_side=True, do_handshake_on_connect=False)

    def get_request(self):
        connection, address = super().get_request()
        self.accepted += 1  # counted before any TLS handshake, so a refused handshake still counts
        if isinstance(connection, ssl.SSLSocket):
            connection.do_handshake()
        return connection, address


@contextlib.contextmanager
def _serving(*servers: _Listener):
    for server in servers:
        threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield servers
    finally:
        for server in servers:
            server.shutdown()
            server.server_close()


@contextlib.contextmanager
def page_and_trap(body: bytes = PAGE, tls: ssl.SSLContext | None = None):
    """The page on 127.0.0.2 and a trap on 127.0.0.1, on the same port: a ``*.test`` name looked up again after
    the check (see ``rebinding_dns``) connects to the trap."""
    for _ in range(20):  # the port the page got may be taken on 127.0.0.1
        page = _Listener((PUBLIC_STAND_IN, 0), body, tls)
        try:
            trap = _Listener(("127.0.0.1", page.server_port), b"the service's own secrets")
        except OSError:
            page.server_close()
            continue
        with _serving(page, trap):
            yield page, trap
        return
    pytest.fail("no port free on both 127.0.0.1 and 127.0.0.2")


def test_a_rebound_name_is_fetched_from_the_address_that_was_checked(rebinding_dns):
    with page_and_trap() as (page, trap):
        response = web_guard.GuardedRequests(allowed=only_the_stand_in).get(
            f"http://rebind.test:{page.server_port}/", timeout=5
        )
    assert trap.accepted == 0  # before: the check saw 127.0.0.2, requests looked again and connected to 127.0.0.1
    assert response.content == PAGE and page.accepted == 1
    assert rebinding_dns["rebind.test"] == 1  # resolved once, for the check


def test_the_pinned_fetch_keeps_the_host_name_in_the_host_header(rebinding_dns):
    with page_and_trap() as (page, trap):
        web_guard.GuardedRequests(allowed=only_the_stand_in).get(f"http://rebind.test:{page.server_port}/", timeout=5)
    assert [request["Host"] for request in page.requests] == [f"rebind.test:{page.server_port}"]
    assert trap.accepted == 0


def test_redirects_are_checked_and_pinned_hop_by_hop(rebinding_dns):
    guarded = web_guard.GuardedRequests(allowed=only_the_stand_in)
    with page_and_trap() as (page, trap):
        port = page.server_port
        response = guarded.get(f"http://first.test:{port}/redirect?http://second.test:{port}/page", timeout=5)
        assert response.content == PAGE
        assert [request["Host"] for request in page.requests] == [f"first.test:{port}", f"second.test:{port}"]
        assert rebinding_dns == {"first.test": 1, "second.test": 1}  # one check per hop, and no lookup after it
        # A hop back to first.test is checked again: its second answer is 127.0.0.1, so the hop is refused.
        with pytest.raises(web_guard.UnsafeURL, match="127.0.0.1, which is not a public address"):
            guarded.get(f"http://third.test:{port}/redirect?http://first.test:{port}/page", timeout=5)
    assert trap.accepted == 0


def test_the_size_cap_holds_on_a_pinned_fetch(rebinding_dns):
    with page_and_trap(body=b"x" * (web_guard.MAX_FETCH_BYTES + 100_000)) as (page, trap):
        response = web_guard.GuardedRequests(allowed=only_the_stand_in).get(
            f"http://big.test:{page.server_port}/", timeout=5
        )
    assert len(response.content) == web_guard.MAX_FETCH_BYTES and set(response.content) == {ord("x")}
    assert trap.accepted == 0


def test_proxies_from_the_environment_are_ignored(monkeypatch):
    with page_and_trap() as (page, proxy):  # the "trap" on 127.0.0.1 plays the proxy
        proxy_url = f"http://127.0.0.1:{proxy.server_port}"
        for variable in ("HTTP_PROXY", "http_proxy", "HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
            monkeypatch.setenv(variable, proxy_url)
        monkeypatch.delenv("NO_PROXY", raising=False)
        monkeypatch.delenv("no_proxy", raising=False)
        response = web_guard.GuardedRequests(allowed=only_the_stand_in).get(
            f"http://{PUBLIC_STAND_IN}:{page.server_port}/", timeout=5
        )
    assert proxy.accepted == 0  # before: requests sent the fetch to the proxy the environment named
    assert response.content == PAGE


def test_netrc_credentials_are_never_sent(monkeypatch, tmp_path):
    netrc = tmp_path / "netrc"
    netrc.write_text(f"machine {PUBLIC_STAND_IN} login operator password not-for-the-model\n")
    netrc.chmod(0o600)
    monkeypatch.setenv("NETRC", str(netrc))
    with page_and_trap() as (page, _):
        web_guard.GuardedRequests(allowed=only_the_stand_in).get(f"http://{PUBLIC_STAND_IN}:{page.server_port}/")
    assert [request.get("Authorization") for request in page.requests] == [None]  # before: operator's Basic auth


@pytest.fixture(scope="module")
def rebind_test_certificate(tmp_path_factory) -> tuple[str, str]:
    """(certificate, key): a self-signed certificate for ``rebind.test`` only (no IP address in it)."""
    if shutil.which("openssl") is None:
        pytest.skip("the TLS tests make their certificate with the openssl command")
    folder = tmp_path_factory.mktemp("tls")
    certificate, key = str(folder / "rebind.test.pem"), str(folder / "rebind.test.key")
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=rebind.test"]
        + ["-addext", "subjectAltName=DNS:rebind.test", "-keyout", key, "-out", certificate],
        check=True,
        capture_output=True,
    )
    return certificate, key


def server_tls(certificate_and_key: tuple[str, str]) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(*certificate_and_key)
    return context


def test_https_is_verified_against_the_host_name_not_the_address(rebinding_dns, rebind_test_certificate):
    guarded = web_guard.GuardedRequests(allowed=only_the_stand_in, ca_bundle=rebind_test_certificate[0])
    with page_and_trap(tls=server_tls(rebind_test_certificate)) as (page, trap):
        response = guarded.get(f"https://rebind.test:{page.server_port}/", timeout=5)
    assert response.content == PAGE  # the certificate names rebind.test, not 127.0.0.2: verified against the name
    assert [request["sni"] for request in page.requests] == ["rebind.test"]
    assert trap.accepted == 0


def test_https_refuses_a_certificate_for_another_name(rebinding_dns, rebind_test_certificate):
    guarded = web_guard.GuardedRequests(allowed=only_the_stand_in, ca_bundle=rebind_test_certificate[0])
    with page_and_trap(tls=server_tls(rebind_test_certificate)) as (page, trap):
        with pytest.raises(requests.exceptions.SSLError):
            guarded.get(f"https://impostor.test:{page.server_port}/", timeout=5)
    assert page.accepted == 1 and page.requests == [] and trap.accepted == 0

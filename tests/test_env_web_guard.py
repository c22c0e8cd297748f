"""Server-side request forgery through the web-search backend's page fetch: only public addresses, checked for
every resolved address and after every redirect, within a time and size budget. Everything here stays on
loopback: refused URLs are refused before any connection, and the redirect test serves both hops on 127.0.0.x.
"""

from __future__ import annotations

import http.server
import json
import threading

import pytest

from env_service import web_guard
from env_service.client import EnvClient
from env_service.manager import EpisodeManager
from env_service.ood_tasks import SERPAPI_KEY_ENV
from env_service.service import ServerThread

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

"""The GPU install's flash-attn step (``scripts/flash_attn_wheel.py`` and the gpu block of ``scripts/install.sh``)
against a release served on loopback: the wheel's URL is checked before anything downloads, a miss says which
Python versions have one, and the source-build fallback names what it needs and refuses to start without nvcc."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from tests.support.processes import repo_script

REPO = Path(__file__).resolve().parents[2]
HELPER = REPO / "scripts" / "flash_attn_wheel.py"
HERE = f"{sys.version_info[0]}.{sys.version_info[1]}"
TAG = f"cp{sys.version_info[0]}{sys.version_info[1]}"


class _Release(BaseHTTPRequestHandler):
    """A release page like GitHub's: the download redirects to a storage host, which answers HEAD; a GET (a
    download) is refused so that a check which turns into a download fails."""

    wheels: set[str] = set()

    def do_HEAD(self):
        name = self.path.rsplit("/", 1)[-1]
        if self.path.startswith("/release/") and name in self.wheels:
            self.send_response(302)
            self.send_header("Location", f"/storage/{name}")
        elif self.path.startswith("/storage/"):
            self.send_response(200)
            self.send_header("Content-Length", "123456789")
        else:
            self.send_response(404)
        self.end_headers()

    def do_GET(self):
        self.send_response(500)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def release():
    wheel = f"flash_attn-2.8.3+cu130torch2.11-{TAG}-{TAG}-linux_x86_64.whl"
    _Release.wheels = {wheel}
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Release)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}/release"
    server.shutdown()
    server.server_close()


def _run_helper(*args, env=None):
    return subprocess.run(
        [sys.executable, str(HELPER), *args], capture_output=True, text=True, timeout=60, env=env or os.environ
    )


def test_the_default_url_is_the_release_wheel_for_torch_2_11_cuda_13():
    assert repo_script("scripts/flash_attn_wheel.py").wheel_url("3.12") == (
        "https://github.com/mjun0812/flash-attention-prebuild-wheels/releases/download/v0.9.4/"
        "flash_attn-2.8.3+cu130torch2.11-cp312-cp312-linux_x86_64.whl"
    )


def test_an_existing_wheel_is_found_through_the_redirect_without_downloading(release):
    done = _run_helper("url", "--release-url", release)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"{release}/flash_attn-2.8.3+cu130torch2.11-{TAG}-{TAG}-linux_x86_64.whl"


def test_a_missing_wheel_names_the_pythons_that_have_one(release):
    done = _run_helper("url", "--python", "3.9", "--release-url", release)
    assert done.returncode == 1 and done.stdout == ""
    assert "no prebuilt flash-attn 2.8.3 wheel for Python 3.9" in done.stderr and "HTTP 404" in done.stderr
    assert "Python 3.10, 3.11, 3.12, 3.13; recommended: a venv made with python3.12" in done.stderr


def test_an_unreachable_release_is_a_miss_that_says_so():
    done = _run_helper("url", "--release-url", "http://127.0.0.1:9/release")  # discard port: nothing listens
    assert done.returncode == 1 and "unreachable" in done.stderr


def test_a_toolkit_of_another_cuda_major_is_refused(tmp_path):
    helper = repo_script("scripts/flash_attn_wheel.py")
    nvcc = tmp_path / "bin" / "nvcc"
    nvcc.parent.mkdir()
    nvcc.write_text("#!/bin/sh\necho 'Cuda compilation tools, release 12.4, V12.4.131'\n")
    nvcc.chmod(0o755)
    assert helper.nvcc_release(str(nvcc)) == "12.4"
    [problem] = helper.source_build_problems(str(nvcc), "12.4", "13.0")
    assert "CUDA 12.4 but torch is built with CUDA 13.0" in problem
    assert helper.source_build_problems(str(nvcc), "13.1", "13.0") == []
    assert "nvcc not found" in helper.source_build_problems(None, None, "13.0")[0]


def _gpu_flash_attn_block() -> str:
    """The flash-attn step of install.sh's gpu block, as the script has it."""
    text = (REPO / "scripts" / "install.sh").read_text()
    start = text.index('  if wheel="$(python scripts/flash_attn_wheel.py url)"; then')
    end = text.index("\n  fi\n", start) + len("\n  fi\n")
    return text[start:end]


def _run_block(release_url: str, tmp_path: Path, **env_vars: str) -> subprocess.CompletedProcess:
    # pip stands in as `echo`: what the block would install is printed, nothing is installed
    script = f"set -euo pipefail\nPIP='echo PIP'\n{_gpu_flash_attn_block()}"
    env = {
        "PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin",
        "HOME": str(tmp_path),
        "SEAL_FLASH_ATTN_RELEASE_URL": release_url,
        **env_vars,
    }
    return subprocess.run(["bash", "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120, env=env)


def test_install_sh_installs_the_wheel_it_found(release, tmp_path):
    done = _run_block(release, tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        f"PIP install -q {release}/flash_attn-2.8.3+cu130torch2.11-{TAG}-{TAG}-linux_x86_64.whl"
    ]


def test_install_sh_names_the_source_builds_needs_and_stops_without_nvcc(release, tmp_path):
    _Release.wheels = set()  # no wheel for this Python
    empty_toolkit = tmp_path / "cuda"
    empty_toolkit.mkdir()
    done = _run_block(release, tmp_path, CUDA_HOME=str(empty_toolkit))
    assert done.returncode != 0
    assert f"no prebuilt flash-attn 2.8.3 wheel for Python {HERE}" in done.stderr
    assert "needs: nvcc from a CUDA 13.x toolkit" in done.stderr and "20-30 minutes" in done.stderr
    assert "cannot build flash-attn: nvcc not found" in done.stderr
    assert "flash-attn==2.8.3" not in done.stdout  # the build never started

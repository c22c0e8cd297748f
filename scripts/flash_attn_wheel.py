"""Which flash-attn the GPU install (``bash scripts/install.sh gpu``) can get, checked before anything downloads.

The package index has only flash-attn's source, a 20-30 minute nvcc build; prebuilt wheels for the torch that
``verl[vllm]==0.9.1`` pins (2.11, CUDA 13.0) come from a community release, one wheel per CPython version.

    python scripts/flash_attn_wheel.py url            # prints this Python's wheel URL; exit 1 (and why) when none
    python scripts/flash_attn_wheel.py source-build   # names what a source build needs; exit 1 when nvcc is missing

``$SEAL_FLASH_ATTN_RELEASE_URL`` points ``url`` at a mirror of the release. Standard library only: it runs in the
fresh venv before seal itself is installed.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import urllib.error
import urllib.request

FLASH_ATTN = "2.8.3"
#: the torch and CUDA that verl[vllm]==0.9.1 pins; the wheel must be built for exactly these
TORCH_MINOR, CUDA_TAG = "2.11", "cu130"
RELEASE_URL = "https://github.com/mjun0812/flash-attention-prebuild-wheels/releases/download/v0.9.4"
#: CPython versions that release has a Linux x86_64 wheel for (the URL check below is what decides)
PREBUILT_PYTHONS = ("3.10", "3.11", "3.12", "3.13")
#: the version verl's own installer points at this release with
RECOMMENDED_PYTHON = "3.12"
CHECK_TIMEOUT_S = 30


def wheel_url(python: str, release_url: str = RELEASE_URL) -> str:
    tag = "cp" + python.replace(".", "")
    return f"{release_url}/flash_attn-{FLASH_ATTN}+{CUDA_TAG}torch{TORCH_MINOR}-{tag}-{tag}-linux_x86_64.whl"


class _KeepHead(urllib.request.HTTPRedirectHandler):
    """Release downloads redirect to a storage host; urllib would follow with a GET and fetch the whole wheel."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        follow = super().redirect_request(req, fp, code, msg, headers, newurl)
        if follow is not None:
            follow.method = req.get_method()
        return follow


def url_problem(url: str, timeout: float = CHECK_TIMEOUT_S) -> str | None:
    """None when ``url`` answers a HEAD request (after redirects) with success, else what went wrong."""
    opener = urllib.request.build_opener(_KeepHead)
    try:
        with opener.open(urllib.request.Request(url, method="HEAD"), timeout=timeout):
            return None
    except urllib.error.HTTPError as exc:
        return f"HTTP {exc.code}"
    except (urllib.error.URLError, OSError) as exc:
        return f"unreachable ({getattr(exc, 'reason', exc)})"


def no_wheel_message(python: str, url: str, problem: str) -> str:
    return (
        f"no prebuilt flash-attn {FLASH_ATTN} wheel for Python {python} at {url} ({problem}). Prebuilt for torch "
        f"{TORCH_MINOR} + CUDA 13: Python {', '.join(PREBUILT_PYTHONS)}; recommended: a venv made with "
        f"python{RECOMMENDED_PYTHON}."
    )


def nvcc_path() -> str | None:
    """The nvcc torch's extension builder would use: $CUDA_HOME's (or $CUDA_PATH's) when set, else the one on
    PATH, else /usr/local/cuda's."""
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home:
        candidate = os.path.join(home, "bin", "nvcc")
        return candidate if os.access(candidate, os.X_OK) else None
    found = shutil.which("nvcc")
    if found:
        return found
    default = "/usr/local/cuda/bin/nvcc"
    return default if os.access(default, os.X_OK) else None


def nvcc_release(nvcc: str) -> str | None:
    """'13.0' from ``nvcc --version``'s "release 13.0, V13.0.88" line."""
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    match = re.search(r"release (\d+\.\d+)", out)
    return match.group(1) if match else None


def torch_cuda() -> str | None:
    try:
        import torch
    except ImportError:
        return None
    return torch.version.cuda


def source_build_problems(nvcc: str | None, nvcc_version: str | None, torch_cuda_version: str | None) -> list[str]:
    """What stops a source build before it starts: no nvcc, or a toolkit whose CUDA major differs from torch's
    (torch's extension builder refuses it, after the download)."""
    if nvcc is None:
        return ["nvcc not found (set CUDA_HOME to a CUDA toolkit, or put its bin/ on PATH)"]
    if nvcc_version and torch_cuda_version and nvcc_version.split(".")[0] != torch_cuda_version.split(".")[0]:
        return [
            f"{nvcc} is CUDA {nvcc_version} but torch is built with CUDA {torch_cuda_version}: the majors must match"
        ]
    return []


def source_build_requirements() -> str:
    return (
        f"building flash-attn {FLASH_ATTN} from source needs: nvcc from a CUDA 13.x toolkit (torch {TORCH_MINOR} is "
        "built with CUDA 13.0), a C++ compiler, ninja, and 20-30 minutes on many cores; ninja runs one compile job "
        "per core, each can take several GB of RAM: set MAX_JOBS (e.g. MAX_JOBS=4) on a machine with less than ~96 GB"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    url_cmd = sub.add_parser("url", help="print this Python's prebuilt wheel URL if it exists")
    url_cmd.add_argument("--python", default=f"{sys.version_info[0]}.{sys.version_info[1]}")
    url_cmd.add_argument("--release-url", default=os.environ.get("SEAL_FLASH_ATTN_RELEASE_URL", RELEASE_URL))
    sub.add_parser("source-build", help="name what a source build needs; fail when it cannot start")
    args = parser.parse_args(argv)
    if args.command == "url":
        url = wheel_url(args.python, args.release_url)
        problem = url_problem(url)
        if problem:
            print(no_wheel_message(args.python, url, problem), file=sys.stderr)
            return 1
        print(url)
        return 0
    print(source_build_requirements(), file=sys.stderr)
    nvcc = nvcc_path()
    problems = source_build_problems(nvcc, nvcc_release(nvcc) if nvcc else None, torch_cuda())
    for problem in problems:
        print(f"cannot build flash-attn: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())

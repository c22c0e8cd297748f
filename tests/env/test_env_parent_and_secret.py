"""The service's process and file hygiene: ``serve --parent-pid`` follows the named process itself (not
its place in the process tree), refuses at start when it cannot, and removes the secret file only once that process is
gone; the secret file is written and read only where no one else can swap it (0600, a folder others cannot write, no
symbolic link at its path)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from env_service.http.auth import read_secret_file
from env_service.workers.parent_watch import EXIT_ORPHANED
from seal.eval.serve import free_port
from seal.launch.service import write_secret

REPO = Path(__file__).resolve().parents[2]
SECRET = "correct horse battery staple"


def _serve(parent_pid: int, secret_file: Path, port: int, wrapper: bool) -> subprocess.Popen:
    command = (
        f"{sys.executable} -m env_service serve --workers 0 --log-level warning --port {port} "
        f"--secret-file {secret_file} --parent-pid {parent_pid}"
    )
    # ``& wait``: the shell forks the service and stays its parent, as a process manager or ``sh -c`` wrapper does
    argv = ["sh", "-c", f"{command} & wait $!"] if wrapper else command.split()
    return subprocess.Popen(argv, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _healthy(port: int) -> bool:
    try:
        return requests.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200
    except requests.ConnectionError:
        return False


def test_a_service_started_through_a_forking_wrapper_follows_the_named_process(tmp_path):
    secret_file = Path(write_secret(tmp_path / "secret", SECRET))
    owner = subprocess.Popen(["sleep", "120"])  # the run's process: alive, and not the service's parent
    port = free_port()
    wrapper = _serve(owner.pid, secret_file, port, wrapper=True)
    try:
        deadline = time.monotonic() + 60
        while not _healthy(port):
            assert wrapper.poll() is None, f"the service exited: {wrapper.communicate()[1][-1500:]}"
            assert time.monotonic() < deadline, "the service did not come up"
            time.sleep(0.2)
        time.sleep(1.5)  # three of the old watch's polls: before, it had exited by now, the secret file removed
        assert _healthy(port) and secret_file.exists()
        owner.kill()
        owner.wait()
        assert wrapper.wait(timeout=20) == EXIT_ORPHANED  # ``wait`` hands the service's exit status on
        assert not secret_file.exists(), "the owner is gone: its secret file goes with its service"
    finally:
        owner.kill()
        wrapper.kill()
        wrapper.wait()


def _started(port: int, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + 60
    while not _healthy(port):
        assert proc.poll() is None, f"the service exited: {proc.communicate()[1][-1500:]}"
        assert time.monotonic() < deadline, "the service did not come up"
        time.sleep(0.2)


def test_the_secret_is_removed_from_the_folder_it_was_read_in_even_if_that_folders_path_now_names_another(tmp_path):
    """The run's folder is moved away and its path made a symbolic link to another folder holding a file of the
    secret's name while the service runs: at exit the service removes its secret from the folder it opened at start,
    never the other folder's file (before: it unlinked by path, through the link)."""
    run_dir, victim = tmp_path / "run", tmp_path / "victim"
    run_dir.mkdir(mode=0o700)
    victim.mkdir(mode=0o700)
    (victim / "secret").write_text("someone else's file")
    secret_file = Path(write_secret(run_dir / "secret", SECRET))
    owner = subprocess.Popen(["sleep", "120"])
    port = free_port()
    proc = _serve(owner.pid, secret_file, port, wrapper=False)
    try:
        _started(port, proc)
        run_dir.rename(tmp_path / "moved")
        run_dir.symlink_to(victim, target_is_directory=True)
        owner.kill()
        owner.wait()
        assert proc.wait(timeout=20) == EXIT_ORPHANED
        assert (victim / "secret").read_text() == "someone else's file"
        assert not (tmp_path / "moved" / "secret").exists(), "the secret goes, from the folder it was read in"
    finally:
        owner.kill()
        proc.kill()
        proc.wait()


def test_serve_refuses_a_parent_pid_it_cannot_follow_and_keeps_the_secret_file(tmp_path):
    secret_file = Path(write_secret(tmp_path / "secret", SECRET))
    gone = subprocess.Popen(["true"])
    gone.wait()
    proc = _serve(gone.pid, secret_file, free_port(), wrapper=False)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 2 and f"--parent-pid {gone.pid}" in stderr and "Traceback" not in stderr, stderr
    assert secret_file.read_text() == SECRET  # before: the service started, exited 0.5 s later and removed it


# ---------------------------------------------------------------------------------------------
# The secret file
# ---------------------------------------------------------------------------------------------


def test_the_secret_file_is_created_0600_whatever_the_umask_or_an_earlier_file(tmp_path):
    path = tmp_path / "secret"
    path.write_text("old")
    path.chmod(0o644)
    previous = os.umask(0)
    try:
        write_secret(path, SECRET)
    finally:
        os.umask(previous)
    assert path.stat().st_mode & 0o777 == 0o600 and read_secret_file(str(path)) == SECRET


def test_a_symbolic_link_at_the_secret_files_path_is_refused_by_writer_and_reader(tmp_path):
    target = tmp_path / "elsewhere"
    target.write_text("someone's file")
    target.chmod(0o600)
    link = tmp_path / "secret"
    link.symlink_to(target)
    with pytest.raises(ValueError, match="symbolic link"):
        write_secret(link, SECRET)
    assert target.read_text() == "someone's file"  # before: the secret was written through the link
    with pytest.raises(ValueError, match="symbolic link"):
        read_secret_file(str(link))  # before: read through the link, as if it were the secret file


@pytest.mark.parametrize("mode", [0o777, 0o1777, 0o770])  # world-writable, sticky like /tmp, group-writable
def test_a_secret_file_in_a_folder_others_may_write_is_refused_by_writer_and_reader(tmp_path, mode):
    folder = tmp_path / "shared"
    folder.mkdir()
    written = write_secret(folder / "secret", SECRET)  # while the folder is still private
    folder.chmod(mode)
    with pytest.raises(ValueError, match="other users"):
        write_secret(folder / "another", SECRET)
    assert not (folder / "another").exists()
    with pytest.raises(ValueError, match="other users"):
        read_secret_file(written)


def test_a_secret_file_that_is_not_a_regular_file_is_refused(tmp_path):
    (tmp_path / "secret").mkdir()
    with pytest.raises(ValueError):
        read_secret_file(str(tmp_path / "secret"))

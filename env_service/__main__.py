"""Command line for the environment service.

``python -m env_service serve [--host 127.0.0.1] [--port 8082] [--secret-file FILE]``
    Run the HTTP service (foreground). Any address but loopback needs a shared secret: ``--secret-file``
    (readable by its owner only) or ``$SEAL_ENV_SECRET``.
``python -m env_service prompt TASK_ID --mode train|validate [--config JSON|FILE] [--profile FILE]``
    Print the episode's initial messages as JSON ``{"messages": [...]}`` (what the model sees first).
``python -m env_service score --input FILE.jsonl [--output OUT.jsonl]``
    Score ``{"id", "turns": [[{"name", "arguments"}, ...], ...]}`` records with the verifier; one
    JSON verdict per line. Every malformed line (bad JSON, nested too deeply, a bad record) is reported
    with its number and exits 2, with nothing written; ``--output`` must not be the input, and is
    replaced atomically (a temporary file beside it, then a rename).
``python -m env_service replay [--split heldout] [--concurrency N] [--url URL] [--mode validate]``
    Replay the ground truth through the full episode mechanics (in-process, or against a running
    service with ``--url``) and print a per-category pass table. Exit 0 when every task passes or
    fails as expected (see ``replay.EXPECTED_FAILURES``), 1 on errors or unexpected failures.

Exit codes: 0 ok, 1 failure (replay), 2 bad input or usage.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
from dataclasses import fields
from typing import Any

from env_service.files import atomic_write_text
from env_service.vocabulary import EPISODE_MODES, MODE_VALIDATE

EXIT_OK, EXIT_FAIL, EXIT_USAGE = 0, 1, 2


class CliError(Exception):
    """A user error: printed as one line on stderr, exit code 2."""


# ---------------------------------------------------------------------------------------------
# Config / profile loading
# ---------------------------------------------------------------------------------------------


def load_params(value: str | None) -> dict:
    """``--config``: inline JSON, or a JSON/YAML file; a full recipe is reduced to ``env_service.bfcl``."""
    if not value:
        return {}
    if os.path.isfile(value):
        data = _load_file(value)
    else:
        try:
            data = json.loads(value)
        except json.JSONDecodeError as error:
            raise CliError(f"--config: {value!r} is neither a file nor valid JSON ({error})") from None
    if isinstance(data, dict) and isinstance(data.get("env_service"), dict):
        data = data["env_service"].get("bfcl", {})
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise CliError(f"--config must be a JSON/YAML mapping, got {type(data).__name__}")
    return data


def _load_file(path: str) -> Any:
    with open(path, encoding="utf-8") as handle:
        text = handle.read()
    if path.endswith((".yaml", ".yml")):
        import yaml

        try:
            return yaml.safe_load(text)
        except yaml.YAMLError as error:
            raise CliError(f"{path}: invalid YAML: {error}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise CliError(f"{path}: invalid JSON: {error}") from None


# ---------------------------------------------------------------------------------------------
# Commands
# ---------------------------------------------------------------------------------------------


def cmd_serve(args) -> int:
    from env_service.episodes.manager import EpisodeManager
    from env_service.http.auth import check_bind, resolve_secret
    from env_service.http.limits import HttpLimits
    from env_service.http.service import serve

    if args.parent_pid:
        _exit_with_owner(args.parent_pid, args.secret_file)
    try:
        secret = resolve_secret(secret_file=args.secret_file)
        check_bind(args.host, secret)
    except ValueError as error:
        raise CliError(str(error)) from None
    given = {
        name: getattr(args, name)
        for name in (
            "max_header_bytes",
            "max_headers",
            "read_timeout_s",
            "max_connections",
            "max_connections_per_peer",
            "max_requests_per_owner",
            "max_run_ids_per_peer",
            "max_pipelined_requests",
            "max_body_bytes_in_flight",
            "write_timeout_s",
            "max_answer_bytes_in_flight",
        )
        if getattr(args, name) is not None
    }
    try:
        limits = HttpLimits.serving(args.peak_episodes, **given)
    except ValueError as error:
        raise CliError(str(error)) from None
    from env_service.bfcl.config import ServiceLimits

    try:
        service_limits = ServiceLimits.from_dict(
            {f.name: getattr(args, f.name) for f in fields(ServiceLimits) if getattr(args, f.name) is not None}
        )
    except ValueError as error:
        raise CliError(str(error)) from None
    if args.workers is None:
        from env_service.workers.sizing import size_workers

        sizing = size_workers(args.peak_episodes)
        print(f"env_service serve: {sizing.describe()}", file=sys.stderr, flush=True)  # the service's log says why
        workers = sizing.workers
    else:
        workers = args.workers
    manager = EpisodeManager(limits=service_limits, workers=workers)
    serve(
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        manager=manager,
        access_log=args.access_log,
        secret=secret,
        service_id=args.service_id,
        limits=limits,
        fd=args.fd,
    )
    return EXIT_OK


def _exit_with_owner(parent_pid: int, secret_file: str | None) -> None:
    """A service started for one process's run: it ends with that process, and takes the run's secret file along
    (the owner cannot remove it when it was SIGKILLed). Refused at once when that process cannot be watched (it is not
    there): a service that cannot tell when its run ends must not start as if it could."""
    from env_service.workers.parent_watch import CannotWatch, exit_with_parent

    remove_secret = _secret_remover(secret_file) if secret_file else None
    try:
        exit_with_parent(parent_pid, on_exit=remove_secret)
    except CannotWatch as error:
        raise CliError(f"--parent-pid {parent_pid}: {error}") from None


def _secret_remover(secret_file: str):
    """What removes ``secret_file`` at exit: an unlink of its name in the folder it is in now, opened now. Its path is
    read again at exit no more: by then the folder may have been moved and its path made a link to another folder,
    and an unlink by path removed that folder's file of the same name."""
    folder, name = os.path.split(os.path.abspath(secret_file))
    try:
        folder_fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0))
    except OSError as error:
        raise CliError(f"--secret-file {secret_file}: its folder: {error.strerror}") from None

    def remove_secret() -> None:
        with contextlib.suppress(OSError):
            os.unlink(name, dir_fd=folder_fd)

    return remove_secret


def cmd_prompt(args) -> int:
    from env_service.client import EnvServiceError, InProcessEnvClient

    client = InProcessEnvClient()
    if args.profile:
        profile = _load_file(args.profile)
        try:
            client.set_profile(profile)
        except EnvServiceError as error:
            raise CliError(f"--profile: {error.message}") from None
    try:
        created = client.create(args.task_id, args.mode, load_params(args.config))
    except EnvServiceError as error:
        raise CliError(error.message) from None
    client.release(created["instance_id"])
    json.dump({"messages": created["messages"]}, sys.stdout, ensure_ascii=False, indent=args.indent)
    sys.stdout.write("\n")
    return EXIT_OK


def _read_records(path: str) -> tuple[list[tuple[int, dict]], list[tuple[int, str]]]:
    """All non-blank lines as (line number, object), and (line number, problem) per malformed line."""
    records, problems = [], []
    try:
        handle = open(path, encoding="utf-8")
    except OSError as error:
        raise CliError(f"--input: cannot read {path}: {error.strerror}") from None
    with handle:
        try:
            for number, line in enumerate(handle, start=1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as error:
                    problems.append((number, f"{path}:{number}: invalid JSON ({error.msg}, column {error.colno})"))
                    continue
                except RecursionError:
                    problems.append((number, f"{path}:{number}: JSON nested too deeply"))
                    continue
                if not isinstance(record, dict):
                    problems.append((number, f"{path}:{number}: expected a JSON object, got {type(record).__name__}"))
                    continue
                records.append((number, record))
        except UnicodeDecodeError as error:
            problems.append((0, f"{path}: not UTF-8 text ({error.reason} at byte {error.start})"))
    return records, problems


def cmd_score(args) -> int:
    from env_service.bfcl.verifier import score_record

    to_file = bool(args.output) and args.output != "-"
    if to_file and _same_file(args.input, args.output):
        raise CliError(f"--output {args.output!r} is the input file; write the verdicts elsewhere")
    outputs = []
    records, problems = _read_records(args.input)
    for number, record in records:
        try:
            outputs.append(json.dumps(score_record(record), ensure_ascii=False) + "\n")
        except RecursionError:
            problems.append((number, f"{args.input}:{number}: record nested too deeply"))
        except (ValueError, KeyError, TypeError, AttributeError) as error:
            message = error.args[0] if error.args else type(error).__name__
            problems.append((number, f"{args.input}:{number}: {message}"))
    _raise_problems([text for _, text in sorted(problems)])
    if to_file:
        _write_atomically(args.output, "".join(outputs))
    else:
        sys.stdout.write("".join(outputs))
    return EXIT_OK


def _raise_problems(problems: list[str]) -> None:
    if problems:
        more = f"\n... and {len(problems) - 20} more" if len(problems) > 20 else ""
        raise CliError("\n".join(problems[:20]) + more)


def _same_file(a: str, b: str) -> bool:
    """True when ``a`` and ``b`` name one file (same path, a symlink or a hard link to it)."""
    try:
        return os.path.samefile(a, b)
    except OSError:  # ``b`` does not exist yet
        return os.path.realpath(a) == os.path.realpath(b)


def _write_atomically(path: str, text: str) -> None:
    try:
        atomic_write_text(path, text)
    except OSError as error:
        raise CliError(f"--output: cannot write {path}: {error.strerror}") from None


def cmd_replay(args) -> int:
    from env_service import replay
    from env_service.bfcl.config import EnvConfig
    from env_service.client import EnvClient, EnvServiceError, make_client
    from env_service.http.auth import resolve_secret

    task_ids = _replay_task_ids(args)
    params = load_params(args.config)
    try:
        EnvConfig.from_dict(params)
    except ValueError as error:
        raise CliError(f"--config: {error}") from None
    try:
        secret = resolve_secret(secret_file=args.secret_file)
        # one pooled connection per replay thread: fewer would serialise them, more would sit idle
        client = make_client(args.url, secret=secret, pool_size=args.concurrency)
        if args.url:  # fail fast, with one clear line, when the service is not there
            with EnvClient(args.url, timeout_s=10, retries=1, backoff_s=0.2) as probe:
                probe.health()
    except (ValueError, EnvServiceError) as error:
        raise CliError(f"--url: {error}") from None
    with client:
        results = replay.replay_split(
            client, task_ids, concurrency=args.concurrency, mode=args.mode, params=params, progress=not args.no_progress
        )
    report = replay.summarize(results)
    print(replay.format_report(report))
    skipped = sum(r.error == replay.SKIPPED_UNREACHABLE for r in results)
    if skipped:
        print(
            f"error: the service at {args.url} stopped answering; {skipped} of {len(results)} tasks were not replayed",
            file=sys.stderr,
        )
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump({"summary": report, "results": [r.to_dict() for r in results]}, handle, indent=1)
    return EXIT_OK if report["ok"] else EXIT_FAIL


def _replay_task_ids(args) -> list[str]:
    from env_service.bfcl import tasks

    if args.tasks:
        return list(args.tasks)
    ids = tasks.task_ids(args.split)
    if args.category:
        wanted = {f"multi_turn_{c}_" for c in args.category}
        ids = [t for t in ids if any(t.startswith(w) and t[len(w) :].isdigit() for w in wanted)]
    if args.limit is not None:
        ids = _spread(ids, args.limit)
    return ids


def _spread(ids: list[str], limit: int) -> list[str]:
    """``limit`` ids taken round-robin over categories, so a small sample still covers all four."""
    from env_service.bfcl import tasks

    by_category: dict[str, list[str]] = {}
    for task_id in ids:
        by_category.setdefault(tasks.parse_task_id(task_id)[0], []).append(task_id)
    picked, queues = [], [list(v) for v in by_category.values()]
    while len(picked) < limit and any(queues):
        for queue in queues:
            if queue and len(picked) < limit:
                picked.append(queue.pop(0))
    return picked


# ---------------------------------------------------------------------------------------------
# Parser
# ---------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m env_service", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the HTTP service")
    serve.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8082)
    serve.add_argument(
        "--fd",
        type=int,
        help="serve this inherited listening socket instead of binding --host/--port (the launcher holds its "
        "service's port this way: a restarted service answers at the same address, and no other server can take it)",
    )
    serve.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    serve.add_argument("--access-log", action="store_true", help="log every request")
    serve.add_argument(
        "--workers",
        type=int,
        help="episode processes (default: one per usable CPU, at most one per --peak-episodes, within a share of the memory available; 0: in the service process, without time budgets)",
    )
    from env_service.bfcl.config import ServiceLimits  # budgets and limits: one flag per field, README "Limits"

    for f in fields(ServiceLimits):
        serve.add_argument("--" + f.name.replace("_", "-"), type=type(f.default), help=f"default {f.default}")
    serve.add_argument(
        "--secret-file",
        help="file holding the shared secret required on every endpoint "
        "but /health (default: $SEAL_ENV_SECRET; none on loopback)",
    )
    serve.add_argument(
        "--service-id",
        help="an identity /health echoes, so whoever started the service can tell it from another one on the same port",
    )
    serve.add_argument(
        "--parent-pid",
        type=int,
        help="the process this service was started for (the launcher passes its own): when that process is gone (it "
        "is watched itself, by a pidfd or its start time, whatever wraps this service), the service and its workers "
        "exit and --secret-file is removed; refused at start when there is no such process",
    )
    # HTTP limits: unset flags keep env_service.http.limits.HttpLimits' defaults
    serve.add_argument("--max-header-bytes", type=int, help="request line + headers, bytes (431 beyond; 64 KiB)")
    serve.add_argument("--max-headers", type=int, help="headers per request (431 beyond; 100)")
    serve.add_argument(
        "--read-timeout-s", type=float, help="a request must arrive complete within this long (408 beyond; 30 s)"
    )
    serve.add_argument("--max-connections", type=int, help="open connections + requests in flight (503 beyond; 2048)")
    serve.add_argument(
        "--max-connections-per-peer",
        type=int,
        help="open connections of one address (all of loopback is one); beyond it idle ones and ones still "
        "receiving their request are shed, the longest waiting first (1024)",
    )
    serve.add_argument(
        "--max-requests-per-owner",
        type=int,
        help="requests of one client address in flight at once, all its run ids together (all of loopback is one "
        "address, an IPv6 /64 is one; 429 beyond; 96, or as --peak-episodes sets)",
    )
    serve.add_argument(
        "--peak-episodes",
        type=int,
        help="episodes the main client (the trainer this service is started for) runs at once: the per-client "
        "requests in flight, connections per address and connections are raised to 2 requests each (an explicit "
        "limit flag wins); the launcher passes the recipe's",
    )
    serve.add_argument(
        "--max-run-ids-per-peer", type=int, help="run ids one client address may use at once (429 beyond; 16)"
    )
    serve.add_argument(
        "--max-pipelined-requests",
        type=int,
        help="requests of one connection parsed and unanswered; the connection is not read beyond them (4)",
    )
    serve.add_argument(
        "--max-body-bytes-in-flight",
        type=int,
        help="declared request bodies and held-back pipelined bytes of all connections together; waiting ones are "
        "shed to make room, else 503 before the body is read (64 MiB)",
    )
    serve.add_argument(
        "--write-timeout-s",
        type=float,
        help="an answer must be taken by its client within this long of being written, else the connection is "
        "dropped (reset) (30 s)",
    )
    serve.add_argument(
        "--max-answer-bytes-in-flight",
        type=int,
        help="answer bytes held for clients that have not taken them, all connections together; beyond, the "
        "connections holding theirs the longest are dropped (64 MiB)",
    )
    serve.set_defaults(func=cmd_serve)

    prompt = sub.add_parser("prompt", help="print an episode's initial messages")
    prompt.add_argument("task_id")
    prompt.add_argument("--mode", choices=EPISODE_MODES, required=True)
    prompt.add_argument(
        "--config", help="env config: inline JSON or a JSON/YAML file (a recipe file is reduced to env_service.bfcl)"
    )
    prompt.add_argument("--profile", help="failure profile JSON file (capability cues, train mode)")
    prompt.add_argument("--indent", type=int, default=None)
    prompt.set_defaults(func=cmd_prompt)

    score = sub.add_parser("score", help="score trajectories with the verifier")
    score.add_argument("--input", required=True, help='JSONL of {"id", "turns"} records')
    score.add_argument("--output", help="output JSONL (default stdout)")
    score.set_defaults(func=cmd_score)

    rep = sub.add_parser("replay", help="replay the ground truth through full episodes")
    rep.add_argument("--split", default="heldout", choices=["train", "val", "test", "heldout", "all"])
    rep.add_argument("--category", action="append", choices=["base", "miss_func", "miss_param", "long_context"])
    rep.add_argument("--tasks", nargs="+", help="explicit task ids (overrides --split)")
    rep.add_argument("--limit", type=int, help="at most N tasks, spread over the categories")
    rep.add_argument("--concurrency", type=int, default=1)
    rep.add_argument("--url", help="env service URL (default: in-process)")
    rep.add_argument("--secret-file", help="the service's shared secret (default: $SEAL_ENV_SECRET)")
    rep.add_argument("--mode", default=MODE_VALIDATE, choices=EPISODE_MODES)
    rep.add_argument("--config", help="env config: inline JSON or a JSON/YAML file")
    rep.add_argument("--json", help="write per-task results to this JSON file")
    rep.add_argument("--no-progress", action="store_true", help="no progress bar")
    rep.set_defaults(func=cmd_replay)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    limit = getattr(args, "limit", None)
    if getattr(args, "concurrency", 1) < 1 or (limit is not None and limit < 1):
        print("error: --concurrency and --limit must be >= 1", file=sys.stderr)
        return EXIT_USAGE
    try:
        return args.func(args)
    except CliError as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_USAGE
    except BrokenPipeError:  # e.g. piped into `head`
        return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())

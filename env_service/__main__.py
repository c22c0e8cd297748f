"""Command line for the environment service.

``python -m env_service serve [--host 127.0.0.1] [--port 8082]``
    Run the HTTP service (foreground).
``python -m env_service prompt TASK_ID --mode train|validate [--config JSON|FILE] [--profile FILE]``
    Print the episode's initial messages as JSON ``{"messages": [...]}`` (what the model sees first).
``python -m env_service score --input FILE.jsonl [--output OUT.jsonl]``
    Score ``{"id", "turns": [[{"name", "arguments"}, ...], ...]}`` records with the verifier; one
    JSON verdict per line. A malformed line is reported with its number and exits 2 (nothing written).
``python -m env_service replay [--split heldout] [--concurrency N] [--url URL] [--mode validate]``
    Replay the ground truth through the full episode mechanics (in-process, or against a running
    service with ``--url``) and print a per-category pass table. Exit 0 when every task passes or
    fails as expected (see ``replay.EXPECTED_FAILURES``), 1 on errors or unexpected failures.

Exit codes: 0 ok, 1 failure (replay), 2 bad input or usage.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import Any

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
    from env_service.manager import EpisodeManager
    from env_service.service import serve

    manager = EpisodeManager(max_episodes=args.max_episodes, idle_timeout_s=args.idle_timeout_s,
                             reclaim_interval_s=args.reclaim_interval_s)
    serve(host=args.host, port=args.port, log_level=args.log_level, manager=manager,
          access_log=args.access_log)
    return EXIT_OK


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


def _read_records(path: str) -> list[tuple[int, dict]]:
    """All non-blank lines as (line number, object); every malformed line is reported at once."""
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
                    problems.append(f"{path}:{number}: invalid JSON ({error.msg}, column {error.colno})")
                    continue
                if not isinstance(record, dict):
                    problems.append(f"{path}:{number}: expected a JSON object, got {type(record).__name__}")
                    continue
                records.append((number, record))
        except UnicodeDecodeError as error:
            problems.append(f"{path}: not UTF-8 text ({error.reason} at byte {error.start})")
    if problems:
        more = f"\n... and {len(problems) - 20} more" if len(problems) > 20 else ""
        raise CliError("\n".join(problems[:20]) + more)
    return records


def cmd_score(args) -> int:
    from env_service.verifier import score_record

    outputs = []
    for number, record in _read_records(args.input):
        try:
            outputs.append(score_record(record))
        except (ValueError, KeyError, TypeError) as error:
            message = error.args[0] if error.args else type(error).__name__
            raise CliError(f"{args.input}:{number}: {message}") from None
    text = "".join(json.dumps(out, ensure_ascii=False) + "\n" for out in outputs)
    if args.output and args.output != "-":
        with open(args.output, "w", encoding="utf-8") as handle:
            handle.write(text)
    else:
        sys.stdout.write(text)
    return EXIT_OK


def cmd_replay(args) -> int:
    from env_service import replay
    from env_service.client import EnvClient, EnvServiceError, make_client

    from env_service.config import EnvConfig

    task_ids = _replay_task_ids(args)
    params = load_params(args.config)
    try:
        EnvConfig.from_dict(params)
    except ValueError as error:
        raise CliError(f"--config: {error}") from None
    try:
        client = make_client(args.url)
        if args.url:  # fail fast, with one clear line, when the service is not there
            with EnvClient(args.url, timeout_s=10, retries=1, backoff_s=0.2) as probe:
                probe.health()
    except (ValueError, EnvServiceError) as error:
        raise CliError(f"--url: {error}") from None
    with client:
        results = replay.replay_split(client, task_ids, concurrency=args.concurrency, mode=args.mode,
                                      params=params, progress=not args.no_progress)
    report = replay.summarize(results)
    print(replay.format_report(report))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump({"summary": report, "results": [r.to_dict() for r in results]}, handle, indent=1)
    return EXIT_OK if report["ok"] else EXIT_FAIL


def _replay_task_ids(args) -> list[str]:
    from env_service import tasks

    if args.tasks:
        return list(args.tasks)
    ids = tasks.task_ids(args.split)
    if args.category:
        wanted = {f"multi_turn_{c}_" for c in args.category}
        ids = [t for t in ids if any(t.startswith(w) and t[len(w):].isdigit() for w in wanted)]
    if args.limit is not None:
        ids = _spread(ids, args.limit)
    return ids


def _spread(ids: list[str], limit: int) -> list[str]:
    """``limit`` ids taken round-robin over categories, so a small sample still covers all four."""
    from env_service import tasks

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
    parser = argparse.ArgumentParser(prog="python -m env_service", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the HTTP service")
    serve.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8082)
    serve.add_argument("--log-level", default="info",
                       choices=["critical", "error", "warning", "info", "debug"])
    serve.add_argument("--access-log", action="store_true", help="log every request")
    serve.add_argument("--max-episodes", type=int, default=4096)
    serve.add_argument("--idle-timeout-s", type=float, default=3600.0)
    serve.add_argument("--reclaim-interval-s", type=float, default=300.0)
    serve.set_defaults(func=cmd_serve)

    prompt = sub.add_parser("prompt", help="print an episode's initial messages")
    prompt.add_argument("task_id")
    prompt.add_argument("--mode", choices=["train", "validate"], required=True)
    prompt.add_argument("--config", help="env config: inline JSON or a JSON/YAML file (a recipe "
                                         "file is reduced to env_service.bfcl)")
    prompt.add_argument("--profile", help="failure profile JSON file (capability cues, train mode)")
    prompt.add_argument("--indent", type=int, default=None)
    prompt.set_defaults(func=cmd_prompt)

    score = sub.add_parser("score", help="score trajectories with the verifier")
    score.add_argument("--input", required=True, help='JSONL of {"id", "turns"} records')
    score.add_argument("--output", help="output JSONL (default stdout)")
    score.set_defaults(func=cmd_score)

    rep = sub.add_parser("replay", help="replay the ground truth through full episodes")
    rep.add_argument("--split", default="heldout", choices=["train", "val", "test", "heldout", "all"])
    rep.add_argument("--category", action="append",
                     choices=["base", "miss_func", "miss_param", "long_context"])
    rep.add_argument("--tasks", nargs="+", help="explicit task ids (overrides --split)")
    rep.add_argument("--limit", type=int, help="at most N tasks, spread over the categories")
    rep.add_argument("--concurrency", type=int, default=1)
    rep.add_argument("--url", help="env service URL (default: in-process)")
    rep.add_argument("--mode", default="validate", choices=["validate", "train"])
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

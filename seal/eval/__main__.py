"""Evaluate a model on BFCL multi-turn: the paper's table, the failure profile, and bfcl-eval's own score.

    python -m seal.eval checkpoint [--model PATH_OR_HUB_ID] [--conf exp/SEAL.yaml] [task options] [-- overrides]
    python -m seal.eval endpoint --endpoint http://host:8000/v1 --model NAME [--api-key KEY] [task options]
    python -m seal.eval endpoint --serve CHECKPOINT --model NAME [--tool-call-parser hermes] [task options]
    python -m seal.eval report --out DIR

Task options: ``--tasks heldout|train|all`` (default heldout), ``--category base``, ``--ids a,b,...``,
``--limit N`` (per category), ``--max-model-calls N``. Everything goes under ``--out`` (default
``eval_results/<name>``): ``results.jsonl`` (one line per task, appended as each finishes; a rerun skips the
finished ones), ``table.{md,csv,json}``, ``failure_profile.{md,json}`` and ``bfcl/`` (bfcl-eval's result files
and its own scores, ``bfcl/score.json``; ``--no-bfcl`` skips it).

Out-of-distribution (evaluate-only, ``endpoint`` only): ``--category memory_kv,memory_rec_sum`` (also
``memory_vector``, ``web_search_base``, ``web_search_no_snippet``) runs bfcl's memory / web-search questions;
a category that cannot run here is skipped with its reason (``seal/eval/ood.py``). ``--categories
tau2_retail,tau2_airline,tau2_telecom`` (or ``--ids tau2_retail_5,...``) runs tau2-bench with tau2's own
environments, user simulator and evaluator, the user played by ``--user-endpoint``/``--user-model``
(``seal/eval/tau2.py``; needs ``bash scripts/install.sh tau2``). ``--serve`` serves a checkpoint with vLLM for the
evaluation's length: started, watched and stopped here (``seal/eval/serve.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys

from env_service.bfcl.ood_tasks import OOD_CATEGORIES, is_ood_task
from seal.eval import serve
from seal.eval.tasks import SELECTIONS, select_tasks
from seal.results import tables
from seal.results.records import describe_failures, finished_tasks, load_records
from seal.results.tau2_tasks import TAU2_CATEGORIES, split_tau2_task_id

RESULTS_FILE = "results.jsonl"


def _task_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tasks", default="heldout", choices=SELECTIONS, help="which split (default: heldout)")
    parser.add_argument(
        "--category",
        "--categories",
        dest="category",
        help="comma-separated categories: base, miss_func, miss_param, long_context, or the out-of-distribution "
        f"{', '.join(OOD_CATEGORIES + TAU2_CATEGORIES)} (endpoint only)",
    )
    parser.add_argument("--ids", help="comma-separated task ids (overrides --tasks)")
    parser.add_argument("--limit", type=int, help="the first N tasks of each category")
    parser.add_argument("--max-model-calls", type=int, help="model calls per episode (default: the recipe's, 20)")
    parser.add_argument("--out", help="output folder (default: eval_results/<name>)")
    parser.add_argument("--name", help="the row name in the table (default: from the model)")
    parser.add_argument("--no-bfcl", action="store_true", help="do not score with bfcl-eval's own evaluate")
    parser.add_argument("--no-progress", action="store_true")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m seal.eval", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    ckpt = sub.add_parser("checkpoint", help="a checkpoint or hub id through training's validation path")
    ckpt.add_argument("--model", help="HF checkpoint dir or hub id (default: the recipe's model)")
    ckpt.add_argument("--conf", help="recipe (default: exp/SEAL.yaml with a GPU, exp/cpu_tiny.yaml without)")
    ckpt.add_argument("overrides", nargs="*", help="extra Hydra overrides for the recipe")
    _task_args(ckpt)
    api = sub.add_parser("endpoint", help="an OpenAI-compatible chat endpoint")
    where = api.add_mutually_exclusive_group(required=True)
    where.add_argument("--endpoint", help="base URL of a running server, e.g. http://127.0.0.1:8000/v1")
    where.add_argument(
        "--serve",
        metavar="CHECKPOINT",
        help="serve this Hugging Face checkpoint (or hub id) with `vllm serve` for this evaluation: started, watched "
        "and stopped here (seal/eval/serve.py; its log: serve.log under --out)",
    )
    api.add_argument("--model", required=True, help="the model name the endpoint serves (with --serve: its name)")
    api.add_argument(
        "--tool-call-parser",
        default=serve.DEFAULT_TOOL_CALL_PARSER,
        help="with --serve: vLLM's tool-call parser (hermes for Qwen2.5, pythonic for ToolACE-2)",
    )
    api.add_argument(
        "--max-model-len", type=int, default=serve.DEFAULT_MAX_MODEL_LEN, help="with --serve: the served context"
    )
    api.add_argument(
        "--tokenizer",
        help="the served model's tokenizer (a folder, or a hub id in the local cache), whose control strings are "
        "escaped in the environment's text before it is sent, as in training (default: the --serve checkpoint, else "
        "--model)",
    )
    api.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="default: $OPENAI_API_KEY")
    api.add_argument("--max-tokens", type=int, default=1024, help="tokens per model call")
    api.add_argument("--concurrency", type=int, default=4, help="episodes in flight")
    api.add_argument("--env-url", help="a running environment service (default: one in this process)")
    api.add_argument("--env-secret-file", help="that service's shared secret (default: $SEAL_ENV_SECRET)")
    api.add_argument("--tool-prompt-mode", default="bfcl_qwen_fc", help="bfcl_qwen_fc or toolace_llama")
    api.add_argument("--user-endpoint", help="tau2: the OpenAI-compatible server that plays the user")
    api.add_argument("--user-model", help="tau2: the user simulator's model name on that server")
    api.add_argument("--user-api-key", default=os.environ.get("SEAL_TAU2_USER_API_KEY"))
    api.add_argument("--judge-endpoint", help="tau2: a server for its optional repetition judge")
    api.add_argument("--judge-model", help="tau2: the judge's model name (default: no judge)")
    api.add_argument("--judge-api-key", default=os.environ.get("SEAL_TAU2_JUDGE_API_KEY"))
    _task_args(api)
    rep = sub.add_parser("report", help="table, failure profile and bfcl score of an existing results file")
    rep.add_argument("--out", required=True)
    rep.add_argument("--name")
    rep.add_argument("--no-bfcl", action="store_true")
    return parser


def _name(args) -> str:
    if args.name:
        return args.name
    model = getattr(args, "model", None) or "model"
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", model.rstrip("/").split("/")[-1] if os.path.isdir(model) else model)


def _split_tau2(args) -> tuple[list[str], list[str]]:
    """(tau2 categories, tau2 task ids) of ``--categories``/``--ids``; they are removed from ``args``."""
    ids = [t.strip() for t in args.ids.split(",") if t.strip()] if args.ids else []
    categories = [c.strip() for c in (args.category or "").split(",") if c.strip()]
    tau2_ids = [t for t in ids if split_tau2_task_id(t)]
    tau2_categories = [c for c in categories if c in TAU2_CATEGORIES]
    args.ids = ",".join(t for t in ids if t not in tau2_ids) or None
    args.category = ",".join(c for c in categories if c not in tau2_categories) or None
    return tau2_categories, tau2_ids


def _pending(args, results_path: str) -> tuple[list[str], list[str]]:
    """(multi-turn tasks, out-of-distribution questions) selected and not yet in the results file."""
    from seal.eval.ood import select_ood

    ids = [t.strip() for t in args.ids.split(",") if t.strip()] if args.ids else []
    categories = [c.strip() for c in (args.category or "").split(",") if c.strip()]
    ood_categories = [c for c in categories if c in OOD_CATEGORIES]
    ood_ids = [t for t in ids if is_ood_task(t)]
    categories = [c for c in categories if c not in OOD_CATEGORIES]
    ids = [t for t in ids if not is_ood_task(t)]
    tasks = []
    if categories or ids or not (ood_categories or ood_ids):
        for category in categories or [None]:
            tasks += [t for t in select_tasks(args.tasks, category, ids or None, args.limit) if t not in tasks]
    ood = select_ood(ood_categories, ood_ids, args.limit)
    for reason in ood.skipped.values():
        print(f"[seal.eval] {reason}")
    done = finished_tasks(results_path)
    pending = [t for t in tasks if t not in done]
    ood_pending = [t for t in ood.task_ids if t not in done]
    selected = len(tasks) + len(ood.task_ids)
    print(
        f"[seal.eval] {selected} task(s) selected, {selected - len(pending) - len(ood_pending)} already in "
        f"{results_path}"
    )
    return pending, ood_pending


def _run_tau2(args, categories: list[str], ids: list[str], results_path: str, out_dir: str) -> None:
    """tau2-bench's selected domains (``seal/eval/tau2.py``); an unavailable one is skipped with its reason.
    Raises ``Tau2Failed`` when the tau2 worker stops (the records it wrote are kept)."""
    from tqdm import tqdm

    from seal.eval.tau2 import Tau2Endpoints, run_tau2, select_tau2, unavailable_reason

    endpoints = Tau2Endpoints(
        agent_url=args.endpoint,
        agent_model=args.model,
        user_url=args.user_endpoint,
        user_model=args.user_model,
        judge_url=args.judge_endpoint or args.user_endpoint,
        judge_model=args.judge_model,
        agent_api_key=args.api_key,
        user_api_key=args.user_api_key,
        judge_api_key=args.judge_api_key,
    )
    selection = {}
    for domain, tau2_ids in select_tau2(categories, ids).items():
        reason = unavailable_reason(f"tau2_{domain}", endpoints)
        if reason:
            print(f"[seal.eval] {reason}")
        else:
            selection[domain] = tau2_ids
    if selection:
        with tqdm(desc=f"tau2 {args.model}", disable=args.no_progress, unit="task") as bar:
            done = finished_tasks(results_path)
            run_tau2(
                selection, args.limit, endpoints, results_path, out_dir, done, args.concurrency, lambda _: bar.update()
            )


def finish(out_dir: str, name: str, bfcl: bool = True) -> dict:
    """Write the table and the failure profile; score the same results with bfcl-eval; print the table."""
    results_path = os.path.join(out_dir, RESULTS_FILE)
    summary = tables.write_report(results_path, out_dir, name)
    bfcl_records = [r for r in load_records(results_path) if r["category"] not in TAU2_CATEGORIES]
    if bfcl and bfcl_records:  # tau2's results are scored by tau2 (``seal/eval/tau2.py``), not bfcl
        from seal.eval.bfcl_files import score_with_bfcl

        scores = score_with_bfcl(bfcl_records, os.path.join(out_dir, "bfcl"))
        summary["bfcl_eval"] = scores
        os.makedirs(os.path.join(out_dir, "bfcl"), exist_ok=True)  # no result files when no episode could run
        with open(os.path.join(out_dir, "bfcl", "score.json"), "w") as f:
            json.dump(scores, f, indent=1)
        print(
            "[seal.eval] bfcl-eval's own accuracy: "
            + ", ".join(
                f"{c} {100 * s['accuracy']:.2f}% ({s['correct_count']}/{s['total_count']})" for c, s in scores.items()
            )
        )
    with open(os.path.join(out_dir, "table.md")) as f:
        print(f.read())
    print(
        f"[seal.eval] wrote {out_dir}/table.md, table.csv, table.json, failure_profile.md"
        + (", bfcl/" if bfcl and bfcl_records else "")
    )
    return summary


def main(argv: list[str] | None = None) -> int:
    try:
        return evaluate(build_parser().parse_args(argv))
    except SelectionError as exc:
        print(f"[seal.eval] error: {exc}", file=sys.stderr)
        return 2


class SelectionError(ValueError):
    """Tasks or categories that do not exist."""


def _selected(args, results_path: str) -> tuple[list[str], list[str]]:
    try:
        return _pending(args, results_path)
    except ValueError as exc:  # an unknown task id or category: one line, not a traceback
        raise SelectionError(str(exc)) from None


def _endpoint_selection(args, results_path: str) -> tuple[list[str], list[str], list[str], list[str]]:
    """(tau2 categories, tau2 ids, multi-turn tasks, out-of-distribution questions) still to run."""
    tau2_categories, tau2_ids = _split_tau2(args)
    # only tau2 asked for: nothing else (an empty selection would mean the default held-out tasks)
    only_tau2 = bool(tau2_categories or tau2_ids) and not (args.ids or args.category)
    pending, ood_pending = ([], []) if only_tau2 else _selected(args, results_path)
    if pending or ood_pending:  # their replies are escaped for the served tokenizer: refused before anything is served
        from seal.eval.endpoint import EndpointError, control_text_of

        try:
            control_text_of(_tokenizer_of(args))
        except EndpointError as exc:
            raise SelectionError(str(exc)) from None
    return tau2_categories, tau2_ids, pending, ood_pending


def _tokenizer_of(args) -> str:
    """The served model's tokenizer: ``--tokenizer``, else the checkpoint ``--serve`` serves, else ``--model``."""
    return args.tokenizer or args.serve or args.model


def _run_endpoint(args, out_dir: str, results_path: str, selection) -> int:
    """The endpoint's episodes: the selected multi-turn tasks, out-of-distribution questions and tau2 domains."""
    from seal.eval.endpoint import EndpointSettings, run_endpoint

    tau2_categories, tau2_ids, pending, ood_pending = selection
    settings = EndpointSettings(
        url=args.endpoint,
        model=args.model,
        api_key=args.api_key,
        max_tokens=args.max_tokens,
        max_model_calls=args.max_model_calls or EndpointSettings.max_model_calls,
        tokenizer=_tokenizer_of(args),
    )
    shared = {
        "env_url": args.env_url,
        "env_secret_file": args.env_secret_file,
        "env_params": {"tool_prompt_mode": args.tool_prompt_mode},
        "concurrency": args.concurrency,
        "progress": not args.no_progress,
    }
    if pending:
        run_endpoint(pending, settings, results_path, **shared)
    if ood_pending:
        from seal.eval.endpoint import run_endpoint_ood

        run_endpoint_ood(ood_pending, settings, results_path, out_dir, **shared)
    if tau2_categories or tau2_ids:
        from seal.eval.tau2 import Tau2Failed

        try:
            _run_tau2(args, tau2_categories, tau2_ids, results_path, out_dir)
        except Tau2Failed as error:
            print(f"[seal.eval] tau2: {error}", file=sys.stderr)
            return 1
    return 0


def out_dir_of(args) -> str:
    """``--out``, else ``eval_results/<name>``."""
    return args.out or os.path.join("eval_results", _name(args))


def evaluate(args) -> int:
    """Run the command; 0 when every selected episode ran, 1 when some could not (their tables are written), 2 when
    it was refused before any episode ran (then it leaves no folder it made)."""
    model = args.model if args.command == "checkpoint" else getattr(args, "serve", None)
    if model:
        from seal.launch.preflight import model_problem

        problem, _ = model_problem(model)  # before anything is written, loaded or served
        if problem:
            raise SelectionError(f"--{'model' if args.command == 'checkpoint' else 'serve'} {problem}")
    out_dir = out_dir_of(args)
    made = not os.path.exists(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    try:
        status = _evaluate(args, out_dir)
    except SelectionError:
        _remove_if_empty(out_dir, made)
        raise
    if status == 2:
        _remove_if_empty(out_dir, made)
    return status


def _remove_if_empty(out_dir: str, made: bool) -> None:
    """A folder this command made and that holds no result: removed, so a refused command leaves nothing."""
    if made and not load_records(os.path.join(out_dir, RESULTS_FILE)):
        shutil.rmtree(out_dir, ignore_errors=True)


def _evaluate(args, out_dir: str) -> int:
    name = _name(args)
    results_path = os.path.join(out_dir, RESULTS_FILE)
    if args.command == "endpoint":
        selection = _endpoint_selection(args, results_path)  # an unknown task is refused before anything is served
        if args.serve and any(selection):
            port = serve.free_port()
            argv = serve.vllm_argv(args.serve, args.model, port, args.tool_call_parser, args.max_model_len)
            try:
                with serve.served(argv, f"http://127.0.0.1:{port}/v1", os.path.join(out_dir, "serve.log")) as url:
                    args.endpoint = url
                    status = _run_endpoint(args, out_dir, results_path, selection)
            except serve.ServeFailed as error:
                print(f"[seal.eval] error: {error}", file=sys.stderr)
                return 1
        else:
            status = _run_endpoint(args, out_dir, results_path, selection)
        if status:
            return status
    elif args.command == "checkpoint":
        from seal.eval.checkpoint import run_checkpoint

        tau2_selected = any(_split_tau2(args))
        pending, ood_pending = ([], []) if tau2_selected else _selected(args, results_path)
        if ood_pending or tau2_selected:
            print(
                "[seal.eval] the out-of-distribution categories run through `endpoint` only: "
                "`python -m seal.eval endpoint --serve CHECKPOINT --model NAME ...` serves the checkpoint for them",
                file=sys.stderr,
            )
            return 2
        if pending:
            status = run_checkpoint(
                pending,
                results_path,
                out_dir,
                recipe=args.conf,
                model=args.model,
                max_model_calls=args.max_model_calls,
                extra_overrides=args.overrides,
                progress=not args.no_progress,
            )
            if status:
                return status
    if not load_records(results_path):
        print(f"[seal.eval] no results in {results_path}", file=sys.stderr)
        return 1
    finish(out_dir, name, bfcl=not args.no_bfcl)
    failures = describe_failures(load_records(results_path))
    if failures:  # the tables are written, but they do not cover every selected task: say so, and fail
        print(f"[seal.eval] {failures}; rerun the same command to run them again", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

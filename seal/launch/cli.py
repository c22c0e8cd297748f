"""The launcher's command line: ``python launcher.py --conf RECIPE [overrides ...] [--dry-run [--full-config]]``.

A run composes the recipe, checks it (``checked_config``: refused at the first class of problem), starts its
environment service and trains; ``--dry-run`` runs every check, prints every problem, then what the run would do
(``dry_run``). The help text is the package's (``seal/launch/__init__.py``).
"""

from __future__ import annotations

import argparse
import sys
import threading

from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

import seal.launch
from seal.launch.preflight import Findings, run_checks
from seal.launch.recipe import PreflightError, check_keys, compose_recipe
from seal.launch.run_env import set_run_environment
from seal.launch.service import RunStopped, environment_service


def train(config: DictConfig) -> None:
    set_run_environment(config)
    import ray
    from verl.trainer.main_ppo import run_ppo

    from seal.trainer import CheckpointSaveError, make_task_runner

    connected = ray.is_initialized()  # by the node services' owner (connect_ray), which disconnects itself
    try:
        run_ppo(config, task_runner_class=make_task_runner())
    except CheckpointSaveError as exc:  # raised in Ray's task runner: Ray's error is an instance of it too
        raise RunStopped(str(getattr(exc, "cause", exc))) from None
    finally:
        if not connected and ray.is_initialized():
            ray.shutdown()


def exit_on_termination(run):
    """SIGTERM and SIGHUP (a scheduler's cancel, a closed terminal) leave ``run`` through its ``finally`` blocks, as
    Ctrl-C does: the service is stopped and the run's secret file removed (Python's default ends at once). A SIGKILL
    cannot be caught: then the service sees its launcher gone and does both itself (``serve --parent-pid``)."""
    import functools
    import signal

    def leave(signum, frame):
        raise SystemExit(128 + signum)

    @functools.wraps(run)
    def guarded(*args, **kwargs):
        if threading.current_thread() is not threading.main_thread():  # only the main thread can take signals
            return run(*args, **kwargs)
        previous = {sig: signal.signal(sig, leave) for sig in (signal.SIGTERM, signal.SIGHUP)}
        try:
            return run(*args, **kwargs)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    return guarded


@exit_on_termination
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=seal.launch.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--conf", required=True, help="recipe YAML, e.g. exp/SEAL.yaml")
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="run every check and print every problem found, then what the run would do and its memory and disk "
        "estimate; do not train (exit 2 when a problem was found)",
    )
    parser.add_argument("--full-config", action="store_true", help="with --dry-run: also print the composed config")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. trainer.total_epochs=1")
    args = parser.parse_args(argv)
    try:
        if args.dry_run:
            return dry_run(args.conf, args.overrides, full_config=args.full_config)
        config = checked_config(args.conf, args.overrides)
        with environment_service(config) as url:
            OmegaConf.set_struct(config, False)
            config.env_service.url = url
            train(config)
    except PreflightError as exc:
        print(f"[seal] error: {exc}", file=sys.stderr)
        return 2
    except RunStopped as exc:
        print(f"[seal] error: {exc}", file=sys.stderr)
        return 1
    except (HydraException, OmegaConfBaseException) as exc:  # a bad override or key: say which, not a traceback
        print(f"[seal] error: invalid configuration: {exc}", file=sys.stderr)
        return 2
    return 0


def checked_config(conf: str, overrides: list[str]) -> DictConfig:
    """The recipe composed, prepared and checked, refused at the first class with a problem: keys (before anything
    is composed), then ``run_checks``' values, inputs and, once prepared, the node and the cluster. Nothing has
    started yet."""
    found = Findings()
    found.add("keys", check_keys(conf, overrides))
    found.raise_if_any()
    config = compose_recipe(conf, overrides)
    for warning in run_checks(config).warnings:
        print(f"[seal] warning: {warning}")
    return config


def dry_run(conf: str, overrides: list[str], full_config: bool = False) -> int:
    """Every check of every class, all problems printed together (stderr), then what the run would do and its memory
    and disk estimate, whatever was found (stdout); 2 when a problem was found. An override that names an unknown
    key is reported and left out, so that the recipe still composes and the other checks run."""
    from seal.config.keys import bad_overrides
    from seal.launch.summary import summary

    found = Findings()
    found.add("keys", check_keys(conf, overrides))
    refused = set(bad_overrides(overrides))
    config = compose_recipe(conf, [o for o in overrides if o not in refused])
    shown = config.copy()  # the recipe's own paths, before run_checks prepares it (absolute paths)
    run_checks(config, collect_all=True, found=found)
    for kind, text in found.problems:
        print(f"[seal] error: [{kind}] {text}", file=sys.stderr)
    for warning in found.warnings:
        print(f"[seal] warning: {warning}", file=sys.stderr)
    for skipped in found.skipped:
        print(f"[seal] not checked: {skipped}", file=sys.stderr)
    for line in summary(conf, shown, problems=bool(found.problems)):
        print(f"[seal] {line}")
    if full_config:
        print(OmegaConf.to_yaml(config, resolve=not found.problems))
    if found.problems:
        print(f"[seal] {len(found.problems)} problem(s): the run would be refused", file=sys.stderr)
        return 2
    return 0

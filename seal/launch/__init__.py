"""Compose a recipe, check it, start (or connect to) the environment service, and train.

    python launcher.py --conf exp/SEAL.yaml [hydra overrides ...] [--dry-run [--full-config]]

A recipe is a Hydra config whose defaults are verl's ``ppo_trainer`` and ``seal_defaults``; the search path for
both and for the paper's recipes in ``exp/`` is supplied here, so a recipe kept anywhere can build on one
(``defaults: [SEAL, _self_]``). Every key of the recipe's files and of the overrides must exist
(``seal/config/keys.py``); then preflight turns the usual first-run failures (a bad value, no GPU, a missing model or
data file, an unreachable service, lengths that cannot fit, a disk too small for the checkpoints) into clear messages
before Ray and verl start. A run is refused at the first class of problem, in that order: keys, values, inputs
(before anything is built from them or torch is imported), the node. ``--dry-run`` runs every check, prints every
problem, then what the run would do and its memory and disk estimate. A run that stops for a cause one line can say
(a checkpoint that cannot be written) exits 1 with it.

The modules, by job: ``recipe`` (composition, the keys, ``prepare``), ``preflight`` (the checks by class,
``run_checks``), ``service`` (the environment service's lifetime), ``run_env`` (the run's environment variables and
Ray connection), ``cli`` (the command line: ``main``, ``checked_config``, ``dry_run``, ``train``); and ``summary``,
``memory_estimate``, ``node_checks``, ``multinode`` for what the dry run prints and the node and cluster checks.
"""

"""The BFCL adapters: one episode of a BFCL task and everything it is made of.

``upstream`` is the only module that imports bfcl-eval internals; ``tasks`` and ``ood_tasks`` load the tasks;
``parser`` reads model messages, ``calls`` and ``executor`` run tool calls without ``eval``, ``verifier`` gives
the verdict, tags and labels; ``prompts`` and ``interface`` build what the model sees; ``episode`` and
``ood_episode`` play one episode; ``config`` holds the environment's settings and per-episode budgets.
"""

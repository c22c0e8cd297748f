"""Run bfcl-eval's own evaluation (``eval_runner.main``, what ``bfcl evaluate`` calls) on a result folder.

    python -m seal.eval.bfcl_score ROOT CATEGORY [CATEGORY ...]

Reads ``ROOT/result`` and writes ``ROOT/score`` with ``--partial-eval`` semantics (the tasks present). Run it in a
fresh process with ``BFCL_PROJECT_ROOT=ROOT`` (``seal.eval.bfcl_files.run_bfcl_evaluate`` does).

bfcl's model registry (``bfcl_eval.constants.model_config``) imports every vendor SDK it supports (anthropic,
cohere, google-genai, ...), which the project does not install. When that import fails, the registry is narrowed
to the one entry we score with, built with bfcl's own handler class; the runner, decoder, checker and score files
are bfcl's, unchanged.
"""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass


@dataclass
class _ModelConfig:  # the fields of bfcl's ModelConfig
    model_name: str
    display_name: str
    url: str
    org: str
    license: str
    model_handler: type
    input_price: float | None
    output_price: float | None
    is_fc_model: bool
    underscore_to_dot: bool


def _narrowed_registry(model: str) -> types.ModuleType:
    from bfcl_eval.model_handler.local_inference.qwen_fc import QwenFCHandler

    module = types.ModuleType("bfcl_eval.constants.model_config")
    module.ModelConfig = _ModelConfig
    module.MODEL_CONFIG_MAPPING = {
        model: _ModelConfig(
            model_name=model.removesuffix("-FC"),
            display_name=f"{model} (FC)",
            url="https://huggingface.co/Qwen/Qwen3-8B",
            org="Qwen",
            license="apache-2.0",
            model_handler=QwenFCHandler,
            input_price=None,
            output_price=None,
            is_fc_model=True,
            underscore_to_dot=False,
        )
    }
    return module


def main(argv: list[str]) -> int:
    from seal.eval.bfcl_files import BFCL_MODEL, bfcl_category

    root, categories = argv[0], argv[1:]
    try:
        import bfcl_eval.constants.model_config  # noqa: F401
    except ImportError:
        sys.modules["bfcl_eval.constants.model_config"] = _narrowed_registry(BFCL_MODEL)
    from bfcl_eval.eval_checker import eval_runner

    eval_runner.main(
        [BFCL_MODEL], [bfcl_category(c) for c in categories], f"{root}/result", f"{root}/score", partial_eval=True
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

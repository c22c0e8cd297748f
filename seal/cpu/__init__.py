"""Running the same trainer on a machine without a GPU: verl's CPU platform (``platform``), an HF-generate rollout
server behind verl's rollout-server interface (``hf_rollout``), what the CPU build of vLLM needs around verl's
weight update (``vllm_cpu``), and the offline tiny model the CPU recipes and tests train (``tiny_model``)."""

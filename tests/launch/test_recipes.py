"""Every recipe in exp/ composes; SEAL.yaml carries the released recipe's values; ablations differ only by their switches."""

from pathlib import Path

import pytest
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from seal.config.checks import value_problems
from seal.launch.cli import main
from seal.launch.preflight import preflight
from seal.launch.recipe import PreflightError, compose_recipe

ROOT = Path(__file__).resolve().parents[2]
RECIPES = sorted((ROOT / "exp").glob("*.yaml"))

# The released recipe's key (upstream name) -> (our key, expected effective value). Keys upstream had but that configure
# nothing in our stack are listed in NOT_APPLICABLE with the reason.
RELEASED_RECIPE = {
    "data.train_batch_size": ("data.train_batch_size", 32),
    "data.val_batch_size": ("data.val_batch_size", 400),
    "data.max_prompt_length": ("data.max_prompt_length", 8192),
    "data.max_response_length": ("data.max_response_length", 4096),
    "data.return_raw_chat": ("data.return_raw_chat", True),
    "data.filter_overlong_prompts": ("data.filter_overlong_prompts", False),
    "data.truncation": ("data.truncation", "error"),
    "data.shuffle": ("data.shuffle", True),
    "data.validation_shuffle": ("data.validation_shuffle", False),
    # verl's GRPO under the name it is registered with: failed episodes out of their groups (identical without one)
    "algorithm.adv_estimator": ("algorithm.adv_estimator", "seal_grpo"),
    "algorithm.norm_adv_by_std_in_grpo": ("algorithm.norm_adv_by_std_in_grpo", True),
    "algorithm.use_kl_in_reward": ("algorithm.use_kl_in_reward", False),
    "algorithm.kl_ctrl.kl_coef": ("algorithm.kl_ctrl.kl_coef", 0.0),
    "actor_rollout_ref.hybrid_engine": ("actor_rollout_ref.hybrid_engine", True),
    "model.path": ("actor_rollout_ref.model.path", "Qwen/Qwen2.5-7B-Instruct"),  # the paper's / release commit's
    "model.use_remove_padding": ("actor_rollout_ref.model.use_remove_padding", True),
    "model.enable_gradient_checkpointing": ("actor_rollout_ref.model.enable_gradient_checkpointing", True),
    # upstream left it to verl's default (flash attention); named here so the GPU install and preflight can see it
    "model.override_config.attn_implementation": (
        "actor_rollout_ref.model.override_config.attn_implementation",
        "flash_attention_2",
    ),
    "rollout.name": ("actor_rollout_ref.rollout.name", "vllm"),
    "rollout.mode": ("actor_rollout_ref.rollout.mode", "async"),
    "rollout.temperature": ("actor_rollout_ref.rollout.temperature", 1.0),
    "rollout.top_p": ("actor_rollout_ref.rollout.top_p", 1),
    "rollout.top_k": ("actor_rollout_ref.rollout.top_k", -1),
    "rollout.n": ("actor_rollout_ref.rollout.n", 8),
    "rollout.prompt_length": ("actor_rollout_ref.rollout.prompt_length", 8192),
    "rollout.response_length": ("actor_rollout_ref.rollout.response_length", 4096),
    "rollout.max_model_len": ("actor_rollout_ref.rollout.max_model_len", 16384),
    "rollout.gpu_memory_utilization": ("actor_rollout_ref.rollout.gpu_memory_utilization", 0.4),
    "rollout.tensor_model_parallel_size": ("actor_rollout_ref.rollout.tensor_model_parallel_size", 1),
    "rollout.enforce_eager": ("actor_rollout_ref.rollout.enforce_eager", True),
    "rollout.free_cache_engine": ("actor_rollout_ref.rollout.free_cache_engine", True),
    "rollout.enable_chunked_prefill": ("actor_rollout_ref.rollout.enable_chunked_prefill", True),
    "rollout.max_num_batched_tokens": ("actor_rollout_ref.rollout.max_num_batched_tokens", 8192),
    "rollout.val_kwargs.n": ("actor_rollout_ref.rollout.val_kwargs.n", 1),
    "rollout.val_kwargs.temperature": ("actor_rollout_ref.rollout.val_kwargs.temperature", 0),
    "rollout.val_kwargs.top_k": ("actor_rollout_ref.rollout.val_kwargs.top_k", -1),
    "rollout.val_kwargs.top_p": ("actor_rollout_ref.rollout.val_kwargs.top_p", 1.0),
    "rollout.val_kwargs.do_sample": ("actor_rollout_ref.rollout.val_kwargs.do_sample", False),
    "rollout.multi_turn.enable": ("actor_rollout_ref.rollout.multi_turn.enable", True),
    "rollout.multi_turn.max_steps": ("seal.rollout.max_model_calls", 20),
    "rollout.max_env_len": ("seal.rollout.max_env_tokens", 4096),
    "actor.optim.lr": ("actor_rollout_ref.actor.optim.lr", 1e-6),
    "actor.optim.lr_warmup_steps": ("actor_rollout_ref.actor.optim.lr_warmup_steps", -1),
    "actor.optim.lr_warmup_steps_ratio": ("actor_rollout_ref.actor.optim.lr_warmup_steps_ratio", 0.0),
    "actor.optim.warmup_style": ("actor_rollout_ref.actor.optim.lr_scheduler_type", "constant"),
    "actor.optim.weight_decay": ("actor_rollout_ref.actor.optim.weight_decay", 0.01),
    "actor.ppo_mini_batch_size": ("actor_rollout_ref.actor.ppo_mini_batch_size", 8),
    "actor.ppo_micro_batch_size_per_gpu": ("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", 1),
    "actor.use_dynamic_bsz": ("actor_rollout_ref.actor.use_dynamic_bsz", False),
    "actor.ppo_max_token_len_per_gpu": ("actor_rollout_ref.actor.ppo_max_token_len_per_gpu", 16384),
    "actor.clip_ratio": ("actor_rollout_ref.actor.clip_ratio", 0.2),
    "actor.clip_ratio_low": ("actor_rollout_ref.actor.clip_ratio_low", 0.2),
    "actor.clip_ratio_high": ("actor_rollout_ref.actor.clip_ratio_high", 0.2),
    "actor.clip_ratio_c": ("actor_rollout_ref.actor.clip_ratio_c", 10.0),
    "actor.grad_clip": ("actor_rollout_ref.actor.grad_clip", 1.0),
    "actor.entropy_coeff": ("actor_rollout_ref.actor.entropy_coeff", 0),
    "actor.loss_agg_mode": ("actor_rollout_ref.actor.loss_agg_mode", "token-mean"),
    "actor.ppo_epochs": ("actor_rollout_ref.actor.ppo_epochs", 1),
    "actor.use_kl_loss": ("actor_rollout_ref.actor.use_kl_loss", True),
    "actor.kl_loss_coef": ("actor_rollout_ref.actor.kl_loss_coef", 0.001),
    "actor.kl_loss_type": ("actor_rollout_ref.actor.kl_loss_type", "low_var_kl"),
    "actor.fsdp_config.param_offload": ("actor_rollout_ref.actor.fsdp_config.param_offload", False),
    "actor.fsdp_config.optimizer_offload": ("actor_rollout_ref.actor.fsdp_config.optimizer_offload", False),
    "ref.fsdp_config.param_offload": ("actor_rollout_ref.ref.fsdp_config.param_offload", True),
    "ref.log_prob_micro_batch_size_per_gpu": ("actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu", 1),
    "ref.log_prob_max_token_len_per_gpu": ("actor_rollout_ref.ref.log_prob_max_token_len_per_gpu", 16384),
    "trainer.n_gpus_per_node": ("trainer.n_gpus_per_node", 4),
    "trainer.nnodes": ("trainer.nnodes", 1),
    "trainer.total_epochs": ("trainer.total_epochs", 6),
    "trainer.test_freq": ("trainer.test_freq", 10),
    "trainer.val_before_train": ("trainer.val_before_train", True),
    "trainer.save_freq": ("trainer.save_freq", 0),
    "trainer.save_best_checkpoint": ("seal.checkpoint.save_best", True),
    "trainer.keep_only_best_checkpoint": ("seal.checkpoint.keep_only_best", True),
    "trainer.best_checkpoint_mode": ("seal.checkpoint.best_mode", "max"),
    "trainer.resume_mode": ("trainer.resume_mode", "auto"),
    "trainer.balance_batch": ("trainer.balance_batch", True),
    # upstream logged to the console only; ours also writes the metrics file (figures, tables) and tensorboard
    "trainer.logger": ("trainer.logger", ["console", "file", "tensorboard"]),
    "trainer.default_local_dir": ("trainer.default_local_dir", "checkpoints/SEAL/SEAL"),
    "env_service.bfcl.strict_tool_parser": ("env_service.bfcl.strict_tool_parser", True),
    "env_service.bfcl.enforce_available_tools": ("env_service.bfcl.enforce_available_tools", True),
    "env_service.bfcl.tool_prompt_mode": ("env_service.bfcl.tool_prompt_mode", "bfcl_qwen_fc"),
    "env_service.bfcl.tool_result_mode": ("env_service.bfcl.tool_result_mode", "bfcl_tool_response"),
    "env_service.bfcl.observation_lite.enable": ("env_service.bfcl.observation_lite.enable", True),
    "env_service.bfcl.observation_lite.apply_to_validation": (
        "env_service.bfcl.observation_lite.apply_to_validation",
        False,
    ),
    "env_service.bfcl.observation_lite.add_required_hint": (
        "env_service.bfcl.observation_lite.add_required_hint",
        True,
    ),
    "env_service.bfcl.observation_lite.add_type_hint": ("env_service.bfcl.observation_lite.add_type_hint", False),
    "env_service.bfcl.observation_lite.add_enum_hint": ("env_service.bfcl.observation_lite.add_enum_hint", True),
    "env_service.bfcl.observation_lite.hide_optional": ("env_service.bfcl.observation_lite.hide_optional", False),
    "tocf.enable": ("seal.diagnosis.enable", True),
    "tocf.dense_reward.mode (cap 0.0 = binary)": ("seal.reward.mode", "binary"),
    "tocf.dense_reward.partial_credit_cap": ("seal.reward.partial_credit_cap", 0.0),
    "tocf.dense_reward.partial_credit_weight": ("seal.reward.partial_credit_weight", 1.0),
    "tocf.apatch.enable": ("seal.apatch.enable", True),
    "tocf.apatch.min_scale": ("seal.apatch.min_scale", 0.5),
    "tocf.apatch.max_scale": ("seal.apatch.max_scale", 2.0),
    "tocf.apatch.apply_to": ("seal.apatch.apply_to", "all"),
    "tocf.apatch.metric_prefix": ("seal.apatch.metric_prefix", "seal/apatch"),
    "tocf.apatch.warmup_steps": ("seal.apatch.warmup_steps", 0),
    "tocf.apatch.dynamic.enable": ("seal.apatch.dynamic.enable", True),
    "tocf.apatch.dynamic.ema_beta": ("seal.apatch.dynamic.ema_beta", 0.25),
    "tocf.apatch.dynamic.prevalence_alpha": ("seal.apatch.dynamic.prevalence_alpha", 1.0),
    "tocf.apatch.dynamic.confidence_samples": ("seal.apatch.dynamic.confidence_samples", 32),
    "tocf.apatch.tag_weights": (
        "seal.apatch.tag_weights",
        {
            "spurious_tool_call": 2.0,
            "correct_abstention": 1.8,
            "empty_turn_model_response": 1.5,
            "state_mismatch": 1.0,
            "response_mismatch": 0.9,
            "instance_mismatch": 0.6,
            "pass": 1.0,
        },
    ),
}

NOT_APPLICABLE = {
    "rollout.multi_turn.format / completion_callback / tool_config_path": "configure vLLM's tool parser and upstream's "
    "OpenAI-chat callback; our agent loop is token-in/token-out and the environment parses <tool_call> itself",
    "rollout.max_env_worker / thread_pool.max_workers": "episodes are asyncio coroutines in verl's agent-loop workers",
    "rollout.context_template / use_qwen3 / sparse / debug_llm_io": "upstream token-builder switches; verl's Continuous Token builder",
    "task_manager.*": "synthetic-task machinery, inactive in the recipe (n 0, ratio 0.0)",
    "trainer.best_checkpoint_metric": "null upstream = multi_turn_base accuracy; ours is the 4-category average (docs/upstream-differences.md)",
    "trainer.rollout_data_dir / validation_data_dir": "same role, under experiments/<experiment_name>/",
}

# The paper's ablations: the switches each ablation flips relative to full SEAL (plus its experiment name and derived paths).
ABLATIONS = {
    "vanilla_rl": {
        "env_service.bfcl.observation_lite.enable": False,
        "seal.diagnosis.enable": False,
        "seal.apatch.enable": False,
        "seal.apatch.dynamic.enable": False,
    },
    "wo_env_adaptation": {"env_service.bfcl.observation_lite.enable": False},
    "wo_reweighting": {"seal.apatch.enable": False, "seal.apatch.dynamic.enable": False},
    "wo_closed_loop": {"seal.apatch.dynamic.enable": False},
}
NAME_DERIVED = (
    "trainer.experiment_name",
    "actor_rollout_ref.rollout.trace.experiment_name",
    "trainer.default_local_dir",
    "trainer.rollout_data_dir",
    "trainer.validation_data_dir",
    "seal.run_dir",
    "seal.diagnosis.state_dir",
    "seal.diagnosis.dump_dir",
)


def flatten(cfg, prefix=""):
    out = {}
    for key, value in cfg.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, path + "."))
        else:
            out[path] = value
    return out


def resolved(name: str) -> dict:
    return OmegaConf.to_container(compose_recipe(str(ROOT / "exp" / f"{name}.yaml")), resolve=True)


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_every_recipe_composes_and_resolves(recipe):
    cfg = compose_recipe(str(recipe))
    container = OmegaConf.to_container(cfg, resolve=True)
    assert container["actor_rollout_ref"]["rollout"]["agent"]["default_agent_loop"] == "seal_bfcl"
    assert container["trainer"]["use_v1"] is False
    assert value_problems(cfg) == []  # the value checks refuse nothing a shipped recipe sets


def test_seal_recipe_has_every_released_value():
    cfg = flatten(resolved("SEAL"))
    whole = resolved("SEAL")
    mismatches = {}
    for released_key, (our_key, expected) in RELEASED_RECIPE.items():
        actual = OmegaConf.select(OmegaConf.create(whole), our_key)
        actual = OmegaConf.to_container(actual) if OmegaConf.is_config(actual) else actual
        if actual != expected:
            mismatches[released_key] = (our_key, actual, expected)
    assert not mismatches, mismatches
    assert cfg["data.train_files"] == "data/bfcl_train.parquet"


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_every_recipe_writes_the_metrics_file_that_figures_and_tables_read(recipe):
    # verl writes metrics_*.jsonl only with its `file` logger; without it a run leaves no figures and no table row
    assert "file" in OmegaConf.to_container(compose_recipe(str(recipe)).trainer.logger)


@pytest.mark.parametrize("ablation", sorted(ABLATIONS))
def test_ablation_differs_from_seal_exactly_by_its_switches(ablation):
    base, variant = flatten(resolved("SEAL")), flatten(resolved(ablation))
    assert base.keys() == variant.keys()
    differing = {k for k in base if base[k] != variant[k]} - set(NAME_DERIVED)
    expected = {k for k, v in ABLATIONS[ablation].items() if base[k] != v}
    assert differing == expected, (differing, expected)
    for key, value in ABLATIONS[ablation].items():
        assert variant[key] == value


def test_backbone_variants_swap_only_the_model_and_its_format():
    base = flatten(resolved("SEAL"))
    for name, changed in {
        "qwen2.5_3b": {"actor_rollout_ref.model.path"},
        # ToolACE's tool docs need a longer prompt budget and, by as much, a longer context (tests/rollout/test_prompt_budget.py)
        # ... and bfcl's Llama format: its prompt template, ipython tool results, <|eot_id|> ending a turn
        "toolace2_8b": {
            "actor_rollout_ref.model.path",
            "env_service.bfcl.tool_prompt_mode",
            "data.max_prompt_length",
            "actor_rollout_ref.rollout.max_model_len",
            "actor_rollout_ref.model.custom_chat_template",
            "env_service.bfcl.tool_result_mode",
            "seal.rollout.end_of_turn_token",
        },
    }.items():
        served = "actor_rollout_ref.rollout.prometheus.served_model_name"  # verl derives it from model.path
        changed = changed | {served}
        if "data.max_prompt_length" in changed:  # verl interpolates the prompt length from it
            changed |= {
                "actor_rollout_ref.rollout.prompt_length",
                "distillation.teacher_models.teacher_model.inference.prompt_length",
            }
        variant = flatten(resolved(name))
        assert {k for k in base if base[k] != variant[k]} - set(NAME_DERIVED) == changed


def test_interface_evolution_recipe_turns_on_the_whole_interface():
    cfg = flatten(resolved("SEAL_interface_evolution"))
    assert cfg["env_service.bfcl.observation_lite.enable"]
    assert cfg["env_service.bfcl.tool_feedback_evolution.enable"]
    assert cfg["env_service.bfcl.capability_cues.enable"]


def test_preflight_names_every_problem_of_a_gpu_recipe_on_this_cpu_machine(tmp_path):
    cfg = compose_recipe(
        str(ROOT / "exp" / "SEAL.yaml"),
        ["data.train_files=/nonexistent/train.parquet", "actor_rollout_ref.rollout.max_model_len=1000"],
    )
    with pytest.raises(PreflightError) as err:
        preflight(cfg)
    message = str(err.value)
    assert "CUDA device" in message and "exp/cpu_tiny.yaml" in message
    assert "/nonexistent/train.parquet" in message
    assert "exceeds max_model_len (1000)" in message


def test_preflight_refuses_switches_that_would_silently_do_nothing_or_harm():
    with pytest.raises(
        ConfigCompositionException, match="seal.reward.cap_decay"
    ):  # the option no grader could use is gone
        compose_recipe(str(ROOT / "exp" / "SEAL.yaml"), ["seal.reward.cap_decay=true"])
    cfg = compose_recipe(str(ROOT / "exp" / "SEAL.yaml"), ["+trainer.max_actor_ckpt_to_keep=2"])
    with pytest.raises(PreflightError) as err:
        preflight(cfg)
    assert "max_actor_ckpt_to_keep would rotate out the best checkpoint" in str(err.value)


def test_preflight_rejects_batches_that_cannot_split():
    cfg = compose_recipe(str(ROOT / "exp" / "SEAL.yaml"), ["actor_rollout_ref.rollout.n=1", "data.train_batch_size=30"])
    with pytest.raises(PreflightError) as err:
        preflight(cfg)
    assert "rollout.n >= 2" in str(err.value)
    assert "divisible by actor.ppo_mini_batch_size" in str(err.value)


def test_launcher_reports_bad_overrides_without_a_traceback(capsys):
    from seal.launch.cli import main

    assert main(["--conf", str(ROOT / "exp" / "SEAL.yaml"), "no.such.key=1"]) == 2
    err = capsys.readouterr().err
    assert "override no.such.key=1: no.such.key: no such key" in err and "Traceback" not in err
    assert main(["--conf", str(ROOT / "exp" / "SEAL.yaml"), "data.train_batch_size=[1"]) == 2  # not an override
    assert "invalid configuration" in capsys.readouterr().err


def test_launcher_refuses_an_unreachable_environment_service(capsys):
    from seal.launch.cli import main

    rc = main(["--conf", str(ROOT / "exp" / "cpu_tiny.yaml"), "env_service.url=http://127.0.0.1:9"])
    err = capsys.readouterr().err
    assert rc == 2 and "env_service.url 'http://127.0.0.1:9' is not reachable" in err and "Traceback" not in err


@pytest.mark.parametrize(
    "override, says",
    [
        ("seal.apatch.apply_to=bogus", "config key 'seal.apatch.apply_to': expected one of all, positive_advantage"),
        ("seal.apatch.dynamic.ema_beta=2", "config key 'seal.apatch.dynamic.ema_beta': must be within [0.0, 1.0]"),
        ("seal.reward.mode=bogus", "seal.reward.mode': expected one of binary, capped, t3rl"),
        ("seal.checkpoint.best_mode=up", "seal.checkpoint.best_mode must be max or min, got 'up'"),
        ("seal.validation.max_env_failure_share=2", "seal.validation.max_env_failure_share must be a share"),
        ("seal.rollout.max_model_calls=2.5", "seal.rollout.max_model_calls must be an integer"),
        ("data.max_prompt_length=abc", "data.max_prompt_length must be a number (like its default 512), got 'abc'"),
        ("trainer.val_before_train=1", "trainer.val_before_train must be true or false"),
        ("actor_rollout_ref.actor.optim.lr=fast", "actor_rollout_ref.actor.optim.lr must be a number"),
    ],
)
def test_a_bad_value_is_refused_in_one_line_before_anything_starts(capsys, override, says):
    # a real run (no --dry-run) stops at the first class of problem: the values, before the inputs or the node
    assert main(["--conf", str(ROOT / "exp" / "SEAL.yaml"), override]) == 2
    out, err = capsys.readouterr()
    assert says in err and "Traceback" not in err
    assert err.count("\n  - ") == 1  # one problem, one line
    assert not out  # refused before anything is built or started


def test_fractional_knobs_verl_writes_with_integer_defaults_pass():
    cfg = compose_recipe(
        str(ROOT / "exp" / "SEAL.yaml"),
        ["actor_rollout_ref.rollout.top_p=0.9", "actor_rollout_ref.actor.entropy_coeff=0.001"],
    )
    assert value_problems(cfg) == []


def test_verls_plain_grpo_is_allowed_with_a_warning_that_failed_episodes_enter_their_groups():
    plain = compose_recipe(str(ROOT / "exp" / "cpu_tiny.yaml"), ["algorithm.adv_estimator=grpo"])
    assert any("enters its group as reward 0" in w for w in preflight(plain))
    recipe = compose_recipe(str(ROOT / "exp" / "cpu_tiny.yaml"))
    assert not any("enters its group" in w for w in preflight(recipe))


def test_a_misspelt_estimator_is_refused_before_anything_starts_naming_the_nearest():
    with pytest.raises(
        PreflightError, match=r"'seal_grop' is not an estimator verl knows \(did you mean seal_grpo\?\)"
    ):
        preflight(compose_recipe(str(ROOT / "exp" / "cpu_tiny.yaml"), ["algorithm.adv_estimator=seal_grop"]))

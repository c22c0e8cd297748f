"""Padding removal packs sequences into one row: are their log-probs still their own?

With ``use_remove_padding: true`` verl's FSDP engine concatenates a micro-batch's sequences into one row and calls
the model with only ``input_ids`` and restarting ``position_ids`` (no attention mask, ``use_cache=False``). Flash
attention's varlen path reads the sequence boundaries from the position ids; sdpa and eager get them from
transformers, which builds a block-diagonal mask from restarting position ids when there is no mask and no cache
(``transformers.masking_utils.find_packed_sequence_indices``). This test feeds the tiny model exactly verl's input
(after verl's own model patch) and compares each packed sequence's log-probs with the sequence run alone: equal
with that detection, mixed without it (the second sequence attends to the first) -- the case preflight refuses
(``seal.launch.node_checks.separates_packed_sequences``, tests/launch/test_preflight_gpu.py).

flash_attention_2 runs only on a GPU with flash-attn (a CUDA extension with no CPU build); there the same
comparison applies.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

LENGTHS = (7, 11)


def _next_token_logprobs(model, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():  # verl's call: no attention mask, no cache ("prevent model thinks we are generating")
        logits = model(input_ids=input_ids, attention_mask=None, position_ids=position_ids, use_cache=False).logits[0]
    targets = torch.roll(input_ids[0], shifts=-1)
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, targets[:, None])[:, 0]


def _packed_vs_alone(tiny_dir, attention: str) -> list[float]:
    """Largest |log-prob difference| per sequence between the packed row and the sequence alone."""
    from transformers import AutoModelForCausalLM
    from verl.models.transformers.monkey_patch import apply_monkey_patch

    flash = attention.startswith("flash")  # flash attention runs on CUDA in half precision only
    device, dtype = ("cuda", torch.bfloat16) if flash else ("cpu", torch.float32)
    model = AutoModelForCausalLM.from_pretrained(tiny_dir, attn_implementation=attention, dtype=dtype).to(device).eval()
    apply_monkey_patch(model=model, use_remove_padding=True, ulysses_sp_size=1)
    generator = torch.Generator().manual_seed(0)
    sequences = [torch.randint(0, 150000, (n,), generator=generator).to(device) for n in LENGTHS]
    packed_ids = torch.cat(sequences)[None]
    packed_pos = torch.cat([torch.arange(n, device=device) for n in LENGTHS])[
        None
    ]  # restarting position ids, as verl packs
    packed = _next_token_logprobs(model, packed_ids, packed_pos)
    differences, start = [], 0
    for seq in sequences:
        alone = _next_token_logprobs(model, seq[None], torch.arange(len(seq), device=device)[None])
        # the last position predicts across the boundary (packed) or wraps around (alone): compare the others
        differences.append((packed[start : start + len(seq) - 1] - alone[:-1]).abs().max().item())
        start += len(seq)
    return differences


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_packed_sequences_keep_their_own_log_probs(tiny_dir, attention):
    assert max(_packed_vs_alone(tiny_dir, attention)) < 1e-5


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_without_packed_sequence_detection_they_mix(tiny_dir, attention, monkeypatch):
    import transformers.masking_utils

    monkeypatch.setattr(transformers.masking_utils, "find_packed_sequence_indices", lambda position_ids: None)
    first, second = _packed_vs_alone(tiny_dir, attention)
    assert first < 1e-5  # nothing comes before the first sequence
    assert second > 1e-2  # the second attends to the first: its log-probs are not its own


@pytest.mark.skipif(
    not (torch.cuda.is_available() and importlib.util.find_spec("flash_attn")),
    reason="flash-attn is CUDA-only (no CPU build); its varlen path is what keeps packed sequences apart",
)
def test_flash_attention_keeps_packed_sequences_apart(tiny_dir):
    assert max(_packed_vs_alone(tiny_dir, "flash_attention_2")) < 1e-2  # bf16 rounding only

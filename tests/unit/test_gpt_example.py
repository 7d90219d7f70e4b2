"""examples/gpt/model.py: the shapes it promises, and that attention never looks ahead."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "gpt"))
from model import GPT, GPTConfig  # the example's folder is not a package, so from its path

CONFIG = GPTConfig(vocab_size=11, block_size=16, n_layer=2, n_head=4, n_embd=32)


@pytest.fixture
def model() -> GPT:
    torch.manual_seed(0)
    return GPT(CONFIG).eval()


def test_logits_cover_every_position_and_token(model: GPT) -> None:
    idx = torch.randint(CONFIG.vocab_size, (3, CONFIG.block_size))
    assert model(idx).shape == (3, CONFIG.block_size, CONFIG.vocab_size)
    assert model(idx[:, :5]).shape == (3, 5, CONFIG.vocab_size)


def test_a_later_token_never_changes_earlier_logits(model: GPT) -> None:
    idx = torch.randint(CONFIG.vocab_size, (2, CONFIG.block_size))
    changed = idx.clone()
    changed[:, 9] = (idx[:, 9] + 1) % CONFIG.vocab_size
    before, after = model(idx), model(changed)
    torch.testing.assert_close(before[:, :9], after[:, :9], rtol=0, atol=0)
    assert not torch.allclose(before[:, 9:], after[:, 9:])  # the change is seen from its position on


def test_a_sequence_longer_than_the_block_is_refused(model: GPT) -> None:
    with pytest.raises(ValueError, match="block_size"):
        model(torch.zeros(1, CONFIG.block_size + 1, dtype=torch.long))


def test_generate_appends_greedy_tokens_within_the_block(model: GPT) -> None:
    prompt = torch.randint(CONFIG.vocab_size, (1, CONFIG.block_size))  # longer than the block once extended
    out = model.generate(prompt, max_new_tokens=5)
    assert out.shape == (1, CONFIG.block_size + 5)
    assert torch.equal(out[:, : CONFIG.block_size], prompt)
    assert out[0, -1] == model(out[:, -CONFIG.block_size - 1 : -1])[0, -1].argmax()

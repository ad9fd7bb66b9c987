"""The GPT and the data of the peer drills, in plain torch (no megatron-core, no mindio).

The model has the shapes of examples/megatron/pretrain_gpt.py's GPT at the same ``--size``
(bench/_sizes.py): token + position embeddings, pre-norm transformer layers (attention with one
fused QKV projection, a 4x GELU MLP), a final LayerNorm and an output layer without bias (not tied
to the embedding, as in the example): 12 h^2 + 13 h parameters per layer, megatron-core's count. The data is the
example's corpus and tokenizer; sample ``i`` of the stream is drawn from a permutation seeded by
(seed, epoch), so every system trains on the same samples in the same order.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import _sizes  # noqa: E402  (bench/_sizes.py)

DATA = Path(__file__).resolve().parents[2] / "examples" / "megatron" / "data"


class GPT(nn.Module):
    def __init__(self, size: _sizes.Size):
        super().__init__()
        h = size.hidden
        self.tok = nn.Embedding(_sizes.VOCAB, h)
        self.pos = nn.Embedding(_sizes.SEQ, h)
        layer = nn.TransformerEncoderLayer(h, size.heads, 4 * h, dropout=0.0, activation="gelu",
                                           batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, size.layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(h)
        self.out = nn.Linear(h, _sizes.VOCAB, bias=False)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(_sizes.SEQ),
                             persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        s = tokens.size(1)
        x = self.tok(tokens) + self.pos(torch.arange(s))
        return self.out(self.norm(self.blocks(x, mask=self.mask[:s, :s], is_causal=True)))


def loss_fn(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    logits = model(batch[:, :-1])
    return nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1))


class Corpus:
    """The example's corpus cut into seq+1-token samples, in a seeded per-epoch order."""

    def __init__(self, seed: int = 1234):
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(DATA / "tokenizer.json"))
        self.tokens = torch.tensor(tok.encode((DATA / "corpus.txt").read_text(encoding="utf-8")).ids)
        self.n = (len(self.tokens) - 1) // _sizes.SEQ
        self.seed = seed
        self._orders: dict = {}

    def sample(self, i: int) -> torch.Tensor:
        epoch, j = divmod(i, self.n)
        if epoch not in self._orders:
            self._orders = {epoch: np.random.RandomState(self.seed + epoch).permutation(self.n)}
        k = int(self._orders[epoch][j]) * _sizes.SEQ
        return self.tokens[k:k + _sizes.SEQ + 1]

    def batch(self, step: int, slot: int, slots: int, micro_batch: int) -> torch.Tensor:
        """Data slot ``slot`` of ``slots`` at ``step`` (step counts from 0)."""
        start = (step * slots + slot) * micro_batch
        return torch.stack([self.sample(start + k) for k in range(micro_batch)])


def build(size: _sizes.Size, seed: int = 1234) -> GPT:
    torch.manual_seed(seed)
    model = GPT(size)
    with torch.no_grad():  # megatron-core's init: N(0, 0.02) weights, zero biases, LayerNorms 1 / 0
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.02)
            elif "norm" not in name:
                p.zero_()
    n = sum(p.numel() for p in model.parameters())
    if n != size.params:  # the shapes must stay those of the megatron GPT of this size
        raise AssertionError(f"peer GPT has {n} parameters, megatron's GPT of size {size.name} {size.params}")
    return model

"""Model sizes of the benchmarks: examples/megatron/pretrain_gpt.py's GPT (vocabulary 512, sequence 64).

``--size`` of recovery_bench.py, repair_rate.py, ha_overhead.py and peers/run_all.py picks one:

======  ====================================  ===========  =======================================
size    GPT                                    parameters   state per rank, 4 ranks DP=4 R=2
======  ====================================  ===========  =======================================
tiny    2 layers, hidden 64 (the defaults)     0.17 M       1.7 MB
128m    4 layers, hidden 512, micro batch 1    13.2 M       132 MB (0.12 GiB)
1g      9 layers, hidden 1024, micro batch 1   114.5 M      1.14 GB (1.07 GiB)
======  ====================================  ===========  =======================================

State per rank = the fp32 model (4 B x P) + this rank's optimizer shard (fp32 main params and two Adam
moments, 12 B x P x R / d = 6 B x P at d=4, R=2). The gradient buffer (another 4 B x P) and the
activations come on top: a 1g rank peaks at about 2.5 GB, 4 ranks about 10 GB.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List

VOCAB, SEQ = 512, 64  # examples/megatron/data/tokenizer.json, the example's --seq-length


@dataclass(frozen=True)
class Size:
    name: str
    layers: int
    hidden: int
    heads: int
    micro_batch: int

    def args(self) -> List[str]:
        """pretrain_gpt.py flags (none for tiny: the example's defaults)."""
        if self.name == "tiny":
            return []
        return ["--num-layers", str(self.layers), "--hidden-size", str(self.hidden),
                "--num-attention-heads", str(self.heads), "--micro-batch-size", str(self.micro_batch)]

    @property
    def params(self) -> int:
        """Parameters of megatron-core's GPTModel as the example builds it (local spec; the output layer
        is not tied to the embedding): 12 h^2 + 13 h per layer, token and position embeddings, the
        final LayerNorm, the output layer."""
        h = self.hidden
        return self.layers * (12 * h * h + 13 * h) + (VOCAB + SEQ) * h + 2 * h + VOCAB * h

    def state_bytes(self, replicas: int = 2, dp: int = 4) -> int:
        """Model (fp32) + optimizer shard (fp32 main + 2 moments) held by one rank."""
        return 4 * self.params + 12 * self.params * replicas // dp

    def describe(self, replicas: int = 2, dp: int = 4) -> str:
        b = self.state_bytes(replicas, dp)
        return (f"size {self.name}: GPT {self.layers} layers, hidden {self.hidden}, {self.params / 1e6:.1f} M "
                f"params; state per rank {b / 1e9:.3f} GB ({b / 2**30:.3f} GiB: model {4 * self.params} B + "
                f"optimizer shard {12 * self.params * replicas // dp} B at DP={dp}, R={replicas})")


SIZES = {s.name: s for s in (
    Size("tiny", 2, 64, 4, 2),
    Size("128m", 4, 512, 8, 1),
    Size("1g", 9, 1024, 16, 1),
)}


def get(name: str) -> Size:
    try:
        return SIZES[name]
    except KeyError:
        raise SystemExit(f"unknown --size {name!r}; choose from {', '.join(SIZES)}") from None

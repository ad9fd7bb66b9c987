"""Train the example's byte-level BPE tokenizer on corpus.txt (run once; the JSON is committed).

    python examples/megatron/data/make_tokenizer.py
"""

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

HERE = Path(__file__).resolve().parent
VOCAB_SIZE = 512

if __name__ == "__main__":
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train([str(HERE / "corpus.txt")], trainer)
    tokenizer.save(str(HERE / "tokenizer.json"))
    print(f"vocab {tokenizer.get_vocab_size()} -> {HERE / 'tokenizer.json'}")

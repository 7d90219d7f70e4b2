"""A small GPT-2 trained with Hugging Face's Trainer on the Zen of Python, character by character.

The model is built from a config (nothing is downloaded); the text ships with Python."""

import argparse
import codecs
import contextlib
import io

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

BLOCK = 32


class Characters(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """Every BLOCK-character window of the text; the labels are the inputs (the model shifts them)."""

    def __init__(self, text: str) -> None:
        self.vocab = sorted(set(text))
        self.ids = torch.tensor([self.vocab.index(c) for c in text])

    def __len__(self) -> int:
        return len(self.ids) - BLOCK

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        window = self.ids[i : i + BLOCK]
        return {"input_ids": window, "labels": window}


def zen_of_python() -> str:
    with contextlib.redirect_stdout(io.StringIO()):  # importing `this` prints the text
        import this
    return codecs.decode(this.s, "rot13")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=float, default=3)
    cli = parser.parse_args()
    torch.set_num_threads(1)
    data = Characters(zen_of_python())
    config = GPT2Config(
        vocab_size=len(data.vocab), n_positions=BLOCK, n_embd=64, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0
    )
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config)
    args = TrainingArguments(
        output_dir="out",
        num_train_epochs=cli.epochs,
        per_device_train_batch_size=16,
        learning_rate=3e-3,
        logging_steps=10,
        save_steps=40,
        seed=0,
        report_to="none",
        disable_tqdm=True,
        dataloader_pin_memory=False,
        ddp_find_unused_parameters=False,
    )
    trainer = Trainer(model=model, args=args, train_dataset=data)
    trainer.train()


if __name__ == "__main__":
    main()

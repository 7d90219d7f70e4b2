"""A small character-level GPT on corpus.txt (the GNU GPL, version 3) with DDP or FSDP2, the job's
autocast (bf16 in job.yaml), gradient accumulation and sharded checkpoints that resume exactly."""

import argparse
import contextlib
import hashlib
import math
import time
from dataclasses import asdict
from pathlib import Path

import torch
from model import GPT, GPTConfig
from torch import nn
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel

import phalanx.train as pt

CORPUS = Path(__file__).with_name("corpus.txt")
PROMPT = "The GNU General Public License"
WARMUP_STEPS = 10


def checksum(state: dict[str, torch.Tensor]) -> str:
    digest = hashlib.sha256()
    for key in sorted(state):
        digest.update(state[key].to(torch.float32).contiguous().numpy().tobytes())
    return digest.hexdigest()


def sample(data: torch.Tensor, seed: int, batch_size: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`batch_size` windows of the corpus at random offsets, and the same windows one character on.
    They depend on `seed` alone, so a resumed run draws exactly the batches the first one would have."""
    generator = torch.Generator().manual_seed(seed)
    starts = torch.randint(len(data) - block_size, (batch_size, 1), generator=generator)
    windows = data[starts + torch.arange(block_size + 1)]
    return windows[:, :-1], windows[:, 1:]


def lr_at(step: int, steps: int, peak: float) -> float:
    """Linear warmup, then cosine decay to a tenth of the peak: a function of the step alone."""
    if step <= WARMUP_STEPS:
        return peak * step / WARMUP_STEPS
    progress = (step - WARMUP_STEPS) / max(steps - WARMUP_STEPS, 1)
    return peak / 10 + (peak - peak / 10) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, help="optimizer steps in all (overrides the steps hyperparameter)")
    args = parser.parse_args()
    # A model this small runs fastest on one thread per rank, and its float sums then do not
    # depend on the machine's core count.
    torch.set_num_threads(1)
    ctx = pt.init()
    if ctx.precision == "fp16-mixed":
        # float16 needs loss scaling (ctx.backward), which this loop's accumulation leaves out; bf16 does not.
        raise SystemExit("examples/gpt runs with precision 32 or bf16-mixed, not fp16-mixed")
    hp = ctx.hparams
    lr = float(hp.get("lr", 3e-3))
    batch_size = int(hp.get("batch_size", 8))
    grad_accum = int(hp.get("grad_accum", 4))
    steps = args.steps if args.steps is not None else int(hp.get("steps", 100))
    checkpoint_every = int(hp.get("checkpoint_every", 25))
    strategy = str(hp.get("strategy", "ddp"))  # or "fsdp": parameters, gradients and optimizer state sharded

    text = CORPUS.read_text(encoding="utf-8")
    chars = sorted(set(text))
    index = {char: i for i, char in enumerate(chars)}
    data = torch.tensor([index[char] for char in text], dtype=torch.long)
    config = GPTConfig(
        vocab_size=len(chars),
        block_size=int(hp.get("block_size", 64)),
        n_layer=int(hp.get("n_layer", 2)),
        n_head=int(hp.get("n_head", 4)),
        n_embd=int(hp.get("n_embd", 64)),
    )
    torch.manual_seed(0)  # the same initial weights on every rank and in every run
    model = ctx.prepare_model(GPT(config), strategy=strategy)
    ddp = isinstance(model, DistributedDataParallel)
    module = model.module if ddp else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    if ctx.rank == 0:
        params = sum(p.numel() for p in module.parameters())
        print(f"{ctx.world_size} rank(s), {ctx.precision}, {params} parameters, {asdict(config)}", flush=True)

    start = 1
    extra = ctx.load_sharded_checkpoint(model, optimizer)  # resharded for this world size, DDP or FSDP
    if extra is not None:
        start = extra["step"] + 1
        print(f"rank {ctx.rank} resumes after step {extra['step']}", flush=True)

    last, timed_from, timer = start - 1, None, 0.0
    for step in range(start, steps + 1):
        step_lr = lr_at(step, steps, lr)
        for group in optimizer.param_groups:
            group["lr"] = step_lr
        losses = []
        for micro in range(grad_accum):
            seed = (step * ctx.world_size + ctx.rank) * grad_accum + micro  # one seed per micro-batch of the run
            x, y = (t.to(ctx.device) for t in sample(data, seed, batch_size, block_size=config.block_size))
            with gradient_sync(model, micro == grad_accum - 1):
                with ctx.autocast():
                    logits = model(x)
                # The softmax over the vocabulary in float32: bf16's 8-bit mantissa would blur the loss.
                loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
                (loss / grad_accum).backward()
            losses.append(loss.detach())
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        mean_loss = torch.stack(losses).mean()
        ctx.report({"loss": mean_loss, "lr": step_lr}, step=step)  # queued: the tensor is read off this thread
        last = step
        if step == start + 9:  # the rate leaves out this attempt's first ten steps: warm-up
            timed_from, timer = step, time.perf_counter()
        if ctx.rank == 0 and (step in (start, steps) or step % 10 == 0):
            print(f"step {step} loss {mean_loss.item():.4f} lr {step_lr:.2e}", flush=True)
        stop = ctx.should_stop()
        if stop or step % checkpoint_every == 0 or step == steps:
            ctx.save_sharded_checkpoint(model, optimizer, extra={"step": step}, step=step)
        if stop:  # checkpointed above: the next attempt carries on from here
            print(f"rank {ctx.rank} stops after step {step}: asked to stop", flush=True)
            break

    rate = (last - timed_from) / (time.perf_counter() - timer) if timed_from is not None and last > timed_from else None
    full_state = ctx.full_model_state(model)  # gathered on rank 0; every rank takes part
    prompt = torch.tensor([[index[char] for char in PROMPT]], device=ctx.device)
    module.eval()
    # every rank generates: under FSDP each forward gathers the parameters from all of them
    generated = "".join(chars[i] for i in module.generate(prompt, max_new_tokens=100)[0].tolist())
    if ctx.rank == 0:
        if rate is not None:
            print(f"phalanx-steps-per-second {rate:.2f}", flush=True)
        print(f"final-checksum: {checksum(full_state)}")
        print(f"sample: {generated!r}", flush=True)
    ctx.finish()


def gradient_sync(model: nn.Module, sync: bool) -> contextlib.AbstractContextManager[None]:
    """With accumulation only the last micro-batch's backward needs to reduce the gradients."""
    if isinstance(model, DistributedDataParallel):
        return contextlib.nullcontext() if sync else model.no_sync()
    if hasattr(model, "set_requires_gradient_sync"):  # FSDP2
        model.set_requires_gradient_sync(sync)
    return contextlib.nullcontext()


if __name__ == "__main__":
    main()

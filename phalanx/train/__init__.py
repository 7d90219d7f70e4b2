"""The in-training API: what a script run by Phalanx imports.

    import phalanx.train as pt

    ctx = pt.init()
    model = ctx.prepare_model(model)
    loader = ctx.prepare_data_loader(loader)
    for epoch in range(epochs):
        for x, y in loader:
            with ctx.autocast():
                loss = loss_fn(model(x), y)
            ctx.backward(loss, optimizer)
            ctx.report({"loss": loss}, step=step)
            if ctx.should_stop():  # every rank, every step: all turn true at the same step
                break
        ctx.save_checkpoint({"model": model.state_dict(), "epoch": epoch}, step=step)
    ctx.finish()

The same script runs unchanged under plain `python` or `torchrun`: metrics are then kept in
memory. Importing this package loads torch and nothing from the server.
"""

from phalanx.train._checkpoint import Checkpoint
from phalanx.train._context import Context, init
from phalanx.train._data import PreparedDataLoader
from phalanx.train._env import PRECISIONS
from phalanx.train._metrics import MetricRecordDict, MetricStats

__all__ = ["PRECISIONS", "Checkpoint", "Context", "MetricRecordDict", "MetricStats", "PreparedDataLoader", "init"]

"""Phalanx for training frameworks: each module imports its framework, and only when imported.

- `phalanx.integrations.lightning`: `trainer_kwargs()` and `ckpt_path()` for `L.Trainer`.

Install a framework with its extra: `pip install 'phalanx[lightning]'`.
"""

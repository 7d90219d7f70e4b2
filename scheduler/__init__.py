"""Phalanx scheduler: gang placement, reaping lost agents, driving Optuna studies."""

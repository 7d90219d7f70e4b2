"""What runs Phalanx's processes: the launcher commands, the embedded stack, the process supervisor.

Not for users' imports: `phalanx` is, and it never imports this package (see README.md).
"""

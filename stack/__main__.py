"""`python -m stack`: the `phalanx` command, whatever console script the environment has."""

from stack.cli import main

if __name__ == "__main__":
    main()

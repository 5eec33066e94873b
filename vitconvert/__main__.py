"""``python -m vitconvert`` (so ``torchrun -m vitconvert distill ...`` works)."""

from .cli import main

if __name__ == "__main__":
    main()

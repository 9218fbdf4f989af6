"""Train an exit adapter for LayerSkip self-speculation on SmolLM2-135M (the target stays frozen), then
measure the draft acceptance with and without it.

The trainer is ``models.training.early_exit`` (``--help`` prints its description: the stages, where it writes,
how a run resumes, and why E=4, F=512). Outputs go to ``${JSPEC_CACHE:-~/.cache/jspec}/early_exit/``.

    python examples/train_early_exit.py                  # E=4, F=512, 8192-row draft head, 300 steps
    python examples/train_early_exit.py --exit-layer 8 --width 1024 --steps 400 --force
"""

from models.training import early_exit

if __name__ == "__main__":
    early_exit.main()

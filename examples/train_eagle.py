"""Train an EAGLE draft head for SmolLM2-135M on the target's own text and features, then measure acceptance.

The trainer is ``models.training.eagle`` (its docstring: the stages, where it writes, how a run resumes, and how
the bundled head was made); ``--help`` lists the flags. Outputs go to ``${JSPEC_CACHE:-~/.cache/jspec}/eagle/``.

    python examples/train_eagle.py [--name smollm2-8k] [--head-tokens 8192] [--gen-batches 3] [--force]
        [--export models/heads/NAME]
"""

from models.training import eagle

if __name__ == "__main__":
    eagle.main()

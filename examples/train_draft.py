"""Distil a small draft from the target (DistillSpec-style, on-policy) and evaluate its acceptance.

The trainer is ``models.training.draft`` (its docstring: the stages, where it writes, how a run resumes);
``--help`` lists the flags. Outputs go to ``${JSPEC_CACHE:-~/.cache/jspec}/draft/``.

    python examples/train_draft.py [--name smollm2-2L-8k] [--layers 2] [--head-size 8192] [--force]
"""

from models.training import draft

if __name__ == "__main__":
    draft.main()

"""Training the drafters of ``models``: EAGLE heads, distilled draft models and LayerSkip exit adapters.

- ``prompts``: every prompt set the trainers and their evaluations read (and the EAGLE benchmark's prompts).
- ``data``: what the three trainers share to make their data: chat encoding, the target's answers through
  ``jspec.decode``, per-batch caches, atomic writes.
- ``runs``: the settings a run records next to its checkpoints and results (a rerun with others is refused), the
  resumable checkpoint manager and the per-step metrics kept with it.
- ``eagle`` (with ``eagle_data``, ``eagle_eval``), ``draft``, ``early_exit``: the trainers. Each has ``Args`` (its
  flags, parsed and frozen), ``parse_args(argv)``, ``run(args)`` and ``main(argv)``; the scripts
  ``examples/train_eagle.py``, ``train_draft.py`` and ``train_early_exit.py`` call ``main``.

Everything a trainer writes goes under ``${JSPEC_CACHE:-~/.cache/jspec}``, never into the repository.
"""

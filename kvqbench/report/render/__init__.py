"""The rendering layer: Markdown, the terminal table and the figures, each a function of the assembled
leaderboard document (:mod:`kvqbench.report.board`) and, for the figures, the saved per-experiment files.
Torch-free."""

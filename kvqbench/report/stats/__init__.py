"""The statistics of the report: pure functions of cell records and of the statistics they give
(intervals and the tie rule, aggregation over seeds, rankings and budgets, predictivity, the headline
rule, the long-decode and two-model analyses, data-quality checks). No renderer, tabulate, matplotlib
or torch is imported here; :mod:`kvqbench.report.board` assembles them into the leaderboard document."""

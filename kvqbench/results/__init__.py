"""Result folders: write a result set (:mod:`~kvqbench.results.write`), read one back
(:mod:`~kvqbench.results.read`), keep the sets it displaces (:mod:`~kvqbench.results.previous`), re-render it
(``kvqbench report``), merge shards, compare two and publish one. Above :mod:`kvqbench.report`, which
never imports it. Torch-free."""

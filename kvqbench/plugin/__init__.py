"""The kvqbench pytest plugin (docs/DESIGN.md §1, §5), one module per responsibility, each owning its
options and its ``config.stash`` keys, as pytest's own core plugins do:

- :mod:`~kvqbench.plugin.state` — the session's settings and state, the xdist and cell helpers;
- :mod:`~kvqbench.plugin.options` — the ``--kvq-*`` options, resolved into the settings at configure time;
- :mod:`~kvqbench.plugin.collection` — cells parametrized from ``@pytest.mark.kvq``, sharding, run order;
- :mod:`~kvqbench.plugin.fixtures` — ``kvq_settings``, ``kvq_data``, ``kvq_model``, ``kvq_method``;
- :mod:`~kvqbench.plugin.sharing` — ``kvq_run``/``kvq_seed_rows``: one computation for several cells;
- :mod:`~kvqbench.plugin.recording` — ``kvq_record`` and the records' way to the controller;
- :mod:`~kvqbench.plugin.results` — the result set written at session end;
- :mod:`~kvqbench.plugin.progress` — the progress line and its ETA.

Loaded through the ``pytest11`` entry point ``kvqbench`` (or by the repository's root ``conftest.py``
when the package is not installed); pytest registers the modules below with it. Heavy imports (torch,
the methods) happen lazily, only when cells are collected or run.
"""

pytest_plugins = [
    "kvqbench.plugin.state",
    "kvqbench.plugin.options",
    "kvqbench.plugin.collection",
    "kvqbench.plugin.fixtures",
    "kvqbench.plugin.sharing",
    "kvqbench.plugin.recording",
    "kvqbench.plugin.results",
    "kvqbench.plugin.progress",
]

"""The kvqbench pytest plugin (docs/DESIGN.md §1, §5): one module per responsibility, each a plugin of
its own with its hooks and its ``config.stash`` keys, as pytest's own core plugins are:

- :mod:`~kvqbench.plugin.state` — the session's settings and state, the xdist and cell helpers;
- :mod:`~kvqbench.plugin.options` — the ``--kvq-*`` options, resolved into the settings at configure time;
- :mod:`~kvqbench.plugin.collection` — cells parametrized from ``@pytest.mark.kvq``, sharding, run order;
- :mod:`~kvqbench.plugin.fixtures` — ``kvq_settings``, ``kvq_data``, ``kvq_model``, ``kvq_method``;
- :mod:`~kvqbench.plugin.sharing` — ``kvq_run``/``kvq_seed_rows``: one computation for several cells;
- :mod:`~kvqbench.plugin.recording` — ``kvq_record`` and the records' way to the controller;
- :mod:`~kvqbench.plugin.resume` — the results folder's journal: records kept as computed, reused by a rerun;
- :mod:`~kvqbench.plugin.results` — the result set written at session end;
- :mod:`~kvqbench.plugin.progress` — the progress line and its ETA.

Loaded through the ``pytest11`` entry point ``kvqbench`` (or by the repository's root ``conftest.py``
when the package is not installed); this package registers the modules above (:func:`pytest_addhooks`).
Heavy imports (torch, the methods) happen lazily, only when cells are collected or run.
"""

from __future__ import annotations

import pytest

from kvqbench.plugin import collection, fixtures, options, progress, recording, results, resume, sharing, state

#: the plugin's modules, in the order they are registered (their options appear in this order)
MODULES = (state, options, collection, fixtures, sharing, recording, resume, results, progress)


def pytest_addhooks(pluginmanager: pytest.PytestPluginManager) -> None:
    """Add kvqbench's hook specifications (:mod:`kvqbench.hookspecs`, docs/HOOKS.md) and register the
    modules above under their own names (``-p no:kvqbench.plugin.progress`` leaves one out). They are
    registered directly rather than through ``pytest_plugins``, which marks them for assertion rewriting:
    ``kvqbench run`` imports them for its ``--help`` before it starts pytest in the same process, and
    pytest would then warn that they were imported too early to be rewritten."""
    from kvqbench import hookspecs

    pluginmanager.add_hookspecs(hookspecs)
    for mod in MODULES:
        if pluginmanager.get_plugin(mod.__name__) is None and not pluginmanager.is_blocked(mod.__name__):
            pluginmanager.register(mod, mod.__name__)

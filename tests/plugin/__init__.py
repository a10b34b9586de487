"""Plugin tests. :func:`inner_session` prepares a pytester session of benchmark cells of its own."""


def inner_session(pytester, monkeypatch, args, cell_test) -> list[str]:
    """Write ``cell_test`` as the inner session's test file and return its pytest arguments (``args`` plus
    ``-p kvqbench.plugin`` when the plugin is not installed as an entry point). The inner run is a session
    of its own: under an outer ``-n auto`` the worker's variables would make pytest-benchmark think it runs
    under xdist and switch itself off, so they are removed."""
    from importlib.metadata import entry_points

    args = list(args)
    if not any(ep.name == "kvqbench" for ep in entry_points(group="pytest11")):
        args += ["-p", "kvqbench.plugin"]
    pytester.makepyfile(test_cells=cell_test)
    for var in ("PYTEST_XDIST_WORKER", "PYTEST_XDIST_WORKER_COUNT", "PYTEST_XDIST_TESTRUNUID"):
        monkeypatch.delenv(var, raising=False)
    return args

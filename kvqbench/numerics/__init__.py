"""Pure tensor functions (no knowledge of methods, pytest or files).

Every module here states the invariant it keeps in its docstring and has a unit test for it.
"""

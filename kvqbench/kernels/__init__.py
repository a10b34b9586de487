"""Fast versions of named reference steps — the one home for speed. Importing this package registers every
one of them with :mod:`kvqbench.steps` (the registry and the contract: decline, tolerance, off switch).

The numerics of every method are plain torch, written as the paper's steps (``kvqbench/numerics/`` and
``kvqbench/quantizers/``); that code is the definition. A module here holds the fast versions of one group of
steps, each registered with :func:`kvqbench.steps.fast` with the conditions under which it applies and the
tolerance it keeps (``tests/property/test_kernels_<module>.py`` checks it).

* **One carrier.** Fast versions are C, compiled on first use and loaded with :mod:`ctypes`
  (:mod:`kvqbench.kernels.build`); no build step at install time, no torch headers, no vendor library.
  Nothing decides speed by probing whether this machine's BLAS sums in some order.
* **No C compiler**, or ``KVQBENCH_KERNELS=0``: every fast version declines and every step runs its reference.

Layering: these modules sit above ``numerics/`` (they import its constants and shared helpers) and below the
methods; ``kvqbench.quantizers`` imports this package, so every method runs with them.
"""

from kvqbench.kernels import (  # noqa: F401  (each module registers its fast versions)
    dense_sparse,
    hadamard,
    lloyd_max,
    packing,
    polarquant,
    rtn,
    turboquant,
    varn,
    zpoint,
)

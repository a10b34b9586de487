"""Quantization methods. Importing this package registers every built-in method.

To add a method: one new module here with a :func:`~kvqbench.quantizers.base.register`-decorated
:class:`~kvqbench.quantizers.base.Quantizer` subclass, imported below (see docs/ADDING_METHODS.md).
"""

from kvqbench.quantizers.base import (  # noqa: F401
    QuantizedTensor,
    Quantizer,
    Stored,
    StreamPolicy,
    UnknownMethodError,
    available,
    create,
    get,
    register,
    registry,
)

# every fast version, registered with kvqbench.steps before a method runs
from kvqbench import kernels as _kernels  # noqa: F401,E402

# built-in methods, in the leaderboard's canonical order
from kvqbench.quantizers import fp16  # noqa: F401,E402
from kvqbench.quantizers import rtn  # noqa: F401,E402
from kvqbench.quantizers import kivi  # noqa: F401,E402
from kvqbench.quantizers import quarot  # noqa: F401,E402
from kvqbench.quantizers import kvquant  # noqa: F401,E402
from kvqbench.quantizers import kvarn  # noqa: F401,E402
from kvqbench.quantizers import polarquant  # noqa: F401,E402
from kvqbench.quantizers import turboquant  # noqa: F401,E402
from kvqbench.quantizers import kitty  # noqa: F401,E402

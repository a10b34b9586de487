"""Root conftest: makes the kvqbench plugin available when running from a source tree where the
package's ``pytest11`` entry point is not installed, and sets up hypothesis profiles."""

from __future__ import annotations

import os
from importlib.metadata import entry_points

from hypothesis import HealthCheck, settings

if not any(ep.name == "kvqbench" for ep in entry_points(group="pytest11")):
    pytest_plugins = ["kvqbench.plugin"]

# "ci": derandomized so CI is reproducible; "dev": more examples, random.
settings.register_profile("ci", derandomize=True, max_examples=40, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", max_examples=100, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

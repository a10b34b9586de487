"""Statistics of the report layer: pure functions of numbers (numpy, scipy.stats), no renderers, no torch."""

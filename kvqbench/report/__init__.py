"""Reporting: assemble cell records into rankings/leaderboards and render them. Torch-free."""

"""Convergence studies: observed orders in the depth step and in the resolution."""

from ._depth import format_table, run_depth_study, write_outputs
from ._grid import run_grid_study

__all__ = ["format_table", "run_depth_study", "run_grid_study", "write_outputs"]
